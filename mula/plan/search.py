"""`mula plan --search`: the layouts that fit the device (and the node's host memory), fastest first.

Varies the expert-parallel size E (divisors of the experts up to one node), pipeline stages P (powers of
two up to the number of layers: a 1T dense model needs 16 or more), the tensor-parallel size T (1, 2, 4, 8 up to one node, with and without sequence parallelism, with
or without stages: T x P layouts split each stage over its TP group), the context-parallel size C
(Ulysses: C x T dividing a node's devices, so that both stay on its fabric, innermost in the rank order;
the heads and the sequence split by C), the micro-batch (1, 2, 4, 8), activation checkpointing (none,
moe, moe+attention, full), the ZeRO stage (1, 2), bf16 weights (bf16-true with fp32 masters in the
sharded optimizer, or the recipe's precision) and optimizer offload (`optimizer_options.offload`: the
masters and moments in host memory) at the recipe's ranks, sequence length and global batch. Which
combinations run is decided in one place, `check_runnable` (`mula.layout.rules`): `--search` lists
only layouts `mula plan` and `mula fit` accept. The step-time model does not price offload's host
update (docs/offload.md), so at equal step time a layout without offload comes first. Without a
machine (no step-time model) the layouts are sorted by device memory instead.
"""

from __future__ import annotations

import itertools
from typing import Any

from mula.layout.rules import micro_batches_per_step
from mula.plan.layout import Layout, check_runnable
from mula.plan.memory import plan_memory
from mula.plan.settings import PlanInputs
from mula.plan.step_time import step_time

CHECKPOINTING: list[Any] = ["none", ["moe"], ["moe", "attention"], "full"]
MICRO_BATCHES = (1, 2, 4, 8)
TENSOR = (1, 2, 4, 8)
OFFLOAD = (False, True)


def _tensor_choices(inputs: PlanInputs, node: int) -> list[tuple[int, bool]]:
    """(T, sequence parallel) pairs to try: T up to one node (TP stays on a node's fabric), SP where
    T splits the sequence (as an MoE model's layers always do under TP: their tokens are split)."""
    seq, moe = inputs.layout.seq_len, inputs.config.is_moe
    return [(1, False)] + [
        (t, sp) for t in TENSOR[1:] if t <= node for sp in (False, True) if not (sp or moe) or seq % t == 0
    ]


def _pipeline_choices(num_layers: int) -> list[int]:
    """P to try: 1, 2, 4, ... up to one block per stage (uneven splits are `check_runnable`'s to refuse)."""
    return [1 << i for i in range(num_layers.bit_length()) if 1 << i <= num_layers]


def _context_choices(node: int, tp: int) -> list[int]:
    """C to try next to T: 1, and every C > 1 with C x T dividing a node's `node` devices (the CP and TP
    groups, innermost in the rank order, stay inside one node); whether the heads and the sequence split
    is `check_runnable`'s."""
    return [1] + [c for c in range(2, node // tp + 1) if node % (c * tp) == 0]


def candidate_layouts(inputs: PlanInputs) -> list[Layout]:
    """Every valid layout of the search space for `inputs`' model, ranks and batch."""
    config, base = inputs.config, inputs.layout
    node = inputs.machine.tiles_per_node if inputs.machine else base.world_size
    eps = [e for e in range(1, node + 1) if config.num_experts % e == 0] if config.is_moe else [1]
    bf16 = "bf16-mixed" if base.precision == "bf16-true" else base.precision
    out = []
    tensor_context = [
        (t, sp, c) for t, sp in _tensor_choices(inputs, node) for c in _context_choices(node, t)
    ]
    for e, p, (t, sp, c), mb, ckpt, zero, precision, offload in itertools.product(
        eps,
        _pipeline_choices(config.num_layers),
        tensor_context,
        MICRO_BATCHES,
        # a dense model has no MoE layers to recompute: ["moe"] would repeat "none" row for row
        CHECKPOINTING if config.is_moe else [c for c in CHECKPOINTING if c != ["moe"]],
        (1, 2),
        ("bf16-true", bf16),
        OFFLOAD,
    ):
        try:  # P * T * C that does not divide W: the layout refuses it
            layout = base.replace(
                ep_size=e, pp_size=p, tp_size=t, sequence_parallel=sp, cp_size=c, micro_batch=mb,
                checkpointing=ckpt, zero_stage=zero, precision=precision, shard_optimizer=True,
                pp_stage_layers=None, pp_virtual_stages=1 if p == 1 else base.pp_virtual_stages,
                offload=offload, offload_tail_buckets=base.offload_tail_buckets if offload else 0,
            )  # fmt: skip
            steps = micro_batches_per_step(inputs.global_batch, layout.dp_size, mb, check=False)
            layout = layout.replace(micro_batches=steps)
            check_runnable(config, layout, inputs.global_batch)  # what the strategy would refuse
        except ValueError:
            continue
        out.append(layout)
    return out


def search_layouts(inputs: PlanInputs, limit: int = 15) -> list[dict[str, Any]]:
    """The `limit` fastest layouts that fit the device and the node's host memory (smallest device
    memory first without a machine), as table rows: the layout, device bytes per rank (`total_gb`) and
    host bytes per rank (`host_gb`: the offloaded optimizer, an asynchronous checkpoint's staging copy)."""
    rows = []
    for layout in candidate_layouts(inputs):
        mem = plan_memory(inputs.config, layout)
        if mem.total > inputs.device_bytes or inputs.host_fit(mem.host_bytes)["host_fits"] is False:
            continue
        time = (
            step_time(inputs.config, layout, inputs.machine, inputs.global_batch) if inputs.machine else None
        )
        rows.append({
            "E": layout.ep_size, "P": layout.pp_size, "T": layout.tp_size, "SP": layout.sequence_parallel,
            "C": layout.cp_size, "micro_batch": layout.micro_batch,
            "checkpointing": layout.checkpointing, "zero_stage": layout.zero_stage,
            "bf16_weights": layout.precision == "bf16-true", "offload": layout.offload,
            "total_gb": round(mem.total / 1e9, 2), "host_gb": round(mem.host_bytes / 1e9, 2),
            "step_time_s": None if time is None else round(time.step_time_s, 3),
        })  # fmt: skip
    # offload's host update is not priced: at equal step time the layout without it first
    rows.sort(
        key=lambda r: (r["step_time_s"] or 0.0, r["step_time_s"] is not None and r["offload"], r["total_gb"])
    )
    return rows[:limit]
