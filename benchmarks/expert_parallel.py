"""Training throughput of expert parallelism (E = 1, 2, 4) against plain DDP of the same MoE model.

W gloo CPU processes (default 4, one torch thread each) train the same Mula MoE from the same seed
on the same fixed token batches, full training steps (forward, backward, gradient sync, AdamW):

  DDP         torch DistributedDataParallel + torch.optim.AdamW: every rank holds every expert;
  (before)    the same EP layout with the previous all-to-all dispatcher, kept in this file
              (`BeforeDispatcher`), so one run prints tokens/s before and after the fast path;
  uniform     routing_mode="uniform": every expert gets the same number of tokens, which isolates
              kernels and communication from routing skew;
  EP E=k      the strategy's path: experts sliced over EP groups of k ranks, all-to-all dispatch,
              bucketed EP-aware gradient all-reduce (strategies.optim.grad_sync) + torch.optim.AdamW;
  EP E=k +S   the same with the EP-aware sharded optimizer (strategies.optim.sharded_optimizer), which is
              XPUMoEStrategy's default.

Reported per layout: global tokens/s (slowest rank's step time, median over steps), step time, bytes
each rank sends in all-to-all per step, parameter and optimizer-state memory per rank. On CPUs the
ranks share a few cores, so throughput mostly reflects total work plus communication overhead; the
memory columns show what expert parallelism buys. Benchmarks print tables and never assert.

    python benchmarks/expert_parallel.py --doc docs/benchmarks.md
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import (  # benchmarks/ is on sys.path when run as a script
    MiB,
    by_case,
    gloo_ranks,
    largest_over_ranks,
    markdown_table,
    medians,
    moe_config,
    moe_shape,
    publish,
    run_gloo,
    slowest_rank_seconds,
    spread,
    start_together,
)
from torch import Tensor

from mula import Mula, MulaConfig
from mula.model.moe import iter_moe_layers
from strategies.experts.all_to_all import AllToAllDispatcher, _AllToAll, wire_dtype
from strategies.experts.expert_parallel import apply_expert_parallel
from strategies.optim.grad_sync import GradientSynchronizer
from strategies.topology import build_topology

SECTION = "## expert_parallel"


@dataclasses.dataclass
class Case:
    """One row of the table."""

    name: str
    ep_size: int  # 0 = DDP
    sharded: bool = False
    before: bool = False  # the previous all-to-all dispatcher (`BeforeDispatcher`)
    routing: str = "learned"  # MulaConfig.routing_mode: "uniform" isolates kernels and communication


@dataclasses.dataclass
class Spec:
    """What every worker runs (picklable)."""

    config: dict[str, Any]
    cases: list[Case]
    micro_batch: int
    seq_len: int
    steps: int
    warmup: int


# ----- the previous expert-parallel dispatcher (the "before" rows) -----------------------------------
@dataclasses.dataclass
class _BeforeState:
    """What `combine` needs to undo `dispatch` for one call."""

    inv_order: Tensor  # [N*K] position of each (token, k) pair in the expert-sorted send buffer
    wire_dtype: torch.dtype  # dtype the token rows travel in
    out_dtype: torch.dtype  # dtype of dispatch's input, which combine returns
    regroup: Tensor | None  # [M] received-row index of each expert-ordered row (None: identity)
    send_splits: list[int]
    recv_splits: list[int]
    topk_weight: Tensor  # [N, K]
    num_tokens: int
    top_k: int


class BeforeDispatcher:
    """The all-to-all dispatcher as it was before it moved onto the local path's plan and kernels (the
    "before" rows): its own argsort and index_select, the counts copied to the host in two syncs, a
    CPU-built regroup index, and an [N, K, H] gather + weighted sum to combine. Kept here, not in
    the library, so that one run measures both."""

    def __init__(self, current: AllToAllDispatcher) -> None:
        self.num_experts, self.ep_size, self.ep_rank = current.num_experts, current.ep_size, current.ep_rank
        self.ep_group, self.num_local_experts, self.bytes_sent = (
            current.ep_group,
            current.num_local_experts,
            0,
        )

    def dispatch(
        self, x: Tensor, topk_idx: Tensor, topk_weight: Tensor
    ) -> tuple[Tensor, Tensor, _BeforeState]:
        """Send rows of x [N, H] to their top-k experts' ranks.

        Returns (x_sorted [M, H] grouped by local expert, tokens_per_local_expert [E_local] long, state).
        """
        num_tokens, top_k = topk_idx.shape
        flat_idx = topk_idx.reshape(-1)
        # Stable sort keeps token order inside each expert, like the single-process dispatcher.
        order = torch.argsort(flat_idx, stable=True)
        inv_order = torch.empty_like(order)
        inv_order[order] = torch.arange(order.numel(), device=order.device)
        x_send = x.index_select(0, order // top_k)
        counts = torch.bincount(flat_idx, minlength=self.num_experts)

        if self.ep_size == 1:
            state = _BeforeState(inv_order, x.dtype, x.dtype, None, [], [], topk_weight, num_tokens, top_k)
            return x_send, counts, state
        wire = wire_dtype(x)
        x_send = x_send.to(wire)

        # counts.view(ep, E_local)[p] goes to EP rank p: rows of recv_counts are source ranks.
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.ep_group)
        self.bytes_sent += (self.ep_size - 1) * self.num_local_experts * counts.element_size()
        send_splits = counts.view(self.ep_size, self.num_local_experts).sum(1).tolist()
        recv_table = recv_counts.view(self.ep_size, self.num_local_experts).cpu()
        recv_splits = recv_table.sum(1).tolist()

        # Back in the layer's dtype: the experts get what they would get without expert parallelism
        # (under autocast they cast to bf16 again, exactly, since the values are bf16 already).
        x_recv = _AllToAll.apply(x_send, recv_splits, send_splits, self.ep_group, self).to(x.dtype)
        regroup = _regroup_index(recv_table).to(x.device)
        x_sorted = x_recv.index_select(0, regroup)
        tokens_per_local_expert = recv_table.sum(0).to(device=x.device, dtype=torch.long)
        state = _BeforeState(
            inv_order, wire, x.dtype, regroup, send_splits, recv_splits, topk_weight, num_tokens, top_k
        )
        return x_sorted, tokens_per_local_expert, state

    def combine(self, y_sorted: Tensor, state: _BeforeState) -> Tensor:
        """Bring expert outputs back to their tokens and return the weighted sum y [N, H]."""
        if state.regroup is not None:
            # Undo the regrouping: the row at received position regroup[i] is y_sorted[i].
            inv_regroup = torch.empty_like(state.regroup)
            inv_regroup[state.regroup] = torch.arange(state.regroup.numel(), device=state.regroup.device)
            y_recv = y_sorted.index_select(0, inv_regroup).to(state.wire_dtype)
            y_send = _AllToAll.apply(y_recv, state.send_splits, state.recv_splits, self.ep_group, self)
            y_send = y_send.to(state.out_dtype)
        else:
            y_send = y_sorted
        y_pairs = y_send.index_select(0, state.inv_order).view(
            state.num_tokens, state.top_k, y_send.shape[-1]
        )
        weights = state.topk_weight.to(y_pairs.dtype).unsqueeze(-1)
        return (y_pairs * weights).sum(dim=1)


def _regroup_index(recv_table: Tensor) -> Tensor:
    """Index that reorders received rows from (source, local expert) blocks to (local expert, source).

    recv_table [ep, E_local] holds the row count of each block in arrival order (source-major).
    """
    sizes = recv_table.reshape(-1)
    starts = (torch.cumsum(sizes, 0) - sizes).view_as(recv_table)
    # Visit blocks expert-major; each block contributes its consecutive received rows.
    block_starts = starts.t().reshape(-1)
    block_sizes = recv_table.t().reshape(-1)
    out_starts = torch.cumsum(block_sizes, 0) - block_sizes
    total = int(block_sizes.sum())
    shift = torch.repeat_interleave(block_starts - out_starts, block_sizes, output_size=total)
    return torch.arange(total, dtype=torch.long) + shift


def _loss(model: torch.nn.Module, batch: torch.Tensor, config: MulaConfig) -> torch.Tensor:
    out = model(batch[:, :-1])
    ce = F.cross_entropy(out.logits.float().flatten(0, 1), batch[:, 1:].flatten())
    return ce + config.router_aux_loss_coef * out.aux_loss + config.router_z_loss_coef * out.z_loss


def _run_case(case: Case, spec: Spec, rank: int, world: int) -> dict[str, Any]:
    config = MulaConfig(**{**spec.config, "routing_mode": case.routing})
    torch.manual_seed(0)
    model = Mula(config)
    sync = None
    if case.ep_size == 0:
        net: torch.nn.Module = torch.nn.parallel.DistributedDataParallel(model)
        optimizer: Any = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    else:
        topo = build_topology(case.ep_size)
        apply_expert_parallel(model, topo)
        if case.before:
            for _, layer in iter_moe_layers(model):
                if isinstance(layer.dispatcher, AllToAllDispatcher):
                    layer.dispatcher = BeforeDispatcher(layer.dispatcher)
        net = model
        named = list(model.named_parameters())
        adamw = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
        if case.sharded:
            from strategies.optim.sharded_optimizer import EPShardedAdamW

            optimizer = EPShardedAdamW.from_adamw(adamw, named, topo)
        else:
            optimizer = adamw
            sync = GradientSynchronizer(named, topo, bucket_size_mb=16.0)
    dispatchers = [
        layer.dispatcher
        for _, layer in iter_moe_layers(model)
        if isinstance(layer.dispatcher, (AllToAllDispatcher, BeforeDispatcher))
    ]
    g = torch.Generator().manual_seed(1000 + rank)
    batches = [
        torch.randint(0, config.vocab_size, (spec.micro_batch, spec.seq_len + 1), generator=g)
        for _ in range(spec.warmup + spec.steps)
    ]
    times, sent = [], 0
    for i, batch in enumerate(batches):
        if i == spec.warmup:
            for d in dispatchers:
                d.bytes_sent = 0
        start = start_together()
        optimizer.zero_grad(set_to_none=True)
        _loss(net, batch, config).backward()
        if sync is not None:
            sync.finish()
        optimizer.step()
        elapsed = slowest_rank_seconds(start)
        if i >= spec.warmup:
            times.append(elapsed)
    sent = sum(d.bytes_sent for d in dispatchers) / spec.steps
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if hasattr(optimizer, "state_bytes"):
        state_bytes = optimizer.state_bytes()
    else:  # unsharded AdamW: the fp32 parameters are the master weights, plus two moments
        state_bytes = 3 * param_bytes
    if sync is not None:
        sync.remove_hooks()
    if hasattr(optimizer, "close"):
        optimizer.close()
    step_s = statistics.median(times)
    return {
        "case": case.name,
        "ep_size": case.ep_size,
        "step_ms": step_s * 1e3,
        "tokens_per_s": world * spec.micro_batch * spec.seq_len / step_s,
        "a2a_mib": sent / MiB,
        "param_mib": param_bytes / MiB,
        "state_mib": state_bytes / MiB,
    }


def _rank_rows(rank: int, world: int, spec: Spec) -> list[dict[str, Any]]:
    return [_run_case(case, spec, rank, world) for case in spec.cases]


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown table; speedups relative to the DDP row."""
    base = next(r for r in rows if r["ep_size"] == 0)
    head = ["layout", "tokens/s", "vs DDP", "step ms", "a2a MiB sent/rank/step", "params MiB/rank",
            "optimizer state MiB/rank"]  # fmt: skip
    return markdown_table(head, [
        [r["case"], f"{r['tokens_per_s']:.0f}", f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x",
         f"{r['step_ms']:.0f}", f"{r['a2a_mib']:.1f}", f"{r['param_mib']:.1f}", f"{r['state_mib']:.1f}"]
        for r in rows
    ])  # fmt: skip


