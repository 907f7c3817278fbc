"""Multi-token prediction (mula.model.mtp) under XPUMoEStrategy, 1 process vs 4 gloo ranks: a tiny
DeepSeek-V3 -- the layout probe's model (tests/composition.py) with MLA, sigmoid group-limited routing
with the balancing bias, a dense first block, a shared expert -- with one MTP module (an MoE block)
trains as one process at E = 2 (DP = 4), C = 2 (DP = 2), C = 2 x E = 2 with the sharded optimizer
(ZeRO-1), T = 2 x E = 2 without sequence parallelism (the covering array's rows take it with SP), and
with pipeline stages P = 2 x E = 2 and P = 2 (DP = 2; the MTP module on the last stage with a copy of the
embedding, strategies/pipeline/embedding.py), by the suite's equality rule (tests/equality.py: step
losses, the MTP term included, and gradient norms, expert choices, then every weight). With stages the
two copies of the embedding must end bit for bit equal; a run skipping the sum of their gradients
(each copy trained on its own use of it) breaks both that and the equality.

Under C each rank holds a slice of every depth's shifted ids and targets, and its MTP cross-entropy is
scaled to its slice's share of the batch's real targets (the last slice holds the padded ones): each rank
taking the mean over its own real targets instead must break C = 2's equality.
"""

from __future__ import annotations

import pytest
import torch
from composition import STEPS, _Batches, assert_row_matches, fit_row
from dist_helpers import cpu_trainer, lightning_env, run_distributed, whole_params
from equality import ADAMW_EPS, assert_same_weights, seeded

from mula.layout.features import PRESET, probe

DEEPSEEK = {"MLA", "DeepSeek-routing", "dense-first-blocks", "MTP"}
SHARED = {"num_shared_experts": 1, "shared_expert_intermediate_size": 16}  # the probe's model has none
RUNS = {"E2": {"E"}, "C2": {"C"}, "C2xE2-ZeRO-1": {"C", "E", "ZeRO-1"}, "T2xE2": {"T", "E"}}
PIPELINED = {"P2xE2": {"P", "E"}, "P2": {"P"}}
EMBED = "model.embed.weight"


def _plant_local_mean() -> None:
    """The tempting bug: each CP rank's MTP cross-entropy the mean over its own real targets."""
    import torch.nn.functional as F

    import mula.training.module as module
    from mula.model.mtp import IGNORE_INDEX

    def local_mean(logits, targets, depth, seq_len, shards):
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)

    module.mtp_cross_entropy = local_mean


def _plant_skipped_embedding_sum() -> None:
    """The tempting bug with pipeline stages: the two copies of the embedding each trained on its own
    gradient (the first stage's from the inputs, the last stage's from the MTP modules)."""
    from strategies.pipeline.embedding import EmbeddingCopies

    EmbeddingCopies.sum_grads = lambda self: None


class _FromStep(_Batches):
    """fit_row's batches of the steps from `first_step` on (a run resumed there)."""

    def __init__(self, *args, first_step: int) -> None:
        super().__init__(*args)
        self.first_step = first_step

    def __iter__(self):
        for step, batch in enumerate(super().__iter__()):
            if step >= self.first_step:
                yield batch


def _fit_p2(rank: int, root: str, steps: int, *, save_dir=None, ckpt_path=None, first_step: int = 0) -> dict:
    """The P2 run as fit_row trains it, to `steps`, saving every 2 steps into `save_dir` or resuming from
    `ckpt_path` (saved at `first_step`): every parameter of this rank's stage."""
    from mula.training.module import MulaLightningModule
    from strategies import XPUMoEStrategy

    run = probe(DEEPSEEK | PIPELINED["P2"])
    run.overrides.update(SHARED)
    strategy = XPUMoEStrategy(**run.strategy)
    strategy.pipeline_microbatches = run.micro_batches
    dp = run.layout.group_rank("dp", rank)
    batches = _FromStep(dp, run.dp_size, run.micro_batch, True, first_step=first_step)
    trainer = cpu_trainer(
        run.world_size, strategy, max_steps=steps, accumulate_grad_batches=1, callbacks=[],
        gradient_clip_val=0.5, save_dir=save_dir, default_root_dir=root,
    )  # fmt: skip
    torch.manual_seed(seeded(0))
    module = MulaLightningModule(
        PRESET, overrides=run.overrides, lr=1e-2, min_lr=1e-3, warmup_steps=1, decay_steps=10, eps=ADAMW_EPS
    )
    trainer.fit(module, batches, ckpt_path=ckpt_path)
    return {"params": whole_params(trainer.lightning_module, strategy.topology)}


