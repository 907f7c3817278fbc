"""Optimizer offload with speculation (strategies/optim/offload.py) against the update after backward.

The tiny MoE on 2 gloo ranks (E=2, sharded optimizer, small buckets so backward launches several),
20 steps, `gradient_clip_val` low enough that some steps clip and others do not, and at step BAD_STEP
one expert gradient made `inf` on rank 0 (tests/test_optimizer_step.py's `_InfGradient`). Offload on (host
updates started during backward, validated after) and off give bitwise-equal weights after every
step in fp32 and under bf16-true; every step that clipped or was skipped counts one rollback of the
speculation; `mem/*` puts the state on the host. A run that saves with offload on at step 10 and
resumes with offload off, and one that saves with offload off and resumes with it on, continue the
uninterrupted run's losses exactly.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import pytest
import torch
from dist_helpers import cpu_trainer, lightning_env, run_distributed
from test_optimizer_step import BAD_STEP, OVERRIDES, _InfGradient  # an inf expert gradient on rank 0

from mula.layout.parallel_layout import ParallelLayout
from mula.layout.sharding_options import ShardingOptions
from mula.model.config import resolve_config
from mula.plan import Layout, plan_memory
from mula.training.module import MulaLightningModule
from strategies import XPUMoEStrategy
from strategies.optim.sharded_optimizer import EPShardedAdamW

MICRO, SEQ, STEPS, CLIP, RESUME = 2, 16, 20, 1.45, 10
MICROS, STAGE_CLIP = 2, 0.95  # pipeline micro-batches per step; a clip that the larger batch's norms cross


class _Batches:
    """Rank `rank`'s micro-batch of every step from `start` on (a function of the step only)."""

    def __init__(self, world: int, rank: int, start: int = 0) -> None:
        self.world, self.rank, self.start = world, rank, start

    def __iter__(self):
        for step in range(self.start, STEPS):
            g = torch.Generator().manual_seed(100 + step)
            batch = torch.randint(0, OVERRIDES["vocab_size"], (self.world * MICRO, SEQ + 1), generator=g)
            yield batch[self.rank * MICRO : (self.rank + 1) * MICRO]


