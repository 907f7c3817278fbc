"""`mula calibrate`: measure the machine a job runs on and write a machine file the planner prices
layouts with (`recipes/machines/<name>.yaml` plus measured curves).

`fit.py` fits latency and bandwidth (t = alpha + beta * bytes) to timed points, `measure.py` times
matmuls, elementwise traffic and the collectives Mula issues, `command.py` runs the job (its ranks,
groups, progress bar) and writes the file.
"""
