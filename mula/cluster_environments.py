"""Cluster environment for jobs started by `mpiexec` (PBS + PALS on Aurora, MPICH / Intel MPI, Open MPI).

torchrun and SLURM are handled by Lightning's own `TorchElasticEnvironment` and `SLURMEnvironment`;
`XPUMoEStrategy` picks `PALSEnvironment` only when neither of those applies. Ranks come from the
launcher's environment variables (no mpi4py needed):

    global rank  PALS_RANKID | PMI_RANK | OMPI_COMM_WORLD_RANK | PMIX_RANK
    world size   PMI_SIZE | OMPI_COMM_WORLD_SIZE | WORLD_SIZE
    local rank   PALS_LOCAL_RANKID | PMI_LOCAL_RANK | MPI_LOCALRANKID | OMPI_COMM_WORLD_LOCAL_RANK
    local size   PALS_LOCAL_SIZE | PMI_LOCAL_SIZE | MPI_LOCALNRANKS | OMPI_COMM_WORLD_LOCAL_SIZE
    node rank    PALS_NODEID | global rank // local size (ranks placed node by node)

The rendezvous address is MASTER_ADDR if set, else the first host of PBS_NODEFILE (rank 0's node under
PBS), else localhost for a single-node job; the port is MASTER_PORT if set, else derived from PBS_JOBID
so that every rank computes the same one without communicating.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

from lightning.fabric.plugins.environments import (
    ClusterEnvironment,
    SLURMEnvironment,
    TorchElasticEnvironment,
)
from typing_extensions import override

_RANK = ("PALS_RANKID", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")
_SIZE = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "WORLD_SIZE")
_LOCAL_RANK = ("PALS_LOCAL_RANKID", "PMI_LOCAL_RANK", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK")
_LOCAL_SIZE = ("PALS_LOCAL_SIZE", "PMI_LOCAL_SIZE", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE")
DEFAULT_PORT = 29500


def _first(names: tuple[str, ...]) -> int | None:
    for name in names:
        value = os.environ.get(name)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError as error:
                raise ValueError(f"Environment variable {name}={value!r} is not an integer.") from error
    return None


class PALSEnvironment(ClusterEnvironment):
    """Processes launched by mpiexec under PBS/PALS (Aurora) or another MPI launcher; see module doc."""

    @property
    @override
    def creates_processes_externally(self) -> bool:
        """mpiexec started every process already."""
        return True

    @staticmethod
    @override
    def detect() -> bool:
        """True when an MPI launcher set a rank and a world size of more than one process."""
        size = _first(_SIZE[:2])
        return _first(_RANK) is not None and size is not None and size > 1

    @property
    @override
    def main_address(self) -> str:
        """MASTER_ADDR, else the first host of PBS_NODEFILE, else localhost for a one-node job."""
        if os.environ.get("MASTER_ADDR"):
            return os.environ["MASTER_ADDR"]
        nodefile = os.environ.get("PBS_NODEFILE")
        if nodefile:
            path = Path(nodefile)
            if not path.is_file():
                raise FileNotFoundError(f"PBS_NODEFILE {nodefile} does not exist.")
            hosts = [line.strip() for line in path.read_text().splitlines() if line.strip()]
            if not hosts:
                raise ValueError(f"PBS_NODEFILE {nodefile} lists no hosts.")
            return hosts[0]
        if self.world_size() == self._local_size():
            return "127.0.0.1"
        raise ValueError(
            "Cannot find the rank-0 host of this multi-node job: set MASTER_ADDR or run under PBS."
        )

    @property
    @override
    def main_port(self) -> int:
        """MASTER_PORT, else a port in [20000, 40000) derived from PBS_JOBID, else 29500."""
        if os.environ.get("MASTER_PORT"):
            return int(os.environ["MASTER_PORT"])
        job = os.environ.get("PBS_JOBID")
        if job:
            return 20000 + zlib.crc32(job.encode()) % 20000
        return DEFAULT_PORT

    @override
    def world_size(self) -> int:
        """Number of processes in the job."""
        size = _first(_SIZE)
        if size is None:
            raise ValueError("No world size in the environment (expected PMI_SIZE or OMPI_COMM_WORLD_SIZE).")
        return size

    @override
    def set_world_size(self, size: int) -> None:
        """The launcher fixed the world size; a different value means a misconfigured Trainer."""
        if size != self.world_size():
            raise ValueError(
                f"The Trainer expects {size} processes (devices x num_nodes) but mpiexec started {self.world_size()}; "
                "set trainer.devices to the ranks per node and trainer.num_nodes to the node count."
            )

    @override
    def global_rank(self) -> int:
        """This process's rank in the job."""
        rank = _first(_RANK)
        if rank is None:
            raise ValueError(
                "No rank in the environment (expected PALS_RANKID, PMI_RANK or OMPI_COMM_WORLD_RANK)."
            )
        return rank

    @override
    def set_global_rank(self, rank: int) -> None:
        """The launcher fixed the rank; nothing to set."""

    @override
    def local_rank(self) -> int:
        """Rank within this node (selects the device)."""
        local = _first(_LOCAL_RANK)
        return local if local is not None else self.global_rank() % self._local_size()

    def _local_size(self) -> int:
        size = _first(_LOCAL_SIZE)
        return size if size is not None else self.world_size()

    @override
    def node_rank(self) -> int:
        """Index of this node."""
        node = _first(("PALS_NODEID",))
        return node if node is not None else self.global_rank() // self._local_size()

    @override
    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        """Trainer devices x num_nodes must equal the processes mpiexec started."""
        self.set_world_size(num_devices * num_nodes)


def launched_by_mpiexec() -> bool:
    """mpiexec/PALS/PMI launch that no Lightning environment claims (torchrun and SLURM come first)."""
    return PALSEnvironment.detect() and not TorchElasticEnvironment.detect() and not SLURMEnvironment.detect()
