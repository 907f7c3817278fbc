"""Sharded Muon (`model.optimizer: muon` with `shard_optimizer: true`, `EPShardedMuon`) checkpoints at the
Lightning level: SIGKILL and resume, and resharding across pipeline and expert parallelism.

1. `mula fit` of the tiny MoE recipe on 2 gloo ranks with E=2 and sharded Muon, every rank SIGKILLed
   after step 5 (checkpoints at steps 2 and 4): the killed run's newest checkpoint holds Muon's state
   (a "momentum_buffer" for the Muon matrices, experts' and routers' included, and "exp_avg_sq" only
   for AdamW's parameters, so the test cannot pass with AdamW), and the same command auto-resumes from
   it and repeats the killed run's recorded steps bit for bit (losses, parameter and batch digests of
   tests/ft_app.py's StepRecorder, on both ranks). The killed run is its own reference (as in
   tests/test_pipeline_resume.py). The first repeated step's parameter digest is taken after its
   update, so it already reads the restored momentum. Why bit for bit on any host: the resumed run is
   the same program at the same layout on the same batches, and the checkpoint restores every bit that
   program reads (fp32 masters, Muon's momentum, AdamW's moments, step count, schedule, RNG and data
   position), so each rank redoes the same floating-point operations in the same order.
2. A checkpoint saved by a 4-rank run at (P=2, E=2) resumes in one process (P=1, E=1, the sharded
   optimizer's one-rank layout). Its next steps equal the uninterrupted run's by the suite's equality
   rule (tests/equality.py), the uninterrupted run being the one-process `MulaMuon` reference (the
   saving run must follow it to the checkpoint too), and the state it loaded (fp32 masters, Muon's
   momentum, AdamW's moments, by global parameter) is the reference's after step 2: the masters within
   the rule's WEIGHT_ATOL, the moments within STATE_RTOL. The state is checked directly because the
   resumed run's first step depends on the weights alone and a near-tied top-k flip may end the rule's
   comparison one step later (one does at step 4 on the host this was written on). Why it holds by
   construction: the optimizer state is saved per parameter over the flattened global tensor
   (strategies/optim/state.py), so any layout reads the same values back; what remains between layouts
   is gradient summation order, which moves the moments by rounding (Newton-Schulz runs in fp32 here,
   so no bf16 rounding boundary amplifies it: tests/equality.py, mechanism 3), and near-tied top-k
   flips, which the rule detects.
   A checkpoint saved by a sharded AdamW run refuses to load into a sharded Muon run, and the reverse,
   with one sentence naming model.optimizer (a ValueError: `mula fit` prints it as one line, exit 2),
   raised before torch.distributed.checkpoint reads anything (it would fail on the first missing key
   with every rank's traceback).
"""

from __future__ import annotations

import tempfile

import lightning.pytorch as L
import torch
from dist_helpers import lightning_env, run_distributed
from equality import (
    assert_compared_through,
    assert_same_training,
    assert_same_weights,
)
from test_fault_tolerance import (
    REPO,
    _tiny_moe_command,
)
from test_pipeline import _fit as pipeline_fit
from test_pipeline_resume import assert_rerun_repeats_the_killed_steps, kill_after_step_5

from mula.checkpoint import read_manifest
from mula.checkpoint.sharded import saved_keys
from mula.training.lightning_compat import ends_optimizer_step
from strategies import XPUMoEStrategy
from strategies.optim.state import _pieces

# ---------------------------------------------------------------------------------------------------
# 1. `mula fit`, SIGKILL, the same command

SHARDED_MUON = [
    "-c", str(REPO / "recipes" / "strategies" / "xpu-moe.yaml"),
    "--trainer.devices=2", "--trainer.accelerator=cpu",
    "--trainer.strategy.init_args.expert_parallel_size=2",
    "--trainer.strategy.init_args.shard_optimizer=true",
    "--model.optimizer=muon",
]  # fmt: skip


def test_sharded_muon_mula_fit_killed_and_rerun_resumes_exactly(tmp_path):
    command = [*_tiny_moe_command(tmp_path, "run", injector={"step_sleep_s": 0.2}), *SHARDED_MUON]
    killed, newest = kill_after_step_5(command, tmp_path)
    assert read_manifest(newest.path).kind == "dir"  # a sharded checkpoint
    # Muon's state, not AdamW's: a momentum per Muon matrix (an expert stack's and a router's included),
    # the second moment only for AdamW's parameters
    keys = saved_keys(newest.path)
    momentum = {k.removesuffix(".momentum_buffer") for k in keys if k.endswith(".momentum_buffer")}
    second = {k.removesuffix(".exp_avg_sq") for k in keys if k.endswith(".exp_avg_sq")}
    assert any(".experts." in k for k in momentum) and any(k.endswith("router.weight") for k in momentum)
    assert second and not momentum & second, sorted(momentum & second)[:3]
    assert_rerun_repeats_the_killed_steps(command, tmp_path, killed, newest)


# ---------------------------------------------------------------------------------------------------
# 2. (P=2, E=2) on 4 ranks -> one process; AdamW's checkpoint refused by Muon and the reverse

STEPS = 4  # checkpoints at steps 2 and 4
# loaded moments against the one-process reference's, relative distance per tensor (measured <= 3.2e-6:
# summation order only; a moment not restored is at distance 1)
STATE_RTOL = 1e-3


