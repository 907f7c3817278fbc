"""The step-time model's communication volumes against the bytes real runs hand to the collectives.

4 gloo CPU ranks train a tiny MoE (uniform routing, so every rank sends exactly (E-1)/E of its rows)
with `XPUMoEStrategy` under Lightning's Trainer, in several layouts: expert parallelism, the sharded
optimizer (ZeRO-1, ZeRO-2, EP-unaware, bf16 gradients, rooted and native collectives), replicated
AdamW, activation checkpointing, bf16 weights and bf16 autocast, pipeline stages (1F1B, interleaved),
a model whose first block is dense (no all-to-all there), and sharded Muon (its exchange planned for its
busiest rank). Every collective a step issues is counted by `mula.bench.collectives.CollectiveMeter` (the meter
`mula bench` reports with), by kind of collective, bytes sent and received as `comm_volumes` counts
them (the nccl-tests "bus bytes": what an all-to-all sends to other ranks, (n-1)/n of a
reduce-scatter's or all-gather's buffer, 2(n-1)/n of an all-reduce's; a rooted reduce or broadcast
counts what its root receives or sends, the same per rank over a bucket's shards), and the calls. Per
rank and step, `mula.plan.collective_kinds.planned_collectives` (the expert all-to-all rows with the
counts' and combine weights' exchanges, gradient reduction, parameter gather, pipeline sends, the
gradient norm's and expert counts' all-reduces) must equal them exactly, kind by kind; a missing
(E-1)/E, a lost forward or backward pass, a recompute pass, a wrong dtype, group or padding all fail it
(`test_a_planted_bug_fails_the_comparison` plants three). The second step is counted: the first also holds
the pipeline schedule's one-time set-up messages.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

import lightning.pytorch as L
import pytest
import torch
from dist_helpers import lightning_env, run_distributed

from mula import MulaConfig
from mula.bench.collectives import CollectiveSteps
from mula.plan import Layout
from mula.plan.collective_kinds import KINDS, planned_collectives
from mula.plan.split_volumes import expert_all_to_all_sends
from mula.training.module import MulaLightningModule
from strategies import XPUMoEStrategy

WORLD, MICRO, SEQ, GLOBAL, STEPS = 4, 2, 16, 16, 2
OVERRIDES = dict(
    vocab_size=256, hidden_size=32, num_layers=4, num_heads=2, num_experts=8, top_k=2,
    expert_intermediate_size=32, max_position_embeddings=64, routing_mode="uniform",
)  # fmt: skip
CONFIG = MulaConfig.from_name("mula-tiny-moe", **OVERRIDES)
# name: (strategy init_args, trainer precision, activation checkpointing)
LAYOUTS: dict[str, tuple[dict[str, Any], str, Any]] = {
    "E=2 ZeRO-1": ({"expert_parallel_size": 2}, "32-true", "none"),
    "E=4 ZeRO-2 bf16, moe recomputed": (
        {
            "expert_parallel_size": 4,
            "optimizer_options": {"zero_stage": 2, "reduce_dtype": "bf16", "bucket_numel": 3000},
        },
        "bf16-true",
        ["moe"],
    ),  # fmt: skip
    "E=2 native, EP-unaware, full recompute": (
        {"expert_parallel_size": 2, "optimizer_options": {"collectives": "native", "ep_aware": False}},
        "32-true",
        "full",
    ),  # fmt: skip
    "E=2 AdamW, bf16 autocast": ({"expert_parallel_size": 2, "shard_optimizer": False}, "bf16-mixed", "none"),
    "P=2 E=2 1f1b": ({"expert_parallel_size": 2, "pipeline_parallel_size": 2}, "32-true", ["attention"]),
    "P=2 V=2 interleaved AdamW, bf16 autocast": (
        {
            "pipeline_parallel_size": 2,
            "pipeline_schedule": "interleaved-1f1b",
            "pipeline_virtual_stages": 2,
            "shard_optimizer": False,
        },
        "bf16-mixed",
        "none",
    ),  # fmt: skip
}
LAYOUTS["P=2 E=2 1f1b, first block dense, moe recomputed"] = (
    {"expert_parallel_size": 2, "pipeline_parallel_size": 2},
    "32-true",
    ["moe"],
)
# sharded Muon over the 4 data-parallel ranks (one domain: its busiest rank is the plan's)
LAYOUTS["Muon ZeRO-1"] = ({}, "32-true", "none")
# an expert capacity: the all-to-alls move the fixed E x C blocks (padding included) and the weights
LAYOUTS["E=2 capacity 1.25, moe recomputed"] = ({"expert_parallel_size": 2}, "32-true", ["moe"])
OPTIMIZER = {"Muon ZeRO-1": "muon"}
# MulaConfig fields a layout's model changes (the others train CONFIG)
MODEL_CHANGES = {
    "P=2 E=2 1f1b, first block dense, moe recomputed": {"num_dense_layers": 1, "intermediate_size": 64},
    "E=2 capacity 1.25, moe recomputed": {"capacity_factor": 1.25},
}


def config_of(name: str) -> MulaConfig:
    """The model one of LAYOUTS trains."""
    return MulaConfig.from_name("mula-tiny-moe", **{**OVERRIDES, **MODEL_CHANGES.get(name, {})})


def layout_of(name: str) -> Layout:
    """The planner's layout of one of LAYOUTS."""
    args, precision, ckpt = LAYOUTS[name]
    opts = args.get("optimizer_options", {})
    p, e = args.get("pipeline_parallel_size", 1), args.get("expert_parallel_size", 1)
    return Layout(
        world_size=WORLD, ep_size=e, pp_size=p, pp_schedule=args.get("pipeline_schedule", "1f1b"),
        pp_virtual_stages=args.get("pipeline_virtual_stages", 1), micro_batch=MICRO, seq_len=SEQ,
        micro_batches=GLOBAL // (MICRO * WORLD // p), precision=precision, checkpointing=ckpt,
        shard_optimizer=args.get("shard_optimizer", True), zero_stage=opts.get("zero_stage", 1),
        reduce_dtype=opts.get("reduce_dtype", "fp32"), bucket_numel=opts.get("bucket_numel", 2**24),
        ep_aware=opts.get("ep_aware", True), collectives=opts.get("collectives", "rooted"),
        optimizer=OPTIMIZER.get(name, "adamw"),
    )  # fmt: skip


