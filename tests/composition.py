"""Training one covering-array row of the layout matrix (tests/layout_coverage.py) and its reference.

A row is a set of `mula.layout.features` names; `mula.layout.features.probe` turns it into the run
(strategy arguments, model overrides, precision, recompute, compile), the same run the validator is
asked about, so what is run is what the matrix counts. `fit_row` trains it for `STEPS` steps on the
probe's ranks (or, `reference=True`, the one-process reference of it) on fixed global batches, and
returns what the suite's equality rule compares (tests/equality.py) and every parameter whole.

The fp32 reference is the plain model in one process (eager, nothing recomputed, torch's AdamW): the row
equals one process by the rule. A bf16-true row's reference is one process of XPUMoEStrategy with the
row's optimizer (bf16 weights, fp32 masters), compared within bf16's rounding (`BF16_RTOL`).
"""

from __future__ import annotations

import lightning.pytorch as L
import torch
from dist_helpers import cpu_trainer, lightning_env, whole_params
from equality import (
    ADAMW_EPS,
    MUON_NS_DTYPE,
    RoutingRecord,
    assert_same_training,
    assert_same_weights,
    seeded,
)
from test_strategy import _StepLosses  # per step: the global-batch loss and the global gradient norm

from mula.layout.features import MICRO, MICROS, PRESET, SEQ, probe
from mula.training.module import MulaLightningModule

# how a compiled row compiles: dynamo and AOTAutograd trace every block, and the traced graphs run as
# traced ("aot_eager"). A layout changes what they trace (DTensor weights, a pipeline stage's blocks, the
# strategy's hooks, checkpoint boundaries, the MoE layer's graph break); Inductor's code for a traced
# graph is held against eager by tests/test_compile.py (the tiny MoE and dense models, E x P stages,
# bf16-true, recompute). Inductor's C++ compile on every rank made a compiled row about 4x slower here.
COMPILE_BACKEND = {"backend": "aot_eager"}
from strategies import XPUMoEStrategy
from strategies.optim.state import whole_state

STEPS = 4
# bf16-true rows, against a one-process bf16 run at a learning rate whose steps stay near a bf16 ulp of
# the weights (so that the fp32 masters matter, as in tests/test_bf16_master.py): bf16 keeps 8 bits of
# mantissa (2^-8 = 3.9e-3 relative spacing), and a layout changes the order of its roundings, which
# moves the scores enough to flip top-k choices now and then. The rule, bf16's own: every step's loss
# within BF16_LOSS_RTOL and gradient norm within BF16_NORM_RTOL (relative; measured <= 1.1e-5 and
# <= 1.7e-4), and the fp32 master weights -- what the steps move; at this lr most bf16 weights never move
# by one bf16 ulp, so a rank dropping its update would leave them as they are -- within BF16_MASTER_RTOL
# of the distance the reference's masters moved: ||m - m_ref|| <= BF16_MASTER_RTOL * ||m_ref - m_0|| for
# every parameter (measured <= 0.08 on the five bf16-true rows, the expert stacks, whose top-k choices flip
# in bf16; a rank skipping its shard's updates leaves a parameter it owns wholly at 1.0, and one it owns a
# quarter of near 0.5: tests/test_composition.py plants it for AdamW and Muon). The router bias,
# whose update is the sign of each expert's integer load error, is compared by the fp32 rows only.
BF16_LR = 1e-4
BF16_LOSS_RTOL = 1e-3
BF16_NORM_RTOL = 1e-2
BF16_MASTER_RTOL = 0.25


class _Batches:
    """Data-parallel rank `dp_rank`'s micro-batches of `micro` sequences of every step (its share of the
    step's MICROS * MICRO sequences), or its whole share of each step in one batch (`whole_steps`: what a
    pipeline step consumes)."""

    def __init__(self, dp_rank: int, dp_size: int, micro: int, whole_steps: bool, data_seed: int = 0) -> None:
        self.dp_rank, self.dp_size, self.micro, self.whole_steps = dp_rank, dp_size, micro, whole_steps
        self.data_seed = data_seed
        self.consumed = 0

    def __iter__(self):
        share = MICROS * MICRO // self.dp_size
        for step in range(STEPS):
            g = torch.Generator().manual_seed(seeded(2000 + 100 * self.data_seed + step))
            batch = torch.randint(0, 256, (MICROS * MICRO, SEQ + 1), generator=g)
            mine = batch[self.dp_rank * share : (self.dp_rank + 1) * share]
            yield from [mine] if self.whole_steps else mine.split(self.micro)


class _InitialWeights(L.Callback):
    """Every parameter as training starts, in fp32: where a bf16-true run's masters start from."""

    def __init__(self) -> None:
        self.params: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer, pl_module) -> None:
        self.params = {n: p.detach().float().clone() for n, p in pl_module.named_parameters()}


def skip_updates_on(victim: int, optimizer: str) -> None:
    """Plant a bug in this process: global rank `victim` computes but never applies its shard's update
    (`optimizer` "adamw": the sharded AdamW's bucket updates; "muon": sharded Muon's matrix updates, its
    AdamW buckets still updated) -- what the bf16-true rows' master comparison must catch."""
    from strategies.optim.sharded_muon import EPShardedMuon
    from strategies.optim.sharded_optimizer import EPShardedAdamW

    if torch.distributed.get_rank() != victim:
        return
    if optimizer == "adamw":
        EPShardedAdamW._update_bucket = lambda self, index, grads, step, found_inf=None: None
        return

    def apply(self, flight) -> None:  # EPShardedMuon._apply without the master's update
        for handle in flight.handles:
            handle.wait()
        self._returned(flight)
        self._gather.launch(flight.index, self.bucket_state(flight.index)[0])

    EPShardedMuon._apply = apply


