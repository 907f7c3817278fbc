"""OLMo's in-loop tasks at training layouts (issue 50): the same scores at E=2 and at P=2 x E=2 as on one
process, on gloo CPU ranks, through the path `DownstreamEval` and `mula eval --strategy` take
(`mula.downstream.trainer_eval.evaluate_trainer_model` under an `XPUMoEStrategy`: the strategy's
`SpreadForward`, documents split over its data-parallel ranks, rank 0 gathering).

The model is tests/test_olmo_tasks.py's tiny OLMoE imported into Mula (4 experts, 2 layers, OLMo's
vocabulary, 48 positions), saved as a weights file that every rank reads and the strategy lays out.

Tolerance, by construction: the ranks hold the same fp32 weights and run the same operations, but the
experts' outputs are combined after an all-to-all and every data-parallel rank batches its own share of the
documents (other batch widths), so a sum of log-likelihoods may round differently in its last bits:
1e-5, or 3 fp32 spacings (3.6e-7 of the value) for the ~100-nat sums where fp32's spacing is 7.6e-6, as
tests/test_olmo_tasks.py states. The metrics (acc, len_norm of few documents) are equal.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("olmo_eval")
pytest.importorskip("transformers")

from test_olmo_tasks import OLMO_TOKENIZER, tiny_olmoe

LABELS = ["arc_easy", "winogrande", "csqa_rc_0shot"]


def _at_layout(rank: int, world: int, weights: str, layout: dict, limit: int, unshared: bool = False) -> dict:
    """`mula eval --strategy`'s evaluation of `weights` at `layout` on this rank (run_distributed worker):
    {"layout": rank 0's results (None elsewhere)}. With `plain` in `layout`, first also {"plain": the whole
    model on every rank, the documents split over all ranks} (DDP's path: `MulaLM(data_parallel=True)`
    without a spread model; {} on the other ranks). `unshared`: the planted bug of a pipeline whose last
    stage keeps its scores (`SpreadForward.share` sends nothing)."""
    from dist_helpers import lightning_env

    from mula.checkpoint import load_weights
    from mula.data.tokenizer import load_tokenizer
    from mula.downstream.checkpoint_eval import EvalSettings, checkpoint_config
    from mula.downstream.evaluate import evaluate
    from mula.downstream.lm import MulaLM
    from mula.downstream.tasks import resolve_tasks
    from mula.downstream.trainer_eval import evaluate_with_strategy

    if unshared:
        from strategies.eval_forward import SpreadForward

        SpreadForward.share = lambda self, scores: scores  # this process only: it ends with the test
    tokenizer = load_tokenizer(OLMO_TOKENIZER)
    tasks = resolve_tasks(LABELS)
    out = {}
    if layout.get("plain"):
        lm = MulaLM(load_weights(weights), tokenizer, batch_size=3, data_parallel=True)
        out["plain"] = evaluate(lm, tasks, limit)
        layout = {k: v for k, v in layout.items() if k != "plain"}
    lightning_env(rank, world)
    settings = EvalSettings(
        tasks=tasks, batch_size=3, limit=limit, device="cpu", dtype="float32",
        strategy={"class_path": "strategies.XPUMoEStrategy", "init_args": layout}, devices=world,
    )  # fmt: skip
    out["layout"] = evaluate_with_strategy(
        Path(weights), checkpoint_config(Path(weights)), tokenizer, tasks, settings
    )
    return out


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> Path:
    from mula.checkpoint import save_weights
    from mula.hf import from_hf

    path = tmp_path_factory.mktemp("olmo_dist") / "tiny-olmoe.pt"
    save_weights(from_hf(tiny_olmoe()), path)
    return path


def _one_process(weights: Path, limit: int) -> dict:
    from mula.checkpoint import load_weights
    from mula.data.tokenizer import load_tokenizer
    from mula.downstream.evaluate import evaluate
    from mula.downstream.lm import MulaLM
    from mula.downstream.tasks import resolve_tasks

    lm = MulaLM(load_weights(weights), load_tokenizer(OLMO_TOKENIZER), batch_size=3)
    return evaluate(lm, resolve_tasks(LABELS), limit)


def _assert_same(results: dict, single: dict, documents: int) -> None:
    assert list(results) == LABELS
    for label in LABELS:
        ours, ref = results[label], single[label]
        assert [s["doc_id"] for s in ours["samples"]] == [s["doc_id"] for s in ref["samples"]]
        assert ours["documents"] == documents
        for mine, theirs in zip(ours["samples"], ref["samples"]):
            assert {k: v for k, v in mine.items() if k != "loglikelihoods"} == {
                k: v for k, v in theirs.items() if k != "loglikelihoods"
            }
            assert mine["loglikelihoods"] == pytest.approx(theirs["loglikelihoods"], abs=1e-5, rel=3.6e-7)
        assert ours["metrics"][ours["metric_type"]] == ref["metrics"][ref["metric_type"]], label
        assert ours["metrics"] == pytest.approx(ref["metrics"], rel=1e-6), label


def test_expert_parallel_and_data_parallel_score_as_one_process(weights):
    """E=2 on 2 ranks (2 data-parallel ranks) and plain data parallelism over the whole model, with one
    document per task: the second rank has no document and forwards dummy batches in lock step with the
    first (every expert all-to-all has both ranks); rank 0's results are one process's."""
    from dist_helpers import run_distributed

    rank0, rank1 = run_distributed(_at_layout, 2, str(weights), {"expert_parallel_size": 2, "plain": True}, 1)
    single = _one_process(weights, 1)
    _assert_same(rank0["plain"], single, 1)
    _assert_same(rank0["layout"], single, 1)
    assert rank1 == {"plain": {}, "layout": None}


def test_pipeline_and_expert_parallel_score_as_one_process(weights):
    """P=2 x E=2 on 4 ranks (2 data-parallel ranks, 3 and 2 of the first 5 documents of each task, so one
    rank forwards more batches than the other): the same per-example scores and metrics as one process."""
    from dist_helpers import run_distributed

    layout = {"expert_parallel_size": 2, "pipeline_parallel_size": 2, "pipeline_schedule": "gpipe"}
    ranks = run_distributed(_at_layout, 4, str(weights), layout, 5)
    _assert_same(ranks[0]["layout"], _one_process(weights, 5), 5)
    assert [r["layout"] for r in ranks[1:]] == [None] * 3


def test_a_pipeline_that_keeps_its_scores_on_the_last_stage_fails_the_comparison(weights):
    """Planted bug: at P=2 the last stage does not send its scores to the first (which reports them, as
    global rank 0): rank 0's results differ from one process's, and the comparison says so."""
    from dist_helpers import run_distributed

    rank0, _ = run_distributed(_at_layout, 2, str(weights), {"pipeline_parallel_size": 2}, 2, True)
    with pytest.raises(AssertionError):
        _assert_same(rank0["layout"], _one_process(weights, 2), 2)
