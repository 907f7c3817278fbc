"""`mula calibrate`: measure the machine a job runs on and write a machine file the planner prices
layouts with (`recipes/machines/<name>.yaml` plus measured curves).

`fit.py` fits latency and bandwidth (t = alpha + beta * bytes) to timed points, `measure.py` times
matmuls, elementwise traffic and the collectives Mula issues, `command.py` checks the options and starts
the job, `estimate.py` says how long it will take, `job.py` is one rank of it (its groups, progress bar)
and writes the file. The timings that run
the strategy's own code (its splits, its sharded AdamW) are the strategy's (`strategy.py`).
"""
