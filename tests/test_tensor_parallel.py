"""Tensor (and sequence) parallelism of a dense model under XPUMoEStrategy, 1 process vs 4 gloo ranks.

Reference: one process, the same MulaLightningModule, gradient accumulation over the same global
batches. On W = 4 CPU ranks, fp32, 6 optimizer steps with global-norm clipping: T = 2 (DP = 2),
T = 2 with sequence parallelism, and T = 4 (DP = 1) on the tiny dense model, compared by the suite's
equality rule (tests/equality.py): every logged loss and global gradient norm, then every parameter
(gathered to its full tensor) after the last step. The T = 2 model has RMSNorm weights and QK-norm
(normalised over all heads, split over the TP group) and grouped KV heads. Dropping the TP all-reduce
of partial gradients (the norm weights under sequence parallelism) must break the equality: the
classic silent bug, caught. Layouts that are not available yet are refused with one sentence. MoE
models: tests/test_tensor_parallel_moe.py.
"""

from __future__ import annotations

import pytest
import torch
from dist_helpers import cpu_trainer, lightning_env, run_distributed
from equality import ADAMW_EPS, RoutingRecord, assert_same_training, assert_same_weights, seeded
from test_strategy import _StepLosses  # per step: the global-batch loss and the global gradient norm
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from callbacks import MemoryMetrics
from mula.layout.parallel_layout import ParallelLayout
from mula.model.config import resolve_config
from mula.model.transformer import Mula
from mula.training.module import MulaLightningModule
from strategies import XPUMoEStrategy
from strategies.tensor_parallel import apply_tensor_parallel

MICRO, SEQ, MICROS_PER_STEP, STEPS, WORLD = 2, 16, 4, 6, 4
# RMSNorm weights (partial gradients under SP), QK-norm over all heads, GQA (4 heads, 2 KV heads)
RMS = dict(
    vocab_size=256, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64,
    max_position_embeddings=64, norm="rmsnorm", qk_norm=True,
)  # fmt: skip
# the tiny dense preset (non-parametric LayerNorm, no QK-norm), small
TINY = dict(vocab_size=256, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64)


def _module(overrides: dict) -> MulaLightningModule:
    torch.manual_seed(seeded(0))
    return MulaLightningModule(
        "mula-tiny-dense", overrides=overrides, lr=1e-2, min_lr=1e-3, warmup_steps=1, decay_steps=10,
        eps=ADAMW_EPS,
    )  # fmt: skip


class _Batches:
    """Data-parallel rank `dp_rank`'s micro-batches of every step: each global batch of MICROS_PER_STEP
    micro-batches split into contiguous runs over `dp_size` ranks (TP ranks read the same); with
    `whole_steps` (pipeline stages) each step's run as one batch."""

    def __init__(
        self, dp_rank: int, dp_size: int, first_step: int = 0, steps: int = STEPS, whole_steps: bool = False
    ) -> None:
        self.dp_rank, self.dp_size, self.first_step, self.steps = dp_rank, dp_size, first_step, steps
        self.whole_steps = whole_steps
        self.consumed = 0  # micro-batches trained on (counted by _StepLosses)

    def __iter__(self):
        per_rank = MICROS_PER_STEP // self.dp_size
        for step in range(self.first_step, self.steps):
            g = torch.Generator().manual_seed(seeded(1000 + step))
            batch = torch.randint(0, RMS["vocab_size"], (MICROS_PER_STEP * MICRO, SEQ + 1), generator=g)
            mine = batch.split(MICRO)[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank]
            yield from [torch.cat(mine)] if self.whole_steps else mine


