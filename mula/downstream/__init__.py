"""Downstream evaluation with lm-evaluation-harness (the `eval` extra): `mula eval` and `callbacks.DownstreamEval`.

Modules, one job each: ``lm`` (`MulaLM`, the lm-eval model class that runs a `Mula` directly),
``tasks`` (hub task names and local task YAML files, checked before any work), ``evaluate`` (run
lm-eval, keep metrics and per-example log-likelihoods), ``checkpoint_eval`` (one checkpoint ->
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
