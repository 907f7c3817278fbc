"""`model.compile`: eager vs compiled training steps, compile time, and the cache of a resumed run.

For each model (the tiny MoE preset; a wider one: hidden 1,024, 8 layers, 32 experts top-8) and dtype
(fp32, bf16): forward + backward of the cross-entropy loss on one batch, timed as tokens/s over
`rounds` interleaved rounds of `steps` steps each (every candidate once per round, in order), for
  - Mula eager, Mula with its blocks compiled (`mula.model.compile.compile_blocks`, as `model.compile: true`),
  - transformers' OLMoE (`mula.hf.to_hf`, identical weights) with each experts implementation; the
    table shows the fastest of them in the same rounds.
The compiled model's first step (compilation included) is timed in fresh processes: with an empty
Inductor cache (a cold start) and again with the cache the first one left (a resumed run), with the
compile time `mula.model.compile.CompileWatch` counts and the eager first step for reference.

    python benchmarks/compile.py                                   # CPU, both models, fp32 and bf16
    python benchmarks/compile.py --models [tiny] --steps 2 --rounds 1    # a quick look
    python benchmarks/compile.py --doc docs/benchmarks.md

Benchmarks print tables and never assert.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from common import (  # benchmarks/ is on sys.path when run as a script
    command_line,
    host_line,
    interleaved_rounds,
    markdown_table,
    median_range,
    positive,
    spread,
    write_section,
)
from moe_layer import _hf_candidates

from mula.model.compile import CompileWatch, compile_blocks, parse_compile, use_cache_dir
from mula.model.config import MulaConfig
from mula.model.transformer import Mula

SECTION = "## compile"
# name -> (preset, overrides, batch, sequence length)
MODELS = {
    "tiny": ("mula-tiny-moe", {}, 8, 256),
    "wide": (
        "mula-tiny-moe",
        dict(
            hidden_size=1024,
            num_layers=8,
            num_heads=16,
            num_experts=32,
            top_k=8,
            expert_intermediate_size=512,
            vocab_size=4096,
        ),
        4,
        256,
    ),  # fmt: skip
}
NOTES = """
Notes: tokens/s of forward + backward of the cross-entropy loss (no optimizer step), median over the
rounds with [min-max]; "compiled / eager" is the per-round ratio's median and range. Compiled: every
block through Inductor, the MoE layer's routed experts outside the graphs (docs/compile.md), so what
compilation fuses is the attention's and norms' elementwise work, RoPE, the router and the residuals;
on a CPU the expert GEMMs dominate a MoE model's time, so the gain is small there. First step: one
fresh process each, "cold" with an empty Inductor cache, "warm" with the cache the cold process left
(what a resumed run finds in its run directory); compile time is what `CompileWatch` counts.
Where compiled is not faster, the table says so: the routed experts (most of a CPU MoE step) run the
same kernels either way, and each MoE block's graph break costs a return to Python and a second graph
call, which a small model's step does not earn back.
"""


def _config(name: str) -> tuple[MulaConfig, int, int]:
    preset, overrides, batch, seq = MODELS[name]
    return MulaConfig.from_name(preset, **overrides), batch, seq


def _step(model: Callable, inputs: torch.Tensor, targets: torch.Tensor, zero: Callable) -> Callable[[], None]:
    def run() -> None:
        zero()
        logits = model(inputs).logits
        F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()).backward()

    return run


def _candidates(name: str, dtype: torch.dtype, max_batched_gib: float) -> tuple[dict, dict, int]:
    """The step functions (eager, compiled, transformers' implementations), notes, tokens per step."""
    from mula.hf import to_hf

    config, batch, seq = _config(name)
    torch.manual_seed(0)
    eager = Mula(config).to(dtype)
    compiled = Mula(config).to(dtype)
    compiled.load_state_dict(eager.state_dict())
    compile_blocks(compiled.layers, parse_compile(True))
    hf = to_hf(eager).to(dtype).train()
    ids = torch.randint(0, config.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(2))
    inputs, targets = ids[:, :-1], ids[:, 1:]

    def hf_step(impl: str) -> Callable[[], None]:
        def forward(x):
            hf.set_experts_implementation(impl)
            return hf(input_ids=x)

        return _step(forward, inputs, targets, lambda: hf.zero_grad(set_to_none=True))

    routed = batch * seq * config.top_k * config.hidden_size * config.expert_intermediate_size
    steps, notes = _hf_candidates(hf_step, routed, dtype, max_batched_gib)
    steps["mula eager"] = _step(eager, inputs, targets, lambda: eager.zero_grad(set_to_none=True))
    steps["mula compiled"] = _step(compiled, inputs, targets, lambda: compiled.zero_grad(set_to_none=True))
    return steps, notes, batch * seq


def _rounds(
    steps: dict[str, Callable[[], None]], rounds: int, per_round: int, tokens: int
) -> dict[str, list]:
    """tokens/s of each candidate in each round (one untimed step each first: compilation, warm-up)."""
    seconds = interleaved_rounds(steps, rounds, warmup=1, calls=per_round)
    return {name: [tokens * per_round / s for s in times] for name, times in seconds.items()}


def first_step(name: str, dtype: str, compiled: bool, cache: str) -> dict[str, float]:
    """In this (fresh) process: the first training step's time, and the compile counters."""
    use_cache_dir(cache)
    config, batch, seq = _config(name)
    torch.manual_seed(0)
    model = Mula(config).to(getattr(torch, dtype))
    watch = CompileWatch().start()
    if compiled:
        compile_blocks(model.layers, parse_compile(True))
    ids = torch.randint(0, config.vocab_size, (batch, seq + 1))
    step = _step(model, ids[:, :-1], ids[:, 1:], lambda: model.zero_grad(set_to_none=True))
    t0 = time.perf_counter()
    step()
    return {"first_step_s": time.perf_counter() - t0, **watch.metrics()}


def _first_step_in_process(name: str, dtype: str, compiled: bool, cache: str) -> dict[str, float]:
    """`first_step` in a fresh interpreter (nothing of this one's in-memory compile caches)."""
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); from compile import first_step; "
        "print(json.dumps(first_step(sys.argv[2], sys.argv[3], sys.argv[4] == '1', sys.argv[5])))"
    )
    here = str(Path(__file__).resolve().parent)
    out = subprocess.run(
        [sys.executable, "-c", code, here, name, dtype, "1" if compiled else "0", cache],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def _throughput_table(name: str, dtype: str, rates: dict[str, list], notes: dict[str, str]) -> list[str]:
    hf = {k: v for k, v in rates.items() if k.startswith("transformers")}
    fastest = max(hf, key=lambda k: statistics.median(hf[k])) if hf else None
    cells = [
        [f"{cand} (fastest of {len(hf)})" if cand == fastest else cand, median_range(rates[cand]),
         spread([a / b for a, b in zip(rates[cand], rates["mula eager"])])]
        for cand in ("mula eager", "mula compiled", fastest)
        if cand is not None
    ]  # fmt: skip
    lines = [markdown_table(["candidate", "tokens/s median [min-max]", "vs eager"], cells)]
    for cand, note in notes.items():
        lines.append(f"| {cand} | {note} | |")
    faster = statistics.median(rates["mula compiled"]) > statistics.median(rates["mula eager"])
    lines.append(f"\nCompiled is {'faster' if faster else 'NOT faster'} than eager here ({name}, {dtype}).")
    return lines


def main(
    models: list[str] | None = None,
    dtypes: list[str] | None = None,
    rounds: int = 3,
    steps: int = 5,
    first_steps: bool = True,
    max_batched_gib: float = 1.0,
    doc: Path | None = None,
) -> str:
    """Run the benchmark; print the tables; optionally replace `doc`'s "## compile" section.

    Args:
        models: any of "tiny", "wide" (default both).
        dtypes: any of "float32", "bfloat16" (default both).
        rounds: interleaved timed rounds.
        steps: timed steps per candidate per round.
        first_steps: also time the first step in fresh processes (cold and warm cache, eager).
        max_batched_gib: skip transformers' batched_mm when its per-token weight gather needs more.
        doc: markdown file whose "## compile" section is replaced with the results.
    """
    models = models or list(MODELS)
    dtypes = dtypes or ["float32", "bfloat16"]
    for m in models:
        if m not in MODELS:
            raise ValueError(f"models must be among {list(MODELS)}, got {m!r}.")
    for d in dtypes:
        if d not in ("float32", "bfloat16"):
            raise ValueError(f"dtypes must be 'float32' or 'bfloat16', got {d!r}.")
    positive(rounds=rounds, steps=steps)
    out = [
        f"{SECTION}\n",
        command_line(),
        f"{host_line()}  ",
        f"{rounds} interleaved rounds of {steps} steps per candidate, after one untimed step each.",
    ]
    first_rows = ["| model | dtype | eager first step s | compiled cold s (compile s) | warm cache s (compile s) |",
                  "|---|---|---|---|---|"]  # fmt: skip
    for name in models:
        config, batch, seq = _config(name)
        for dtype in dtypes:
            steps_fns, notes, tokens = _candidates(name, getattr(torch, dtype), max_batched_gib)
            rates = _rounds(steps_fns, rounds, steps, tokens)
            title = (
                f"\n### {name}, {dtype}: hidden {config.hidden_size}, {config.num_layers} layers, "
                f"{config.num_experts} experts top-{config.top_k} FFN {config.expert_intermediate_size}, "
                f"batch {batch} x {seq} tokens\n"
            )
            block = [title, *_throughput_table(name, dtype, rates, notes)]
            out += block
            print("\n".join(block), flush=True)
            if first_steps:
                with tempfile.TemporaryDirectory() as cache:
                    eager = _first_step_in_process(name, dtype, False, cache)
                    cold = _first_step_in_process(name, dtype, True, cache)
                    warm = _first_step_in_process(name, dtype, True, cache)
                first_rows.append(
                    f"| {name} | {dtype} | {eager['first_step_s']:.2f} | {cold['first_step_s']:.2f} "
                    f"({cold['compile/time_s']:.2f}) | {warm['first_step_s']:.2f} ({warm['compile/time_s']:.2f}) |"
                )
                print(first_rows[-1], flush=True)
    if first_steps:
        out += ["\n### First step: compilation, cold and with a resumed run's cache\n", *first_rows]
    print(NOTES)
    text = "\n".join([*out, NOTES]) + "\n"
    write_section(doc, SECTION, text)
    return text


if __name__ == "__main__":
    from jsonargparse import CLI

    CLI(main, as_positional=False)
