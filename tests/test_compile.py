"""`model.compile` against eager runs (docs/compile.md).

fp32 on CPU, Inductor, the same weights and batches: 20 optimizer steps of 4 micro-batches with
global-norm clipping, compared with the eager run by the suite's equality rule (tests/equality.py:
every step's loss and gradient norm, then every weight after step 20), for a tiny MoE model (the
compiled run goes on for 50 more steps: after the first 3 steps, learned and uneven routing compiles
nothing more, counted from torch's compile callbacks) and a tiny dense one, with
`activation_checkpointing: full` and with every part checkpointed, and on 4 gloo ranks with
E = 2 x P = 2 (there also bf16-true with fp32 masters and the meta-device build, compiled against eager
within bf16's rounding), and under tensor parallelism (T = 2 on 2 gloo ranks: the MoE model with
sequence parallelism through Inductor, the dense one through "aot_eager", and a planted bug in the
vocabulary-parallel embedding's backward that the rule rejects). Graph breaks: at most one per MoE
block kind, none in a dense block (docs/compile.md says why). State-dict keys are those of the eager
model (no `_orig_mod.`).

CI time: torch.compile on a small CPU is slow, so the tests share one Inductor cache (a module-scoped
directory) -- the graphs of identical blocks compile once, the later runs and the 4 ranks find them
there -- and the models are tiny, with 2 blocks of one kind each (identical blocks share one graph).
"""

from __future__ import annotations

import os

import pytest
import torch
from dist_helpers import cpu_trainer, lightning_env, run_distributed
from equality import ADAMW_EPS, RoutingRecord, assert_same_training, assert_same_weights, seeded
from test_strategy import _StepLosses  # per step: the global-batch loss and the global gradient norm
from test_tensor_parallel import MICROS_PER_STEP, _Batches  # vocabulary 256
from torch.distributed.tensor import DTensor

from callbacks import MemoryMetrics
from mula.model.compile import (
    CompileWatch,
    compile_blocks,
    compile_regions,
    parse_compile,
    rank_cache_dir,
    use_cache_dir,
)
from mula.training.module import MulaLightningModule
from strategies import XPUMoEStrategy

STEPS, MORE_STEPS, WARMUP, BF16_STEPS = 20, 50, 3, 4
# the learning rate at which 20 steps of these models stop amplifying rounding (tests/equality.py: a test
# whose own training amplifies rounding cannot be compared): compiled against eager, the gradient norms
# were 5.7e-6 apart (relative) at lr 1e-2 on an AMD EPYC and 1.4e-5 on another host, over LOSS_RTOL;
# 7e-8 (MoE) and 1.6e-7 (dense) at 1e-3
LR = 1e-3
MOE = dict(vocab_size=256, hidden_size=32, num_layers=2, num_heads=4, num_experts=4, top_k=2,
           expert_intermediate_size=32, max_position_embeddings=64)  # fmt: skip
DENSE = dict(vocab_size=256, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64,
             max_position_embeddings=64)  # fmt: skip
PRESETS = {"moe": ("mula-tiny-moe", MOE), "dense": ("mula-tiny-dense", DENSE)}
# graph breaks per block kind (docs/compile.md): the MoE layer's routed experts; nothing in a dense block
GRAPH_BREAKS = {"moe": 1, "dense": 0}


def _module(kind: str, compile_value, checkpointing: str = "none") -> MulaLightningModule:
    preset, overrides = PRESETS[kind]
    torch.manual_seed(seeded(0))
    return MulaLightningModule(
        preset, overrides=overrides, lr=LR, min_lr=LR / 10, warmup_steps=1, decay_steps=STEPS,
        activation_checkpointing=checkpointing, compile=compile_value, eps=ADAMW_EPS,
    )  # fmt: skip


