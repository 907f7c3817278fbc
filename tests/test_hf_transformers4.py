"""Exported checkpoints load in transformers 4.x (the 5.x case is in test_hf.py).

scripts/setup.sh dev installs transformers 4.x into .venv/transformers4; the load runs in a
subprocess with only that directory prepended to the path, so this process keeps 5.x.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mula import Mula, MulaConfig
from mula.checkpoint import save_weights
from mula.hf import export_hf

TF4 = Path(__file__).resolve().parents[1] / ".venv" / "transformers4"

LOAD = """
import sys, torch, transformers
assert transformers.__version__.startswith("4."), transformers.__version__
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
ids = torch.load(sys.argv[2], weights_only=True)
with torch.no_grad():
    torch.save(model(ids).logits, sys.argv[3])
"""


@pytest.mark.skipif(
    not (TF4 / "transformers").is_dir(), reason="run `bash scripts/setup.sh dev` to install transformers 4.x"
)
@pytest.mark.parametrize(
    "overrides",
    [
        dict(num_experts=6, top_k=2, expert_intermediate_size=16, qk_norm=True, num_kv_heads=2),
        dict(num_experts=0, norm="layernorm", qk_norm=False),
    ],
    ids=["olmoe", "olmo"],
)
def test_export_loads_in_transformers_4(tmp_path: Path, overrides: dict) -> None:
    config = MulaConfig(
        name="t4",
        vocab_size=128,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        max_position_embeddings=64,
        intermediate_size=64,
        **overrides,
    )
    torch.manual_seed(0)
    model = Mula(config).eval()
    save_weights(model, tmp_path / "w.pt")
    export_hf(tmp_path / "w.pt", tmp_path / "hf")
    ids = torch.randint(0, config.vocab_size, (2, 12))
    torch.save(ids, tmp_path / "ids.pt")
    env = dict(os.environ, PYTHONPATH=str(TF4))
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            LOAD,
            str(tmp_path / "hf"),
            str(tmp_path / "ids.pt"),
            str(tmp_path / "out.pt"),
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    with torch.no_grad():
        expected = model(ids).logits
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    assert (got - expected).abs().max().item() < 1e-4
