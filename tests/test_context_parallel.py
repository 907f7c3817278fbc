"""Ulysses context parallelism under XPUMoEStrategy, 1 process vs 4 gloo ranks (docs/context-parallel.md).

Reference: one process, the same MulaLightningModule, gradient accumulation over the same global
batches of sequences of SEQ = 1,024 tokens. On W = 4 CPU ranks, fp32, 6 optimizer steps with
global-norm clipping: the tiny dense model (RMSNorm, QK-norm over all heads, GQA) at C = 2 (DP = 2,
sharded optimizer) and C = 4 (DP = 1, torch's AdamW), the tiny MoE (a dense first block, a shared
expert, the router-bias update) at C = 2 (DP = 2) and C = 2 x E = 2 (DP = 1). Compared by the suite's
equality rule (tests/equality.py): the MoE's step expert counts, every logged loss (total; aux and z
for the MoE) and every global gradient norm, then every parameter and router bias after the last step.
Taking the router losses' CP sum with an identity backward (as tensor parallelism may) must break the
MoE's equality. Checkpoints resume across C (2 -> 1 -> 4), continuing the uninterrupted run by the same
rule. MLA and Qwen3's per-head QK-norm forward as one process at C = 2. The planner's
activations (within 10 %) and Ulysses all-to-all bytes (exactly) match measured ones. Heads, KV heads
and sequences that C does not divide are refused with one sentence.
"""

from __future__ import annotations

import lightning.pytorch as L
import pytest
import torch
import torch.distributed as dist
from dist_helpers import cpu_trainer, lightning_env, run_distributed
from equality import ADAMW_EPS, RoutingRecord, assert_same_training, assert_same_weights, seeded
from test_strategy import _StepLosses  # per step: the global-batch loss and the global gradient norm
from test_tensor_parallel_moe import _Logged  # per step: the logged aux and z losses
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from mula.layout.parallel_layout import ParallelLayout
from mula.model.config import resolve_config
from mula.model.moe import is_expert_param
from mula.model.transformer import Mula
from mula.training.module import MulaLightningModule
from strategies import XPUMoEStrategy
from strategies.context_parallel import apply_context_parallel

MICRO, SEQ, MICROS_PER_STEP, STEPS, WORLD = 2, 1024, 4, 6, 4
DENSE = dict(
    vocab_size=256, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=4, intermediate_size=64,
    max_position_embeddings=SEQ, norm="rmsnorm", qk_norm=True,
)  # fmt: skip
GQA = {**DENSE, "num_kv_heads": 2}  # C = 2 splits the 2 KV heads too
MOE = dict(
    vocab_size=256, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64,
    num_dense_layers=1, num_experts=4, top_k=2, expert_intermediate_size=32, max_position_embeddings=SEQ,
    router_bias_update_rate=1e-3, num_shared_experts=1, shared_expert_intermediate_size=16,
)  # fmt: skip
# the 4-rank runs: key -> (preset, overrides, C, E, sharded optimizer)
RUNS = {
    "dense_c2": ("mula-tiny-dense", GQA, 2, 1, True),
    "dense_c4": ("mula-tiny-dense", DENSE, 4, 1, False),
    "moe_c2": ("mula-tiny-moe", MOE, 2, 1, False),
    "moe_c2e2": ("mula-tiny-moe", MOE, 2, 2, True),
}
# the per-step series the equality rule compares (`_fit`'s result; aux and z are empty for a dense model)
SERIES = ("losses", "norms", "aux", "z", "logged_loss")


class _Batches:
    """Data-parallel rank `dp_rank`'s micro-batches of every step (CP ranks read the same ones), or its
    whole share of each step in one batch (`whole_steps`: what a pipeline step consumes)."""

    def __init__(self, dp_rank: int, dp_size: int, first_step: int = 0, whole_steps: bool = False) -> None:
        self.dp_rank, self.dp_size, self.first_step, self.consumed = dp_rank, dp_size, first_step, 0
        self.whole_steps = whole_steps

    def __iter__(self):
        per_rank = MICROS_PER_STEP // self.dp_size
        for step in range(self.first_step, STEPS):
            g = torch.Generator().manual_seed(seeded(1000 + step))
            batch = torch.randint(0, 256, (MICROS_PER_STEP * MICRO, SEQ + 1), generator=g)
            mine = batch.split(MICRO)[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank]
            yield from [torch.cat(mine)] if self.whole_steps else mine