def _fit(
    kind: str,
    compile_value,
    strategy=None,
    dp_rank=0,
    dp_size=1,
    steps=STEPS,
    checkpointing="none",
    precision="32-true",
    world=4,
):
    """Train on `world` ranks under `strategy` (one process without it); return (the step losses' record: what `equality.assert_same_training` compares, with the
    near ties of the eager one-process reference; parameters after step 20, state-dict keys, per step:
    the compile counters and the step's expert counts)."""
    import lightning.pytorch as L

    staged = strategy is not None and strategy.layout.pp > 1
    if staged:
        strategy.pipeline_microbatches = MICROS_PER_STEP // dp_size
    batches = _Batches(dp_rank, dp_size, 0, steps, whole_steps=staged)
    routing = RoutingRecord(near_ties=strategy is None and not compile_value)
    losses = _StepLosses(batches, routing)
    snapshots: list[dict] = []
    params: dict = {}

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, module, *args) -> None:
            if trainer.global_step == STEPS and not params and strategy is None:
                params.update({n: p.detach().clone() for n, p in module.named_parameters()})
            watch = module._compile_watch
            if watch is not None and len(snapshots) < trainer.global_step:
                counts = module.step_expert_counts
                snapshots.append(dict(watch.metrics(), counts=None if counts is None else counts.clone()))

    torch._dynamo.reset()  # each run traces afresh (the graphs themselves come from the shared cache)
    trainer = cpu_trainer(
        world if strategy is not None else 1,
        strategy,
        max_steps=steps,
        accumulate_grad_batches=1 if staged else MICROS_PER_STEP // dp_size,
        callbacks=[
            losses,
            routing,
            MemoryMetrics(),
            Record(),
        ],  # MemoryMetrics: saved-tensor hooks over the graphs
        gradient_clip_val=0.5,
        log_every_n_steps=2,
        precision=precision,
    )
    module = _module(kind, compile_value, checkpointing)
    trainer.fit(module, batches)
    if strategy is not None:  # this rank's parameters; expert stacks at their global rows
        if strategy._sharded_optimizer() is not None:
            strategy._sharded_optimizer().wait_for_params()
        for name, p in module.named_parameters():
            first = strategy.topology.rank("ep") * p.shape[0] if ".experts." in name else 0
            whole = p.full_tensor() if isinstance(p, DTensor) else p  # a tensor-parallel split gathered
            params[name] = (first, whole.detach().clone())
    return losses.record(), params, list(module.state_dict()), snapshots


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """One Inductor cache for the module's compiled runs; the process's setting restored afterwards."""
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    yield str(tmp_path_factory.mktemp("inductor"))
    if before is None:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
    else:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = before


@pytest.fixture(scope="module")
def eager():
    """The eager reference runs, 20 steps each."""
    return {kind: _fit(kind, False) for kind in PRESETS}


def _first_steps(record: dict, steps: int = STEPS) -> dict:
    """`record` (`_StepLosses.record()`) cut to its first `steps` steps."""
    return {**record, **{key: record[key][:steps] for key in ("losses", "norms", "counts")}}


def _assert_matches(run, ref, what: str, steps=STEPS) -> None:
    """The equality rule: the first `steps` steps of `run` against the eager reference's, then the
    weights after them."""
    record, params, keys, _ = run
    ref_record, ref_params, ref_keys, _ = ref
    assert len(record["losses"]) >= steps
    assert keys == ref_keys and params.keys() == ref_params.keys()
    assert_same_training(_first_steps(record, steps), ref_record, what=what)
    assert_same_weights(params, ref_params, what=what)


