"""The run-directory lock: one training run at a time writes a run directory's checkpoints.

Two runs on one run directory (a requeued job overlapping a stale one, a typo in a job array) would
replace each other's ``step=N.ckpt`` and ``last.ckpt``, and a starting run removes every ``.tmp-*``
entry -- another run's save in progress included. Global rank 0 of a ``fit`` run therefore holds
``<run dir>/mula.lock`` for the life of the run, and a second run is refused with one sentence naming
the holder.

Safe on shared filesystems (Lustre, GPFS, NFSv3+), without ``flock``: the lock file is written
completely under a unique name and then ``link()``-ed to ``mula.lock``, which fails atomically when
the name exists (and whose success is confirmed by the link count, since an NFS reply can be lost).
It holds JSON {host, pid, job, started, heartbeat, token}; a daemon thread rewrites the heartbeat
every ``heartbeat_s`` seconds (an atomic replace, after checking the lock is still ours).

A lock is stale -- its holder is dead -- when its heartbeat is older than ``stale_after_s``, or when
it names this host and a process that no longer exists (or this very process). A stale lock is
broken by renaming it aside (only one contender's rename can succeed; a contender that moved a fresh
lock aside by mistake puts it back) and the create is retried, with a warning naming the broken lock.
A fresh lock left by an earlier attempt of this same job (same SLURM/PBS job id: a requeue after a
node failure) is waited for, up to ``stale_after_s``: a dead holder's heartbeat stops, a zombie that
still runs keeps it fresh and the new attempt is refused.

Lightning-free; ``callbacks.FaultTolerantCheckpoint`` takes and releases the lock, ``mula fit``
takes it before any work (:func:`lock_run_dir_before_launch`).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

log = logging.getLogger(__name__)

LOCK_NAME = "mula.lock"
# torchrun's rendezvous id last: it is the same across the restarts of one torchrun (whose rank 0 may
# land on another node), and a false match only costs a wait before refusing a live holder.
_JOB_ID_VARS = ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "FLUX_JOB_ID", "TORCHELASTIC_RUN_ID")


class RunDirLocked(ValueError):
    """Another live run holds the run directory (a ValueError: ``mula`` prints it as one line, exit 2)."""


@dataclass
class LockInfo:
    """What a lock file says about its holder."""

    host: str
    pid: int
    job: str | None
    started: float
    heartbeat: float
    token: str

    def describe(self) -> str:
        """``host x, pid 123, job 456, since 2026-11-23 11:00:00 UTC (heartbeat 12 s ago)``."""
        if self.pid < 0:
            return f"an unreadable lock file, written {max(0.0, time.time() - self.heartbeat):.0f} s ago"
        job = f", job {self.job}" if self.job else ""
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.started))
        age = max(0.0, time.time() - self.heartbeat)
        return f"host {self.host}, pid {self.pid}{job}, since {since} (heartbeat {age:.0f} s ago)"


def current_job_id() -> str | None:
    """The batch system's job id of this process (SLURM, PBS, LSF, Flux; else torchrun's run id), or None."""
    return next((os.environ[v] for v in _JOB_ID_VARS if os.environ.get(v)), None)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _read(path: Path) -> LockInfo | None:
    """The lock at ``path``; None if it vanished. An unreadable one counts as a holder of unknown origin."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    try:
        data = json.loads(text)
        return LockInfo(
            host=str(data["host"]),
            pid=int(data["pid"]),
            job=data.get("job"),
            started=float(data["started"]),
            heartbeat=float(data["heartbeat"]),
            token=str(data["token"]),
        )
    except (ValueError, KeyError, TypeError):
        # Written by hand or damaged: judge it by its age alone.
        try:
            mtime = path.stat().st_mtime
        except FileNotFoundError:
            return None
        return LockInfo("unknown", -1, None, mtime, mtime, f"unparsable-{mtime}")