def before_after(rows: list[dict[str, Any]]) -> str:
    """Markdown table: the all-to-all dispatcher before and after its fast path, per layout; the ratio is
    taken within each interleaved round (median [min-max] over rounds)."""
    grouped = by_case(rows)
    med = statistics.median
    cells = [
        [case, f"{med(b['tokens_per_s'] for b in prev):.0f}", f"{med(a['tokens_per_s'] for a in after):.0f}",
         spread([a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(after, prev)])]
        for case, after in grouped.items()
        if (prev := grouped.get(f"{case} (before)")) is not None
    ]  # fmt: skip
    head = ["layout", "before tokens/s", "after tokens/s", "after / before (median [min-max] of rounds)"]
    return markdown_table(head, cells)


def main(
    world: int = 4,
    ep_sizes: list[int] = [1, 2, 4],  # noqa: B006 (jsonargparse reads the default from the signature)
    sharded: bool = True,
    before: bool = True,
    uniform: bool = True,
    steps: int = 5,
    warmup: int = 2,
    micro_batch: int = 4,
    seq_len: int = 256,
    hidden_size: int = 256,
    num_layers: int = 4,
    num_experts: int = 16,
    top_k: int = 4,
    expert_intermediate_size: int = 256,
    vocab_size: int = 4096,
    rounds: int = 3,
    doc: str | None = None,
) -> str:
    """Run DDP and EP (each E, plain and sharded optimizer) in one job of `world` CPU processes.

    `before`: also run each E > 1 with the previous all-to-all dispatcher (`BeforeDispatcher`) and
    print tokens/s before and after; `uniform`: also run the largest E with uniform routing (every
    expert the same number of tokens), which separates the kernels and communication from routing skew.
    """
    bad = [e for e in ep_sizes if e < 1 or world % e or num_experts % e]
    if bad:
        raise ValueError(f"ep_sizes {bad} must divide both world={world} and num_experts={num_experts}.")
    config = moe_config(
        seq_len, hidden_size=hidden_size, num_layers=num_layers, num_experts=num_experts, top_k=top_k,
        expert_intermediate_size=expert_intermediate_size, vocab_size=vocab_size,
    )  # fmt: skip
    cases = [Case("DDP", 0)]
    for e in ep_sizes:
        cases.append(Case(f"EP E={e}", e))
        if before and e > 1:
            cases.append(Case(f"EP E={e} (before)", e, before=True))
        if sharded:
            cases.append(Case(f"EP E={e} + sharded AdamW", e, sharded=True))
    if uniform:
        e = max(ep_sizes)
        cases.append(Case(f"EP E={e} uniform routing", e, routing="uniform"))
        if before and e > 1:
            cases.append(Case(f"EP E={e} uniform routing (before)", e, before=True, routing="uniform"))
    runs = [case for _ in range(rounds) for case in cases]  # interleaved rounds: drift hits every layout
    spec = Spec(dataclasses.asdict(config), runs, micro_batch, seq_len, steps, warmup)
    # rank 0's rows with the largest rank's bytes (they differ per rank only by rounding)
    rows = largest_over_ranks(run_gloo(_rank_rows, world, spec), ("a2a_mib", "param_mib", "state_mib"))
    header = (
        f"Model: {moe_shape(config)}. fp32, gloo, {gloo_ranks(world)}, micro-batch {micro_batch} x {seq_len} "
        f"tokens per rank, median of {steps} full training steps (slowest rank) after {warmup} warm-up steps; "
        f"every number is the median of {rounds} interleaved rounds."
    )
    result = header + "\n\n" + table(medians(rows))
    if any(r["case"].endswith("(before)") for r in rows):
        result += (
            "\n\nThe all-to-all dispatcher before and after its fast path (same run):\n\n"
            + before_after(rows)
        )
    return publish(result, doc, SECTION, _doc_section(result, world))


