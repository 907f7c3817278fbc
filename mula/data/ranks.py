"""The processes of one `mula prepare` job and the few collectives it needs (gloo, CPU only).

`mula prepare` launched by torchrun, srun or mpiexec runs one process per rank; the rank and the world
size come from the environment variables `mula fit` reads (Lightning's ``TorchElasticEnvironment`` and
``SLURMEnvironment``, Mula's ``PALSEnvironment`` for mpiexec). A job talks only a few times, whatever
its size: rank 0 broadcasts the plan, every rank sends its report to rank 0 once per pass, and rank 0
broadcasts the outcome -- no per-file or per-task messages, so 1,024 nodes cost a handful of
collectives (and every task's result travels through the file system, where it must be anyway).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

# A rank waits in a collective for the slowest rank's whole share of the job (hours on a big corpus),
# so the gloo timeout is far above any share; a dead peer is noticed by its closed connection instead.
_WAIT = timedelta(days=30)
# The exception types whose message is re-raised on every rank as the same type (bad input, exit 2).
_SHARED_ERRORS: dict[str, type[Exception]] = {
    "ValueError": ValueError,
    "FileNotFoundError": FileNotFoundError,
}


class Ranks:
    """This process's place in a prepare job (rank 0 of 1 without a launcher) and the job's collectives.

    Args:
        rank: This process's rank.
        world: The number of processes.
        group: The gloo process group joining them (None for a single process).
        owns_default_group: Whether closing must destroy the default process group (we created it).
    """

    def __init__(self, rank: int = 0, world: int = 1, group: Any = None, owns_default_group: bool = False):
        self.rank = rank
        self.world = world
        self.group = group
        self._owns = owns_default_group

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj``, on every rank."""
        if self.world == 1:
            return obj
        import torch.distributed as dist

        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` in rank order on rank 0; None on the other ranks."""
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        out: list[Any] | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.group)
        return out

    def on_zero(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` run on rank 0 alone, its value broadcast; its bad-input error raised on every rank.

        Rank 0's ValueError / FileNotFoundError is re-raised as the same type with the same sentence on
        every rank (each prints it and exits 2); any other error becomes a RuntimeError on the other
        ranks, so that no rank waits for a rank 0 that has failed.
        """
        outcome: tuple[str, Any] | None = None
        error: BaseException | None = None
        if self.rank == 0:
            try:
                outcome = ("ok", fn())
            except Exception as exc:  # shared below, then re-raised here unchanged
                error = exc
                outcome = ("error", describe_error(exc))
        outcome = self.broadcast(outcome)
        if error is not None:
            raise error
        kind, value = outcome
        if kind == "ok":
            return value
        raise shared_error(0, *value)

    def close(self) -> None:
        """Leave the job's process group: the default group if this object created it, else its own gloo
        group beside an existing default group."""
        if self.world == 1:
            return
        import torch.distributed as dist

        if self._owns:
            dist.destroy_process_group()
        elif self.group is not None:
            dist.destroy_process_group(self.group)
        self._owns, self.group, self.world = False, None, 1


def describe_error(exc: BaseException) -> tuple[str, str]:
    """(type name, message) of an error to send to the other ranks; bad input keeps its base type's name,
    so that a ValueError subclass (such as the lock's refusal) stops every rank as a ValueError."""
    name = next((n for n, t in _SHARED_ERRORS.items() if isinstance(exc, t)), type(exc).__name__)
    return name, str(exc)


def shared_error(rank: int, name: str, message: str) -> Exception:
    """The exception to raise for an error ``name: message`` reported by ``rank``: the same type and
    sentence for bad input (ValueError, FileNotFoundError: one line, exit 2), else a RuntimeError."""
    if name in _SHARED_ERRORS:
        return _SHARED_ERRORS[name](message)
    return RuntimeError(f"rank {rank} failed: {name}: {message}")


def launcher_environment() -> Any | None:
    """The cluster environment of the launcher that started this process, or None (a plain process)."""
    from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment

    from mula.cluster_environments import PALSEnvironment

    for env in (TorchElasticEnvironment, SLURMEnvironment, PALSEnvironment):
        if env.detect():
            return env()
    return None


def job_ranks(distributed: bool = True) -> Ranks:
    """The ranks of this prepare job.

    With ``distributed`` false, or without a launcher, this process alone. Inside an already initialised
    ``torch.distributed`` job, every rank of it (a gloo group is made beside the default group, which
    may be NCCL). Otherwise the launcher's rank and world size, joined by a new gloo process group
    (rendezvous at the launcher's MASTER_ADDR / MASTER_PORT, or the address and port Lightning's
    environment derives from the job, as `mula fit` does).
    """
    if not distributed:
        return Ranks()
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        if dist.get_world_size() == 1:
            return Ranks()
        group = dist.new_group(backend="gloo", timeout=_WAIT)
        return Ranks(dist.get_rank(), dist.get_world_size(), group)
    env = launcher_environment()
    if env is None or env.world_size() <= 1:
        return Ranks()
    rank, world = env.global_rank(), env.world_size()
    # torchrun set these (and serves the store itself); srun and mpiexec get them from the environment.
    os.environ.setdefault("MASTER_ADDR", str(env.main_address))
    os.environ.setdefault("MASTER_PORT", str(env.main_port))
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world, timeout=_WAIT)
    return Ranks(rank, world, None, owns_default_group=True)