class RunDirLock:
    """The lock on one run directory, held by one process (global rank 0 of a ``fit`` run).

    Args:
        run_dir: the run directory (``trainer.default_root_dir``); the lock is ``<run_dir>/mula.lock``.
        stale_after_s: a lock whose heartbeat is older than this is taken over.
        heartbeat_s: how often the holder refreshes its heartbeat (well below ``stale_after_s``).
    """

    def __init__(
        self, run_dir: str | os.PathLike, stale_after_s: float = 300.0, heartbeat_s: float = 30.0
    ) -> None:
        if stale_after_s <= 0 or heartbeat_s <= 0:
            raise ValueError(
                f"stale_after_s and heartbeat_s must be > 0, got {stale_after_s}, {heartbeat_s}."
            )
        if heartbeat_s * 2 > stale_after_s:
            raise ValueError(
                f"heartbeat_s ({heartbeat_s}) must be at most half of stale_after_s ({stale_after_s}),"
                " or a live run's lock could be taken for stale."
            )
        self.path = Path(run_dir) / LOCK_NAME
        self.stale_after_s = stale_after_s
        self.heartbeat_s = heartbeat_s
        self.host = socket.gethostname()
        self.info: LockInfo | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __getstate__(self) -> dict[str, Any]:
        # Picklable for spawn-based launchers (the trainer and its callbacks are pickled to the ranks);
        # the heartbeat thread stays with the process that took the lock.
        state = dict(self.__dict__)
        state["_stop"], state["_thread"] = None, None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._stop = threading.Event()

    @property
    def held(self) -> bool:
        """Whether this object holds the lock."""
        return self.info is not None

    # ------------------------------------------------------------------ acquiring

    def acquire(self) -> None:
        """Take the lock, breaking a stale one; raise :class:`RunDirLocked` if a live run holds it."""
        if self.held:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        now = time.time()
        mine = LockInfo(self.host, os.getpid(), current_job_id(), now, now, uuid.uuid4().hex)
        waited_for: str | None = None
        deadline = time.monotonic() + self.stale_after_s + self.heartbeat_s
        while True:
            mine.started = mine.heartbeat = time.time()  # fresh, however long we waited
            if self._create(mine):
                break
            holder = _read(self.path)
            if holder is None:  # released between our create and our read
                continue
            reason = self._stale_reason(holder)
            if reason is not None:
                self._break(holder, reason)
                continue
            same_job = holder.job is not None and holder.job == mine.job
            if same_job and time.monotonic() < deadline:
                if waited_for != holder.token:
                    waited_for = holder.token
                    log.warning(
                        "%s is held by an earlier attempt of this job (%s); waiting up to %.0f s for its"
                        " heartbeat to stop.",
                        self.path,
                        holder.describe(),
                        self.stale_after_s,
                    )
                time.sleep(min(self.heartbeat_s, 5.0))
                continue
            raise RunDirLocked(self.refusal(holder))
        self.info = mine
        log.info("Locked run directory %s (%s).", self.path.parent, mine.describe())
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name="mula-run-dir-lock", daemon=True)
        self._thread.start()
        atexit.register(self.release)

    def refusal(self, holder: LockInfo) -> str:
        """The one sentence that refuses a second user of the directory while ``holder`` holds it."""
        return (
            f"{self.path.parent} is in use by another run ({holder.describe()}): two runs on one run"
            " directory would overwrite each other's checkpoints, so this one stops; wait for that run to"
            f" end, use another trainer.default_root_dir, or delete {self.path} if that run is dead."
        )

    def _create(self, info: LockInfo) -> bool:
        """Atomically create the lock file with its full content; False if it exists."""
        unique = self.path.with_name(f"{LOCK_NAME}.{info.host}.{info.pid}.{info.token}")
        unique.write_text(json.dumps(asdict(info)), encoding="utf-8")
        try:
            os.link(unique, self.path)
        except FileExistsError:
            return False
        except OSError:
            # NFS: the link may have happened although the reply was lost; the link count tells.
            if unique.stat().st_nlink != 2:
                raise
        finally:
            with contextlib.suppress(FileNotFoundError):
                unique.unlink()
        return True

    def _stale_reason(self, holder: LockInfo) -> str | None:
        """Why ``holder``'s lock is stale, or None when its holder may be alive."""
        age = time.time() - holder.heartbeat
        if age > self.stale_after_s:
            return f"no heartbeat for {age:.0f} s (limit {self.stale_after_s:.0f} s)"
        if holder.host == self.host and holder.pid == os.getpid():
            return "left by this process"
        if holder.host == self.host and holder.pid > 0 and not _pid_alive(holder.pid):
            return f"process {holder.pid} no longer exists on this host"
        return None

    def _break(self, holder: LockInfo, reason: str) -> None:
        """Remove the stale lock of ``holder``, unless another contender got there first."""
        aside = self.path.with_name(f"{LOCK_NAME}.broken.{uuid.uuid4().hex}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:  # another contender broke it
            return
        moved = _read(aside)
        if moved is not None and moved.token != holder.token:
            # Between our read and our rename another contender replaced the stale lock by its own,
            # fresh one: put it back (link fails only if yet another lock appeared meanwhile).
            with contextlib.suppress(FileExistsError):
                os.link(aside, self.path)
        else:
            log.warning("Broke the stale lock %s of %s: %s.", self.path, holder.describe(), reason)
        with contextlib.suppress(FileNotFoundError):
            aside.unlink()

    # ------------------------------------------------------------------ holding and releasing

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            self.refresh()

    def refresh(self) -> None:
        """Rewrite the heartbeat (the daemon thread does this every ``heartbeat_s``)."""
        info = self.info
        if info is None:
            return
        try:
            current = _read(self.path)
        except OSError as err:  # a filesystem hiccup (e.g. ESTALE): the next beat tries again
            log.warning("Could not read %s to refresh its heartbeat: %s", self.path, err)
            return
        if current is None or current.token != info.token:
            log.error(
                "The lock %s of this run was taken over (now: %s); another run may write this run directory.",
                self.path,
                current.describe() if current else "no lock",
            )
            self._stop.set()
            return
        info.heartbeat = time.time()
        tmp = self.path.with_name(f"{LOCK_NAME}.{info.host}.{info.pid}.{info.token}")
        try:
            tmp.write_text(json.dumps(asdict(info)), encoding="utf-8")
            os.replace(tmp, self.path)
        except OSError as err:  # a filesystem hiccup: the next beat tries again
            log.warning("Could not refresh the heartbeat of %s: %s", self.path, err)

    def release(self) -> None:
        """Stop the heartbeat and remove the lock file if it is still ours (idempotent)."""
        info, self.info = self.info, None
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._thread = None
        atexit.unregister(self.release)
        if info is None:
            return
        current = _read(self.path)
        if current is not None and current.token == info.token:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()


@runtime_checkable
class RunDirLocker(Protocol):
    """A callback that holds the run-directory lock for the run (`callbacks.FaultTolerantCheckpoint`)."""

    def lock_run_dir(self, trainer: Any) -> None:
        """Take the lock (one sentence naming the holder if another run has it)."""
        ...


def lock_run_dir_before_launch(trainer: Any) -> None:
    """Take the run-directory lock in ``mula fit`` before any work, where that cannot strand other ranks.

    Asks the trainer's callbacks that are a :class:`RunDirLocker` (a protocol, as
    ``auto_resume_ckpt_path`` asks a ``ResumeFinder``). Only in the process that will be global rank 0
    and only when the trainer starts the other ranks itself (one device, or Lightning's own launcher,
    which has not started them yet): ranks started by torchrun, srun or mpiexec already run, and learn a
    refusal from rank 0 in ``FaultTolerantCheckpoint.setup`` (a broadcast) instead of waiting forever for it.
    """
    env = getattr(trainer.strategy, "cluster_environment", None)  # a parallel strategy's
    external = env is not None and bool(env.creates_processes_externally)
    if trainer.world_size > 1 and external:
        return
    if trainer.global_rank != 0:
        return
    for callback in trainer.callbacks:
        if isinstance(callback, RunDirLocker):
            callback.lock_run_dir(trainer)
