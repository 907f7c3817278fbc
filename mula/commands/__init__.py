"""The `mula` command: the dispatcher (`entry.py`), `fit`/`validate`/`test` and `plan`'s full parser
(`lightning_cli.py`), the tools (`tools.py`: prepare, import-hf, export-hf, eval, calibrate, ...),
`mula report` (`report.py`) and the one-line refusals of a recipe's constructors
(`constructor_refusals.py`). `bench/`, `plan/` and `calibrate/` are commands with rooms of their own.
"""
