"""MoE layer and whole-model forward+backward: Mula's expert kernels against transformers' OLMoE.

Part 1, one MoE layer on identical weights, inputs and output gradient:
  transformers OlmoeSparseMoeBlock with each experts implementation (eager, batched_mm, grouped_mm);
  Mula's MoELayer as mula/moe builds it, on each usable experts backend; the loop reference;
  and a dense matmul with the same FLOPs (fwd + both backward products) as the ceiling.
Part 2, whole model (tiny, MoE-dominated config) forward+backward of the cross-entropy loss:
  Mula vs OlmoeForCausalLM made by `mula.hf.to_hf` (identical weights), each experts implementation.

Timing: candidates run interleaved for `rounds` rounds (background load hits all alike) after
`warmup` untimed rounds, each timed call right after an untimed one of the same candidate; the table shows the best round (the machine may be shared) and the median.
TFLOP/s counts the expert GEMM FLOPs only (6 * tokens * top_k * 3 * hidden * expert_ffn).
"speedup" = time of the fastest transformers implementation / time of the row.

    python benchmarks/moe_layer.py --small true                      # CPU, seconds
    python benchmarks/moe_layer.py --small true --doc docs/benchmarks.md
    python benchmarks/moe_layer.py --device cuda                      # OLMoE shapes, bf16

Benchmarks print tables and never assert.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from common import (  # benchmarks/ is on sys.path when run as a script
    command_line,
    interleaved_rounds,
    markdown_table,
    write_section,
)
from torch import Tensor

import mula.model.kernels as mk
from mula.model.config import MulaConfig
from mula.model.kernels import padded
from mula.model.moe import MoELayer
from mula.model.transformer import Mula
from mula.training.devices import device_name

SECTION = "## moe_layer"
UNIFORM = "mula MoELayer [auto], uniform routing"
NOTES = """
How to read it.

- "mula MoELayer [backend]" is the layer exactly as the model uses it (`mula.model.moe.MoELayer`: router ->
  `LocalDispatcher` -> `GroupedExperts` -> combine) on that experts backend ("= auto" marks the one
  `auto` picks here; the summary uses it). "loop reference" is the same layer on the `loop` backend
  (one matmul per expert, autograd gradients). The whole-model rows are `Mula` as built.
- "uniform routing" is the auto row with `routing_mode="uniform"`: every expert gets the same number
  of tokens (within one), so the kernels run without routing skew; its output differs by design.
- max abs diff: forward output against transformers' grouped_mm on identical weights and inputs.
- TFLOP/s counts the expert GEMMs only; the dense row is one [T*K, hidden] x [hidden, 3*FFN] matmul
  and both of its backward products: the same FLOPs with no routing, the ceiling for the experts.
- CPU, where Mula's time goes (`mula.model.kernels.padded`): the permutation writes the expert input
  straight into a padded layout where experts of similar token counts share a bucket (a few
  percent of padding rows); each bucket's whole MLP (gate, up, SwiGLU, down and the backward
  products) runs as batched GEMMs, one bucket after the other; the router's combine weights are
  applied to the [rows, FFN] activations inside the experts, so the combine is a scatter-add with no
  [N, K, hidden] temporaries. In bf16 this also avoids oneDNN's per-shape JIT recompiles (its cache
  holds 1024 kernels and a grouped GEMM has one shape per expert row count), which is why the bf16
  whole model gains more than the single layer.
- fp32 on this CPU is GEMM-bound for both, and the 1.5x target is not reachable at this shape:
  Mula's expert MLP alone (fwd + bwd, 2.5 GFLOP) takes ~20 ms of its ~28 ms layer, its batched GEMMs
  running at ~140 GFLOP/s in the chain (the same products reach ~185 GFLOP/s on cache-warm data,
  the dense-ceiling row ~155; the layer's ~60 MB working set does not stay in this VM's cache),
  and routing, permutation and combine take ~6 ms more. 1.5x over
  transformers' ~38 ms needs the whole layer in ~25 ms. The whole model adds attention,
  projections and the LM head (~80 ms of ~190 here), which both implementations run on the same
  torch kernels, so it gains less than the layer.