class _Record(L.Callback):
    """Per optimizer step: the weights, the loss, the global norm."""

    def __init__(self) -> None:
        self.params, self.losses, self.norms = {}, {}, {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.norms[trainer.global_step + 1] = float(trainer.strategy.last_grad_norm)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        trainer.optimizers[0].wait_for_params()
        step = trainer.global_step
        self.params[step] = {n: p.detach().float().clone() for n, p in pl_module.named_parameters()}
        self.losses[step] = float(outputs["loss"])


class _StageBatches:
    """With P pipeline stages: the whole step's batch of rank `rank`'s data-parallel index, MICROS
    micro-batches of MICRO sequences (every stage of a pipeline reads the same rows)."""

    def __init__(self, layout: ParallelLayout, rank: int) -> None:
        c = layout.coordinates(rank)
        self.dp, self.dp_size = c.edp * layout.ep + c.ep, layout.dp_size

    def __iter__(self):
        rows = MICROS * MICRO
        for step in range(STEPS):
            g = torch.Generator().manual_seed(100 + step)
            batch = torch.randint(0, OVERRIDES["vocab_size"], (self.dp_size * rows, SEQ + 1), generator=g)
            yield batch[self.dp * rows : (self.dp + 1) * rows]


def _fit(
    world: int, rank: int, offload: bool, precision: str = "32-true", save_dir=None, ckpt=None, tail: int = 0,
    stages: int = 1, clip: float = CLIP,
) -> dict:  # fmt: skip
    options = {"offload": offload, "bucket_numel": 4096, "offload_tail_buckets": tail}
    strategy = XPUMoEStrategy(
        expert_parallel_size=2, optimizer_options=options, pipeline_parallel_size=stages
    )
    batches: Any = _Batches(world, rank, 0 if ckpt is None else RESUME)
    if stages > 1:
        strategy.pipeline_microbatches = MICROS
        batches = _StageBatches(ParallelLayout(world_size=world, ep=2, pp=stages), rank)
    record = _Record()
    trainer = cpu_trainer(
        world, strategy, max_steps=STEPS, accumulate_grad_batches=1, callbacks=[_InfGradient(), record], save_dir=save_dir,
        gradient_clip_val=clip, precision=precision,
    )  # fmt: skip
    torch.manual_seed(0)
    module = MulaLightningModule(
        "mula-tiny-moe", overrides=OVERRIDES, lr=1e-2, warmup_steps=1, decay_steps=20
    )
    trainer.fit(module, batches, ckpt_path=ckpt)
    opt = trainer.optimizers[0]
    return {
        "params": record.params,
        "losses": record.losses,
        "norms": record.norms,
        "metrics": opt.metrics(),
        "buckets": len(opt.buckets),
    }


def _run(rank: int, world: int, root: str) -> dict:
    import warnings

    lightning_env(rank, world)
    warnings.simplefilter("ignore")
    out = {
        "off": _fit(world, rank, False, save_dir=f"{root}/off"),
        "on": _fit(world, rank, True, save_dir=f"{root}/on"),
        "bf16_off": _fit(world, rank, False, "bf16-true"),
        "bf16_on": _fit(world, rank, True, "bf16-true"),
        "tail_on": _fit(world, rank, True, tail=2),
    }
    for saved, resumed in (("on", False), ("off", True)):
        ckpt = next(p for p in Path(f"{root}/{saved}").iterdir() if f"step={RESUME}" in p.name)
        out[f"resumed_from_{saved}"] = _fit(world, rank, resumed, ckpt=str(ckpt))
    return out


def test_offload_with_speculation_matches_the_update_after_backward() -> None:
    with tempfile.TemporaryDirectory() as root:
        ranks = run_distributed(_run, 2, root)
    for rank, out in enumerate(ranks):
        off, on = out["off"], out["on"]
        assert on["buckets"] > 2, "the test needs several buckets to speculate on"
        clipped = [s for s, n in off["norms"].items() if math.isfinite(n) and n + 1e-6 > CLIP]
        unclipped = [s for s, n in off["norms"].items() if math.isfinite(n) and n + 1e-6 <= CLIP]
        assert clipped and unclipped, f"CLIP={CLIP} must clip some steps and not others: {off['norms']}"
        assert not math.isfinite(off["norms"][BAD_STEP])
        for kind, a, b in (
            ("", off, on),
            ("bf16_", out["bf16_off"], out["bf16_on"]),
            ("tail_", off, out["tail_on"]),
        ):
            assert a["losses"] == b["losses"], f"rank {rank} {kind}: losses differ"
            for step, params in a["params"].items():
                for name, value in params.items():
                    assert torch.equal(value, b["params"][step][name]), (
                        f"rank {rank} {kind}step {step}: {name}"
                    )
            # the skipped step left every weight as it was
            before, after = b["params"][BAD_STEP - 1], b["params"][BAD_STEP]
            assert all(torch.equal(before[n], after[n]) for n in before)
        # one rollback per clipped step and one for the skipped step
        assert on["metrics"]["optim/offload_rollbacks"] == len(clipped) + 1
        assert on["metrics"]["mem/device_optimizer_bytes"] == 0
        assert on["metrics"]["mem/host_optimizer_bytes"] >= on["metrics"]["optim/state_bytes"] > 0
        assert off["metrics"]["mem/host_optimizer_bytes"] == 0
        tail = out["tail_on"]["metrics"]  # two buckets' state on the device, the rest on the host
        assert (
            0
            < tail["mem/device_optimizer_bytes"]
            < tail["optim/state_bytes"]
            == on["metrics"]["optim/state_bytes"]
        )
        assert tail["mem/host_optimizer_bytes"] < on["metrics"]["mem/host_optimizer_bytes"]
        # the planner's host and device optimizer bytes are what the optimizer holds
        for tail_buckets, metrics in ((0, on["metrics"]), (2, tail)):
            layout = Layout(
                world_size=2, ep_size=2, micro_batch=MICRO, seq_len=SEQ, shard_optimizer=True, offload=True,
                offload_tail_buckets=tail_buckets, bucket_numel=4096, collectives="rooted",
            )  # fmt: skip
            plan = plan_memory(resolve_config("mula-tiny-moe", OVERRIDES), layout)
            assert plan.host_bytes == metrics["mem/host_optimizer_bytes"], tail_buckets
            assert plan.optimizer == metrics["mem/device_optimizer_bytes"], tail_buckets
        # resumed with offload off from offload on's checkpoint, and the other way round: the
        # uninterrupted run's losses
        for saved in ("on", "off"):
            resumed = out[f"resumed_from_{saved}"]["losses"]
            assert resumed and all(resumed[s] == off["losses"][s] for s in resumed), (rank, saved)


_DENSE_25B = """
config: {root}/recipes/mula-tiny-dense.yaml
model.overrides: {{vocab_size: 32000, hidden_size: 5120, num_layers: 80, num_heads: 40,
                  intermediate_size: 13824, max_position_embeddings: 4096}}
model.activation_checkpointing: full
trainer.precision: bf16-true
trainer.devices: 1
data.seq_len: 4096
data.micro_batch_size: 1
data.global_batch_size: 8
trainer.strategy:
  class_path: strategies.XPUMoEStrategy
  init_args:
    shard_optimizer: true
    optimizer_options: {{zero_stage: 2, reduce_dtype: bf16, offload: {offload}, offload_speculation: false}}
"""


def test_plan_a_25b_dense_model_fits_one_gh200_with_offload_and_not_without(tmp_path, capsys) -> None:
    """SuperOffload's headline, as `mula plan` sees it: 25.7B dense parameters, bf16, one GH200."""
    import json

    from mula.commands.entry import main

    out = {}
    for offload in (False, True):
        recipe = tmp_path / f"offload_{offload}.yaml"
        recipe.write_text(_DENSE_25B.format(root=Path(__file__).parents[1], offload=str(offload).lower()))
        main(["plan", "-c", str(recipe), "--machine=gh200", "--format=json"])
        out[offload] = json.loads(capsys.readouterr().out)
    assert 25e9 < out[True]["per_rank_bytes"]["params"] / 2 < 26e9
    assert not out[False]["fits"] and out[False]["host_bytes"] == 0
    assert out[False]["per_rank_bytes"]["total"] > 144e9  # 12 bytes of state per parameter on the device
    assert out[True]["fits"] and out[True]["per_rank_bytes"]["optimizer"] == 0
    assert 144e9 > out[True]["per_rank_bytes"]["total"] and out[True]["host_fits"]
    assert out[True]["host_bytes_per_node"] <= out[True]["host_memory_per_node"] == 480e9


def _run_4(rank: int, world: int) -> dict:
    import warnings

    lightning_env(rank, world)
    warnings.simplefilter("ignore")
    return {"off": _fit(world, rank, False), "on": _fit(world, rank, True)}


def test_offload_on_4_ranks_matches_the_update_after_backward() -> None:
    """W=4, E=2 (dense state over 4 ranks, experts over EDP=2): the same weights, one rollback per
    clipped or skipped step."""
    for rank, out in enumerate(run_distributed(_run_4, 4)):
        off, on = out["off"], out["on"]
        for step, params in off["params"].items():
            for name, value in params.items():
                assert torch.equal(value, on["params"][step][name]), f"rank {rank} step {step}: {name}"
        clipped = [s for s, n in off["norms"].items() if math.isfinite(n) and n + 1e-6 > CLIP]
        assert on["metrics"]["optim/offload_rollbacks"] == len(clipped) + 1


def _run_stages(rank: int, world: int) -> dict:
    import warnings

    lightning_env(rank, world)
    warnings.simplefilter("ignore")
    return {f"{o}": _fit(world, rank, o == "on", stages=2, clip=STAGE_CLIP) for o in ("off", "on")}


def test_offload_under_pipeline_stages_overlaps_the_schedule_and_matches_the_update_after_backward() -> None:
    """W=4, P=2, E=2 (1F1B, 2 micro-batches): each stage's buckets reduce, and their host updates start,
    in the stage's last backward of the step, while the schedule goes on (`optim/offload_speculated`);
    the weights are bitwise those of the update after backward, one rollback per clipped or skipped step."""
    for rank, out in enumerate(run_distributed(_run_stages, 4)):
        off, on = out["off"], out["on"]
        assert off["losses"] == on["losses"], f"rank {rank}"
        for step, params in off["params"].items():
            for name, value in params.items():
                assert torch.equal(value, on["params"][step][name]), f"rank {rank} step {step}: {name}"
        clipped = [s for s, n in off["norms"].items() if math.isfinite(n) and n + 1e-6 > STAGE_CLIP]
        assert clipped and len(clipped) < STEPS - 1, (
            f"{STAGE_CLIP} must clip some steps, not all: {off['norms']}"
        )
        assert on["metrics"]["optim/offload_rollbacks"] == len(clipped) + 1
        # every step speculated on every bucket of the rank's stage during the schedule
        assert on["metrics"]["optim/offload_speculated"] == STEPS * on["buckets"], (rank, on["metrics"])


def _one_process_run(offload: bool) -> list[torch.Tensor]:
    """A small MLP in one process, 3 steps: the lr changes between backward and step() (step 1), and
    two backward passes feed one step (step 2): both invalidate a speculation."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = EPShardedAdamW(
        model.parameters(), model.named_parameters(), lr=1e-2, offload=offload, bucket_numel=64
    )
    x = torch.randn(6, 8)
    for step in range(3):
        for _ in range(2 if step == 2 else 1):
            model(x).pow(2).mean().backward()
        if step == 1:
            opt.param_groups[0]["lr"] = 5e-3
        opt.step()
        opt.zero_grad()
    rollbacks = opt.metrics().get("optim/offload_rollbacks")
    opt.close()
    return [p.detach().clone() for p in model.parameters()] + [torch.tensor(rollbacks or 0.0)]


def test_a_changed_lr_or_a_second_backward_recomputes_the_speculation() -> None:
    off, on = _one_process_run(False), _one_process_run(True)
    for a, b in zip(off[:-1], on[:-1]):
        assert torch.equal(a, b)
    assert float(on[-1]) == 2  # steps 1 and 2 rolled back; step 0's speculation stood


def test_tail_buckets_need_offload() -> None:
    with pytest.raises(ValueError, match="offload_tail_buckets"):
        ShardingOptions(offload_tail_buckets=1)
