"""Downstream evaluation with lm-evaluation-harness (the `eval` extra): `mula eval` and `callbacks.DownstreamEval`.

Modules, one job each: ``lm`` (`MulaLM`, the lm-eval model class that runs a `Mula` directly),
``tasks`` (hub task names and local task YAML files, checked before any work), ``evaluate`` (run
lm-eval, keep metrics and per-example log-likelihoods), ``checkpoint_eval`` (one checkpoint ->
`<checkpoint>.eval.json`), ``run_eval`` (every checkpoint of a run, its loggers and the plot).
lm-eval is imported only by these modules, so Mula works without the extra.
"""