def test_compiled_moe_matches_eager_and_never_recompiles_as_routing_changes(eager, cache_dir) -> None:
    setting = {"cache_dir": cache_dir, "warmup_steps": WARMUP}
    run = _fit("moe", setting, steps=STEPS + MORE_STEPS)
    ref = eager["moe"]
    # the first 20 steps against the eager run's (the schedule reaches min_lr at step 20 in both)
    _assert_matches(run, ref, what="compiled moe")
    snaps = run[3]
    assert not any("_orig_mod" in k for k in run[2])
    assert len(snaps) == STEPS + MORE_STEPS
    warm = snaps[WARMUP - 1]
    assert warm["compile/compiles"] >= 1  # it did compile
    for snap in snaps[WARMUP:]:  # 50 more steps: no compilation at all, so no recompilation
        assert snap["compile/compiles"] == warm["compile/compiles"]
        assert snap["compile/recompiles"] == warm["compile/recompiles"] == 0
    assert snaps[-1]["compile/graph_breaks"] <= GRAPH_BREAKS["moe"]
    # the routing was learned and uneven, and it changed from step to step
    counts = torch.stack([s["counts"] for s in snaps[WARMUP:]]).float()  # [steps, layers, E]
    assert (counts.amax(-1) > counts.amin(-1)).all()  # never uniform
    assert (counts.amax(-1) / counts.amin(-1).clamp(min=1)).max() > 1.5  # at times far from it
    assert len({tuple(c.flatten().tolist()) for c in counts}) > MORE_STEPS // 2


def test_compiled_dense_matches_eager(eager, cache_dir) -> None:
    run = _fit("dense", {"cache_dir": cache_dir})
    _assert_matches(run, eager["dense"], what="compiled dense")
    assert run[3][-1]["compile/compiles"] >= 1
    assert run[3][-1]["compile/graph_breaks"] == GRAPH_BREAKS["dense"]
    assert run[3][-1]["compile/recompiles"] == 0


@pytest.mark.parametrize("checkpointing", ["full", ["moe", "attention", "norms"]], ids=["full", "parts"])
def test_compiled_moe_with_activation_checkpointing_matches_eager(eager, cache_dir, checkpointing) -> None:
    run = _fit("moe", {"cache_dir": cache_dir}, checkpointing=checkpointing)
    _assert_matches(run, eager["moe"], what=f"compiled moe, checkpointing {checkpointing}")
    assert run[3][-1]["compile/compiles"] >= 1
    assert run[3][-1]["compile/graph_breaks"] <= GRAPH_BREAKS["moe"]


def _expert_pipeline(rank: int, world: int, cache_dir: str):
    lightning_env(rank, world)
    strategy = XPUMoEStrategy(expert_parallel_size=2, pipeline_parallel_size=2)
    # E = 2 x P = 2 on 4 ranks: stages outermost, so ranks 0, 1 hold the first stage and 2, 3 the second;
    # the two ranks of a stage split its experts and are its two data-parallel ranks (each its share of
    # the global batch, as XPUMoEStrategy.distributed_sampler_kwargs says: experts are split, tokens not)
    dp_rank, dp_size = rank % 2, 2
    fp32 = _fit("moe", {"cache_dir": cache_dir}, strategy, dp_rank=dp_rank, dp_size=dp_size)
    # bf16 weights with fp32 masters, built on the meta device: compiled against eager on this layout
    bf16 = {}
    for compiled in (False, True):
        strategy = XPUMoEStrategy(expert_parallel_size=2, pipeline_parallel_size=2, meta_init=True)
        setting = {"cache_dir": cache_dir} if compiled else False
        run = _fit(
            "moe",
            setting,
            strategy,
            dp_rank=dp_rank,
            dp_size=dp_size,
            steps=BF16_STEPS,
            precision="bf16-true",
        )
        master = strategy._sharded_optimizer().master.dtype
        bf16[compiled] = (run[0], {n: v.dtype for n, (_, v) in run[1].items()}, master, run[3])
    return fp32, bf16


def _sum_vocab_grads_over_tp() -> None:
    """A planted bug: the vocabulary-parallel embedding's backward also sums the output's gradient over
    the TP group (the backward of an all-reduce, where each rank's gradient is already the whole one):
    T times the embedding's gradient, the forward unchanged."""
    import torch.distributed as dist

    import strategies.tensor_parallel as tp

    proper = tp._VocabParallelLookup.backward

    def summed(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.tp_mesh.get_group())
        return proper(ctx, grad)

    tp._VocabParallelLookup.backward = staticmethod(summed)


