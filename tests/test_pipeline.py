"""Pipeline stages in XPUMoEStrategy against one process (gloo CPU processes, Lightning's Trainer).

Reference: one process, the same MulaLightningModule and global batches, gradient accumulation over
the same micro-batches. Checked on 4 ranks for (P=2, E=2), (P=4, E=1) and (P=2, E=1, DP=2) with each
schedule (gpipe, 1f1b, interleaved-1f1b), by the project's equality rule (tests/equality.py): per-step
losses and gradient norms for 6 steps (clipping by the norm over all stages), then every parameter
afterwards and the validation loss (forward only through the stages). Checkpoints
saved at (W=4, P=2, E=2) resume at (W=4, P=1, E=4) and at W=1 with the uninterrupted run's next
steps, one saved at (W=4, P=1, E=4) resumes at (W=4, P=2, E=2), and the pipelined checkpoint reads
as one whole model (export to Hugging Face). Composes with activation checkpointing (the rule) and
bf16-true with fp32 masters (within bf16 rounding); meta_init builds each rank's stage only, with
agreeing replicas; the auxiliary-loss-free router bias, counted per stage by global block, equals the
one-process bias exactly. A model whose first blocks are dense (`num_dense_layers`) trains on 2 ranks
(P=2, 1F1B and interleaved, with stages holding only dense blocks) with the one-process losses,
gradient norms, weights and router bias: the router losses are means over the MoE blocks in both.
Layout errors are one sentence, at start.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as L
import pytest
import torch
from dist_helpers import cpu_trainer, lightning_env, run_distributed
from equality import (
    ADAMW_EPS,
    LOSS_RTOL,
    MUON_NS_DTYPE,
    RoutingRecord,
    assert_compared_through,
    assert_same_training,
    assert_same_weights,
    seeded,
)

from mula.checkpoint import load_weights
from mula.hf import export_hf
from mula.layout.parallel_layout import ParallelLayout
from mula.layout.rules import check_world, stage_layer_counts, validate_schedule
from mula.training.module import MulaLightningModule
from strategies import XPUMoEStrategy

MICRO, SEQ, MICROS_PER_STEP, STEPS = 2, 16, 4, 6
OVERRIDES = dict(
    vocab_size=256, hidden_size=32, num_layers=4, num_heads=2, num_experts=8, top_k=2,
    expert_intermediate_size=32, max_position_embeddings=64,
)  # fmt: skip
# (P, E, schedule, virtual stages) on 4 ranks; DP = 4 / (P * E) x E data-parallel ranks per stage
LAYOUTS = [
    (p, e, schedule, 2 if schedule == "interleaved-1f1b" and p == 2 else 1)
    for p, e in ((2, 2), (4, 1), (2, 1))
    for schedule in ("gpipe", "1f1b", "interleaved-1f1b")
]


def _module(
    activation_checkpointing: str = "none",
    bias_rate: float = 0.0,
    dense_layers: int = 0,
    model: tuple[str, dict] = ("mula-tiny-moe", OVERRIDES),
    lr: float = 1e-2,
    optimizer: str = "adamw",
) -> MulaLightningModule:
    """The test's module: `model` = (preset, overrides), by default the tiny OLMoE-style shape above."""
    torch.manual_seed(seeded(0))
    preset, overrides = model[0], {**model[1], "router_bias_update_rate": bias_rate}
    if dense_layers:  # the first blocks dense, a SwiGLU of width 64
        overrides.update(num_dense_layers=dense_layers, intermediate_size=64)
    return MulaLightningModule(
        preset, overrides=overrides, lr=lr, min_lr=lr / 10, warmup_steps=1, decay_steps=10,
        activation_checkpointing=activation_checkpointing, eps=ADAMW_EPS, optimizer=optimizer,
        muon_ns_dtype=MUON_NS_DTYPE,
    )  # fmt: skip


def _global_batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seeded(1000 + step))
    return torch.randint(0, OVERRIDES["vocab_size"], (MICROS_PER_STEP * MICRO, SEQ + 1), generator=g)