- Notes on the CPU expert path (the numbers behind `mula.model.kernels.padded`, measured on this 2-core
  AMD EPYC VM with AVX-512): routing at the benchmark shape is uneven (64 experts at 256 rows on
  average held 165 to 340 rows), so padding every expert to one capacity wastes ~27% of the rows,
  while the bucketed layout wastes 1-3% for a handful of batched-GEMM calls per projection instead
  of 64 per-expert ones. A 16-bit oneDNN GEMM call costs ~15 us on top of its arithmetic. A batched
  GEMM splits its batch over the threads: 3 experts take as long as 4 on 2 threads, hence bucket
  sizes in multiples of the thread count. The cost model's per-bucket charge (`CALL_COST_ROWS` =
  64 padded rows) was tuned at hidden 128 / FFN 64 in fp32: values from 24 to 128 were within noise
  of each other, 256 and more slower.
- The machine is a shared 2-core VM whose memory is reclaimed in the background: absolute times
  move by up to 40% between runs (transformers' layer ranged 36-51 ms, its whole model 228-304 ms,
  mostly page faults on freshly allocated tensors, which transformers' path has several times more
  of). Rounds
  are interleaved so the load hits every row alike, and the best round is the least disturbed one;
  compare ratios within one run, not times across runs.
"""
HF_IMPLS = ("eager", "batched_mm", "grouped_mm")


@dataclasses.dataclass
class Row:
    """One timed candidate."""

    name: str
    times: list[float]
    flops: float
    err: float | None = None
    note: str = ""

    @property
    def best_ms(self) -> float:
        return min(self.times) * 1e3

    @property
    def median_ms(self) -> float:
        return statistics.median(self.times) * 1e3


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        getattr(torch, device.type).synchronize()


def _time_interleaved(
    steps: dict[str, Callable[[], None]], rounds: int, warmup: int, device: torch.device
) -> dict[str, list[float]]:
    # One untimed call before each timed one (`fresh`): oneDNN keeps a bounded per-shape JIT cache, and the
    # previous candidate's shapes (e.g. transformers' one GEMM per expert) would otherwise evict this
    # one's kernels and charge it their recompilation, which training never pays.
    return interleaved_rounds(steps, rounds, warmup, fresh=True, sync=lambda: _sync(device))


def _hf_candidates(
    make: Callable[[str], Callable[[], Any]], routed: int, dtype: torch.dtype, max_batched_gib: float
) -> tuple[dict[str, Callable[[], Any]], dict[str, str]]:
    """transformers' experts implementations to time, and notes for the ones skipped.

    `routed` = routed tokens x hidden x expert FFN: batched_mm gathers every routed token's expert
    weights (gate, up, down), plus their gradients, so it needs about 9 x routed elements.
    """
    gib = routed * 3 * torch.empty((), dtype=dtype).element_size() * 3 / 2**30
    candidates: dict[str, Callable[[], Any]] = {}
    notes: dict[str, str] = {}
    for impl in HF_IMPLS:
        if impl == "batched_mm" and gib > max_batched_gib:
            notes[f"transformers {impl}"] = f"skipped: gathers per-token expert weights (~{gib:.0f} GiB)"
            continue
        candidates[f"transformers {impl}"] = make(impl)
    return candidates, notes


# ----- part 1: one layer ---------------------------------------------------------------------------------
def _hf_block(hidden: int, ffn: int, experts: int, top_k: int, dtype: torch.dtype, device: torch.device):
    from transformers import OlmoeConfig
    from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock

    cfg = OlmoeConfig(
        hidden_size=hidden, intermediate_size=ffn, num_experts=experts, num_experts_per_tok=top_k
    )
    block = OlmoeSparseMoeBlock(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return cfg, block.to(device=device, dtype=dtype)


def _padded_on(device: torch.device, run: Callable[[], Tensor]) -> Tensor:
    """`run()` with the torch backend's padded layout (`mula.model.kernels.padded.DEVICES`) used on `device`."""
    before = padded.DEVICES
    padded.DEVICES = (*before, device.type)
    try:
        return run()
    finally:
        padded.DEVICES = before


def _backends(device: torch.device, dtype: torch.dtype) -> list[str]:
    usable = []
    for name in ("torch", "triton"):
        try:
            mk.resolve_backend(name, device, dtype)
            usable.append(name)
        except ValueError:
            pass
    return usable