class _LoggedLoss(L.Callback):
    """Per optimizer step: `train/loss` as the module logs it (its mean over the step's ranks)."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
            self.values.append(float(trainer.callback_metrics["train/loss"]))


def _fit(
    preset: str,
    overrides: dict,
    strategy,
    dp_rank: int = 0,
    dp_size: int = 1,
    *,
    save_dir=None,
    ckpt_path=None,
    first_step: int = 0,
    keep_trainer: bool = False,
    world: int = WORLD,
) -> dict:
    """Train to step STEPS (from `ckpt_path`, saved at `first_step`, when given; checkpoints every 2 steps
    into `save_dir`): the per-step losses, norms and logged metrics and the routing record (what
    `equality.assert_same_training` compares, `SERIES`), every parameter and router bias (experts whole;
    a pipeline rank's stage's), and the trainer with `keep_trainer`; `world`: the strategy's ranks."""
    pipelined = strategy is not None and strategy.layout.pp > 1
    if pipelined:  # what MulaDataModule sets: the step's micro-batches, in one batch per step
        strategy.pipeline_microbatches = MICROS_PER_STEP // dp_size
    batches = _Batches(dp_rank, dp_size, first_step, whole_steps=pipelined)
    routing = RoutingRecord(near_ties=strategy is None)  # the one-process reference's near ties
    losses, logged, logged_loss = _StepLosses(batches, routing), _Logged(), _LoggedLoss()
    trainer = cpu_trainer(
        world if strategy is not None else 1, strategy, max_steps=STEPS,
        accumulate_grad_batches=1 if pipelined else MICROS_PER_STEP // dp_size,
        callbacks=[losses, logged_loss, routing] + ([logged] if preset.endswith("moe") else []),
        gradient_clip_val=0.5, log_every_n_steps=1, save_dir=save_dir,
    )  # fmt: skip
    torch.manual_seed(seeded(0))
    module = MulaLightningModule(
        preset, overrides=overrides, lr=1e-2, min_lr=1e-3, warmup_steps=1, decay_steps=10, eps=ADAMW_EPS
    )
    trainer.fit(module, batches, ckpt_path=ckpt_path)
    topo = getattr(strategy, "topology", None)
    params = {}
    module = trainer.lightning_module
    for name, p in [*module.named_parameters(), *module.named_buffers()]:  # the router bias included
        full = p.detach()
        if isinstance(full, DTensor):  # tensor parallelism: this rank's shard, gathered
            full = full.full_tensor()
        if is_expert_param(name) and topo is not None and topo.size("ep") > 1:  # this rank's experts only
            parts = [torch.empty_like(full) for _ in range(topo.size("ep"))]
            dist.all_gather(parts, full.contiguous(), group=topo.group("ep"))
            full = torch.cat(parts)
        params[name] = full.clone()
    return {
        **losses.record(), "aux": logged.aux, "z": logged.z, "logged_loss": logged_loss.values,
        "params": params, **({"trainer": trainer} if keep_trainer else {}),
    }  # fmt: skip


def _identity_router_sum() -> None:
    """The tempting bug: the router losses' CP sum with TP's identity backward (gradients 1/C too small)."""
    from mula.model.moe.balancing import TokenSplit
    from strategies.context_parallel import ContextParallelTokens

    def total(self, t):
        out = t.detach().clone()
        dist.all_reduce(out, group=self.group)
        return t + (out - t).detach()  # forward: the sum; backward: the identity

    ContextParallelTokens.total = total
    assert TokenSplit.total is not total


