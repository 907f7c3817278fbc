"""What `mula calibrate` times of the sharded optimizer's gradient reduction beyond its collectives: the
same small model's step of two micro-batches, forward + backward, without an optimizer and with the
strategy's own sharded AdamW reducing its gradients over a group of a node, updating its shard and
gathering the parameters, at ZeRO-1 and ZeRO-2, timed in turns (`busy_times`;
`mula.plan.grad_reduction.reduction_overhead_seconds` turns the pair into seconds per bucket byte and
micro-batch).

What the collectives' curves do not price is the reducer's own work around them: every micro-batch's
gradients copied (scaled) into the flat buckets or added to what they hold, ZeRO-2's bucket buffers
allocated afresh every round and its shards landed by an add, and the slowdown a reduction in flight
causes the backward it runs beside (on CPU ranks gloo reduces on the cores that compute). The update
and the gather are in the step, as in training, because what runs between two steps' backward passes
changes their cost: on this repository's CPU host, the optimizer stepping between rounds adds 8 ms to
the small model's ZeRO-1 step and 14-21 ms to its ZeRO-2 step, where the update and gather alone
account for about 8. The optimizer is the strategy's
(`strategies.optim.sharded_optimizer.EPShardedAdamW`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from mula.calibrate.measure import busy_times, small_model_config
from mula.layout.parallel_layout import ParallelLayout
from mula.model.config import MulaConfig
from mula.model.transformer import Mula
from strategies.optim.sharded_optimizer import EPShardedAdamW
from strategies.topology import LayoutMesh

ZERO_STAGES = (1, 2)
MICRO_BATCHES = 2  # a step of two: ZeRO-1 accumulates once, ZeRO-2 reduces twice


def reduction_seconds(
    config: MulaConfig, micro_batch: int, seq_len: int, dtype: torch.dtype, device: torch.device, group: Any,
    group_rank: int, group_size: int, reps: int,
) -> dict[int, dict[str, float]]:  # fmt: skip
    """{zero stage: {"plain": s, "reduced": s, "bucket_bytes": B, ...}}: a step of `MICRO_BATCHES`
    micro-batches' forward + backward of the small model (`small_model_config`) on this rank without an
    optimizer ("plain") and with the sharded AdamW of that ZeRO stage reducing over `group` (this rank its
    `group_rank`-th of `group_size`, native collectives), updating and gathering ("reduced"), the stages in
    turns (`busy_times`: each repetition from `zero_grad` on, at the group's slowest rank). With the
    gradient bytes its buckets hold and the small model's shape, which the planner needs to price the
    reduction's own collectives, the gather and the update. Every rank of `group` must call it."""
    small = small_model_config(config)
    # one stage of `group_size` replicas, all of them one EDP group (E = 1)
    topology = LayoutMesh(
        ParallelLayout(world_size=group_size),
        group_rank,
        groups={"replica": group, "edp_cp": group, "edp": group},
    )
    torch.manual_seed(0)
    plain = Mula(small).to(device=device, dtype=dtype)
    reduced: dict[int, Any] = {}
    for stage in ZERO_STAGES:
        torch.manual_seed(0)  # the same weights on every rank of the group, as the optimizer expects
        model = Mula(small).to(device=device, dtype=dtype)
        optimizer = EPShardedAdamW(
            model.parameters(), model.named_parameters(), topology, zero_stage=stage, collectives="native"
        )
        reduced[stage] = (model, optimizer)
    torch.manual_seed(1 + group_rank)  # each data-parallel rank its own tokens
    ids = torch.randint(0, small.vocab_size, (MICRO_BATCHES, micro_batch, seq_len + 1), device=device)

    def backward(model: Any, i: int) -> None:
        out = model(ids[i, :, :-1])
        ce = F.cross_entropy(out.logits.float().flatten(0, 1), ids[i, :, 1:].flatten())
        (ce + small.router_aux_loss_coef * out.aux_loss + small.router_z_loss_coef * out.z_loss).backward()

    def plain_step() -> None:
        plain.zero_grad()
        for i in range(MICRO_BATCHES):
            backward(plain, i)

    def reduced_step(stage: int) -> None:
        model, optimizer = reduced[stage]
        optimizer.zero_grad()  # a pass over the gradient shard (ZeRO-1: the buckets are overwritten)
        for i in range(MICRO_BATCHES - 1):  # as the strategy runs an accumulation micro-batch
            with optimizer.no_sync():
                backward(model, i)
        backward(model, MICRO_BATCHES - 1)
        optimizer.step()  # reduce, update, gather: what runs between this step's backward and the next's

    steps: dict[str, Any] = {"plain": plain_step}
    steps.update({str(stage): lambda s=stage: reduced_step(s) for stage in ZERO_STAGES})
    seconds = busy_times(steps, device, reps, group)
    shape = {"num_layers": small.num_layers, "micro_batch": micro_batch, "seq_len": seq_len}
    out = {}
    for stage in ZERO_STAGES:
        optimizer = reduced[stage][1]
        numel = sum(b.numel for b in optimizer.buckets)
        bucket_bytes = numel * optimizer.reducer.states[0].dtype.itemsize
        out[stage] = {
            "plain": seconds["plain"], "reduced": seconds[str(stage)], "bucket_bytes": bucket_bytes,
            "micro_batches": MICRO_BATCHES, **shape,
        }  # fmt: skip
    return out