def fit_row(
    features,
    rank: int | None = None,
    root: str | None = None,
    data_seed: int = 0,
    overrides: dict | None = None,
) -> dict:
    """Train `features`' row as global `rank` of its ranks (this process is in the process group
    already) or, with `rank=None`, its one-process reference; the per-step record, every parameter whole
    and, with bf16-true, every fp32 master whole (and, in the reference, the weights they started from).
    `root`: the trainer's run directory (the compile cache's home); `data_seed`: which token batches
    (tests/test_composition.py moves a row whose near-tied choice flipped to the next one); `overrides`:
    model settings on top of the row's (tests/test_capacity.py's expert capacity)."""
    run = probe(features)
    run.overrides.update(overrides or {})
    bf16 = run.precision == "bf16-true"
    reference = rank is None
    if not reference:
        # Lightning launches ranks of its own unless told this one was started (a forkserver child has the
        # environment the forkserver started with, which need not hold a previous test's LOCAL_RANK: without
        # this, its launched children failed and Lightning SIGKILLed the rank)
        lightning_env(rank, run.world_size)
    if reference:
        sharding = {k: v for k, v in run.strategy.items() if k in ("shard_optimizer", "optimizer_options")}
        strategy = XPUMoEStrategy(**sharding) if bf16 else None
        # the run's micro-batches, accumulated: a micro-batch-scoped aux loss sees the same tokens
        world, dp_rank, dp_size, micro = 1, 0, 1, run.micro_batch
        micros = MICROS * MICRO // micro
    else:
        strategy = XPUMoEStrategy(**run.strategy)
        world, dp_rank, dp_size = run.world_size, run.layout.group_rank("dp", rank), run.dp_size
        micro, micros = run.micro_batch, run.micro_batches
    pipelined = "pipeline_parallel_size" in run.strategy and not reference
    if pipelined:  # what MulaDataModule sets: the step's micro-batches, in one batch per step
        strategy.pipeline_microbatches = micros
    batches = _Batches(dp_rank, dp_size, micro, pipelined, data_seed)
    routing = RoutingRecord(near_ties=reference and not bf16)
    losses = _StepLosses(batches, routing)
    initial = _InitialWeights()
    trainer = cpu_trainer(
        world, strategy, max_steps=STEPS, accumulate_grad_batches=1 if pipelined else micros,
        callbacks=[losses, routing, initial], gradient_clip_val=0.5, precision=run.precision, default_root_dir=root,
    )  # fmt: skip
    torch.manual_seed(seeded(0))
    exact = reference and not bf16  # the plain model: nothing recomputed or compiled
    lr = BF16_LR if bf16 else 1e-2
    module = MulaLightningModule(
        PRESET, overrides=run.overrides, lr=lr, min_lr=lr / 10, warmup_steps=1, decay_steps=10, eps=ADAMW_EPS,
        activation_checkpointing="none" if exact else run.activation_checkpointing,
        compile=COMPILE_BACKEND if run.compile and not exact else False, optimizer=run.optimizer,
        muon_ns_dtype="bfloat16" if bf16 else MUON_NS_DTYPE,  # fp32 rows: tests/equality.py, mechanism 3
    )  # fmt: skip
    trainer.fit(module, batches)
    topology = None if strategy is None else strategy.topology
    params = whole_params(trainer.lightning_module, topology)
    # the sharded optimizer's own numbers (offload: the bucket updates started during backward)
    metrics = (
        trainer.optimizers[0].metrics()
        if isinstance(strategy, XPUMoEStrategy) and run.strategy["shard_optimizer"]
        else {}
    )
    out = {**losses.record(), "params": {n: p.float() for n, p in params.items()}, "optim": metrics}
    if bf16:
        out["masters"] = whole_state(trainer.optimizers[0], "master")
        if reference:
            out["initial"] = initial.params
    return out


def assert_row_matches(run: dict, ref: dict, features, what: str) -> None:
    """`run` (one rank of a row) equals its reference by the rule the row's features allow (module
    docstring): the suite's equality rule in fp32, bf16's own for a bf16-true row. Each rank holds the
    whole model (gathered), its stage's parameters under pipeline stages."""
    mine = run["params"]
    assert set(mine) <= set(ref["params"]), (what, sorted(set(mine) - set(ref["params"])))
    if "bf16-true" not in probe(features).features:
        assert_same_training(run, ref, what=what)  # the trained models then agree
        assert_same_weights(mine, ref["params"], what=what)
        return
    for key, rtol in (("losses", BF16_LOSS_RTOL), ("norms", BF16_NORM_RTOL)):
        torch.testing.assert_close(
            torch.tensor(run[key], dtype=torch.float64), torch.tensor(ref[key], dtype=torch.float64),
            rtol=rtol, atol=0, msg=lambda m, k=key: f"{what} {k}: {m}",
        )  # fmt: skip
    assert run["masters"] and set(run["masters"]) <= set(ref["masters"]), what
    for name, ratio in master_distances(run, ref).items():
        assert ratio <= BF16_MASTER_RTOL, (
            f"{what} {name}: fp32 masters {ratio:.3f} of the reference's move apart"
        )


def master_distances(run: dict, ref: dict) -> dict[str, float]:
    """Per parameter of a bf16-true `run`: ||m - m_ref|| / ||m_ref - m_0||, its fp32 masters' distance from
    the reference's in units of how far the reference's moved from where they started."""
    out = {}
    for name, master in run["masters"].items():
        want = ref["masters"][name]
        moved = float((want - ref["initial"][name].flatten()).norm())
        assert moved > 0, f"{name}: the reference's masters never moved"
        out[name] = float((master - want).norm()) / moved
    return out
