"""The tiny Qwen3-MoE preset under `XPUMoEStrategy` with E=2 on 2 gloo ranks equals one process,
as it is and with DeepSeek-V3's routing options (sigmoid, groups, scaling, bias balancing).

Per-head QK-norm, head_dim decoupled from hidden/heads, GQA and renormalised top-k: the project's
equality rule (tests/equality.py: per-step losses and gradient norms, then the weights after the last
step, each rank's expert slice against the same experts of the one-process model, router bias
included), and its sharded checkpoint exported with `export_hf` loads in transformers with the
checkpoint's logits. The helpers are test_strategy.py's.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
from dist_helpers import lightning_env, run_distributed
from equality import assert_same_training, assert_same_weights, seeded
from test_strategy import STEPS, _fit

from mula.model.moe import is_expert_param
from strategies import XPUMoEStrategy

PRESET = "qwen3-moe-tiny"
OVERRIDES = {"vocab_size": 256, "num_layers": 2, "max_position_embeddings": 64}  # the preset's other shapes
# DeepSeek-V3's routing on the same shapes: sigmoid scores, 4 groups of 4 experts (2 kept), the combine
# weights scaled, and the balancing bias updated from the step's global counts (EP sums them too)
SIGMOID = {**OVERRIDES, "router_scoring": "sigmoid", "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5,
           "router_bias_update_rate": 1e-2}  # fmt: skip


def _params(trainer) -> dict[str, torch.Tensor]:
    """Parameters and buffers (the router bias) of the trained model."""
    model = trainer.lightning_module.model
    return {n: p.detach().clone() for n, p in [*model.named_parameters(), *model.named_buffers()]}


def _run(rank: int, world: int, root: str, overrides: dict) -> dict:
    lightning_env(rank, world)
    losses, trainer = _fit(
        world, XPUMoEStrategy(expert_parallel_size=2), preset=PRESET, overrides=overrides, save_dir=root
    )
    return {**losses.record(), "params": _params(trainer)}


@pytest.mark.parametrize("overrides", [OVERRIDES, SIGMOID], ids=["qwen3", "sigmoid-groups-bias"])
def test_expert_parallel_two_ranks_equal_one_process(overrides) -> None:
    ref_losses, ref_trainer = _fit(1, None, preset=PRESET, overrides=overrides)
    record, reference = ref_losses.record(), _params(ref_trainer)
    experts = ref_trainer.lightning_module.model.config.num_experts
    if "router_bias_update_rate" in overrides:  # the bias moved, from the same global counts
        assert reference["layers.0.mlp.router.bias"].abs().sum() > 0
    with tempfile.TemporaryDirectory() as root:
        runs = run_distributed(_run, 2, root, overrides)
        for rank, run in enumerate(runs):
            assert len(run["losses"]) == STEPS
            assert run["params"].keys() == reference.keys()
            local = slice(rank * experts // 2, (rank + 1) * experts // 2)
            want = {n: reference[n][local] if is_expert_param(n) else reference[n] for n in reference}
            assert_same_training(run, record, what=f"rank {rank}")
            assert_same_weights(run["params"], want, what=f"rank {rank}")
        if overrides is OVERRIDES:
            _export_loads_in_transformers(Path(root) / "epoch=0-step=2.ckpt", Path(root) / "hf")


def _export_loads_in_transformers(sharded: Path, output: Path) -> None:
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM, Qwen3MoeForCausalLM

    from mula.checkpoint import load_weights
    from mula.hf import export_hf

    export_hf(sharded, output)
    hf = AutoModelForCausalLM.from_pretrained(output).eval()
    assert type(hf) is Qwen3MoeForCausalLM
    model = load_weights(sharded).eval()
    x = torch.randint(0, OVERRIDES["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(seeded(0)))
    with torch.no_grad():
        assert (hf(x).logits - model(x).logits).abs().max().item() <= 1e-4