class _Batches:
    """This data-parallel rank's share of every step's global batch, in micro-batches or whole (a
    class: Lightning takes a plain list for one loader per element)."""

    def __init__(self, dp_rank: int, dp_size: int, whole_steps: bool) -> None:
        self.dp_rank, self.dp_size, self.whole_steps = dp_rank, dp_size, whole_steps

    def __iter__(self):
        rows = GLOBAL // self.dp_size
        for step in range(STEPS):
            g = torch.Generator().manual_seed(100 + step)
            batch = torch.randint(0, CONFIG.vocab_size, (GLOBAL, SEQ + 1), generator=g)
            mine = batch[self.dp_rank * rows :][:rows]
            yield from [mine] if self.whole_steps else mine.split(MICRO)


def _measure(rank: int, world: int) -> dict[str, dict[str, Any]]:
    lightning_env(rank, world)
    out = {}
    for name, (args, precision, ckpt) in LAYOUTS.items():
        strategy = XPUMoEStrategy(**args)
        layout = layout_of(name)
        if layout.pp_size > 1:
            strategy.pipeline_microbatches = layout.micro_batches
        torch.manual_seed(0)
        module = MulaLightningModule(
            config_of(name), activation_checkpointing=ckpt, decay_steps=10, optimizer=layout.optimizer
        )
        # steady state: the first step also holds the pipeline schedule's one-time set-up messages
        counted = CollectiveSteps(range(2, STEPS + 1))
        trainer = L.Trainer(
            accelerator="cpu", devices=world, strategy=strategy, max_steps=STEPS, precision=precision,
            accumulate_grad_batches=1 if layout.pp_size > 1 else layout.micro_batches,
            use_distributed_sampler=False, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, callbacks=[counted],
        )  # fmt: skip
        topo_rank = (rank // (layout.pp_size * layout.ep_size)) * layout.ep_size + rank % layout.ep_size
        loader = _Batches(topo_rank, layout.dp_size, layout.pp_size > 1)
        trainer.fit(module, loader)
        out[name] = {"pp_rank": trainer.strategy.topology.rank("pp"), "steps": counted.counts}
    return out


@pytest.fixture(scope="module")
def measured() -> list[dict[str, dict[str, Any]]]:
    return run_distributed(_measure, WORLD)


def _busiest(name: str) -> tuple[str, ...]:
    """The kinds whose plan is the busiest rank's, not every rank's: sharded Muon's exchange (an
    all-to-all whose share varies with the matrices' owners, `mula.layout.muon_exchange`)."""
    layout = layout_of(name)
    return ("all_to_all",) if layout.optimizer == "muon" and layout.shard_optimizer else ()


def _disagreements(measured: list[dict[str, Any]], name: str) -> list[tuple]:
    """(rank, step, way, kind, measured, planned) wherever a rank's counted step differs from the plan of
    its pipeline stage (`mula bench`'s planned column), and the busiest rank's where only that is
    planned."""
    planned = planned_collectives(config_of(name), layout_of(name))
    busiest = _busiest(name)
    wrong = []
    for rank, runs in enumerate(measured):
        got, plan = runs[name], planned[runs[name]["pp_rank"]]
        for step, counts in got["steps"].items():
            for way in ("sent", "received", "calls"):
                for kind in KINDS:
                    value, expected = counts[way][kind], plan[way][kind]
                    if kind in busiest:
                        ok = value <= expected * (1 + 1e-12)
                    else:
                        ok = value == pytest.approx(expected, rel=1e-9, abs=0)
                    if not ok:
                        wrong.append((rank, step, way, kind, value, expected))
    for kind in busiest:  # the busiest rank's exchange is the plan's
        for way in ("sent", "received"):
            most = max(r[name]["steps"][STEPS][way][kind] for r in measured)
            if most != pytest.approx(planned[0][way][kind], rel=1e-9):
                wrong.append(("busiest", STEPS, way, kind, most, planned[0][way][kind]))
    return wrong


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_collectives_match_the_plan(measured, name: str) -> None:
    """Every counted step of every rank: the bytes sent and received and the calls of each kind of
    collective are those `planned_collectives` gives its pipeline stage."""
    assert all(sorted(r[name]["steps"]) == list(range(2, STEPS + 1)) for r in measured)
    assert _disagreements(measured, name) == []


def _whole_bucket(buckets, elem_bytes):
    """Sharded Muon's exchange planned as if each Muon bucket went whole both ways."""
    from mula.layout.muon_exchange import exchange_volume

    volume = exchange_volume(buckets, elem_bytes)
    whole = sum(2 * b.numel for b in buckets if b.muon and b.group_size > 1) * elem_bytes
    return dataclasses.replace(volume, sent=whole)


PLANTED = {  # the bug each comparison must catch: (module, name, stand-in, layouts that show it)
    "no (n-1)/n": (
        "mula.plan.grad_reduction", "_ring", lambda numel, elem, group: float(numel * elem * (group > 1)),
        ["E=2 ZeRO-1", "E=4 ZeRO-2 bf16, moe recomputed", "E=2 AdamW, bf16 autocast"],
    ),
    "no backward exchange": (
        "mula.plan.step_time", "expert_all_to_all_sends",
        lambda *a, _f=expert_all_to_all_sends: (_f(*a)[0] / 2, _f(*a)[1]), ["E=2 ZeRO-1", "P=2 E=2 1f1b"],
    ),
    "Muon's bucket whole": ("mula.plan.grad_reduction", "exchange_volume", _whole_bucket, ["Muon ZeRO-1"]),
}  # fmt: skip


@pytest.mark.parametrize("bug", list(PLANTED))
def test_a_planted_bug_fails_the_comparison(measured, monkeypatch, bug: str) -> None:
    """Not vacuous: the plan with a planted bug disagrees with the counted bytes of every layout it shows in
    (the comparison above would fail)."""
    module, attr, stand_in, names = PLANTED[bug]
    monkeypatch.setattr(importlib.import_module(module), attr, stand_in)
    for name in names:
        assert _disagreements(measured, name), (bug, name)


def test_the_layouts_exercise_every_kind(measured) -> None:
    """The comparison is not vacuous: each eager kind moves bytes somewhere, and the layouts differ."""
    rows = [
        tuple(round(r[name]["steps"][STEPS]["sent"][k]) for k in KINDS) for r in measured for name in LAYOUTS
    ]
    for i, kind in enumerate(KINDS):
        if not kind.startswith("functional"):  # (tests/test_plan_volumes_tp.py: the functional ones)
            assert any(row[i] > 0 for row in rows), kind
    assert len({row[0] for row in rows if row[0]}) >= 3  # all-to-all: E, dtype, recompute differ
    assert len(set(rows)) >= len(LAYOUTS)
