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

import torch
from dist_helpers import cpu_trainer, whole_params
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
from strategies import XPUMoEStrategy

STEPS = 4
# bf16-true rows, against a one-process bf16 run at a learning rate whose steps stay near a bf16 ulp of
# the weights (so that the fp32 masters matter, as in tests/test_bf16_master.py): bf16 keeps 8 bits of
# mantissa (2^-8 = 3.9e-3 relative spacing), and a layout changes the order of its roundings, which
# moves the scores enough to flip top-k choices now and then. The rule, bf16's own: every step's loss
# within BF16_LOSS_RTOL and gradient norm within BF16_NORM_RTOL (relative; measured <= 1.1e-5 and
# <= 1.7e-4), every weight tensor within BF16_WEIGHT_RTOL of the reference's in relative distance
# ||w - w_ref|| / ||w_ref|| (measured <= 1.3e-3; tests/test_bf16_master.py: <= 3e-3 over 20 steps);
# the router bias, whose update is the sign of each expert's integer load error, is compared by the
# fp32 rows only (a flipped choice flips a sign).
BF16_LR = 1e-4
BF16_LOSS_RTOL = 1e-3
BF16_NORM_RTOL = 1e-2
BF16_WEIGHT_RTOL = 1e-2


class _Batches:
    """Data-parallel rank `dp_rank`'s micro-batches of every step, or its whole share of each step in one
    batch (`whole_steps`: what a pipeline step consumes)."""

    def __init__(self, dp_rank: int, dp_size: int, whole_steps: bool) -> None:
        self.dp_rank, self.dp_size, self.whole_steps, self.consumed = dp_rank, dp_size, whole_steps, 0

    def __iter__(self):
        per_rank = MICROS // self.dp_size
        for step in range(STEPS):
            g = torch.Generator().manual_seed(seeded(2000 + step))
            batch = torch.randint(0, 256, (MICROS * MICRO, SEQ + 1), generator=g)
            mine = batch.split(MICRO)[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank]
            yield from [torch.cat(mine)] if self.whole_steps else mine


def fit_row(features, rank: int | None = None, root: str | None = None) -> dict:
    """Train `features`' row as global `rank` of its ranks (this process is in the process group
    already) or, with `rank=None`, its one-process reference; the per-step record and every parameter
    whole. `root`: the trainer's run directory (the compile cache's home)."""
    run = probe(features)
    bf16 = run.precision == "bf16-true"
    reference = rank is None
    if reference:
        sharding = {k: v for k, v in run.strategy.items() if k in ("shard_optimizer", "optimizer_options")}
        strategy = XPUMoEStrategy(**sharding) if bf16 else None
        world, dp_rank, dp_size = 1, 0, 1
    else:
        strategy = XPUMoEStrategy(**run.strategy)
        world, dp_rank, dp_size = run.world_size, run.layout.group_rank("dp", rank), run.dp_size
    pipelined = "pipeline_parallel_size" in run.strategy and not reference
    if pipelined:  # what MulaDataModule sets: the step's micro-batches, in one batch per step
        strategy.pipeline_microbatches = MICROS // dp_size
    batches = _Batches(dp_rank, dp_size, pipelined)
    routing = RoutingRecord(near_ties=reference and not bf16)
    losses = _StepLosses(batches, routing)
    trainer = cpu_trainer(
        world, strategy, max_steps=STEPS, accumulate_grad_batches=1 if pipelined else MICROS // dp_size,
        callbacks=[losses, routing], gradient_clip_val=0.5, precision=run.precision, default_root_dir=root,
    )  # fmt: skip
    torch.manual_seed(seeded(0))
    exact = reference and not bf16  # the plain model: nothing recomputed or compiled
    lr = BF16_LR if bf16 else 1e-2
    module = MulaLightningModule(
        PRESET, overrides=run.overrides, lr=lr, min_lr=lr / 10, warmup_steps=1, decay_steps=10, eps=ADAMW_EPS,
        activation_checkpointing="none" if exact else run.activation_checkpointing,
        compile=False if exact else run.compile, optimizer=run.optimizer,
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
    return {**losses.record(), "params": {n: p.float() for n, p in params.items()}, "optim": metrics}


def assert_row_matches(run: dict, ref: dict, features, what: str) -> None:
    """`run` (one rank of a row) equals its reference by the rule the row's features allow (module
    docstring): the suite's equality rule in fp32, bf16's own for a bf16-true row. Each rank holds the
    whole model (gathered), its stage's parameters under pipeline stages."""
    mine = run["params"]
    assert set(mine) <= set(ref["params"]), (what, sorted(set(mine) - set(ref["params"])))
    if "bf16-true" not in probe(features).features:
        if assert_same_training(run, ref, what=what):  # the trained models then agree
            assert_same_weights(mine, ref["params"], what=what)
        return
    for key, rtol in (("losses", BF16_LOSS_RTOL), ("norms", BF16_NORM_RTOL)):
        torch.testing.assert_close(
            torch.tensor(run[key], dtype=torch.float64), torch.tensor(ref[key], dtype=torch.float64),
            rtol=rtol, atol=0, msg=lambda m, k=key: f"{what} {k}: {m}",
        )  # fmt: skip
    for name, value in mine.items():
        if name.endswith("router.bias"):
            continue
        want = ref["params"][name]
        distance = float((value - want).norm() / want.norm())
        assert distance <= BF16_WEIGHT_RTOL, f"{what} {name}: relative distance {distance:.2e}"
