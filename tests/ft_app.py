"""Test-only training app for the fault-tolerance tests: a tiny LM, a resumable data module, a step
recorder and a fault injector, behind a LightningCLI that auto-resumes like ``mula fit``.

Run as a script (``python tests/ft_app.py fit --config ...``): the tests start it as a real process
and kill, signal or stall it. The injector only injects faults (NaN/spike logits, sleeps); the
mechanisms under test are the real callbacks.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mula.commands.lean_torchmetrics import skip_torchmetrics_optional_imports

skip_torchmetrics_optional_imports()  # starts as `mula fit` does: ~1.8 s of CPU less per process

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.cli import LightningCLI
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler

from mula.checkpoint import auto_resume_ckpt_path


class TinyLM(pl.LightningModule):
    """Embedding -> dropout -> MLP -> head. Dropout and a tiny loss jitter from python/numpy RNGs make
    every RNG matter for exact resume."""

    def __init__(
        self, vocab_size: int = 64, hidden: int = 32, lr: float = 1e-2, warmup_steps: int = 3
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(vocab_size, hidden)
        self.drop = nn.Dropout(0.1)
        self.mlp = nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh())
        self.lm_head = nn.Linear(hidden, vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.mlp(self.drop(self.embed(x))))

    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        logits = self(batch[:, :-1])
        return nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        jitter = 1.0 + 1e-3 * (random.random() - 0.5) + 1e-3 * (float(np.random.rand()) - 0.5)
        loss = self._loss(batch) * jitter
        self.log("train/loss", loss, prog_bar=False)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val/loss", self._loss(batch))

    def configure_optimizers(self) -> Any:
        # the strategy's optimizer when it builds one (XPUMoEStrategy: sharded), else torch's AdamW
        build = getattr(self.trainer.strategy, "build_optimizer", torch.optim.AdamW)
        opt = build(self.parameters(), lr=self.hparams.lr, weight_decay=0.1)
        warmup = self.hparams.warmup_steps
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) * 0.97**s)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class TokenDataset(Dataset):
    """Fixed random token windows."""

    def __init__(self, num_samples: int, seq_len: int, vocab_size: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, vocab_size, (num_samples, seq_len + 1), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i]


class ResumableSampler(Sampler[int]):
    """Order = f(seed, epoch); this rank's share; can start mid-epoch after ``load_state_dict``."""

    def __init__(self, n: int, seed: int, rank: int, world: int) -> None:
        self.n, self.seed, self.rank, self.world = n, seed, rank, world
        self.epoch = 0
        self.yielded = 0
        self._skip = 0

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self._skip = 0
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n // self.world

    def __iter__(self):
        perm = torch.randperm(
            self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch)
        ).tolist()
        mine = perm[self.rank :: self.world][: len(self)]
        skip, self._skip = self._skip, 0
        self.yielded = skip
        for i in mine[skip:]:
            self.yielded += 1
            yield i


class TinyData(pl.LightningDataModule):
    """Resumable data module: ``state_dict`` holds the epoch and the samples consumed in it."""

    def __init__(
        self,
        num_samples: int = 48,
        seq_len: int = 16,
        vocab_size: int = 64,
        micro_batch_size: int = 4,
        seed: int = 7,
    ) -> None:
        super().__init__()
        self.num_samples, self.seq_len, self.vocab_size = num_samples, seq_len, vocab_size
        self.micro_batch_size, self.seed = micro_batch_size, seed
        self.sampler: ResumableSampler | None = None
        self._pending: dict | None = None

    def setup(self, stage: str) -> None:
        self.train_set = TokenDataset(self.num_samples, self.seq_len, self.vocab_size, self.seed)
        self.val_set = TokenDataset(8, self.seq_len, self.vocab_size, self.seed + 1)

    def train_dataloader(self) -> DataLoader:
        trainer = self.trainer
        self.sampler = ResumableSampler(self.num_samples, self.seed, trainer.global_rank, trainer.world_size)
        if self._pending is not None:
            self.sampler.epoch = self._pending["epoch"]
            self.sampler._skip = self._pending["consumed"]
            self._pending = None
        return DataLoader(self.train_set, batch_size=self.micro_batch_size, sampler=self.sampler)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=4)

    def state_dict(self) -> dict:
        if self.sampler is None:
            return {}
        return {"epoch": self.sampler.epoch, "consumed": self.sampler.yielded}

    def load_state_dict(self, state_dict: dict) -> None:
        if state_dict:
            self._pending = dict(state_dict)


