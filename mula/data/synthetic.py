"""Random token windows in the shapes `MulaDataModule` gives, for benchmarks that need no prepared data.

`mula bench` trains on these: the same global and micro batches per data-parallel rank (a pipeline
rank gets its whole step, as from the real data module), the trainer's gradient accumulation set the
same way, token ids drawn uniformly below the model's vocabulary from a generator seeded by (seed, rank),
so every run of a layout sees the same tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset
from typing_extensions import override

from mula.data.datamodule import MulaDataModule


class _RandomWindows(IterableDataset):
    """Endless [micro, seq_len + 1] batches of token ids below `vocab_size`."""

    def __init__(self, micro: int, seq_len: int, vocab_size: int, seed: int) -> None:
        self.micro, self.seq_len, self.vocab_size, self.seed = micro, seq_len, vocab_size, seed

    def __iter__(self) -> Iterator[torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed)
        while True:
            yield torch.randint(0, self.vocab_size, (self.micro, self.seq_len + 1), generator=generator)


class SyntheticTokens(MulaDataModule):
    """`MulaDataModule`'s batch layout over random tokens: no data directory, no tokenizer, no validation.

    Args:
        seq_len, global_batch_size, micro_batch_size, seed: as `MulaDataModule`'s.
        vocab_size: Token ids are drawn below it (default: the trained model's `vocab_size`).
    """

    def __init__(
        self,
        seq_len: int = 2048,
        global_batch_size: int = 3072,
        micro_batch_size: int = 4,
        seed: int = 42,
        vocab_size: int | None = None,
    ) -> None:
        super().__init__(
            data_dir=".", seq_len=seq_len, global_batch_size=global_batch_size,
            micro_batch_size=micro_batch_size, seed=seed, val_samples=0, num_workers=0,
        )  # fmt: skip
        self.vocab_size = vocab_size

    @override
    def prepare_data(self) -> None:
        """Nothing to prepare."""

    @override
    def _tokenizer_vocab_size(self) -> int | None:
        return None

    @override
    def setup(self, stage: str | None = None) -> None:
        """This rank's batch layout and the trainer's gradient accumulation, as `MulaDataModule.setup`."""
        self._configure_batches()
        if self.vocab_size is None:
            module = self.trainer.lightning_module if self.trainer is not None else None
            self.vocab_size = int(module.config.vocab_size)

    @override
    def train_dataloader(self) -> DataLoader:
        """Endless random micro-batches of this rank (its whole step's share with pipeline stages)."""
        assert self.layout is not None and self.vocab_size is not None, "setup() runs first"
        seed = self.seed * 100_003 + self.layout.rank
        windows = _RandomWindows(self.layout.micro_batch_size, self.seq_len, self.vocab_size, seed)
        return DataLoader(windows, batch_size=None)

    @override
    def val_dataloader(self) -> Any:
        """No validation."""
        return []

    @override
    def state_dict(self) -> dict[str, Any]:
        """Nothing to resume: random tokens."""
        return {}