def bench_layer(
    tokens: int,
    hidden: int,
    ffn: int,
    experts: int,
    top_k: int,
    dtype: torch.dtype,
    device: torch.device,
    rounds: int,
    warmup: int,
    max_batched_gib: float,
) -> list[Row]:
    """Time all layer candidates on one shape; returns rows (first the transformers ones)."""
    cfg, block = _hf_block(hidden, ffn, experts, top_k, dtype, device)
    mcfg = MulaConfig(
        hidden_size=hidden, num_heads=1, num_experts=experts, top_k=top_k, expert_intermediate_size=ffn
    )
    layers = {}
    for backend in ("auto", *_backends(device, dtype), "loop"):
        layer = MoELayer(dataclasses.replace(mcfg, expert_backend=backend)).to(device=device, dtype=dtype)
        with torch.no_grad():
            layer.router.weight.copy_(block.gate.weight)
            layer.experts.gate_up.copy_(block.experts.gate_up_proj)
            layer.experts.down.copy_(block.experts.down_proj)
        layers[backend] = layer
    uniform = MoELayer(dataclasses.replace(mcfg, routing_mode="uniform")).to(device=device, dtype=dtype)
    uniform.load_state_dict(layers["auto"].state_dict())
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, tokens, hidden, generator=gen).to(device, dtype).requires_grad_()
    dy = torch.randn(1, tokens, hidden, generator=gen).to(device, dtype)
    flops = 6.0 * tokens * top_k * 3 * hidden * ffn

    def hf(impl: str) -> Callable[[], Tensor]:
        def fwd() -> Tensor:
            cfg._experts_implementation = impl
            return block(x)

        return fwd

    fwds, notes = _hf_candidates(hf, tokens * top_k * hidden * ffn, dtype, max_batched_gib)
    auto = mk.resolve_backend("auto", device, dtype)
    fwds[f"mula MoELayer [{auto} = auto]"] = lambda: layers["auto"](x)[0]
    for backend in _backends(device, dtype):
        if backend != auto:
            fwds[f"mula MoELayer [{backend}]"] = lambda b=backend: layers[b](x)[0]
    if device.type not in padded.DEVICES and "torch" in layers:
        # the CPU's bucketed padded layout (mula/model/kernels/padded.py) on this device, for comparison
        fwds["mula MoELayer [torch, padded layout]"] = lambda: _padded_on(
            device, lambda: layers["torch"](x)[0]
        )
    fwds["loop reference"] = lambda: layers["loop"](x)[0]
    fwds[UNIFORM] = lambda: uniform(x)[0]

    params = [x, *block.parameters(), *layers["auto"].parameters(), *layers["loop"].parameters()]
    params += list(uniform.parameters())
    outputs: dict[str, Tensor] = {}

    def step(name: str) -> Callable[[], None]:
        def run() -> None:
            for p in params:
                p.grad = None
            y = fwds[name]()
            y.backward(dy)
            outputs[name] = y.detach()

        return run

    steps = {name: step(name) for name in fwds}
    # dense ceiling: y = a @ W (W [H, 3I]) and both backward products, same FLOPs as the experts
    a = torch.randn(tokens * top_k, hidden, generator=gen).to(device, dtype)
    w = torch.randn(hidden, 3 * ffn, generator=gen).to(device, dtype)
    g = torch.randn(tokens * top_k, 3 * ffn, generator=gen).to(device, dtype)
    steps["dense matmul (ceiling)"] = lambda: (a @ w, g @ w.t(), a.t() @ g)

    times = _time_interleaved(steps, rounds, warmup, device)
    ref = outputs.get("transformers grouped_mm", next(iter(outputs.values())))
    rows = []
    for name, ts in times.items():
        compared = name in outputs and name != UNIFORM  # uniform routing computes another function
        err = (outputs[name].float() - ref.float()).abs().max().item() if compared else None
        rows.append(Row(name, ts, flops, err))
    rows += [Row(name, [float("nan")], flops, None, note) for name, note in notes.items()]
    return rows


# ----- part 2: whole model -----------------------------------------------------------------------------
def bench_model(
    config: MulaConfig,
    batch: int,
    seq_len: int,
    dtype: torch.dtype,
    device: torch.device,
    rounds: int,
    warmup: int,
    max_batched_gib: float,
) -> list[Row]:
    """Whole-model fwd+bwd of the CE loss: Mula as built vs OlmoeForCausalLM on the same weights."""
    from mula.hf import to_hf

    torch.manual_seed(0)
    model = Mula(config).to(device=device, dtype=dtype)
    hf = to_hf(model).to(device=device, dtype=dtype).train()
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, config.vocab_size, (batch, seq_len + 1), generator=gen).to(device)
    inputs, targets = ids[:, :-1], ids[:, 1:]
    tokens = batch * seq_len
    flops = config.flops_per_token(seq_len) * tokens

    def ce(logits: Tensor) -> Tensor:
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def mula_step(m: Mula) -> Callable[[], None]:
        def run() -> None:
            m.zero_grad(set_to_none=True)
            ce(m(inputs).logits).backward()

        return run

    def hf_step(impl: str) -> Callable[[], None]:
        def run() -> None:
            hf.set_experts_implementation(impl)
            hf.zero_grad(set_to_none=True)
            ce(hf(input_ids=inputs).logits).backward()

        return run

    routed = tokens * config.top_k * config.hidden_size * config.expert_intermediate_size
    steps, notes = _hf_candidates(hf_step, routed, dtype, max_batched_gib)
    steps["mula (as built)"] = mula_step(model)
    times = _time_interleaved(steps, rounds, warmup, device)
    rows = [Row(name, ts, flops) for name, ts in times.items()]
    rows += [Row(name, [float("nan")], flops, None, note) for name, note in notes.items()]
    return rows