def _digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        # the raw bytes, whatever the dtype (numpy has no bfloat16)
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


class StepRecorder(pl.Callback):
    """Append one JSON line per optimizer step per rank: exact loss, parameter digest, batch digest."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last = trainer.global_step
        path = Path(trainer.default_root_dir) / f"record-rank{trainer.global_rank}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed in teardown)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self._last:
            return
        self._last = trainer.global_step
        guard = next((cb for cb in trainer.callbacks if hasattr(cb, "skipped_steps")), None)
        strag = next((cb for cb in trainer.callbacks if hasattr(cb, "last_report")), None)
        row = {
            "pid": os.getpid(),
            "rank": trainer.global_rank,
            "step": trainer.global_step,
            "loss": float(outputs["loss"]).hex(),
            "params": _digest(list(pl_module.parameters())),
            "batch": _digest([batch]),
            "lr": trainer.optimizers[0].param_groups[0]["lr"],
            "skipped": guard.skipped_steps if guard else None,
            "rollbacks": guard.rollbacks if guard else None,
            "straggler": strag.last_report if strag else None,
        }
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def teardown(self, trainer, pl_module, stage) -> None:
        if getattr(self, "_file", None):
            self._file.close()


class RngRecorder(pl.Callback):
    """Append one JSON line per optimizer step: a digest of every RNG a training step can draw from
    (Python, NumPy, torch CPU), taken after the callbacks listed before this one have run."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self._last:
            return
        self._last = trainer.global_step
        h = hashlib.sha256(repr((random.getstate(), np.random.get_state(legacy=False))).encode())
        h.update(torch.get_rng_state().numpy().tobytes())
        path = Path(trainer.default_root_dir) / f"rng-rank{trainer.global_rank}.jsonl"
        with open(path, "a", encoding="utf-8") as f:
            f.write(
                json.dumps({"pid": os.getpid(), "step": trainer.global_step, "rng": h.hexdigest()[:16]})
                + "\n"
            )


