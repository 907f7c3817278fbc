"""Per-rank optimizer memory and optimizer-step time: EP-aware sharded AdamW vs the alternatives.

For each layout (W ranks, expert-parallel size E) this runs, on gloo CPU processes and the parameter
list of a real Mula MoE (shrunken Mula-7B-A1B shape by default; experts sliced as expert parallelism
slices them), with fixed random gradients:

  (a)       torch.optim.AdamW (defaults) after DDP-style bucketed all-reduce of the gradients
            (dense over the world, experts over EDP);
  (a,fused) the strongest unsharded baseline: AdamW(fused=True), gradients all-reduced with the same
            per-shard reduce + broadcast collectives the sharded optimizer uses on gloo;
  (b)       EP-unaware sharding: EPShardedAdamW(ep_aware=False), everything sharded over EDP only;
  EP-aware  EPShardedAdamW: dense state over all W ranks, experts over EDP.

"Step" is everything between gradients being ready and updated parameters being back in the model:
gradient reduction + update + parameter all-gather. No backward runs, so nothing overlaps it (real
training hides the reduce-scatter behind backward: these numbers are conservative for the sharded
optimizer). Timing: per iteration the slowest rank (barrier, then max over ranks), median over
iterations. State = fp32 master + exp_avg + exp_avg_sq per rank (for (a) the fp32 parameters are the
master weights). Benchmarks print tables and never assert.

    python benchmarks/optimizer.py --worlds [2,4] --iters 10 --doc docs/benchmarks.md
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import statistics
from typing import Any

import torch
import torch.distributed as dist
from common import (  # benchmarks/ is on sys.path when run as a script
    MiB,
    host_line,
    markdown_table,
    median_range,
    publish,
    run_gloo,
    slowest_rank_seconds,
    spread,
    start_together,
)

from mula import Mula, MulaConfig
from mula.bench.collectives import CollectiveMeter
from mula.model.moe import is_expert_param
from mula.model.param_names import is_muon_param
from mula.training.muon import MulaMuon, newton_schulz, optimizer_param_groups
from strategies.optim.grad_reduce import reduce_scatter_shards
from strategies.optim.param_gather import gather_shards
from strategies.optim.sharded_muon import EPShardedMuon, _InFlight
from strategies.optim.sharded_optimizer import EPShardedAdamW
from strategies.topology import build_topology

SECTION = "## optimizer"
MUON_SECTION = "## optimizer: Muon"


@dataclasses.dataclass
class BenchSpec:
    """What to measure (picklable: sent to the worker processes)."""

    config: dict[str, Any]
    iters: int
    warmup: int
    bucket_mb: float
    optimizer: str = "adamw"


def _param_specs(config: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    with torch.device("meta"):
        model = Mula(MulaConfig(**config))
    return [(n, tuple(p.shape)) for n, p in model.named_parameters()]


def _local_params(specs, ep_size: int, seed: int) -> list[tuple[str, torch.nn.Parameter]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for name, shape in specs:
        if is_expert_param(name):
            shape = (shape[0] // ep_size, *shape[1:])
        out.append((name, torch.nn.Parameter(torch.randn(shape, generator=g) * 0.02)))
    return out


def _muon_groups(named) -> list[dict[str, Any]]:
    """The module's Muon grouping (embedding undecayed, as the recipes' `no_decay`)."""
    return optimizer_param_groups(named, 0.1, ("embed.weight",), "muon")


def _groups(named) -> list[dict[str, Any]]:
    return [
        {"params": [p for _, p in named if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0},
    ]


class _BucketedAllReduce:
    """DDP-style gradient averaging for baseline (a): copy into flat buckets, all-reduce, copy back.

    rooted=True builds the all-reduce from the same per-shard reduce + broadcast collectives the
    sharded optimizer uses on gloo (faster there than gloo's all_reduce), so that comparison is
    about the optimizer, not the collective implementation."""

    def __init__(self, named, topo, bucket_numel: int, rooted: bool) -> None:
        self.rooted = rooted
        self.ranks = {
            id(topo.group("replica")): list(range(topo.size("replica"))),
            id(topo.group("edp_cp")): topo.group_ranks("edp_cp"),
        }
        self.plan = []
        for expert in (False, True):
            params = [p for n, p in reversed(named) if is_expert_param(n) == expert]
            group = topo.group("edp_cp") if expert else topo.group("replica")
            size = topo.size("edp_cp") if expert else topo.size("replica")
            current: list[torch.Tensor] = []
            for p in params + [None]:
                if p is None or (current and sum(q.numel() for q in current) + p.numel() > bucket_numel):
                    if current:
                        buf = torch.empty(sum(q.numel() for q in current))
                        self.plan.append((current, buf, group, size))
                    current = []
                if p is not None:
                    current.append(p)
        self.scale = 1.0 / topo.size("replica")

    def __call__(self) -> None:
        for params, buf, group, size in self.plan:
            torch.cat([p.grad.reshape(-1) for p in params], out=buf)
            buf.mul_(self.scale)
            if size > 1 and self.rooted:
                ranks, chunks = self.ranks[id(group)], buf.chunk(size)
                works = [
                    dist.reduce(c, dst=ranks[i], group=group, async_op=True) for i, c in enumerate(chunks)
                ]
                for w in works:
                    w.wait()
                works = [
                    dist.broadcast(c, src=ranks[i], group=group, async_op=True) for i, c in enumerate(chunks)
                ]
                for w in works:
                    w.wait()
            elif size > 1:
                dist.all_reduce(buf, group=group)
            offset = 0
            for p in params:
                p.grad.copy_(buf[offset : offset + p.numel()].view_as(p))
                offset += p.numel()


VARIANTS = ("a", "a,fused", "b", "EP-aware")
# --optimizer muon: Moonlight's rule (mula.training.muon), replicated (every rank runs the Newton-Schulz of
# every matrix it holds, after the same all-reduce as (a,fused)) against EP-aware sharded Muon, whose update
# goes to the matrices' owners by all-to-all, and the same with the all-gather exchange it replaced
MUON_VARIANTS = ("Muon, replicated", "Muon, sharded, all-gather", "Muon, EP-aware sharded")


class _MeteredMuon(EPShardedMuon):
    """EP-aware sharded Muon whose exchange (the update's trip to the owners and back) is counted by
    `meter` when one is set (an untimed step)."""

    meter: CollectiveMeter | None = None

    def _send_update(self, index: int) -> Any:
        with self.meter or contextlib.nullcontext():
            return super()._send_update(index)

    def _orthogonalise(self, flight: Any) -> Any:
        with self.meter or contextlib.nullcontext():
            return super()._orthogonalise(flight)


class _AllGatherMuon(_MeteredMuon):
    """The exchange sharded Muon had before the all-to-all, rebuilt as the reference: each bucket's update
    all-gathered to every rank, each owner's matrices orthogonalised into an otherwise zero buffer of the
    bucket, reduce-scattered back (each element one non-zero contribution). The same weights bit for bit."""

    def _send_update(self, index: int) -> Any:
        with self.meter or contextlib.nullcontext():
            update = self._nesterov_update(index)
            full = update.new_empty(self.buckets[index].numel)
            handles = gather_shards(full, update, self.reducer.states[index].domain)
        return _InFlight(index, update, full, full, handles)

    def _orthogonalise(self, flight: Any) -> Any:
        full, orthogonal = flight.received, torch.zeros_like(flight.received)
        for task in self._mine[flight.index]:
            n, shape = task.rows * task.cols, (task.rows, task.cols)
            steps = int(self.param_groups[task.group]["ns_steps"])
            orthogonal[task.start : task.start + n].view(shape).copy_(
                newton_schulz(full[task.start : task.start + n].view(shape), steps, self._ns_dtype)
            )
        with self.meter or contextlib.nullcontext():
            dom = self.reducer.states[flight.index].domain
            flight.packed, flight.handles = reduce_scatter_shards(orthogonal, dom, flight.update)
        return flight

    def _returned(self, flight: Any) -> torch.Tensor:
        return flight.packed


class _Variant:
    """One optimizer under test with its own copy of this rank's parameters and gradients."""

    def __init__(self, name: str, specs, topo, bucket_numel: int) -> None:
        self.name = name
        self.named = _local_params(specs, topo.size("ep"), seed=topo.rank("ep"))
        g = torch.Generator().manual_seed(1000 + topo.rank("replica"))
        self.grads = [torch.randn(p.shape, generator=g) * 1e-3 for _, p in self.named]
        self.times: list[float] = []
        if name.startswith("a"):
            self.opt = torch.optim.AdamW(_groups(self.named), lr=1e-3, fused=name == "a,fused")
            self.reduce = _BucketedAllReduce(self.named, topo, bucket_numel, rooted=name == "a,fused")
        elif name == MUON_VARIANTS[0]:
            self.opt = MulaMuon(_muon_groups(self.named), lr=1e-3)
            self.reduce = _BucketedAllReduce(self.named, topo, bucket_numel, rooted=True)
        elif name in MUON_VARIANTS:
            kind = _AllGatherMuon if name == MUON_VARIANTS[1] else _MeteredMuon
            self.opt = kind(
                _muon_groups(self.named), self.named, topo, lr=1e-3, overlap_grad_reduce=False,
                bucket_numel=bucket_numel,
            )  # fmt: skip
        else:
            self.opt = EPShardedAdamW(
                _groups(self.named), self.named, topo, lr=1e-3, overlap_grad_reduce=False,
                bucket_numel=bucket_numel, ep_aware=name == "EP-aware",
            )  # fmt: skip

    def set_grads(self) -> None:
        """Gradients as backward would leave them (not timed)."""
        for (_, p), g in zip(self.named, self.grads):
            p.grad = g.clone()

    def step(self) -> None:
        """Gradient reduction + update + (sharded) parameter all-gather."""
        if isinstance(self.opt, EPShardedAdamW):
            self.opt.step()
        else:
            self.reduce()
            self.opt.step()

    def report(self) -> dict[str, Any]:
        """Median step time, every step's time and this rank's memory."""
        if isinstance(self.opt, EPShardedAdamW):
            state, grad_bytes = self.opt.state_bytes(), self.opt.grad_buffer_bytes()
        elif isinstance(self.opt, MulaMuon):  # its fp32 parameters are the master weights
            state = self.opt.state_bytes() + sum(p.numel() * 4 for _, p in self.named)
            grad_bytes = sum(p.numel() * 4 for _, p in self.named)
        else:
            moments = sum(
                t.numel() * t.element_size() for s in self.opt.state.values() for t in s.values() if t.dim()
            )
            state = moments + sum(p.numel() * 4 for _, p in self.named)  # fp32 params are the master weights
            grad_bytes = sum(p.numel() * 4 for _, p in self.named)
        return {"variant": self.name, "step_ms": statistics.median(self.times), "state_bytes": state,
                "grad_bytes": grad_bytes, "times": self.times, "exchange_bytes": self.exchange_bytes}  # fmt: skip

    exchange_bytes = 0.0  # sharded Muon: bytes its exchange sent and received in one step

    def measure_exchange(self) -> None:
        """One untimed step with sharded Muon's exchange counted (sent + received, every kind)."""
        if not isinstance(self.opt, _MeteredMuon):
            return
        self.set_grads()
        self.opt.meter = CollectiveMeter()
        self.step()
        totals = self.opt.meter.totals()
        self.exchange_bytes = sum(totals["sent"].values()) + sum(totals["received"].values())
        self.opt.meter = None


def _measure_layout(specs, topo, spec: BenchSpec) -> list[dict[str, Any]]:
    """All variants of one (W, E) layout, interleaved step by step so background load hits them alike."""
    bucket_numel = int(spec.bucket_mb * MiB) // 4
    names = MUON_VARIANTS if spec.optimizer == "muon" else VARIANTS
    variants = [_Variant(name, specs, topo, bucket_numel) for name in names]
    for v in variants:
        v.measure_exchange()
    for i in range(spec.warmup + spec.iters):
        for v in variants:
            v.set_grads()
            t0 = start_together()
            v.step()
            elapsed = slowest_rank_seconds(t0)
            if i >= spec.warmup:
                v.times.append(elapsed * 1e3)
    rows = [v.report() for v in variants]
    for v in variants:
        if isinstance(v.opt, EPShardedAdamW):
            v.opt.close()
    del variants
    gc.collect()
    return rows


def _rank_rows(rank: int, world: int, spec: BenchSpec) -> list[dict[str, Any]]:
    """Every layout's row, with the largest rank's state and gradient bytes."""
    specs = _param_specs(spec.config)
    rows = []
    for ep in [e for e in (1, 2, 4, 8) if e <= world and world % e == 0]:
        topo = build_topology(ep)
        for r in _measure_layout(specs, topo, spec):
            per_rank = [None] * world
            dist.all_gather_object(per_rank, r)
            rows.append({**r, "W": world, "E": ep, "state_bytes": max(x["state_bytes"] for x in per_rank),
                         "grad_bytes": max(x["grad_bytes"] for x in per_rank),
                         "exchange_bytes": max(x["exchange_bytes"] for x in per_rank)})  # fmt: skip
    return rows


def _formula_bytes(variant: str, p_dense: int, p_expert: int, w: int, e: int) -> float:
    edp = w // e
    if variant.startswith("a"):
        return 12 * (p_dense + p_expert / e)
    if variant == "b":
        return 12 * (p_dense / edp + p_expert / w)
    return 12 * (p_dense + p_expert) / w


def table(rows: list[dict[str, Any]], p_dense: int, p_expert: int) -> str:
    """Markdown table of the measured rows, with the memory formula and speedups against (a)."""
    cells = []
    for r in rows:
        base = next(x for x in rows if x["W"] == r["W"] and x["E"] == r["E"] and x["variant"] == "a")
        fused = next(x for x in rows if x["W"] == r["W"] and x["E"] == r["E"] and x["variant"] == "a,fused")
        f = _formula_bytes(r["variant"], p_dense, p_expert, r["W"], r["E"])
        cells.append([
            r["W"], r["E"], r["variant"], f"{r['state_bytes'] / MiB:.1f}", f"{f / MiB:.1f}",
            f"{base['state_bytes'] / r['state_bytes']:.2f}x", f"{r['grad_bytes'] / MiB:.1f}", f"{r['step_ms']:.1f}",
            f"{base['step_ms'] / r['step_ms']:.2f}x", f"{fused['step_ms'] / r['step_ms']:.2f}x",
        ])  # fmt: skip
    head = ["W", "E", "optimizer", "state MiB/rank", "formula MiB", "state vs (a)", "grad buffers MiB", "step ms",
            "speedup vs (a)", "vs (a,fused)"]  # fmt: skip
    return markdown_table(head, cells)


def summary(rows: list[dict[str, Any]], p_dense: int, p_expert: int, w: int = 4, e: int = 4) -> str:
    """One line on the headline layout (W=4, E=4): speedups and memory ratio vs the formula."""
    pick = {r["variant"]: r for r in rows if r["W"] == w and r["E"] == e}
    if not {"a", "a,fused", "EP-aware"} <= set(pick):
        return ""
    ours, a, fused = pick["EP-aware"], pick["a"], pick["a,fused"]
    formula = _formula_bytes("a", p_dense, p_expert, w, e) / _formula_bytes(
        "EP-aware", p_dense, p_expert, w, e
    )
    return (
        f"\n\nW={w}, E={e}: EP-aware steps are {a['step_ms'] / ours['step_ms']:.2f}x faster than (a) and "
        f"{fused['step_ms'] / ours['step_ms']:.2f}x faster than (a,fused); per-rank state is "
        f"{a['state_bytes'] / ours['state_bytes']:.2f}x smaller than (a) (formula {formula:.2f}x)."
    )


def _muon_counts(specs) -> dict[tuple[bool, bool], int]:
    """Parameter elements by (trained by Muon, expert)."""
    counts = {(m, e): 0 for m in (False, True) for e in (False, True)}
    for name, shape in specs:
        counts[(is_muon_param(name, shape), is_expert_param(name))] += int(torch.Size(shape).numel())
    return counts


def _muon_formula_bytes(variant: str, counts: dict[tuple[bool, bool], int], w: int, e: int) -> float:
    """State per rank: fp32 master (the replicated run's fp32 parameters) + momentum per Muon element, +
    exp_avg + exp_avg_sq per AdamW element; experts 1/E of theirs per rank; sharded, all of it over W."""
    per = {True: 8, False: 12}
    if variant == MUON_VARIANTS[0]:
        return sum(per[m] * n / (e if expert else 1) for (m, expert), n in counts.items())
    return sum(per[m] * n for (m, _), n in counts.items()) / w


def muon_table(rows: list[dict[str, Any]], counts: dict[tuple[bool, bool], int]) -> str:
    """Markdown table of the Muon rows: state against the formula, the sharded exchange's bytes (the
    busiest rank's, sent + received, against the all-gather version's), the step's median and range, and
    the step's speedup as the median (and range) of the per-round ratios (rounds are interleaved)."""
    cells = []
    for r in rows:
        layout = [x for x in rows if (x["W"], x["E"]) == (r["W"], r["E"])]
        base = next(x for x in layout if x["variant"] == MUON_VARIANTS[0])
        gathered = next(x for x in layout if x["variant"] == MUON_VARIANTS[1])
        ratios = [b / t for b, t in zip(base["times"], r["times"])]
        f = _muon_formula_bytes(r["variant"], counts, r["W"], r["E"])
        moved = r["exchange_bytes"]
        vs = f"{moved / gathered['exchange_bytes']:.2f}x" if moved and gathered["exchange_bytes"] else "-"
        cells.append([
            r["W"], r["E"], r["variant"], f"{r['state_bytes'] / MiB:.1f}", f"{f / MiB:.1f}",
            f"{moved / MiB:.2f}" if r["variant"] != MUON_VARIANTS[0] else "-", vs,
            median_range(r["times"]), spread(ratios),
        ])  # fmt: skip
    head = ["W", "E", "optimizer", "state MiB/rank", "formula MiB", "exchange MiB/rank", "vs all-gather",
            "step ms [range]", "speedup vs replicated [range]"]  # fmt: skip
    return markdown_table(head, cells)


def main(
    worlds: list[int] = [2, 4],  # noqa: B006 (jsonargparse reads the default from the signature)
    iters: int = 10,
    warmup: int = 2,
    bucket_mb: float = 16.0,
    model: str = "mula-7b-a1b",
    hidden_size: int = 256,
    num_layers: int = 2,
    num_heads: int = 4,
    expert_intermediate_size: int = 256,
    vocab_size: int = 4096,
    optimizer: str = "adamw",
    doc: str | None = None,
) -> str:
    """Run the comparison for each world size, print the table, optionally write it into ``doc``.

    The model defaults to Mula-7B-A1B's shape (64 experts, top-8) shrunk to fit a laptop-class CPU.
    ``optimizer``: "adamw" (the sharded AdamW against its alternatives) or "muon" (replicated against
    EP-aware sharded Muon, Moonlight's rule: Muon for the blocks' matrices, AdamW for the rest).
    """
    if optimizer not in ("adamw", "muon"):
        raise ValueError(f"optimizer must be adamw or muon, got {optimizer!r}.")
    if any(w < 1 for w in worlds) or iters < 1:
        raise ValueError(f"worlds must be positive and iters >= 1, got {worlds} and {iters}.")
    cfg = MulaConfig.from_name(
        model, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
        expert_intermediate_size=expert_intermediate_size, vocab_size=vocab_size,
    )  # fmt: skip
    spec = BenchSpec(dataclasses.asdict(cfg), iters, warmup, bucket_mb, optimizer)
    specs = _param_specs(spec.config)
    p_expert = sum(int(torch.Size(s).numel()) for n, s in specs if is_expert_param(n))
    p_dense = sum(int(torch.Size(s).numel()) for n, s in specs) - p_expert
    rows: list[dict[str, Any]] = []
    for w in worlds:
        rows += run_gloo(_rank_rows, w, spec)[0]
    if optimizer == "muon":
        counts = _muon_counts(specs)
        header = (
            f"Model: {model} shape shrunk to hidden {hidden_size}, {num_layers} layers, {cfg.num_experts} experts "
            f"(FFN {expert_intermediate_size}), vocab {vocab_size}: Muon {sum(n for (m, _), n in counts.items() if m) / 1e6:.2f}M "
            f"elements (experts {counts[(True, True)] / 1e6:.2f}M), AdamW {sum(n for (m, _), n in counts.items() if not m) / 1e6:.2f}M. "
            f"fp32 master, bf16 Newton-Schulz (5 steps), gloo, 1 torch thread per rank, {iters} interleaved "
            f"rounds after {warmup} warm-up (slowest rank), {bucket_mb:g} MiB buckets.\n{host_line()}"
        )
        result = header + "\n\n" + muon_table(rows, counts)
        return publish(result, doc, MUON_SECTION, _muon_doc_section(result, worlds, iters, warmup))
    header = (
        f"Model: {model} shape shrunk to hidden {hidden_size}, {num_layers} layers, {cfg.num_experts} experts "
        f"(FFN {expert_intermediate_size}), vocab {vocab_size}: P_dense = {p_dense / 1e6:.2f}M, "
        f"P_expert = {p_expert / 1e6:.2f}M. fp32, gloo, {os.cpu_count()} CPU cores, 1 torch thread per rank, "
        f"median of {iters} steps (slowest rank), {bucket_mb:g} MiB buckets."
    )
    result = header + "\n\n" + table(rows, p_dense, p_expert) + summary(rows, p_dense, p_expert)
    return publish(result, doc, SECTION, _doc_section(result, worlds, iters))


def _muon_doc_section(result: str, worlds: list[int], iters: int, warmup: int) -> str:
    return f"""{MUON_SECTION}

EP-aware sharded Muon (`strategies/optim/sharded_muon.py`) against replicated Muon (`MulaMuon` after the
same per-shard reduce + broadcast all-reduce as (a,fused) above: every rank runs the Newton-Schulz of every
matrix it holds), and against sharded Muon with the exchange it had before the all-to-all ("all-gather":
the update all-gathered, the result reduce-scattered; rebuilt in the benchmark). Made with:

    .venv/bin/python benchmarks/optimizer.py --optimizer muon --worlds [{",".join(map(str, worlds))}] \\
        --iters {iters} --warmup {warmup} --doc docs/benchmarks.md

{result}

How to read it.

- "step" = gradient reduction + update (Newton-Schulz included) + parameter all-gather, slowest rank;
  the variants alternate step by step, and the speedup is the median of the per-round ratios with their
  range. No backward runs (nothing overlaps the reduction).
- "state" = fp32 master weights (the replicated run's fp32 parameters) + Muon's momentum (AdamW's two
  moments for its parameters) on the worst rank; the formula is 8 bytes per Muon element and 12 per
  AdamW element, experts' divided by E, replicated; everything divided by W, sharded. Measured equals
  the formula up to alignment padding.
- Sharded, each matrix is orthogonalised once per data-parallel group (dense ones by one of the W ranks,
  experts' by one of their EDP ranks), against once per rank replicated: at E = 1 the Newton-Schulz work
  per rank falls W times, at E = W (EDP = 1) only the dense matrices' does. What sharding adds is the
  exchange: each rank's bf16 update slices to their matrices' owners and the orthogonalised slices back,
  two all-to-alls per bucket, about 2/W of the Muon elements in and as many out per rank.
- "exchange" = bytes the busiest rank's exchange sent plus received in one step, counted on its
  collectives (`mula.bench.collectives.CollectiveMeter`, an untimed step); "vs all-gather" divides it
  by the all-gather version's, which moves 2 (W - 1)/W of the Muon elements each way. Expert matrices
  at E = W have no peers (EDP = 1): neither version moves them.
- On this 2-core machine W = 4 runs 4 single-threaded ranks on 2 cores: ranks' Newton-Schulz compete for
  the cores, so the W = 4 speedups understate what 4 devices would see. The last run shared the host
  with other jobs (load average about 12, whatever the host line says): its times and their ranges are
  noisy, and the all-to-all's gain in time is not resolved by them; its bytes are exact.
"""


def _doc_section(result: str, worlds: list[int], iters: int) -> str:
    return f"""{SECTION}

EP-aware sharded AdamW (`strategies/optim/sharded_optimizer.py`) against unsharded AdamW with all-reduced
gradients, (a), and an EP-unaware sharding, (b). Made with:

    .venv/bin/python benchmarks/optimizer.py --worlds [{",".join(map(str, worlds))}] --iters {iters} \\
        --doc docs/benchmarks.md

{result}

How to read it.

- "step" = gradient reduction + AdamW update + parameter all-gather: from gradients ready to updated
  parameters back in the model, slowest rank. No backward runs, so the sharded optimizers get no
  credit for hiding the reduce-scatter behind backward (they do that in training).
- "state" = fp32 master weights + both Adam moments on the worst rank; "formula" is
  12*(P_d + P_e/E) for (a), 12*(P_d/EDP + P_e/W) for (b) and 12*(P_d + P_e)/W for the EP-aware
  optimizer. Measured = formula up to the alignment padding (16 elements per parameter and shard
  boundary, < 0.1 MiB here). The EP-aware/(a) memory ratio is the formula's: W*(P_d + P_e/E)/P.
- (a) is what a Lightning user gets: `torch.optim.AdamW` defaults (a per-parameter loop on CPU)
  after DDP-style bucketed `all_reduce`. (a,fused) is the strongest unsharded baseline: the fused
  AdamW kernel plus the same collectives the sharded optimizer uses, so EP-aware vs (a,fused) is the
  gain of sharding alone: each rank updates 1/W of the dense state and 1/EDP of its experts' state.
- Collectives on gloo: the sharded optimizer builds reduce-scatter from one `reduce` per shard
  (rooted at its owner) and all-gather from one `broadcast` per shard (`collectives="auto"`; NCCL and
  XCCL use their native reduce-scatter/all-gather). Same bytes moved, but on this machine, 4 ranks,
  64 MiB fp32: `all_reduce` ~310 ms, `reduce_scatter_tensor` ~470-740 ms, `all_gather_into_tensor`
  ~600 ms, per-shard `reduce` ~165 ms, per-shard `broadcast` ~92 ms.
- The machine has 2 cores and was shared with other jobs (load average ~8): W=4 runs 4
  single-threaded ranks on 2 cores, so compute and gloo's loopback traffic contend for the same
  cores and absolute times compare only within one W. Variants are interleaved step by step so
  background load hits them alike; rows that must be equal (E=1: (b) and EP-aware are the same
  layout) differ by up to ~10%, which is the noise level.
- At E = W = 4 (EDP = 1) no variant replicates expert state, so the memory gain is the dense part
  (1.29x); the step-time gain comes from the dense update being split 4 ways plus the fused
  flat-buffer update. The target is >= 1.7x faster steps than (a) at W=4/E=4.
"""


if __name__ == "__main__":
    from jsonargparse import CLI

    CLI(main)
