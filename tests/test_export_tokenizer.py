"""`mula export-hf` ships the run's tokenizer: transformers alone loads model and tokenizer and generates."""

from __future__ import annotations

import json

import pytest
import torch
from test_cli import TINY_MOE, expect_error
from transformers import AutoModelForCausalLM, AutoTokenizer

from mula import Mula, MulaConfig
from mula.checkpoint import save_weights
from mula.cli import main
from mula.data.tokenizer import train_bpe

# the demo recipe, shrunk: 2 steps of a 1-layer model on a few stdlib files with a 512-token tokenizer
TINY_RUN = [
    "--trainer.max_steps=2", "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
    "--trainer.logger=false", "--data.seq_len=32", "--data.global_batch_size=4", "--data.micro_batch_size=4",
    "--data.val_samples=0", '--data.prepare.sources=[{name: stdlib, paths: ["{stdlib}/[a-b]*.py"], format: text}]',
    "--data.prepare.train_tokenizer.vocab_size=512", "--data.prepare.train_tokenizer.max_documents=50",
    "--data.prepare.num_workers=0", "--model.warmup_steps=1",
    ("--model.overrides={vocab_size: 512, hidden_size: 32, num_layers: 1, num_heads: 2, num_experts: 4, top_k: 2, "
     "expert_intermediate_size: 32}"),
]  # fmt: skip
TINY = {"vocab_size": 512, "hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_experts": 4, "top_k": 2,
        "expert_intermediate_size": 32, "max_position_embeddings": 64}  # fmt: skip
MODEL_FILES = {"config.json", "model.safetensors"}
TOKENIZER_FILES = {"tokenizer.json", "tokenizer_config.json", "generation_config.json"}


@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["mula"])
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("MULA_TRACEBACK", raising=False)
    return tmp_path


def tiny_weights(path, vocab_size: int = 512) -> str:
    torch.manual_seed(0)
    save_weights(Mula(MulaConfig.from_name("mula-tiny-moe", **{**TINY, "vocab_size": vocab_size})), path)
    return str(path)


def tiny_tokenizer(path, vocab_size: int = 300) -> str:
    return train_bpe(
        ["def main(argv):\n    return 0\n" * 20] * 10, path, vocab_size=vocab_size, show_progress=False
    )


def test_export_of_a_training_run_loads_and_generates_with_transformers_alone(sandbox):
    main(["fit", "-c", str(TINY_MOE), *TINY_RUN])
    ckpt = sandbox / "runs" / "mula-tiny-moe" / "checkpoints" / "last.ckpt"
    main(["export-hf", "--ckpt", str(ckpt), "--output", "hf"])  # the tokenizer is found from the checkpoint
    assert {p.name for p in (sandbox / "hf").iterdir()} == MODEL_FILES | TOKENIZER_FILES

    tokenizer = AutoTokenizer.from_pretrained(sandbox / "hf")
    model = AutoModelForCausalLM.from_pretrained(sandbox / "hf")
    inputs = tokenizer("def main(", return_tensors="pt")
    assert inputs["input_ids"].numel() > 0
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.model_max_length == 1024
    assert model.config.eos_token_id == tokenizer.eos_token_id == model.generation_config.eos_token_id
    out = model.generate(**inputs, max_new_tokens=4, do_sample=False, min_new_tokens=4)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 4
    assert tokenizer.decode(out[0]).startswith("def main(")


def test_export_without_a_known_tokenizer_warns_and_writes_the_model(sandbox, capsys):
    main(["export-hf", "--ckpt", tiny_weights(sandbox / "w.pt"), "--output", "hf"])
    assert {p.name for p in (sandbox / "hf").iterdir()} == MODEL_FILES
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "no tokenizer exported" in warnings[0] and "--tokenizer" in warnings[0]


def test_export_with_a_given_tokenizer(sandbox, capsys):
    """A Hugging Face tokenizer directory: its tokenizer_config.json is kept, its pad token reaches config.json."""
    tiny_tokenizer(sandbox / "tok" / "tokenizer.json")
    (sandbox / "tok" / "tokenizer_config.json").write_text(json.dumps({"pad_token": "<|endoftext|>"}))
    main(["export-hf", "--ckpt", tiny_weights(sandbox / "w.pt"), "--output", "hf", "--tokenizer", "tok"])
    assert {p.name for p in (sandbox / "hf").iterdir()} == MODEL_FILES | TOKENIZER_FILES
    assert "warning" not in capsys.readouterr().err
    config = json.loads((sandbox / "hf" / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast" and config["model_max_length"] == 64
    assert config["pad_token"] == "<|endoftext|>"
    hf_config = json.loads((sandbox / "hf" / "config.json").read_text())
    assert hf_config["pad_token_id"] == hf_config["eos_token_id"] == 0 and hf_config["bos_token_id"] is None
    assert AutoTokenizer.from_pretrained(sandbox / "hf")("def main(")["input_ids"]


def test_bad_tokenizer_is_a_one_line_error_before_any_work(sandbox, capsys):
    weights = tiny_weights(sandbox / "w.pt", vocab_size=256)
    args = ["export-hf", "--ckpt", weights, "--output", "hf", "--tokenizer"]
    expect_error(
        capsys, [*args, "missing/tokenizer.json"], r"tokenizer file .*missing/tokenizer.json does not exist"
    )
    expect_error(
        capsys,
        [*args, tiny_tokenizer(sandbox / "t.json")],
        r"has \d+ tokens but the model.s vocab_size is 256",
    )
    assert not (sandbox / "hf").exists() and not (sandbox / "hf.tmp-export").exists()
