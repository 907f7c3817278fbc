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
    peak the matmuls reach without communication; optionally the network's groups and global-link
    bandwidth (contention beyond one group), the host memory an offloaded optimizer lives in and the
    links to it, and `mula calibrate`'s measured curves."""

    name: str
    device_type: str
    tiles_per_node: int
    memory_per_tile_gb: float
    peak_bf16_tflops: float
    intra_node_gbps: float
    inter_node_gbps: float
    compute_mfu: float
    calibration: dict[str, Any] | None = None  # `mula calibrate`'s measured curves (mula.plan.calibrated)
    # Contention at scale (optional): nodes per group of the network (a Dragonfly group), and a node's
    # share of the global links between groups when every node sends across them, GB/s per direction.
    nodes_per_group: int | None = None
    global_gbps_per_node: float | None = None
    # Host memory (optional): a node's CPU memory in GB, which `optimizer_options.offload` fills
    # (`mula plan` checks the node's ranks' host bytes against it), its bandwidth, the device-to-host
    # link per device and direction, and the device memory's own bandwidth, GB/s.
    host_memory_per_node_gb: float | None = None
    host_memory_gbps: float | None = None
    host_link_gbps: float | None = None
    device_memory_gbps: float | None = None

    def cross_group_slowdown(self, nodes: float) -> float:
        """How much slower a collective over `nodes` nodes moves its bytes than at the per-tile inter-node
        bandwidth: 1 inside one network group; beyond, the share of its traffic that crosses groups
        (1 - nodes_per_group / nodes, as for traffic spread evenly over the nodes) runs at the node's
        share of the global links instead. Rings and hierarchical algorithms cross less: an upper bound."""
        if not self.nodes_per_group or not self.global_gbps_per_node or nodes <= self.nodes_per_group:
            return 1.0
        ratio = max(1.0, self.inter_node_gbps / (self.global_gbps_per_node / self.tiles_per_node))
        crossing = 1 - self.nodes_per_group / nodes
        return 1 + crossing * (ratio - 1)

    @property
    def device_bytes(self) -> int:
        """Memory of one device in bytes."""
        return int(self.memory_per_tile_gb * 1e9)

    @property
    def host_bytes_per_node(self) -> int | None:
        """A node's host memory in bytes (None when the machine file does not say)."""
        return None if self.host_memory_per_node_gb is None else int(self.host_memory_per_node_gb * 1e9)


# the shipped machine file of a device, by a lower-case part of the name torch reports for it (first
# match wins: GH200 before H200 before H100)
DEVICE_MACHINES = {
    "gh200": "gh200",
    "h200": "h200",
    "h100": "h100",
    "max 1550": "aurora",
    "mi250x": "frontier",
}


def machine_for_device(device_name: str) -> str | None:
    """The shipped machine of a device torch names `device_name` (e.g. 'NVIDIA H100 80GB HBM3'), or None."""
    name = device_name.lower()
    return next((machine for key, machine in DEVICE_MACHINES.items() if key in name), None)


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