class FaultInjector(pl.Callback):
    """Inject faults at given (1-based) optimizer steps on given ranks. Test-only."""

    def __init__(
        self,
        nan_steps: list[int] | None = None,
        spike_steps: list[int] | None = None,
        spike_factor: float = 30.0,
        ranks: list[int] | None = None,
        stall_step: int | None = None,
        stall_rank: int = 0,
        slow_rank: int | None = None,
        slow_s: float = 0.0,
        step_sleep_s: float = 0.0,
        module_path: str = "lm_head",
        sanity_sleep_s: float = 0.0,
        save_error_steps: list[int] | None = None,
    ) -> None:
        self.nan_steps = set(nan_steps or [])
        self.spike_steps = set(spike_steps or [])
        self.spike_factor = spike_factor
        self.ranks = ranks
        self.stall_step, self.stall_rank = stall_step, stall_rank
        self.slow_rank, self.slow_s = slow_rank, slow_s
        self.step_sleep_s = step_sleep_s
        self.module_path = module_path
        self.sanity_sleep_s = sanity_sleep_s
        self.save_error_steps = set(save_error_steps or [])

    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.sanity_sleep_s:
            Path(trainer.default_root_dir).mkdir(parents=True, exist_ok=True)
            (Path(trainer.default_root_dir) / f"sanity-rank{trainer.global_rank}").write_text(
                str(os.getpid())
            )
            time.sleep(self.sanity_sleep_s)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        target = pl_module.get_submodule(self.module_path)
        rank_ok = self.ranks is None or trainer.global_rank in self.ranks

        def hook(module, args, output):
            step = trainer.global_step + 1
            if rank_ok and module.training and step in self.nan_steps:
                return output * float("nan")
            if rank_ok and module.training and step in self.spike_steps:
                return output * self.spike_factor
            return output

        target.register_forward_hook(hook)
        if self.save_error_steps and rank_ok:
            self._fail_saves(trainer)

    def _fail_saves(self, trainer: pl.Trainer) -> None:
        """The strategy's checkpoint write fails with ENOSPC at the given steps, after writing its part
        (as a disk that fills up while the data is flushed)."""
        write = trainer.strategy.save_checkpoint

        def save_checkpoint(checkpoint: dict, filepath: Any, *args: Any, **kwargs: Any) -> None:
            write(checkpoint, filepath, *args, **kwargs)
            if trainer.global_step in self.save_error_steps:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(filepath))

        trainer.strategy.save_checkpoint = save_checkpoint

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step + 1
        rank = trainer.global_rank
        if self.step_sleep_s:
            time.sleep(self.step_sleep_s)
        if self.slow_rank == rank and self.slow_s:
            time.sleep(self.slow_s)
        if self.stall_step == step and self.stall_rank == rank:
            marker = Path(trainer.default_root_dir) / f"stalled-rank{rank}"
            marker.write_text(str(os.getpid()))
            time.sleep(3600)  # the stall the watchdog must catch


class App(LightningCLI):
    """LightningCLI with the same auto-resume rule as ``mula fit``: no --ckpt_path -> newest valid checkpoint."""

    def before_fit(self) -> None:
        if self.config_init[self.subcommand].get("ckpt_path") is None:
            path = auto_resume_ckpt_path(self.trainer)
            if path is not None:
                self.trainer.ckpt_path = path


def _count_hashing(log_path: str) -> None:
    """Append one JSON line per file a checkpoint verification or save hashes in this process."""
    from mula.checkpoint import manifest

    digest = manifest.file_digest

    def counted(path: Any, checksum: Any) -> str:
        with open(log_path, "a", encoding="utf-8") as f:
            f.write(
                json.dumps({"pid": os.getpid(), "path": str(path), "bytes": os.path.getsize(path)}) + "\n"
            )
        return digest(path, checksum)

    manifest.file_digest = counted


def _gate_writes(gate_dir: str) -> None:
    """Hold the DCP write of a checkpoint while ``<gate_dir>/block-<its directory name>`` exists, after
    marking ``started-<name>-rank<R>``: a background write made slow deterministically."""
    from torch.distributed.checkpoint import FileSystemWriter

    from mula.checkpoint import sharded

    class GatedWriter(FileSystemWriter):
        def write_data(self, plan: Any, planner: Any) -> Any:
            name = Path(str(self.path)).name
            block = Path(gate_dir) / f"block-{name}"
            if block.exists():
                rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
                (Path(gate_dir) / f"started-{name}-rank{rank}").write_text(str(os.getpid()))
                while block.exists():
                    time.sleep(0.05)
            return super().write_data(plan, planner)

    sharded.FileSystemWriter = GatedWriter


def main() -> None:
    torch.set_num_threads(1)
    # test-only instrumentation, by environment variables so that the launcher's child processes have it too
    if os.environ.get("FT_HASH_LOG"):
        _count_hashing(os.environ["FT_HASH_LOG"])
    if os.environ.get("FT_WRITE_GATE"):
        _gate_writes(os.environ["FT_WRITE_GATE"])
    if os.environ.get("FT_SMALL_CHECKPOINT_BYTES"):
        from mula.checkpoint import group_verify

        group_verify.SMALL_CHECKPOINT_BYTES = int(os.environ["FT_SMALL_CHECKPOINT_BYTES"])
    App(TinyLM, TinyData, seed_everything_default=1234, save_config_callback=None)


if __name__ == "__main__":
    main()
