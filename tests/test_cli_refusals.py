"""Every layout sentence reaches a `mula fit` user as one line: `mula: error: <sentence>`, exit status 2.

The sentences are read from the source (every `raise ValueError(...)` of mula/layout/rules.py, which
`ParallelLayout.validate` runs, of `XPUMoEStrategy.__init__` and of the sharded optimizer's options,
mula/layout/sharding_options.py), so a new rule without a command line here fails
`test_every_layout_sentence_has_a_command_line`. Each command line runs in-process in an empty directory
(the refusal comes before any data is prepared or any rank is started) and must print its sentence
alone: under 200 characters, on one line, without jsonargparse's Union wrapper or a namespace dump.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from mula.commands.entry import main

ROOT = Path(__file__).resolve().parents[1]
TINY_MOE = str(ROOT / "recipes" / "mula-tiny-moe.yaml")
TINY_DENSE = str(ROOT / "recipes" / "mula-tiny-dense.yaml")
S = "--trainer.strategy.init_args."

# (recipe, devices, extra arguments): the tiny MoE has 4 layers, 4 heads, 16 experts and 2 micro-batches
# of 8 sequences per step on one data-parallel rank
CASES: dict[str, tuple[str, int, list[str]]] = {
    "size below 1": (TINY_MOE, 2, [f"{S}expert_parallel_size=0"]),
    "EP larger than W": (TINY_MOE, 2, [f"{S}expert_parallel_size=4"]),
    "W not divisible by EP": (TINY_MOE, 4, [f"{S}expert_parallel_size=3"]),
    "W not divisible by C x T x E x P": (TINY_MOE, 2, [f"{S}context_parallel_size=4"]),
    "W not divisible by T x E x P": (TINY_MOE, 2, [f"{S}tensor_parallel_size=4"]),
    "W not divisible by P x E": (TINY_MOE, 2, [f"{S}pipeline_parallel_size=4"]),
    "EP of a dense model": (TINY_DENSE, 2, [f"{S}expert_parallel_size=2"]),
    "experts not divisible by EP": (TINY_MOE, 3, [f"{S}expert_parallel_size=3"]),
    "heads not divisible by T": (TINY_MOE, 8, [f"{S}tensor_parallel_size=8"]),
    "compile with T": (TINY_DENSE, 2, [f"{S}tensor_parallel_size=2", "--model.compile=true"]),
    "heads not divisible by C": (TINY_MOE, 8, [f"{S}context_parallel_size=8"]),
    "sequence not divisible by C": (TINY_MOE, 2, [f"{S}context_parallel_size=2", "--data.seq_len=255"]),
    "unknown schedule": (TINY_MOE, 2, [f"{S}pipeline_schedule=zero-bubble"]),
    "virtual stages below 1": (TINY_MOE, 2, [f"{S}pipeline_virtual_stages=0"]),
    "virtual stages without interleaving": (TINY_MOE, 2, [f"{S}pipeline_parallel_size=2", f"{S}pipeline_virtual_stages=2"]),
    "virtual stages without stages": (TINY_MOE, 2, [f"{S}pipeline_schedule=interleaved-1f1b", f"{S}pipeline_virtual_stages=2"]),
    "more stages than layers": (TINY_MOE, 8, [f"{S}pipeline_parallel_size=8"]),
    "stage layers of another length": (TINY_MOE, 2, [f"{S}pipeline_parallel_size=2", f"{S}pipeline_stage_layers=[4]"]),
    "a stage without layers": (TINY_MOE, 2, [f"{S}pipeline_parallel_size=2", f"{S}pipeline_stage_layers=[0, 4]"]),
    "stage layers of another sum": (TINY_MOE, 2, [f"{S}pipeline_parallel_size=2", f"{S}pipeline_stage_layers=[1, 2]"]),
    "tied embeddings across stages": (TINY_MOE, 2, [f"{S}pipeline_parallel_size=2", "--model.overrides.tie_embeddings=true"]),
    "global aux loss across stages": (TINY_MOE, 2, [f"{S}pipeline_parallel_size=2", "--model.overrides.aux_loss_scope=global"]),
    "fewer micro-batches than stages": (TINY_MOE, 2, [f"{S}pipeline_parallel_size=2", "--data.micro_batch_size=16"]),
    "interleaved rounds": (TINY_MOE, 2, [f"{S}pipeline_parallel_size=2", f"{S}pipeline_schedule=interleaved-1f1b",
                                         f"{S}pipeline_virtual_stages=2", "--data.global_batch_size=40"]),
    "ZeRO-2 across stages": (TINY_MOE, 2, [f"{S}pipeline_parallel_size=2", f"{S}optimizer_options={{zero_stage: 2}}"]),
    "batch split": (TINY_MOE, 2, ["--data.micro_batch_size=3"]),
    "sequence parallelism without TP": (TINY_DENSE, 2, [f"{S}sequence_parallel=true"]),
    "bucket size": (TINY_MOE, 2, [f"{S}bucket_size_mb=0"]),
    "reduce dtype": (TINY_MOE, 2, [f"{S}optimizer_options={{reduce_dtype: int32}}"]),
    "ZeRO stage": (TINY_MOE, 2, [f"{S}optimizer_options={{zero_stage: 3}}"]),
    "bucket numel": (TINY_MOE, 2, [f"{S}optimizer_options={{bucket_numel: 0}}"]),
    "max grad norm": (TINY_MOE, 2, [f"{S}optimizer_options={{max_grad_norm: -1}}"]),
    "tail buckets below 0": (TINY_MOE, 2, [f"{S}optimizer_options={{offload: true, offload_tail_buckets: -1}}"]),
    "tail buckets without offload": (TINY_MOE, 2, [f"{S}optimizer_options={{offload_tail_buckets: 1}}"]),
    "clip after step": (TINY_MOE, 2, [f"{S}optimizer_options={{clip_after_step: -1}}"]),
    "collectives": (TINY_MOE, 2, [f"{S}optimizer_options={{collectives: nccl}}"]),
    "unknown optimizer option": (TINY_MOE, 2, [f"{S}optimizer_options={{zero: 1}}"]),
    "Muon with T": (TINY_DENSE, 2, [f"{S}tensor_parallel_size=2", f"{S}shard_optimizer=false", "--model.optimizer=muon"]),
    "Muon with offload": (TINY_MOE, 2, [f"{S}shard_optimizer=true", f"{S}optimizer_options={{offload: true}}", "--model.optimizer=muon"]),
}  # fmt: skip

# sentences no command line reaches, and why
UNREACHABLE = {
    "The world size must be at least 1, got {}.": "Lightning refuses devices=0 before any layout exists",
}

SOURCES = {
    "mula/layout/rules.py": None,  # every function
    "strategies/xpu_moe.py": {"__init__"},
    "mula/layout/sharding_options.py": None,
}


def _sentences() -> dict[str, re.Pattern]:
    """Each `raise ValueError(<string or f-string>)` of SOURCES as a pattern ({} for each formatted value),
    keyed by its text with `{}` in place of the values."""
    out = {}
    for path, functions in SOURCES.items():
        for fn in ast.walk(ast.parse((ROOT / path).read_text())):
            if not isinstance(fn, ast.FunctionDef) or (functions is not None and fn.name not in functions):
                continue
            for node in ast.walk(fn):
                if (
                    isinstance(node, ast.Raise)
                    and isinstance(node.exc, ast.Call)
                    and getattr(node.exc.func, "id", "") == "ValueError"
                ):
                    arg = node.exc.args[0]
                    parts = arg.values if isinstance(arg, ast.JoinedStr) else [arg]
                    text = "".join(p.value if isinstance(p, ast.Constant) else "{}" for p in parts)
                    out[text] = re.compile(".+?".join(re.escape(t) for t in text.split("{}")))
    return out


SENTENCES = _sentences()


def _refusal(recipe: str, devices: int, extra: list[str], capsys) -> str:
    args = ["fit", "-c", recipe, "--trainer.accelerator=cpu", f"--trainer.devices={devices}",
            "--trainer.strategy=strategies.XPUMoEStrategy", *extra]  # fmt: skip
    with pytest.raises(SystemExit) as stopped:
        main(args)
    assert stopped.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("mula: error: ")]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("case", list(CASES))
def test_a_layout_refusal_prints_its_sentence_alone(case, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("MULA_TRACEBACK", raising=False)
    monkeypatch.setattr("sys.argv", ["mula"])
    line = _refusal(*CASES[case], capsys)
    assert len(line) < 200 and "Union" not in line and "Namespace(" not in line, line
    sentence = re.sub(r"^mula: error: (\w+: )?", "", line)
    matched = [text for text, pattern in SENTENCES.items() if pattern.fullmatch(sentence)]
    assert matched, f"{case}: not one of the layout sentences: {line}"
    assert not list(tmp_path.iterdir()), "a refusal must come before anything is written"
    _COVERED.setdefault(case, matched)


_COVERED: dict[str, list[str]] = {}


def test_every_layout_sentence_has_a_command_line(tmp_path, monkeypatch, capsys) -> None:
    """Run after the cases (pytest keeps file order): each sentence was printed by at least one of them."""
    if len(_COVERED) < len(CASES):  # run alone: run the cases first
        for n, case in enumerate(CASES):
            (tmp_path / str(n)).mkdir()
            test_a_layout_refusal_prints_its_sentence_alone(case, tmp_path / str(n), monkeypatch, capsys)
    covered = {text for texts in _COVERED.values() for text in texts}
    missing = sorted(set(SENTENCES) - covered - set(UNREACHABLE))
    assert not missing, f"layout sentences no command line here prints: {missing}"
    assert set(UNREACHABLE) <= set(SENTENCES), "an UNREACHABLE sentence no longer exists"
