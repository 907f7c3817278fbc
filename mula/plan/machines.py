"""Machine descriptions for the planner: `recipes/machines/<name>.yaml` (values and their sources are
stated in each file)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

MACHINES_DIR = Path(__file__).resolve().parents[2] / "recipes" / "machines"


@dataclass(frozen=True)
class Machine:
    """One node type: devices ("tiles") per node, their memory and peak, and per-device bandwidths
    (GB/s) for collectives inside a node and across nodes; `compute_mfu` is the assumed fraction of
    peak the matmuls reach without communication."""

    name: str
    device_type: str
    tiles_per_node: int
    memory_per_tile_gb: float
    peak_bf16_tflops: float
    intra_node_gbps: float
    inter_node_gbps: float
    compute_mfu: float
    calibration: dict[str, Any] | None = None  # `mula calibrate`'s measured curves (mula.plan.calibrated)

    @property
    def device_bytes(self) -> int:
        """Memory of one device in bytes."""
        return int(self.memory_per_tile_gb * 1e9)


def machine_names() -> list[str]:
    """The machines shipped in recipes/machines."""
    return sorted(p.stem for p in MACHINES_DIR.glob("*.yaml"))


def load_machine(name_or_path: str) -> Machine:
    """A shipped machine by name (`aurora`, `h100`) or a YAML file with the same keys."""
    path = Path(name_or_path)
    if not path.suffix:
        path = MACHINES_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        raise ValueError(
            f"Unknown machine {name_or_path!r}; shipped: {', '.join(machine_names())}, or a YAML path."
        )
    data = yaml.safe_load(path.read_text()) or {}
    known = {f.name for f in dataclasses.fields(Machine)}
    required = {f.name for f in dataclasses.fields(Machine) if f.default is dataclasses.MISSING}
    missing, unknown = sorted(required - set(data)), sorted(set(data) - known)
    if missing or unknown:
        raise ValueError(f"Machine file {path} is missing {missing} / has unknown keys {unknown}.")
    return Machine(**data)