# ----- report --------------------------------------------------------------------------------------------
def _table(rows: list[Row], with_err: bool) -> str:
    timed = [r for r in rows if r.times[0] == r.times[0]]  # drop NaN (skipped)
    hf = [r.best_ms for r in timed if r.name.startswith("transformers")]
    hf_best = min(hf) if hf else float("nan")
    dense = [r.best_ms for r in timed if r.name.startswith("dense")]
    dense_ms = dense[0] if dense else float("nan")
    head = ["implementation", "best ms", "median ms", "TFLOP/s", "share of the dense GEMM's",
            "speedup vs fastest transformers"]  # fmt: skip
    head += ["max abs diff vs transformers grouped_mm"] if with_err else []
    cells = []
    for r in rows:
        if r.note:
            cells.append([r.name, "-", "-", "-", "-", r.note] + (["-"] if with_err else []))
            continue
        tflops = r.flops / (r.best_ms * 1e-3) / 1e12
        cells.append([
            r.name, f"{r.best_ms:.2f}", f"{r.median_ms:.2f}", f"{tflops:.3f}", f"{dense_ms / r.best_ms:.0%}",
            f"{hf_best / r.best_ms:.2f}x",
        ] + ([("-" if r.err is None else f"{r.err:.1e}")] if with_err else []))  # fmt: skip
    return markdown_table(head, cells)


def _speedup(rows: list[Row], marker: str, target: float) -> str:
    """Speedup of the row whose name contains `marker`, e.g. "1.62x (target 1.5x: met)"."""
    hf = [r.best_ms for r in rows if r.name.startswith("transformers") and not r.note]
    mine = [r.best_ms for r in rows if marker in r.name]
    if not hf or not mine:
        return "n/a"
    ratio = min(hf) / mine[0]
    return f"{ratio:.2f}x (target {target}x: {'met' if ratio >= target else 'not met'})"


