"""Lightning callbacks that observe and protect Mula training runs.

Fault tolerance (see docs/resilience.md): ``FaultTolerantCheckpoint`` (crash-safe checkpoints,
auto-resume, RNG states), ``PreemptionHandler`` (signals -> checkpoint -> exit 75),
``AnomalyGuard`` (skip non-finite/spiking steps, roll back), ``HangWatchdog`` (stacks + exit 124),
``StragglerDetector`` (slowest/median step-time ratio).
Observation: ``Throughput`` (tokens/s, MFU), ``MoEMetrics`` (all-to-all bytes, global expert load),
``MemoryMetrics`` (parameter, gradient, activation and peak bytes per rank), ``ExpertLoad``
(per-layer expert load, moe_load.csv, load heatmap), ``DownstreamEval`` (lm-evaluation-harness
tasks every N steps, ``eval/<task>/acc``; needs the ``eval`` extra).
Recipes enable them by ``class_path``.
"""

from callbacks.anomaly import AnomalyGuard
from callbacks.downstream_eval import DownstreamEval
from callbacks.exit_codes import ExitCode
from callbacks.expert_load import ExpertLoad
from callbacks.fault_tolerant_checkpoint import FaultTolerantCheckpoint
from callbacks.memory_metrics import MemoryMetrics
from callbacks.moe_metrics import MoEMetrics
from callbacks.preemption import PreemptionHandler
from callbacks.stragglers import StragglerDetector
from callbacks.throughput import Throughput
from callbacks.watchdog import HangWatchdog

__all__ = [
    "AnomalyGuard",
    "DownstreamEval",
    "ExitCode",
    "ExpertLoad",
    "FaultTolerantCheckpoint",
    "HangWatchdog",
    "MemoryMetrics",
    "MoEMetrics",
    "PreemptionHandler",
    "StragglerDetector",
    "Throughput",
]