class _StepBatches:
    """A data-parallel rank's batches, step after step: its contiguous share of each global batch, in
    micro-batches (accumulated by Lightning) or whole (a pipeline step). Resumable by steps consumed."""

    def __init__(self, dp_rank: int, dp_size: int, whole_steps: bool, total_steps: int) -> None:
        self.dp_rank, self.dp_size, self.total_steps = dp_rank, dp_size, total_steps
        self.per_step = 1 if whole_steps else MICROS_PER_STEP // dp_size
        self.start_step = 0
        self.consumed = 0

    def __iter__(self):
        rows = MICROS_PER_STEP * MICRO // self.dp_size
        for step in range(self.start_step, self.total_steps):
            mine = _global_batch(step)[self.dp_rank * rows : (self.dp_rank + 1) * rows]
            yield from mine.split(rows // self.per_step)

    def state_dict(self) -> dict:
        return {"steps": self.start_step + self.consumed // self.per_step}

    def load_state_dict(self, state: dict) -> None:
        self.start_step = state["steps"]


class _StepLosses(L.Callback):
    """Per optimizer step: the global-batch loss and the gradient norm before clipping."""

    def __init__(self, loader: _StepBatches, routing: RoutingRecord) -> None:
        self.loader, self.routing, self.losses, self.norms, self._acc = loader, routing, [], [], 0.0

    def record(self) -> dict:
        """What `equality.assert_same_training` compares: losses, norms and the routing record."""
        return {"losses": self.losses, "norms": self.norms, **self.routing.as_dict()}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if not isinstance(trainer.strategy, XPUMoEStrategy):
            grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
            self.norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.loader.consumed += 1
        self._acc += float(outputs["loss"])  # divided by accumulate_grad_batches (1 with a pipeline)
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
            # a pipeline returns the global mean on every rank; otherwise each rank its own mean
            self.losses.append(float(trainer.strategy.reduce(torch.tensor(self._acc), reduce_op="mean")))
            self._acc = 0.0
            if isinstance(trainer.strategy, XPUMoEStrategy):
                self.norms.append(float(trainer.strategy.last_grad_norm))


def _fit(
    world: int,
    strategy,
    *,
    max_steps: int = STEPS,
    ckpt_path=None,
    save_dir=None,
    precision="32-true",
    activation_checkpointing="none",
    bias_rate: float = 0.0,
    dense_layers: int = 0,
    model: tuple[str, dict] = ("mula-tiny-moe", OVERRIDES),
    lr: float = 1e-2,
    optimizer: str = "adamw",
    callbacks: Sequence[Any] = (),
):
    rank = int(os.environ.get("LOCAL_RANK", 0))
    pp, ep = (strategy.layout.pp, strategy.layout.ep) if strategy else (1, 1)
    dp_size = world // pp
    dp_rank = (rank // (pp * ep)) * ep + rank % ep  # rank inside its stage (EP innermost)
    loader = _StepBatches(dp_rank, dp_size, pp > 1, max_steps)
    if pp > 1:  # what MulaDataModule sets: the step's accumulation micro-batches
        strategy.pipeline_microbatches = MICROS_PER_STEP // dp_size
    routing = RoutingRecord(near_ties=strategy is None)  # the one-process reference's near ties
    losses = _StepLosses(loader, routing)
    trainer = cpu_trainer(
        world,
        strategy,
        max_steps=max_steps,
        accumulate_grad_batches=1 if pp > 1 else MICROS_PER_STEP // world,
        callbacks=[losses, routing, *callbacks],
        save_dir=save_dir,
        precision=precision,
        gradient_clip_val=0.05,  # small enough to clip: the norm must be the whole model's
    )
    module = _module(activation_checkpointing, bias_rate, dense_layers, model, lr, optimizer)
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    return losses, trainer


class _Batches:
    """A loader of fixed batches (a plain list would be taken as one loader per element)."""

    def __init__(self, batches: list[torch.Tensor]) -> None:
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)


VAL_BATCHES = 4  # validation batches of MICRO sequences, split over the data-parallel ranks


def _validate(trainer, dp_rank: int, dp_size: int) -> float:
    """val/loss of the trained model on the same held-out batches for every layout."""
    vocab = OVERRIDES["vocab_size"]
    batches = [
        torch.randint(0, vocab, (MICRO, SEQ + 1), generator=torch.Generator().manual_seed(seeded(7 + k)))
        for k in range(VAL_BATCHES)
    ]
    per_rank = VAL_BATCHES // dp_size
    mine = batches[dp_rank * per_rank : (dp_rank + 1) * per_rank]
    trainer.validate(trainer.lightning_module, _Batches(mine), verbose=False)
    return float(trainer.callback_metrics["val/loss"])


def _local_params(trainer) -> dict:
    """This rank's parameters (expert stacks with the global index of their first row)."""
    strategy = trainer.strategy
    opt = strategy._sharded_optimizer()
    if opt is not None:
        opt.wait_for_params()
    topo = strategy.topology
    out = {}
    for name, p in trainer.lightning_module.named_parameters():
        first = topo.rank("ep") * p.shape[0] if ".experts." in name else 0
        out[name] = (first, p.detach().clone())
    return out


def _run_layouts(rank: int, world: int, root: str) -> dict:
    lightning_env(rank, world)
    out = {}
    for i, (pp, ep, schedule, virtual) in enumerate(LAYOUTS):
        strategy = XPUMoEStrategy(
            expert_parallel_size=ep,
            pipeline_parallel_size=pp,
            pipeline_schedule=schedule,
            pipeline_virtual_stages=virtual,
            shard_optimizer=(pp, ep) != (2, 1),  # the plain AdamW path too
        )
        save = f"{root}/p2e2" if i == 0 else None
        losses, trainer = _fit(world, strategy, save_dir=save)
        dp_rank = (rank // (pp * ep)) * ep + rank % ep
        out[(pp, ep, schedule)] = {
            **losses.record(),
            "val_loss": _validate(trainer, dp_rank, world // pp),
            "params": _local_params(trainer),
        }
    # composes with activation checkpointing (the rule) and bf16 weights with fp32 masters
    recompute, _ = _fit(
        world,
        XPUMoEStrategy(expert_parallel_size=2, pipeline_parallel_size=2),
        activation_checkpointing="full",
    )
    out["recompute"] = recompute.record()
    bf16, trainer = _fit(
        world, XPUMoEStrategy(expert_parallel_size=2, pipeline_parallel_size=2), precision="bf16-true"
    )
    out["bf16"] = bf16.losses
    out["bf16_dtypes"] = {p.dtype for p in trainer.lightning_module.parameters()}
    out["bf16_master"] = trainer.strategy._sharded_optimizer().master.dtype
    # auxiliary-loss-free balancing: each stage reports its blocks' counts by global index
    biased, trainer = _fit(
        world,
        XPUMoEStrategy(expert_parallel_size=2, pipeline_parallel_size=2),
        bias_rate=BIAS_RATE,
        max_steps=3,
    )
    out["biased"] = {**biased.record(), "bias": _router_biases(trainer)}
    # meta_init (as the Aurora recipe): each rank materialises only its stage; replicas of a stage agree
    _, trainer = _fit(
        world, XPUMoEStrategy(expert_parallel_size=2, pipeline_parallel_size=2, meta_init=True), max_steps=1
    )
    topo = trainer.strategy.topology
    dense = next(p for n, p in trainer.lightning_module.named_parameters() if "attn.q_proj" in n).detach()
    gathered = [torch.empty_like(dense) for _ in range(topo.size("replica"))]
    torch.distributed.all_gather(gathered, dense, group=topo.group("replica"))
    out["meta_replicas_agree"] = all(torch.equal(g, dense) for g in gathered)
    out["meta_layers"] = sorted(
        {n.split(".")[2] for n, _ in trainer.lightning_module.named_parameters() if ".layers." in n}
    )
    # the reverse direction's checkpoint: saved without pipeline stages
    p1e4, _ = _fit(world, XPUMoEStrategy(expert_parallel_size=4), max_steps=2, save_dir=f"{root}/p1e4")
    out["p1e4"] = p1e4.record()
    return out


BIAS_RATE = 1e-2


def _router_biases(trainer) -> dict[str, torch.Tensor]:
    return {
        n: b.detach().clone()
        for n, b in trainer.lightning_module.named_buffers()
        if n.endswith("router.bias")
    }


def _assert_bias_follows_counts(trainer, record: dict) -> None:
    """The one-process run's balancing bias moved in every MoE block at its first step and is the sum of
    its steps' updates from the recorded global counts (`update_router_bias`, replayed). Its value at the
    end may be zero: a step's update swings the next step's choices the other way, so after an even
    number of steps the signs often cancel."""
    config = trainer.lightning_module.config
    replayed = torch.zeros(record["counts"][0].shape)
    for step, counts in enumerate(record["counts"]):
        load = counts.float()
        replayed.add_(torch.sign(load.mean(-1, keepdim=True) - load), alpha=BIAS_RATE)
        if step == 0:
            assert bool((replayed.abs().sum(-1) > 0).all()), replayed
    biases = _router_biases(trainer)
    assert len(biases) == config.num_moe_layers
    for name, bias in biases.items():
        assert torch.equal(bias, replayed[config.moe_layer_row(int(name.split(".")[2]))]), name


def _resume(rank: int, world: int, ep: int, pp: int, ckpt: str, max_steps: int) -> dict:
    lightning_env(rank, world)
    strategy = XPUMoEStrategy(expert_parallel_size=ep, pipeline_parallel_size=pp)
    return _fit(world, strategy, max_steps=max_steps, ckpt_path=ckpt)[0].record()


def _assemble(ranks: list[dict], name: str) -> torch.Tensor:
    """A full parameter from the ranks holding it (expert rows placed at their global index)."""
    pieces = {first: t for r in ranks if name in r for first, t in [r[name]]}
    return torch.cat([pieces[k] for k in sorted(pieces)]) if len(pieces) > 1 else next(iter(pieces.values()))


def _assert_trained_like(
    runs: list[dict], key, ref: dict, ref_params: dict, ref_bias: dict | None = None
) -> None:
    """The equality rule (tests/equality.py) for every rank of the runs' layout `key` against the
    one-process record `ref`: the global losses and gradient norms of every step, then the ranks'
    parameters together are the reference's and the router biases they hold are `ref_bias` exactly (the
    same global counts, the same sign updates)."""
    records = [ref, *(r[key] for r in runs)]
    assert all(len(x["counts"]) == len(x["losses"]) for x in records), f"{key}: expert counts not recorded"
    for i, r in enumerate(runs):
        assert_same_training(r[key], ref, what=f"{key} rank {i}")
    ranks = [r[key]["params"] for r in runs]
    assert set().union(*ranks) == set(ref_params), key
    assert_same_weights({name: _assemble(ranks, name) for name in ref_params}, ref_params, what=str(key))
    biases = [(name, bias) for r in runs for name, bias in r[key].get("bias", {}).items()]
    for name, bias in biases if ref_bias is not None else []:
        torch.testing.assert_close(bias, ref_bias[name], rtol=0, atol=0, msg=f"{key} {name}")


def test_pipeline_matches_single_process_and_reshards_checkpoints() -> None:
    ref_losses, ref_trainer = _fit(1, None)
    ref = ref_losses.record()
    ref_params = {n: p.detach().clone() for n, p in ref_trainer.lightning_module.named_parameters()}
    ref_val = _validate(ref_trainer, 0, 1)
    with tempfile.TemporaryDirectory() as root:
        runs = run_distributed(_run_layouts, 4, root)
        for pp, ep, schedule, _ in LAYOUTS:
            key = (pp, ep, schedule)
            _assert_trained_like(runs, key, ref, ref_params)
            for r in runs:  # validation runs forward through the stages
                assert r[key]["val_loss"] == pytest.approx(ref_val, rel=LOSS_RTOL), key
        r0 = runs[0]
        assert_same_training(r0["recompute"], ref, what="recompute")
        # bf16 rounding is far above any top-k flip's or eps's effect
        torch.testing.assert_close(torch.tensor(r0["bf16"]), torch.tensor(ref["losses"]), rtol=2e-2, atol=0)
        assert r0["bf16_dtypes"] == {torch.bfloat16} and r0["bf16_master"] == torch.float32
        biased, biased_trainer = _fit(1, None, bias_rate=BIAS_RATE, max_steps=3)
        ref_bias = _router_biases(biased_trainer)
        assert len(ref_bias) == OVERRIDES["num_layers"]
        _assert_bias_follows_counts(biased_trainer, biased.record())
        # the same training, and each rank's blocks carry the one-process bias
        for rank, r in enumerate(runs):
            assert r["biased"]["bias"] and set(r["biased"]["bias"]) < set(ref_bias)
            assert_same_training(r["biased"], biased.record(), what=f"bias rank {rank}")
            for name, bias in r["biased"]["bias"].items():
                torch.testing.assert_close(bias, ref_bias[name], rtol=0, atol=0, msg=name)
        assert all(r["meta_replicas_agree"] for r in runs)
        assert [r["meta_layers"] for r in runs] == [["0", "1"], ["0", "1"], ["2", "3"], ["2", "3"]]
        saved = f"{root}/p2e2/epoch=0-step=2.ckpt"
        # every stage's part, by global layer and expert index: one process reads the whole model
        whole = load_weights(saved).state_dict()
        assert {f"model.{k}" for k in whole} == set(ref_params)
        assert whole["layers.3.mlp.experts.gate_up"].shape[0] == OVERRIDES["num_experts"]
        export_hf(saved, f"{root}/hf")
        # (W=4, P=2, E=2) -> (W=4, P=1, E=4) and -> one process: the uninterrupted run's next steps, if
        # the run that saved the checkpoint had followed the reference to it (equality.py: top-k flips)
        w4 = run_distributed(_resume, 4, 4, 1, saved, 4)[0]
        w1 = run_distributed(_resume, 1, 1, 1, saved, 4)[0]
        assert_compared_through(r0[(2, 2, "gpipe")], ref, 2, what="p2e2 saving")
        assert_same_training(w4, ref, first_step=2, what="p2e2 -> p1e4")
        assert_same_training(w1, ref, first_step=2, what="p2e2 -> w1")
        # ... and the reverse: (W=4, P=1, E=4) -> (W=4, P=2, E=2)
        back = run_distributed(_resume, 4, 2, 2, f"{root}/p1e4/epoch=0-step=2.ckpt", 4)[0]
        assert_compared_through(r0["p1e4"], ref, 2, what="p1e4 saving")
        assert_same_training(back, ref, first_step=2, what="p1e4 -> p2e2")


# (dense first blocks, schedule, virtual stages) on 2 ranks, P=2: with 1 dense block the interleaved
# stage 0 holds only it (its router sums start at zero); with 2 the interleaved stage 1 holds only a
# dense block between stages (the sums pass through)
DENSE_FIRST = [(1, "1f1b", 1), (1, "interleaved-1f1b", 2), (2, "interleaved-1f1b", 2)]


def _run_dense_first(rank: int, world: int) -> dict:
    lightning_env(rank, world)
    out = {}
    for dense, schedule, virtual in DENSE_FIRST:
        strategy = XPUMoEStrategy(
            pipeline_parallel_size=2, pipeline_schedule=schedule, pipeline_virtual_stages=virtual
        )
        out[(dense, schedule)] = _trained(*_fit(world, strategy, bias_rate=BIAS_RATE, dense_layers=dense))
    return out


def _trained(losses: _StepLosses, trainer) -> dict:
    """What a rank's run leaves to compare with one process: its record (step losses, norms and expert
    counts), its parameters and router biases."""
    return {**losses.record(), "params": _local_params(trainer), "bias": _router_biases(trainer)}


def test_dense_first_blocks_train_the_same_under_stages() -> None:
    runs = run_distributed(_run_dense_first, 2)
    for dense, schedule, _ in DENSE_FIRST:
        key = (dense, schedule)
        ref, ref_trainer = _fit(1, None, bias_rate=BIAS_RATE, dense_layers=dense)
        model = ref_trainer.lightning_module.model
        assert [type(b.mlp).__name__ for b in model.layers] == ["MLP"] * dense + ["MoELayer"] * (4 - dense)
        ref_params = {n: p.detach().clone() for n, p in ref_trainer.lightning_module.named_parameters()}
        ref_bias = _router_biases(ref_trainer)
        assert len(ref_bias) == 4 - dense
        _assert_bias_follows_counts(ref_trainer, ref.record())
        # each rank's MoE blocks carry the one-process router bias
        _assert_trained_like(runs, key, ref.record(), ref_params, ref_bias)
        assert set().union(*(r[key]["bias"] for r in runs)) == set(ref_bias), key


def _fit_errors(rank: int, world: int) -> list[str]:
    lightning_env(rank, world)
    messages = []
    for strategy in (
        XPUMoEStrategy(pipeline_parallel_size=2, pipeline_stage_layers=[1, 2]),
        XPUMoEStrategy(pipeline_parallel_size=2, expert_parallel_size=2),
    ):
        try:
            _fit(world, strategy, max_steps=1)
        except ValueError as error:
            messages.append(str(error))
    return messages


def test_invalid_pipeline_layouts_fail_at_start() -> None:
    for messages in run_distributed(_fit_errors, 2):
        assert messages == [
            "pipeline_stage_layers [1, 2] sums to 3 but the model has 4 layers.",
            "The world size 2 is not divisible by pipeline_parallel_size=2 x expert_parallel_size=2 = 4; "
            "choose sizes whose product divides the number of ranks.",
        ]


def test_layout_errors_are_one_sentence_naming_the_numbers() -> None:
    with pytest.raises(
        ValueError,
        match="world size 4 is not divisible by pipeline_parallel_size=4 x expert_parallel_size=2 = 8",
    ):
        check_world(4, 2, 4)
    with pytest.raises(ValueError, match="4 layers, fewer than its 8 pipeline stages"):
        stage_layer_counts(4, 8)
    with pytest.raises(ValueError, match=r"\[1, 2\] sums to 3 but the model has 4 layers"):
        stage_layer_counts(4, 2, [1, 2])
    with pytest.raises(ValueError, match="has 3 entries but the pipeline has 2 stages"):
        stage_layer_counts(4, 2, [1, 1, 2])
    with pytest.raises(ValueError, match="must be one of"):
        validate_schedule("zero-bubble", 2, 1)
    with pytest.raises(
        ValueError, match="pipeline_virtual_stages=2 needs pipeline_schedule 'interleaved-1f1b'"
    ):
        XPUMoEStrategy(pipeline_parallel_size=2, pipeline_virtual_stages=2)
    assert stage_layer_counts(10, 4) == [3, 3, 2, 2]
    assert stage_layer_counts(4, 2, [1, 3]) == [1, 3]


def stage_ranks(world: int, ep: int, pp: int, stage: int) -> list[int]:
    """Global ranks of pipeline stage `stage`, in stage-local order."""
    layout = ParallelLayout(world_size=world, ep=ep, pp=pp)
    return layout.group_ranks("replica", layout.rank(pp=stage))


def test_stage_ranks_put_experts_innermost_and_data_parallel_outermost() -> None:
    # W=8, P=2, E=2: rank = d*4 + s*2 + e
    assert stage_ranks(8, 2, 2, 0) == [0, 1, 4, 5]
    assert stage_ranks(8, 2, 2, 1) == [2, 3, 6, 7]
    assert stage_ranks(4, 1, 4, 3) == [3]
