"""What a `mula calibrate` job measures (`Settings`, picklable for its spawned ranks) and the machine file it
writes: shared by the launcher (`command.py`) and every rank (`job.py`), which import it and not each
other.
"""

from __future__ import annotations

import datetime
import platform
import socket
from dataclasses import dataclass
from typing import Any

import yaml

DTYPES = ("float32", "bfloat16")


@dataclass
class Settings:
    """What every rank of the job measures (picklable, for spawned local ranks)."""

    output: str
    name: str
    model: str
    overrides: dict[str, Any]
    seq_len: int
    micro_batch: int
    backend: str
    quick: bool
    peak_bf16_tflops: float | None
    memory_per_tile_gb: float | None
    progress: bool
    command: str

    @property
    def sizes(self) -> list[int]:
        """Message sizes (bytes per rank): 1 KiB up, by factors of 4, to 64 MiB (--quick: 4 MiB, past the
        size where a node's collectives turn from latency- to bandwidth-bound)."""
        top = 22 if self.quick else 26
        return [1 << e for e in range(10, top + 1, 2)]

    @property
    def reps(self) -> int:
        """Timed repetitions per point (3 x as many, in turns, of the rates that are differences)."""
        return 3 if self.quick else 5


def write_machine_file(settings: Settings, machine: dict[str, Any], calibration: dict[str, Any]) -> None:
    """Write the machine file: the planner's keys, then the measured curves, headed by how and when."""
    from mula.checkpoint.atomic import atomic_write_text

    when = calibration["measured_at"]
    header = [
        f"# Measured by `mula calibrate` on {when} on {calibration['host']} ({calibration['processor']}),",
        f"# {calibration['world_size']} ranks on {calibration['nodes']} node(s), backend {calibration['backend']},"
        f" torch {calibration['torch']}.",
        f"# Command: {settings.command}",
        "# peak_bf16_tflops: " + ("given with --peak_bf16_tflops" if settings.peak_bf16_tflops else
                                  "the fastest square bf16 matmul measured (not a published figure)"),
        "# compute_mfu: the model's bf16 matmul shapes (calibration.model_tflops) over that peak;",
        "# intra/inter_node_gbps: the asymptotic bus bandwidth of the all-to-all inside a node and of",
        "# send/recv across nodes (one node: the intra-node send/recv). `mula plan` prices every collective",
        "# with its own curve under calibration.collectives (t = alpha + beta * bus bytes per call).",
    ]  # fmt: skip
    body = yaml.safe_dump({**machine, "calibration": calibration}, sort_keys=False, default_flow_style=None)
    atomic_write_text(settings.output, "\n".join(header) + "\n" + body)


def host_description() -> dict[str, str]:
    """Host name, processor model and Python platform, for the file's header."""
    from mula.training.devices import cpu_model  # imports torch: only the ranks write the file

    return {"host": socket.gethostname(), "processor": cpu_model(), "platform": platform.platform()}


def now() -> str:
    """The time of the measurement, UTC, to the second."""
    return datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat()