def _fit(
    overrides: dict,
    strategy,
    dp_rank: int = 0,
    dp_size: int = 1,
    *,
    save_dir=None,
    ckpt_path=None,
    first_step=0,
    steps=STEPS,
    precision="32-true",
) -> tuple[_StepLosses, dict]:
    """Train to step `steps` (from `ckpt_path`, saved at `first_step`, when given; checkpoints every 2 steps
    into `save_dir`); return the step losses (`.record()`: what `equality.assert_same_training` compares,
    with the routing record of an MoE model, its near ties in the one-process reference) and every
    parameter and buffer (an MoE model's router bias) as its full (gathered) tensor."""
    staged = strategy is not None and strategy.layout.pp > 1
    if staged:  # what MulaDataModule sets: the step's micro-batches, handed over as one batch
        strategy.pipeline_microbatches = MICROS_PER_STEP // dp_size
    batches = _Batches(dp_rank, dp_size, first_step, steps, whole_steps=staged)
    routing = RoutingRecord(near_ties=strategy is None)  # the one-process reference's near ties
    losses = _StepLosses(batches, routing)
    world = WORLD if strategy is not None else 1
    trainer = cpu_trainer(
        world,
        strategy,
        max_steps=steps,
        accumulate_grad_batches=1 if staged else MICROS_PER_STEP // dp_size,
        # MemoryMetrics meters DTensors and functional collectives' results
        callbacks=[losses, routing, MemoryMetrics()],
        gradient_clip_val=0.5,
        save_dir=save_dir,
        log_every_n_steps=2,
        precision=precision,
    )
    trainer.fit(_module(overrides), batches, ckpt_path=ckpt_path)
    params = {}
    module = trainer.lightning_module
    for name, p in [*module.named_parameters(), *module.named_buffers()]:
        full = p.full_tensor() if isinstance(p, DTensor) else p
        params[name] = full.detach().clone()
    return losses, params


def _drop_partial_reduction() -> None:
    """The classic bug: a partial (Partial-placement) gradient taken as if it were complete."""
    import strategies.optim.grad_reduce as grad_reduce

    proper = grad_reduce.laid_out_grad

    def dropped(p, grad):
        if any(pl.is_partial() for pl in getattr(grad, "placements", ())):
            return DTensor.from_local(grad.to_local(), p.device_mesh, p.placements, run_check=False)
        return proper(p, grad)

    grad_reduce.laid_out_grad = dropped