def main(
    small: bool = False,
    device: str | None = None,
    dtypes: list[str] | None = None,
    tokens: list[int] | None = None,
    hidden: int | None = None,
    ffn: int | None = None,
    experts: int = 64,
    top_k: int = 8,
    rounds: int | None = None,
    warmup: int = 2,
    model: bool = True,
    max_batched_gib: float = 1.0,
    doc: Path | None = None,
    json_out: Path | None = None,
) -> str:
    """Run the MoE layer (and whole-model) benchmark; print the tables; optionally update `doc`.

    Args:
        small: the CPU shape (hidden 128, expert FFN 64, 64 experts, top-8, 2048 tokens) instead of
            OLMoE's (hidden 2048, FFN 1024, 4k-16k tokens).
        device: "cpu", "cuda", "xpu" (default: cuda/xpu when present, else cpu).
        dtypes: any of "float32", "bfloat16" (weights, activations and GEMMs); default both on CPU,
            bfloat16 on GPUs.
        tokens, hidden, ffn, experts, top_k: override the layer shape.
        rounds, warmup: timed and untimed interleaved rounds.
        model: also run the whole-model comparison (tiny MoE-dominated config).
        max_batched_gib: skip transformers' batched_mm when its per-token weight gather needs more.
        doc: markdown file whose "## moe_layer" section is replaced with the results.
        json_out: also write every table's rows (times, TFLOP/s, shares, speedups) as JSON to this file.
    """
    dev = torch.device(
        device
        or (
            "cuda"
            if torch.cuda.is_available()
            else "xpu"
            if hasattr(torch, "xpu") and torch.xpu.is_available()
            else "cpu"
        )
    )
    on_cpu = small or dev.type == "cpu"
    dtypes = dtypes or (["float32", "bfloat16"] if on_cpu else ["bfloat16"])
    for name in dtypes:
        if name not in ("float32", "bfloat16"):
            raise ValueError(f"dtypes must be 'float32' or 'bfloat16', got {name!r}.")
    hidden = hidden or (128 if on_cpu else 2048)
    ffn = ffn or (64 if on_cpu else 1024)
    tokens = tokens or ([2048] if on_cpu else [4096, 8192, 16384])
    rounds = rounds or (15 if on_cpu else 20)
    out = [
        f"{SECTION}\n",
        command_line(),
        (
            f"Device: {device_name(dev)}; torch {torch.__version__}; best of {rounds} interleaved rounds "
            f"after {warmup} warm-up (whole model: best of {max(rounds // 3, 3)} after 1).  "
        ),
    ]
    if dev.type == "cpu":
        out.append(
            "No GPU was available for this run: GPU targets (1.3x grouped_mm, 70% of dense TFLOP/s) "
            "are unmeasured; Triton kernels were verified only through TRITON_INTERPRET=1 tests "
            "and ahead-of-time sm_90 and gfx90a compiles."
        )
    target = 1.5 if dev.type == "cpu" else 1.3  # the CPU and GPU targets
    summary = ["\nSummary (speedup of Mula as built over the fastest transformers implementation):\n"]
    tables: list[dict[str, Any]] = []
    for name in dtypes:
        dt = getattr(torch, name)
        for t in tokens:
            rows = bench_layer(t, hidden, ffn, experts, top_k, dt, dev, rounds, warmup, max_batched_gib)
            title = (
                f"\n### {name}: MoE layer fwd+bwd, {t} tokens, hidden {hidden}, expert FFN {ffn}, "
                f"{experts} experts, top-{top_k}\n"
            )
            out += [title, _table(rows, with_err=True)]
            print("\n".join(out[-2:]), flush=True)
            summary.append(f"- {name}, MoE layer, {t} tokens: {_speedup(rows, '= auto]', target)}")
            tables.append({"part": "layer", "dtype": name, "tokens": t, "rows": _row_dicts(rows)})
        if model:
            cfg = MulaConfig.from_name(
                "mula-tiny-moe",
                vocab_size=1024,
                num_experts=experts,
                top_k=top_k,
                expert_intermediate_size=ffn if on_cpu else 1024,
                hidden_size=hidden if on_cpu else 1024,
                num_heads=4 if on_cpu else 16,
            )
            batch, seq = (8, 256) if on_cpu else (8, 1024)
            rows = bench_model(cfg, batch, seq, dt, dev, max(rounds // 3, 3), 1, max_batched_gib)
            title = (
                f"\n### {name}: whole model fwd+bwd (CE loss), {cfg.num_layers} layers, hidden "
                f"{cfg.hidden_size}, {cfg.num_experts} experts top-{cfg.top_k} FFN {cfg.expert_intermediate_size}, "
                f"vocab {cfg.vocab_size}, batch {batch} x {seq} tokens (TFLOP/s from MulaConfig.flops_per_token)\n"
            )
            out += [title, _table(rows, with_err=False)]
            print("\n".join(out[-2:]), flush=True)
            summary.append(f"- {name}, whole model: {_speedup(rows, 'mula (as built)', target)}")
            tables.append({"part": "model", "dtype": name, "tokens": batch * seq, "rows": _row_dicts(rows)})
    out += summary + [NOTES]
    print("\n".join(summary), flush=True)
    text = "\n".join(out) + "\n"
    write_section(doc, SECTION, text)
    if json_out is not None:
        Path(json_out).write_text(
            json.dumps({"device": device_name(dev), "torch": torch.__version__, "tables": tables})
        )
    return text


def _row_dicts(rows: list[Row]) -> list[dict[str, Any]]:
    """The rows as JSON-ready dicts: best and median ms, TFLOP/s, the share of the dense GEMM's time and
    the speedup over the fastest transformers implementation (None where the row was skipped)."""
    timed = [r for r in rows if not r.note]
    dense = next((r.best_ms for r in timed if r.name.startswith("dense")), None)
    hf = [r.best_ms for r in timed if r.name.startswith("transformers")]
    out = []
    for r in rows:
        if r.note:
            out.append({"name": r.name, "note": r.note})
            continue
        out.append({
            "name": r.name, "best_ms": r.best_ms, "median_ms": r.median_ms,
            "tflops": r.flops / (r.best_ms * 1e-3) / 1e12, "max_abs_diff": r.err,
            "share_of_dense": dense / r.best_ms if dense else None,
            "speedup_vs_transformers": min(hf) / r.best_ms if hf else None,
        })  # fmt: skip
    return out


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from jsonargparse import CLI

    CLI(main, as_positional=False)
