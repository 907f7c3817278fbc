"""The planner against measured pipelined training on 4 CPU ranks (gloo, Lightning's Trainer with
`XPUMoEStrategy`, one launch for every layout): per rank, the plan of that rank's stage
(`mula.plan.memory.plan_stage`) against what `MemoryMetrics` and `MoEMetrics` log for it after one
real optimizer step of several micro-batches.

Parameter, gradient and optimizer-state bytes (`mem/param_bytes`, `optim/param_bytes`,
`mem/grad_bytes` = `optim/grad_buffer_bytes`, `optim/state_bytes`) must be equal; activations within
10 % of `mem/activation_bytes`. Under pipeline stages that is the peak of saved-tensor bytes over the
whole schedule: `SavedTensorMeter` is entered around the step, wraps every tensor autograd saves in a
holder that autograd keeps in its place, counts a storage from its first save until autograd has let go
of every holder of it (after the backward that used it), and reports the largest sum reached. Forwards
add, backwards free, in the schedule's order, so it is what the stage holds at its fullest: all
micro-batches under GPipe, P - s under 1F1B, the virtual stages' own counts under interleaved 1F1B.

Layouts: (P, E) = (2, 2), (2, 1) with two data-parallel ranks per stage, (4, 1); 1F1B, GPipe and
interleaved 1F1B (2 virtual stages); fp32 and bf16-true weights; checkpointing none, `moe`,
`attention`, `full`; an uneven split; the sharded optimizer and torch's AdamW. The comparison is not
vacuous: stages and layouts differ, and the planner's in-flight micro-batches are checked to matter
(another schedule's count misses). Routing is the real (learned, randomly initialised) router's: the
planner assumes balanced routing, so under expert parallelism a rank's measured activations move with
the rows it happens to receive: up to 8 % here; a stage of a single MoE block reached 12 %, so the
expert-parallel layouts keep two blocks per stage.
"""

from __future__ import annotations

import lightning.pytorch as L
import pytest
import torch
from dist_helpers import lightning_env, run_distributed

from callbacks import MemoryMetrics
from callbacks.moe_metrics import MoEMetrics
from mula import MulaConfig
from mula.plan import Layout
from mula.plan.memory import plan_stage
from strategies import XPUMoEStrategy

WORLD, B, T, MICROS = 4, 2, 128, 4  # micro-batch B x T tokens, MICROS micro-batches per step and rank
OVERRIDES = {"vocab_size": 512, "num_layers": 4, "max_position_embeddings": 256}
CONFIG = MulaConfig.from_name("mula-tiny-moe", **OVERRIDES)
# (P, E, schedule, virtual stages, stage layers, precision, checkpointing, sharded optimizer)
LAYOUTS = [
    (2, 2, "1f1b", 1, None, "32-true", "none", True),
    (2, 1, "gpipe", 1, [1, 3], "bf16-true", ["moe"], True),
    (4, 1, "1f1b", 1, None, "32-true", ["attention"], True),
    (2, 2, "interleaved-1f1b", 2, None, "bf16-true", "none", True),
    (4, 1, "gpipe", 1, None, "32-true", "full", False),
    (2, 1, "interleaved-1f1b", 2, None, "32-true", ["moe"], True),
]
KEYS = ("mem/param_bytes", "mem/grad_bytes", "mem/activation_bytes", "optim/state_bytes",
        "optim/param_bytes", "optim/grad_buffer_bytes")  # fmt: skip


class _Steps:
    """One optimizer step's batch for this data-parallel rank: MICROS micro-batches, whole."""

    def __init__(self, batch: torch.Tensor, steps: int = 1) -> None:
        self.batch, self.steps = batch, steps

    def __iter__(self):
        for _ in range(self.steps):
            yield self.batch


def _measure(rank: int, world: int) -> list[dict[str, float]]:
    from mula.training.module import MulaLightningModule

    lightning_env(rank, world)
    out = []
    for pp, ep, schedule, virtual, layers, precision, ckpt, sharded in LAYOUTS:
        strategy = XPUMoEStrategy(
            expert_parallel_size=ep, pipeline_parallel_size=pp, pipeline_schedule=schedule,
            pipeline_virtual_stages=virtual, pipeline_stage_layers=layers, shard_optimizer=sharded,
        )  # fmt: skip
        strategy.pipeline_microbatches = MICROS  # what MulaDataModule sets
        torch.manual_seed(0)
        module = MulaLightningModule(
            "mula-tiny-moe", overrides=OVERRIDES, decay_steps=10, activation_checkpointing=ckpt
        )
        trainer = L.Trainer(
            accelerator="cpu", devices=world, strategy=strategy, max_steps=1, precision=precision,
            log_every_n_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, use_distributed_sampler=False,
            callbacks=[MemoryMetrics(), MoEMetrics()],
        )  # fmt: skip
        gen = torch.Generator().manual_seed(rank)
        batch = torch.randint(0, CONFIG.vocab_size, (MICROS * B, T + 1), generator=gen)
        trainer.fit(module, _Steps(batch))
        logged = {k: float(v) for k, v in trainer.callback_metrics.items() if k in KEYS}
        out.append({**logged, "stage": strategy.topology.rank("pp")})
    return out


@pytest.fixture(scope="module")
def measured() -> list[list[dict[str, float]]]:
    return run_distributed(_measure, WORLD)