def _run(rank: int, world: int) -> dict:
    lightning_env(rank, world)
    out = {}
    for key, (preset, overrides, cp, ep, shard) in RUNS.items():
        strategy = XPUMoEStrategy(context_parallel_size=cp, expert_parallel_size=ep, shard_optimizer=shard)
        out[key] = _fit(preset, overrides, strategy, rank // cp, world // cp)
        assert (strategy.data_parallel_rank, strategy.data_parallel_size) == (rank // cp, world // cp)
    _identity_router_sum()
    strategy = XPUMoEStrategy(context_parallel_size=2, shard_optimizer=False)
    out["identity"] = _fit("mula-tiny-moe", MOE, strategy, rank // 2, world // 2)
    # a sequence the CP ranks cannot split evenly: refused before any collective
    model = apply_context_parallel(Mula(resolve_config("mula-tiny-dense", DENSE)), None, rank, world)
    module = MulaLightningModule("mula-tiny-dense", overrides=DENSE)
    module.model = model
    with pytest.raises(ValueError, match="sequence length 6 is not divisible by context_parallel_size=4"):
        module.training_step(torch.zeros(1, 7, dtype=torch.long), 0)
    return out


def _resume_across_c(rank: int, world: int, root: str) -> dict:
    """C = 2 saves at step 2; C = 1 (DP = 4) resumes from it and saves at step 4; C = 4 resumes from that."""
    lightning_env(rank, world)

    def strategy(cp: int) -> XPUMoEStrategy:
        return XPUMoEStrategy(context_parallel_size=cp)

    saved = _fit("mula-tiny-dense", DENSE, strategy(2), rank // 2, world // 2, save_dir=f"{root}/c2")
    down = _fit(
        "mula-tiny-dense", DENSE, strategy(1), rank, world, save_dir=f"{root}/c1",
        ckpt_path=f"{root}/c2/epoch=0-step=2.ckpt", first_step=2,
    )  # fmt: skip
    up = _fit(
        "mula-tiny-dense", DENSE, strategy(4), 0, 1, ckpt_path=f"{root}/c1/epoch=0-step=4.ckpt", first_step=4
    )
    del saved["params"], down["params"]
    return {"saved": saved, "down": down, "up": up}


@pytest.fixture(scope="module")
def runs() -> tuple[dict, list[dict]]:
    ref = {
        "dense_c2": _fit("mula-tiny-dense", GQA, None),
        "dense_c4": _fit("mula-tiny-dense", DENSE, None),
        "moe": _fit("mula-tiny-moe", MOE, None),
    }
    ref["moe_c2"] = ref["moe_c2e2"] = ref["identity"] = ref["moe"]
    return ref, run_distributed(_run, WORLD)


@pytest.mark.parametrize("key", list(RUNS))
def test_context_parallel_matches_single_process(runs, key: str) -> None:
    """Expert counts, losses (logged and per step; aux and z) and gradient norms of every step, then every
    parameter and router bias, on every rank (the equality rule, tests/equality.py)."""
    ref, out = runs
    ref = ref[key]
    assert len(ref["losses"]) == STEPS
    for rank, rank_out in enumerate(out):
        run = rank_out[key]
        assert len(run["counts"]) == (STEPS if key.startswith("moe") else 0)
        assert run["params"].keys() == ref["params"].keys()
        assert_same_training(run, ref, series=SERIES, what=f"{key} rank {rank}")
        assert_same_weights(run["params"], ref["params"], what=f"{key} rank {rank}")


def test_checkpoints_resume_at_another_context_parallel_size(runs, tmp_path) -> None:
    """A checkpoint of C = 2 resumes at C = 1 and one of C = 1 at C = 4 (sharded optimizer), each
    continuing the uninterrupted run (losses and gradient norms); the final parameters are one process's."""
    ref = runs[0]["dense_c4"]
    out = run_distributed(_resume_across_c, WORLD, str(tmp_path))[0]
    # the dense model routes nothing: the rule compares every step of each run (no top-k flip possible)
    assert_same_training(out["saved"], ref, series=SERIES, what="C=2")
    assert_same_training(out["down"], ref, first_step=2, series=SERIES, what="C=2 -> C=1")
    assert_same_training(out["up"], ref, first_step=4, series=SERIES, what="C=1 -> C=4")
    assert_same_weights(out["up"]["params"], ref["params"], what="C=1 -> C=4")


def test_router_losses_need_their_true_backward(runs) -> None:
    """With an identity backward of the router losses' CP sum the run is not one process's, by the rule
    itself: its gradient norms leave LOSS_RTOL, or (where the first step's differ by less) the choices it
    routes differently at a later step are not near ties of the reference."""
    ref, out = runs
    for rank, r in enumerate(out):
        with pytest.raises(AssertionError):
            assert_same_training(r["identity"], ref["identity"], series=SERIES, what=f"identity rank {rank}")


@pytest.mark.parametrize(
    ("layout", "overrides", "needle"),
    [
        (
            dict(world_size=4, cp=4),
            dict(hidden_size=48, num_heads=6, num_kv_heads=2),
            "6 attention heads are not divisible",
        ),
        (dict(world_size=4, cp=4), dict(num_kv_heads=2), "2 key/value heads are not divisible"),
        (
            dict(world_size=4, cp=2, tp=2),
            dict(num_kv_heads=2),
            "2 key/value heads are not divisible by context_parallel_size=2 x tensor_parallel_size=2",
        ),
        (dict(world_size=6, cp=4), {}, "world size 6 is not divisible by context_parallel_size=4"),
    ],
)
def test_context_parallel_refusals(layout: dict, overrides: dict, needle: str) -> None:
    """Layouts that cannot run are refused with one sentence, before any process group exists."""
    config = resolve_config("mula-tiny-dense", {**DENSE, **overrides})
    with pytest.raises(ValueError, match=needle):
        ParallelLayout(**layout).validate(config)


def test_context_parallel_rank_order() -> None:
    """CP sits between EP and TP; its peers are the stage's replicas (gradients), not its data ranks."""
    layout = ParallelLayout(world_size=8, cp=2, ep=2)
    assert layout.dp_size == 4 and layout.replica_size == 8 and layout.edp_size == 2
    assert layout.all_groups("cp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.all_groups("ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.group_ranks("edp_cp", 0) == [0, 1, 4, 5]
    assert layout.group_ranks("replica", 0) == list(range(8))
    assert layout.mesh_dims() == ("edp", "pp", "ep", "cp", "tp")
    assert ParallelLayout(world_size=8).mesh_dims() == ("edp", "pp", "ep", "tp")


class _AllToAllBytes(TorchDispatchMode):
    """Bytes the functional all-to-alls run while entered send to other ranks (forward and backward)."""

    def __init__(self, parts: int) -> None:
        super().__init__()
        self.parts, self.bytes, self.calls = parts, 0.0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "_c10d_functional" and func._opname == "all_to_all_single":
            self.bytes += args[0].numel() * args[0].element_size() * (self.parts - 1) / self.parts
            self.calls += 1
        return func(*args, **(kwargs or {}))


def _measure_activations(rank: int, world: int) -> dict[str, int]:
    """Saved-tensor bytes of one micro-batch's forward at C = 2 (DP = 2), dense (GQA) and MoE, and the
    head all-to-alls' bytes of its forward and backward."""
    from mula.training.memory_meter import SavedTensorMeter
    from strategies.topology import topology_from_layout

    topo = topology_from_layout(ParallelLayout(world_size=world, cp=2))
    out = {}
    for preset, overrides in (("mula-tiny-dense", GQA), ("mula-tiny-moe", MOE)):
        torch.manual_seed(0)
        module = MulaLightningModule(preset, overrides=overrides)
        module.configure_model()
        apply_context_parallel(module.model, topo.group("cp"), topo.rank("cp"), topo.size("cp"))
        batch = torch.randint(0, 256, (MICRO, SEQ + 1), generator=torch.Generator().manual_seed(rank // 2))
        with _AllToAllBytes(topo.size("cp")) as sent:
            with SavedTensorMeter(exclude=module.parameters()) as meter:
                loss = module._losses(batch)[0]
            loss.backward()  # the all-to-alls' backward: every rank of the group runs it
        out[preset] = meter.bytes
        out[preset + "/sent"] = (sent.bytes, sent.calls)
    return out


def test_planned_activations_match_measured_under_context_parallelism() -> None:
    """The planner's activation bytes per rank at C = 2 (1/C of the sequence, attention's heads / C over
    the whole of it) within 10 % of the saved-tensor bytes of a forward; the step-time model's Ulysses
    all-to-all bytes and calls exactly those of the forward and backward."""
    from mula.plan import Layout, plan_memory
    from mula.plan.step_time import context_parallel_sends

    measured = run_distributed(_measure_activations, WORLD)
    layout = Layout(world_size=WORLD, cp_size=2, micro_batch=MICRO, seq_len=SEQ)
    for preset, overrides in (("mula-tiny-dense", GQA), ("mula-tiny-moe", MOE)):
        config = resolve_config(preset, overrides)
        planned = plan_memory(config, layout).activations
        sends = context_parallel_sends(config, layout, list(range(config.num_layers)))
        for rank_out in measured:
            assert abs(planned - rank_out[preset]) <= 0.1 * rank_out[preset], (
                preset,
                planned,
                rank_out[preset],
            )
            assert rank_out[preset + "/sent"] == pytest.approx(sends, rel=1e-12)


def _sliced_forward(rank: int, world: int) -> dict[str, float]:
    """Each family's logits and router losses at C = world against one process's, on every rank."""
    group = dist.new_group(list(range(world)))
    out = {}
    for preset in ("deepseek-v3-tiny", "qwen3-moe-tiny"):  # MLA; per-head QK-norm with GQA
        torch.manual_seed(seeded(0))
        model = Mula(resolve_config(preset, {"num_layers": 2}))
        ids = torch.randint(0, 4096, (2, 64), generator=torch.Generator().manual_seed(seeded(1)))
        whole = model(ids)
        apply_context_parallel(model, group, rank, world)
        mine = model(model.sequence_shard.take(ids))
        diff = (mine.logits - model.sequence_shard.take(whole.logits)).abs().max()
        out[preset] = max(float(diff), float((mine.aux_loss - whole.aux_loss).abs()))
    return out


def test_context_parallel_forward_of_every_attention_family() -> None:
    """Multi-head latent attention (its one core) and Qwen3's per-head QK-norm: the logits of each
    rank's slice and the router losses equal one process's at C = 2."""
    for rank_out in run_distributed(_sliced_forward, 2):
        for preset, diff in rank_out.items():
            assert diff < 1e-5, preset