def _run(rank: int, world: int, root: str) -> dict:
    lightning_env(rank, world)
    runs = {**RUNS, **PIPELINED}
    out = {key: fit_row(DEEPSEEK | dims, rank, root, overrides=SHARED) for key, dims in runs.items()}
    # P2 saved at step 2 and resumed from there to the last step: the checkpoint holds the embedding once
    # and loads it into both copies
    _fit_p2(rank, root, 2, save_dir=f"{root}/p2")
    out["resumed"] = _fit_p2(rank, root, STEPS, ckpt_path=f"{root}/p2/epoch=0-step=2.ckpt", first_step=2)
    _plant_skipped_embedding_sum()
    out["planted-embedding"] = fit_row(DEEPSEEK | PIPELINED["P2xE2"], rank, root, overrides=SHARED)
    _plant_local_mean()
    out["planted"] = fit_row(DEEPSEEK | RUNS["C2"], rank, root, overrides=SHARED)
    return out


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("mtp"))


@pytest.fixture(scope="module")
def runs(root: str) -> tuple[dict, list[dict]]:
    # every run's reference: the plain model in one process on the same global batches (fit_row's)
    ref = fit_row(DEEPSEEK | RUNS["E2"], None, root, overrides=SHARED)
    return ref, run_distributed(_run, 4, root)


@pytest.mark.parametrize("key", list(RUNS))
def test_mtp_trains_as_one_process(runs, key: str) -> None:
    ref, out = runs
    assert any(n.startswith("model.mtp.0.") for n in ref["params"]) and any(
        ".shared_experts." in n for n in ref["params"]
    )
    for rank, rank_out in enumerate(out):
        assert rank_out[key]["params"].keys() == ref["params"].keys()
        assert_row_matches(rank_out[key], ref, DEEPSEEK | RUNS[key], f"{key} rank {rank}")


def test_a_local_mean_under_context_parallelism_breaks_equality(runs) -> None:
    ref, out = runs
    with pytest.raises(AssertionError):
        assert_row_matches(out[0]["planted"], ref, DEEPSEEK | RUNS["C2"], "planted")


@pytest.mark.parametrize("key", list(PIPELINED))
def test_mtp_with_pipeline_stages_trains_as_one_process(runs, key: str) -> None:
    """The MTP module and a copy of the embedding on the last stage: each rank's stage equals one process."""
    ref, out = runs
    layout = probe(DEEPSEEK | PIPELINED[key]).layout
    for rank, rank_out in enumerate(out):
        mine = rank_out[key]["params"]
        last = layout.coordinates(rank).pp == layout.pp - 1
        assert any(n.startswith("model.mtp.0.") for n in mine) == last, (key, rank)
        assert EMBED in mine, (key, rank)  # the first stage's embedding, or the last stage's copy
        assert_row_matches(rank_out[key], ref, DEEPSEEK | PIPELINED[key], f"{key} rank {rank}")


def _embedding_copies(out: list[dict], key: str, features: set) -> list[tuple]:
    """(first stage's, last stage's) embedding of each pipeline group of a run."""
    layout = probe(DEEPSEEK | features).layout
    return [
        (out[g[0]][key]["params"][EMBED], out[g[-1]][key]["params"][EMBED]) for g in layout.all_groups("pp")
    ]


@pytest.mark.parametrize("key", list(PIPELINED))
def test_the_embedding_copies_stay_bit_for_bit_equal(runs, key: str) -> None:
    ref, out = runs
    for first, last in _embedding_copies(out, key, PIPELINED[key]):
        assert torch.equal(first, last)


def test_skipping_the_embedding_gradient_sum_breaks_equality(runs) -> None:
    ref, out = runs
    copies = _embedding_copies(out, "planted-embedding", PIPELINED["P2xE2"])
    assert all(not torch.equal(first, last) for first, last in copies)
    with pytest.raises(AssertionError):
        assert_row_matches(out[0]["planted-embedding"], ref, DEEPSEEK | PIPELINED["P2xE2"], "planted")


def test_a_checkpoint_with_pipeline_stages_holds_the_embedding_once_and_resumes_both_copies(
    runs, root
) -> None:
    from mula.checkpoint.sharded import saved_keys, tensor_bytes_by_writer

    ref, out = runs
    path = f"{root}/p2/epoch=0-step=2.ckpt"
    assert [k for k in saved_keys(path) if k.startswith("state_dict.") and "embed" in k] == [
        "state_dict.model.embed.weight"
    ]
    per_writer, total = tensor_bytes_by_writer(path)
    assert sum(per_writer.values()) == total  # no two ranks wrote the same bytes (the embedding included)
    for first, last in _embedding_copies(out, "resumed", PIPELINED["P2"]):
        assert torch.equal(first, last)
    for rank, rank_out in enumerate(out):  # resumed at step 2, the run ends where the whole one ended
        assert_same_weights(rank_out["resumed"]["params"], ref["params"], what=f"resumed rank {rank}")