def _run_tp(rank: int, world: int) -> dict:
    lightning_env(rank, world)
    out = {}
    for key, overrides, tp, sp in (("t2", RMS, 2, False), ("t2sp", RMS, 2, True), ("t4", TINY, 4, False)):
        strategy = XPUMoEStrategy(tensor_parallel_size=tp, sequence_parallel=sp, shard_optimizer=False)
        losses, params = _fit(overrides, strategy, rank // tp, world // tp)
        assert strategy.data_parallel_size == world // tp
        out[key] = {**losses.record(), "params": params}
    _drop_partial_reduction()
    strategy = XPUMoEStrategy(tensor_parallel_size=2, sequence_parallel=True, shard_optimizer=False)
    losses, params = _fit(RMS, strategy, rank // 2, world // 2)
    out["dropped"] = {"losses": losses.losses, "params": params}
    # sequence parallelism refuses a sequence its ranks cannot split evenly, before any collective
    model = apply_tensor_parallel(
        Mula(resolve_config("mula-tiny-dense", TINY)), init_device_mesh("cpu", (world,)), True
    )
    with pytest.raises(ValueError, match="sequence length 6 is not divisible by 4") as err:
        model(torch.zeros(1, 6, dtype=torch.long))
    out["uneven"] = str(err.value)
    return out


def _run_tp_sharded(rank: int, world: int) -> dict:
    """T = 2 and T = 2 with SP under the sharded optimizer (the second with small buckets, so
    parameters, row-split ones included, are cut between the data-parallel ranks' shards, under
    ZeRO-2 with the parameter all-gathers overlapped with the next forward)."""
    lightning_env(rank, world)
    out = {}
    small = {"bucket_numel": 700, "align": 4, "zero_stage": 2, "overlap_param_gather": True}
    for key, sp, options in (("t2", False, {}), ("t2sp", True, small)):
        strategy = XPUMoEStrategy(tensor_parallel_size=2, sequence_parallel=sp, optimizer_options=options)
        losses, params = _fit(RMS, strategy, rank // 2, world // 2)
        opt = strategy._sharded_optimizer()
        assert opt is not None and opt.master.dtype == torch.float32
        # the flat buffers hold local TP shards: counted in the test, each element owned once per TP index
        out[key] = {
            **losses.record(), "params": params,
            "owned": opt.owned_numel(), "split": bool(opt._tp_split_ranges),
        }  # fmt: skip
    # bf16-true: bf16 local shards in the model, fp32 masters and moments in the optimizer's shard
    strategy = XPUMoEStrategy(tensor_parallel_size=2, sequence_parallel=True)
    losses, params = _fit(RMS, strategy, rank // 2, world // 2, precision="bf16-true")
    out["bf16"] = {
        "losses": losses.losses,
        "param_dtypes": {p.dtype for p in params.values()},
        "master_dtype": strategy._sharded_optimizer().master.dtype,
    }
    return out


def test_tensor_parallel_with_the_sharded_optimizer_matches_single_process() -> None:
    """EPShardedAdamW over local TP shards: dense state sharded over the data-parallel group (no TP
    rank in it), clipping by the global norm (TP-split elements summed over the TP group, replicated
    ones once), parameters all-gathered into the local shards."""
    ref, ref_params = _fit(RMS, None)
    runs = run_distributed(_run_tp_sharded, WORLD)
    total = sum(v.numel() for v in ref_params.values())
    for rank_out in runs:
        for key in ("t2", "t2sp"):
            _assert_matches(rank_out[key], ref, ref_params, what=key)
            assert rank_out[key]["split"]
    # every element's state is owned exactly once: replicated (norm) weights once per TP rank
    replicated = sum(
        v.numel() for n, v in ref_params.items() if n.endswith(("attn_norm.weight", "mlp_norm.weight"))
    )
    replicated += ref_params["model.norm.weight"].numel()
    for key in ("t2", "t2sp"):
        assert sum(r[key]["owned"] for r in runs) == total + replicated
    bf16 = runs[0]["bf16"]
    assert bf16["param_dtypes"] == {torch.bfloat16} and bf16["master_dtype"] == torch.float32
    torch.testing.assert_close(torch.tensor(bf16["losses"]), torch.tensor(ref.losses), rtol=2e-2, atol=0)


def _assert_matches(
    run: dict, ref: _StepLosses, ref_params: dict, what: str = "", first_step: int = 0
) -> None:
    """The equality rule (tests/equality.py): `run`'s per-step losses and norms against the reference's
    (from its step `first_step` on: a run resumed there), then its parameters (and router biases) against
    `ref_params`."""
    assert run["params"].keys() == ref_params.keys(), what
    assert_same_training(run, ref.record(), first_step=first_step, what=what)
    assert_same_weights(run["params"], ref_params, what=what)


def test_tensor_parallel_matches_single_process() -> None:
    ref_rms, ref_rms_params = _fit(RMS, None)
    ref_tiny, ref_tiny_params = _fit(TINY, None)
    assert len(ref_rms.losses) == STEPS
    runs = run_distributed(_run_tp, WORLD)
    for rank_out in runs:  # every rank holds the same full model
        _assert_matches(rank_out["t2"], ref_rms, ref_rms_params, what="t2")
        _assert_matches(rank_out["t2sp"], ref_rms, ref_rms_params, what="t2sp")
        _assert_matches(rank_out["t4"], ref_tiny, ref_tiny_params, what="t4")
    assert all(r["uneven"].endswith("choose a seq_len divisible by it.") for r in runs)
    # without the TP all-reduce of partial gradients the norm weights train on half the tokens
    dropped = runs[0]["dropped"]["params"]
    moved = max(float((dropped[n] - v).abs().max()) for n, v in ref_rms_params.items() if "norm" in n)
    assert moved > 1e-3, moved


TIED = {**RMS, "tie_embeddings": True}


def _run_tp_tied(rank: int, world: int) -> dict:
    lightning_env(rank, world)
    out = {}
    for key, sp, shard in (("adamw", False, False), ("sharded_sp", True, True)):
        strategy = XPUMoEStrategy(tensor_parallel_size=2, sequence_parallel=sp, shard_optimizer=shard)
        losses, params = _fit(TIED, strategy, rank // 2, world // 2)
        model = strategy.lightning_module.model
        out[key] = {
            **losses.record(), "params": params,
            "tied": model.lm_head.weight is model.embed.weight and isinstance(model.embed.weight, DTensor),
        }  # fmt: skip
    return out


def test_tied_embeddings_under_tensor_parallelism_match_single_process() -> None:
    """The embedding and the LM head share one vocabulary-split table (both Shard(0) of [V, H]): the
    gradients of both uses land in it, with torch AdamW and with the sharded optimizer under SP."""
    ref, ref_params = _fit(TIED, None)
    assert "model.lm_head.weight" not in ref_params  # one parameter
    for rank_out in run_distributed(_run_tp_tied, WORLD):
        for key in ("adamw", "sharded_sp"):
            assert rank_out[key]["tied"]
            _assert_matches(rank_out[key], ref, ref_params, what=key)


def test_tensor_parallel_rank_order_puts_tp_innermost() -> None:
    layout = ParallelLayout(world_size=8, tp=2, ep=1, pp=1)
    assert layout.dp_size == 4
    assert layout.all_groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # the data-parallel (gradient-reduction) world of each TP index excludes the TP peers
    assert layout.group_ranks("replica", 0) == [0, 2, 4, 6]
    assert layout.group_ranks("replica", 3) == [1, 3, 5, 7]
    assert layout.mesh_shape() == (4, 1, 1, 2)


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (
            lambda: XPUMoEStrategy(sequence_parallel=True),
            "sequence_parallel=True needs tensor_parallel_size > 1",
        ),
        (
            lambda: ParallelLayout(world_size=4, tp=4).validate(
                resolve_config("mula-tiny-dense", {"num_heads": 2})
            ),
            "2 attention heads are not divisible by tensor_parallel_size=4",
        ),
        (
            lambda: ParallelLayout(world_size=4, tp=2).validate(
                resolve_config("mula-tiny-dense", {"vocab_size": 255})
            ),
            "255 vocabulary entries are not divisible by tensor_parallel_size=2",
        ),
        (
            lambda: ParallelLayout(world_size=6, tp=4),
            "world size 6 is not divisible by tensor_parallel_size=4",
        ),
    ],
)
def test_unavailable_tensor_parallel_layouts_are_refused_in_one_sentence(make, needle: str) -> None:
    with pytest.raises(ValueError, match=needle) as err:
        make()
    message = str(err.value)
    assert message.count(". ") == 0 and message.endswith("."), message


def _resume_across_t(rank: int, world: int, root: str, shard: bool = False) -> dict:
    """T = 2 saves at step 2; T = 1 resumes from it (and saves at step 4); T = 2 resumes from that."""
    lightning_env(rank, world)

    def strategy(tp: int) -> XPUMoEStrategy:
        return XPUMoEStrategy(tensor_parallel_size=tp, shard_optimizer=shard)

    _fit(RMS, strategy(2), rank // 2, world // 2, save_dir=f"{root}/t2")
    down, _ = _fit(
        RMS,
        strategy(1),
        rank,
        world,
        save_dir=f"{root}/t1",
        ckpt_path=f"{root}/t2/epoch=0-step=2.ckpt",
        first_step=2,
    )
    up, params = _fit(
        RMS, strategy(2), rank // 2, world // 2, ckpt_path=f"{root}/t1/epoch=0-step=4.ckpt", first_step=4
    )
    return {"down": down.record(), "up": up.record(), "params": params}


@pytest.mark.parametrize("shard", [False, True], ids=["adamw", "sharded"])
def test_checkpoints_resume_at_another_tensor_parallel_size(tmp_path, shard: bool) -> None:
    """Sharded checkpoints hold global tensors: 2 -> 1 and 1 -> 2 continue the uninterrupted losses,
    with torch's AdamW (DTensor moments) and with the sharded optimizer (its flat state addressed in
    the flattened global parameters, a row-split weight's local shard one piece per row)."""
    ref, ref_params = _fit(RMS, None)
    out = run_distributed(_resume_across_t, WORLD, str(tmp_path), shard)[0]
    # a dense model: no top-k choice can flip, so every step is compared (equality.py)
    assert_same_training(out["down"], ref.record(), first_step=2, what="t2 -> t1")
    assert_same_training(out["up"], ref.record(), first_step=4, what="t1 -> t2")
    assert_same_weights(out["params"], ref_params, what="t1 -> t2")
    # the T = 2 directory holds whole tensors: mula's weights reader (export-hf's too) reads them
    from mula.checkpoint import load_weights

    _, at_two = _fit(RMS, None, steps=2)
    saved = tmp_path / "t2" / "epoch=0-step=2.ckpt"
    weights = load_weights(saved).state_dict()
    assert_same_weights({n: weights[n.removeprefix("model.")] for n in at_two}, at_two, what="t2 checkpoint")