def _tensor_parallel(rank: int, world: int, cache_dir: str) -> dict:
    """T = 2 on 2 ranks: the MoE model with sequence parallelism through Inductor, the dense one without
    through AOTAutograd alone ("aot_eager"), then the dense one again with the planted bug."""
    lightning_env(rank, world)
    out = {}
    for key, kind, sp, backend in (
        ("moe sp", "moe", True, "inductor"),
        ("dense", "dense", False, "aot_eager"),
    ):
        strategy = XPUMoEStrategy(tensor_parallel_size=2, sequence_parallel=sp, shard_optimizer=False)
        out[key] = _fit(kind, {"cache_dir": cache_dir, "backend": backend}, strategy, world=2)
    _sum_vocab_grads_over_tp()
    strategy = XPUMoEStrategy(tensor_parallel_size=2, shard_optimizer=False)
    out["planted"] = _fit("dense", {"cache_dir": cache_dir, "backend": "aot_eager"}, strategy, world=2)
    return out


def test_compiled_tensor_parallel_matches_eager(eager, cache_dir) -> None:
    """Compiled blocks under tensor parallelism (T = 2, 2 gloo ranks) against the eager one-process runs:
    the vocabulary-parallel embedding before the first compiled block hands back the gradient it gets
    (`strategies.tensor_parallel.VocabParallelEmbedding`; torch's `RowwiseParallel` stopped the first
    backward there). The planted bug (the embedding's gradient summed over the TP group) fails the rule."""
    runs = run_distributed(_tensor_parallel, 2, cache_dir)
    for rank, out in enumerate(runs):
        for key, kind in (("moe sp", "moe"), ("dense", "dense")):
            record, params, keys, snaps = out[key]
            ref_record, ref_params, ref_keys, _ = eager[kind]
            what = f"compiled T=2 {key}, rank {rank}"
            assert keys == ref_keys, what
            assert_same_training(record, ref_record, what=what)
            assert_same_weights({n: v for n, (_, v) in params.items()}, ref_params, what=what)
            assert snaps[-1]["compile/compiles"] >= 1 and snaps[-1]["compile/recompiles"] == 0, what
        with pytest.raises(AssertionError, match="planted"):
            assert_same_training(out["planted"][0], eager["dense"][0], what="planted")


def _warm_bf16_cache(cache_dir: str) -> None:
    """Compile the bf16 block graphs once here, so the 4 ranks load them from the cache instead of each
    compiling them at the same time on a small runner."""
    from mula.model.config import resolve_config
    from mula.model.transformer import Mula

    use_cache_dir(cache_dir)
    torch._dynamo.reset()
    model = Mula(resolve_config("mula-tiny-moe", MOE)).to(torch.bfloat16)
    compile_blocks(model.layers, parse_compile(True))
    _, batch = next(enumerate(_Batches(0, 1, 0, 1)))
    model(batch[:, :-1]).logits.float().sum().backward()


