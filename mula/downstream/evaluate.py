"""Run lm-evaluation-harness's and OLMo's tasks on a `MulaLM` and reduce the output to what Mula records and logs.

`evaluate` returns, per task, its metrics and per-example records, which is what the results JSON next
to a checkpoint holds: for lm-eval's tasks the metrics (`acc`, `acc_norm`, ... with lm-eval's filter
suffix `,none` dropped; standard errors left out) and per-example log-likelihoods (one per answer choice
for multiple-choice tasks, one per document for perplexity tasks); for OLMo's, what
`mula.downstream.olmo_score` records (`acc` or `len_norm`, `ce_loss`, `bpb`; per choice its
log-likelihood, tokens, bytes and characters). `metric_keys` turns that into logger keys
`eval/<task>/<metric>`.
"""

from __future__ import annotations

from typing import Any

from mula.downstream.lm import MulaLM
from mula.downstream.olmo_tasks import LM_EVAL_HARNESS
from mula.downstream.tasks import ResolvedTasks, check_documents_per_rank


def evaluate(lm: MulaLM, tasks: ResolvedTasks, limit: int | float | None = None) -> dict[str, Any]:
    """{task: {"harness", "metrics": {name: value}, "samples": [{"doc_id", "target", "loglikelihoods", ...}]}}:
    lm-eval's tasks, then OLMo's.

    With a data-parallel `lm` every rank must call this; rank 0 gets the results, the others {}.
    `limit`: the first N documents of each task (a fraction below 1), for quick checks. lm-eval seeds
    Python, NumPy and torch here (its defaults, so that few-shot sampling repeats); callers that must not
    disturb those generators save and restore them around the call.
    """
    results = _evaluate_lm_eval(lm, tasks, limit) if tasks.specs else {}
    if tasks.olmo.labels:
        from mula.downstream.olmo_score import evaluate_olmo

        results.update(evaluate_olmo(lm, tasks.olmo, limit))
    return results


def _evaluate_lm_eval(lm: MulaLM, tasks: ResolvedTasks, limit: int | float | None) -> dict[str, Any]:
    from lm_eval.evaluator import simple_evaluate

    check_documents_per_rank(tasks, lm.world_size, limit)  # the same answer on every rank: no hang
    out = simple_evaluate(
        model=lm,
        tasks=tasks.specs,
        task_manager=tasks.manager,
        limit=limit,
        bootstrap_iters=0,  # no standard errors: they cost minutes on large tasks and are not logged
        log_samples=True,
    )
    if out is None:
        return {}  # not rank 0 of a data-parallel evaluation
    samples = out.get("samples", {})
    return {
        task: {
            "harness": LM_EVAL_HARNESS,
            "metrics": _metrics(values),
            "samples": [_sample(s) for s in samples.get(task, [])],
        }
        for task, values in out["results"].items()
    }


def metric_keys(results: dict[str, Any]) -> dict[str, float]:
    """Logger keys `eval/<task>/<metric>` for every metric of `evaluate`'s results."""
    return {
        f"eval/{task}/{name}": value
        for task, entry in results.items()
        for name, value in entry["metrics"].items()
    }


def _metrics(values: dict[str, Any]) -> dict[str, float]:
    metrics = {}
    for key, value in values.items():
        name, _, filt = key.partition(",")
        if not filt or "_stderr" in name or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue  # alias, sample counts and standard errors are not metrics
        metrics[name if filt == "none" else f"{name}_{filt}"] = float(value)
    return metrics


def _sample(sample: dict[str, Any]) -> dict[str, Any]:
    lls = [r[0] if isinstance(r, (list, tuple)) else r for r in sample.get("filtered_resps", [])]
    target = sample.get("target")
    return {
        "doc_id": sample["doc_id"],
        "target": target if isinstance(target, (int, float, str)) else str(target),
        "loglikelihoods": [float(x) for x in lls],
    }