class _OptimizerState(L.Callback):
    """The optimizer's state per parameter and kind, each flattened over the global parameter: of a
    one-process `MulaMuon` after optimizer step `after_step`, or of a sharded optimizer in one process as
    the resumed run starts (loaded from the checkpoint, before any step)."""

    def __init__(self, after_step: int | None = None) -> None:
        self.after_step, self.state = after_step, {}

    def on_train_start(self, trainer, pl_module) -> None:
        opt = trainer.optimizers[0]
        if self.after_step is not None or not hasattr(opt, "state_kinds"):
            return
        for entry in opt.entries:
            for kind in opt.state_kinds(entry):
                flat = torch.full((entry.global_numel,), float("nan"))
                for piece, start in _pieces(opt, entry, kind):
                    flat[start : start + piece.numel()] = piece
                self.state.setdefault(entry.name, {})[kind] = flat

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if ends_optimizer_step(trainer) and trainer.global_step == self.after_step:
            opt = trainer.optimizers[0]
            for name, p in pl_module.named_parameters():
                self.state.setdefault(name, {})["master"] = p.detach().flatten().clone()
                for kind, value in opt.state[p].items():
                    if value.dim() > 0:
                        self.state.setdefault(name, {})[kind] = value.detach().flatten().clone()


def _fit(
    world: int,
    strategy,
    *,
    optimizer: str = "muon",
    max_steps: int = STEPS,
    ckpt_path=None,
    save_dir=None,
    state: _OptimizerState | None = None,
):
    """tests/test_pipeline.py's `_fit` with `optimizer` (Muon's Newton-Schulz in fp32); the optimizer's state into
    `state` when given; the run's record."""
    losses, _ = pipeline_fit(
        world, strategy, max_steps=max_steps, ckpt_path=ckpt_path, save_dir=save_dir, optimizer=optimizer,
        callbacks=[state] if state is not None else (),
    )  # fmt: skip
    return losses.record()


def _save_p2e2(rank: int, world: int, root: str) -> dict:
    lightning_env(rank, world)
    strategy = XPUMoEStrategy(expert_parallel_size=2, pipeline_parallel_size=2, shard_optimizer=True)
    return _fit(world, strategy, save_dir=f"{root}/p2e2")


def _fit_error(world: int, **kwargs) -> str:
    try:
        _fit(world, XPUMoEStrategy(shard_optimizer=True), **kwargs)
    except ValueError as error:
        return str(error)
    return "no error"


def _resume_one_process(rank: int, world: int, root: str) -> dict:
    lightning_env(rank, world)
    loaded = _OptimizerState()
    saved = f"{root}/p2e2/epoch=0-step=2.ckpt"
    out = {"w1": _fit(world, XPUMoEStrategy(shard_optimizer=True), ckpt_path=saved, state=loaded)}
    out["loaded"] = loaded.state
    # a sharded AdamW checkpoint into sharded Muon, and the P2E2 Muon checkpoint into AdamW
    _fit(
        world, XPUMoEStrategy(shard_optimizer=True), optimizer="adamw", max_steps=2, save_dir=f"{root}/adamw"
    )
    out["adamw_into_muon"] = _fit_error(world, ckpt_path=f"{root}/adamw/epoch=0-step=2.ckpt")
    out["muon_into_adamw"] = _fit_error(
        world, optimizer="adamw", ckpt_path=f"{root}/p2e2/epoch=0-step=2.ckpt"
    )
    return out


def test_sharded_muon_checkpoint_reshards_from_p2e2_to_one_process():
    ref_state = _OptimizerState(after_step=2)
    ref = _fit(1, None, state=ref_state)
    with tempfile.TemporaryDirectory() as root:
        saving = run_distributed(_save_p2e2, 4, root)[0]
        keys = saved_keys(f"{root}/p2e2/epoch=0-step=2.ckpt")
        assert any(k.endswith(".experts.down.momentum_buffer") for k in keys)
        out = run_distributed(_resume_one_process, 1, root)[0]
    assert len(out["w1"]["losses"]) == STEPS - 2
    # the next steps are the uninterrupted run's, if the saving run had followed it to the checkpoint
    # (equality.py: top-k flips)
    assert_compared_through(saving, ref, 2, what="p2e2 saving")
    assert_same_training(out["w1"], ref, first_step=2, what="p2e2 -> w1")
    # The resumed run's first step (3) is decided by the loaded weights alone; the loaded optimizer
    # state shows only from step 4 on, and there only through one step's losses and norms.
    # So the state itself too: every kind of every parameter (fp32 master, Muon's momentum, AdamW's
    # moments) as the one-process reference holds it after step 2, up to the gradients' summation
    # order (and, for the weights, the bf16-ulp moves it makes in Newton-Schulz's update).
    loaded = out["loaded"]
    assert set(loaded) == set(ref_state.state)
    for name, kinds in ref_state.state.items():
        assert set(loaded[name]) == set(kinds), name
        assert_same_weights({name: loaded[name]["master"]}, {name: kinds["master"]}, what="master")
        for kind in set(kinds) - {"master"}:
            want = kinds[kind]
            distance = float((loaded[name][kind] - want).norm() / want.norm())
            assert distance <= STATE_RTOL, f"{name} {kind}: relative distance {distance:.2e}"
    # one sentence, raised before DCP reads anything (it would dump every rank's traceback)
    for key, kind in (("adamw_into_muon", "momentum_buffer"), ("muon_into_adamw", "exp_avg")):
        message = out[key]
        assert (
            message.startswith("Checkpoint ") and f"has no optimizer {kind} for parameter model." in message
        )
        assert message.endswith("model.optimizer must be the one the checkpoint was trained with.")
        assert "\n" not in message and message.count(". ") == 0, message