def test_compiled_moe_under_expert_parallel_pipeline_stages_matches_eager(eager, cache_dir) -> None:
    _warm_bf16_cache(cache_dir)
    runs = run_distributed(_expert_pipeline, 4, cache_dir)
    ref_record, ref_params, _, _ = eager["moe"]
    held: set = set()
    for rank, ((record, params, _keys, snaps), _) in enumerate(runs):
        held |= params.keys()
        assert_same_training(record, ref_record, what=f"E=2 x P=2 rank {rank}")
        # this rank's parameters; expert stacks against the same experts of the reference
        mine = {name: value for name, (_, value) in params.items()}
        want = {
            name: ref_params[name][first : first + value.shape[0]]
            if ".experts." in name
            else ref_params[name]
            for name, (first, value) in params.items()
        }
        assert_same_weights(mine, want, what=f"E=2 x P=2 rank {rank}")
        assert snaps[-1]["compile/compiles"] >= 1 and snaps[-1]["compile/recompiles"] == 0
    assert held == ref_params.keys()
    for _, bf16 in runs:  # bf16-true, fp32 masters, meta-device build: compiled within bf16's rounding
        (eager_record, dtypes, master, _), (record, compiled_dtypes, compiled_master, snaps) = (
            bf16[False],
            bf16[True],
        )
        torch.testing.assert_close(
            torch.tensor(record["losses"]), torch.tensor(eager_record["losses"]), rtol=2e-2, atol=0
        )
        assert set(dtypes.values()) == set(compiled_dtypes.values()) == {torch.bfloat16}
        assert master == compiled_master == torch.float32
        assert snaps[-1]["compile/compiles"] >= 1


def test_ranks_keep_caches_of_their_own_where_graphs_hold_their_groups_collectives() -> None:
    """Under T or C a compiled graph names this rank's process groups, which Inductor's cache keys leave
    out (docs/compile.md): each rank a directory of its own; otherwise one shared directory."""
    assert rank_cache_dir("/c", 3, tp_size=1, cp_size=1) == "/c"
    assert rank_cache_dir("/c", 3, tp_size=2, cp_size=1) == os.path.join("/c", "rank3")
    assert rank_cache_dir("/c", 0, tp_size=1, cp_size=2) == os.path.join("/c", "rank0")


def test_settings_are_checked_before_any_work() -> None:
    assert parse_compile(False) is None and parse_compile(None) is None
    assert parse_compile(True).torch_kwargs()["backend"] == "inductor"
    assert parse_compile({"mode": "max-autotune", "dynamic": False}).mode == "max-autotune"
    for bad, words in (
        ({"modes": "x"}, "unknown key"),
        ({"mode": "fastest"}, "modes"),
        ({"mode": "default", "options": {}}, "not both"),
        ({"warmup_steps": 0}, "warmup_steps"),
        ("yes", "false, true or a mapping"),
    ):
        with pytest.raises(ValueError, match=words):
            MulaLightningModule("mula-tiny-moe", compile=bad)


def test_regions_follow_checkpointing_and_fullgraph_is_refused_for_moe() -> None:
    from mula.model.config import resolve_config
    from mula.model.transformer import Mula

    model = Mula(resolve_config("mula-tiny-moe", MOE))
    block = model.layers[0]
    assert compile_regions(block) == [(block, None)]
    model.set_activation_checkpointing("full")
    assert compile_regions(block) == [(block, "_forward")]
    model.set_activation_checkpointing(["moe", "attention"])
    assert [m for m, _ in compile_regions(block)] == [block.attn_norm, block.attn, block.mlp_norm, block.mlp]
    with pytest.raises(ValueError, match="fullgraph"):
        compile_blocks(model.layers, parse_compile({"fullgraph": True}))
    keys = list(model.state_dict())
    assert compile_blocks(model.layers, parse_compile(True)) == 8  # 4 parts x 2 blocks, lazily compiled
    assert list(model.state_dict()) == keys


def test_watch_logs_once_after_warmup_and_warns_when_recompiling(caplog) -> None:
    watch = CompileWatch(warmup_steps=2)
    assert watch.after_step() is None
    logged = watch.after_step()
    assert set(logged) == {"compile/compiles", "compile/recompiles", "compile/graph_breaks", "compile/time_s"}
    assert watch.after_step() is None  # once
    watch.recompiles += 1  # what the callback counts when a frame compiles again
    with caplog.at_level("WARNING", logger="mula.model.compile"):
        watch.after_step()
        watch.after_step()  # no new recompilation: no second warning
    assert sum("recompiled 1 time" in r.getMessage() for r in caplog.records) == 1