def _layout(index: int) -> Layout:
    pp, ep, schedule, virtual, layers, precision, ckpt, sharded = LAYOUTS[index]
    return Layout(
        world_size=WORLD, ep_size=ep, pp_size=pp, pp_schedule=schedule, pp_virtual_stages=virtual,
        pp_stage_layers=layers, micro_batch=B, seq_len=T, micro_batches=MICROS, precision=precision,
        checkpointing=ckpt, shard_optimizer=sharded, collectives="rooted",
    )  # fmt: skip


@pytest.mark.parametrize("index", range(len(LAYOUTS)))
def test_every_rank_matches_the_plan_of_its_stage(measured, index: int) -> None:
    layout = _layout(index)
    pp, ep = layout.pp_size, layout.ep_size
    for rank, logged in enumerate(measured):
        row = logged[index]
        assert row["stage"] == (rank // ep) % pp  # rank = d * (P * E) + s * E + e
        plan = plan_stage(CONFIG, layout, row["stage"])
        where = f"{LAYOUTS[index]} rank {rank} stage {row['stage']}"
        assert_stage_bytes(plan, row, layout.shard_optimizer, where)


def measure_step(
    world: int, strategy, preset: str, overrides: dict, batch: torch.Tensor, callbacks=(), steps: int = 1
) -> dict:
    """One optimizer step of `batch` (this data-parallel rank's whole step: one micro-batch, or a
    pipeline's micro-batches) under `strategy` on `world` CPU ranks, fp32: the bytes `MemoryMetrics` and
    `MoEMetrics` log (`KEYS`). With `steps` > 1 the same batch trains `steps` steps and only the last
    logs (the others carry no logging collectives)."""
    from dist_helpers import cpu_trainer

    from mula.training.module import MulaLightningModule

    torch.manual_seed(0)
    module = MulaLightningModule(preset, overrides=overrides, decay_steps=10)
    trainer = cpu_trainer(
        world, strategy, max_steps=steps, accumulate_grad_batches=1,
        callbacks=[MemoryMetrics(), MoEMetrics(), *callbacks], log_every_n_steps=steps,
    )  # fmt: skip
    trainer.fit(module, _Steps(batch, steps))
    return {k: float(v) for k, v in trainer.callback_metrics.items() if k in KEYS}


def assert_stage_bytes(plan, row: dict, sharded: bool, where: str) -> None:
    """A stage's plan against one rank's logged bytes: parameters, gradients and optimizer state equal,
    activations within 10 %."""
    assert plan.param_tensor_bytes == row["mem/param_bytes"], where
    assert plan.grads == row["mem/grad_bytes"], where
    if sharded:
        assert plan.params == row["optim/param_bytes"], where
        assert plan.grads == row["optim/grad_buffer_bytes"], where
        assert plan.optimizer == row["optim/state_bytes"], where
    else:  # torch AdamW: MoEMetrics counts the parameters with their two moments
        assert plan.params + plan.optimizer == row["optim/state_bytes"], where
    assert plan.activations == pytest.approx(row["mem/activation_bytes"], rel=0.10), where


def test_the_numbers_differ_between_stages_and_layouts(measured) -> None:
    """Not vacuous: the stages of a layout, and the layouts, hold different bytes (under 1F1B with
    P = 4 every stage holds a different number of micro-batches)."""
    for index in range(len(LAYOUTS)):
        stages = {row[index]["stage"]: row[index] for row in measured}
        for key in ("mem/param_bytes", "mem/activation_bytes"):
            assert len({row[key] for row in stages.values()}) >= 2, (LAYOUTS[index], key)
    one_f_one_b = LAYOUTS.index((4, 1, "1f1b", 1, None, "32-true", ["attention"], True))
    assert len({row[one_f_one_b]["mem/activation_bytes"] for row in measured}) == 4
    activations = {row[i]["mem/activation_bytes"] for row in measured for i in range(len(LAYOUTS))}
    grads = {row[i]["mem/grad_bytes"] for row in measured for i in range(len(LAYOUTS))}
    assert len(activations) >= 2 * len(LAYOUTS) and len(grads) >= len(LAYOUTS)


def test_the_schedule_decides_the_measured_activations(measured) -> None:
    """The in-flight micro-batches matter: another schedule's count (or the planner's former
    interleaved count, P - s + ceil((P - 1) / V) whole micro-batches), times one micro-batch's planned
    bytes, misses the measured peak by more than 10 %."""
    for index in range(len(LAYOUTS)):
        layout = _layout(index)
        p, v = layout.pp_size, layout.pp_virtual_stages
        for rank, logged in enumerate(measured):
            stage = logged[index]["stage"]
            right = plan_stage(CONFIG, layout, stage).activation_micro_batches
            single = layout.replace(pp_schedule="gpipe", pp_virtual_stages=1, micro_batches=1)
            one = plan_stage(CONFIG, single, stage).activations  # one micro-batch through the stage
            wrong = {MICROS, p - stage, min(MICROS, p - stage + -(-(p - 1) // v)), right + 1, right - 1}
            for count in {c for c in wrong if c > 0 and abs(c - right) >= 0.5}:
                got = logged[index]["mem/activation_bytes"]
                assert count * one != pytest.approx(got, rel=0.10), (LAYOUTS[index], rank, count)