def _doc_section(result: str, world: int) -> str:
    return f"""{SECTION}

Expert parallelism (`strategies/`, what `XPUMoEStrategy` runs) against plain DDP of the same model,
all in one job. Made with:

    .venv/bin/python benchmarks/expert_parallel.py --world {world} --doc docs/benchmarks.md

{result}

How to read it.

- Every layout does the same model arithmetic per token (dropless routing, identical batches); what
  differs is how it is split. DDP all-reduces every expert's gradient over all W ranks; EP all-reduces
  experts only over EDP = W/E ranks but exchanges tokens twice per MoE layer forward and twice
  backward (the a2a column), and each rank runs its E_total/E experts on E times more tokens each
  (fewer, larger GEMMs). The sharded optimizer updates only 1/W of the state per rank.
- On these shared CPU cores EP's savings (smaller expert all-reduce, larger GEMMs) outweigh the
  all-to-all at E=4, and the sharded optimizer adds its own gain on top; the rows are single runs
  on a machine other jobs may share, so differences below ~10% are noise.
- "params MiB/rank": EP keeps num_experts/E experts per rank, so expert memory falls by E; with the
  sharded optimizer the fp32 master weights and moments are split once over all W ranks
  (12 bytes x P / W), against 12 bytes x (P_dense + P_expert/E) without it.
- On GPUs the all-to-all runs on xccl/nccl inside a node (E = devices per node) and the gain is the
  larger per-device batch and model that fit; these CPU numbers show the overheads, not that gain.
"""


if __name__ == "__main__":
    from jsonargparse import CLI

    CLI(main)
