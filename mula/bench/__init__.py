"""`mula bench`: a recipe's layout trained on random tokens, measured (command.py), timed (probe.py),
reported (report.py)."""
