"""Bits per byte of the validation targets (`val/bpb`): a loss that does not depend on the tokenizer.

    bpb = (sum over target tokens of the cross-entropy, in nats) / (ln 2 x the UTF-8 bytes of those tokens)

The bytes of a token come from the run's tokenizer, once (`token_byte_table`): a table token id -> bytes,
kept on the device and indexed by the target ids of each batch. A byte-level BPE's tokens count their raw
bytes, so a token holding part of a multi-byte character counts exactly the bytes it holds; EOS and every
other special token count 0 bytes (markers the data adds, not text), while their cross-entropy still
counts in the numerator, as every target's does in `val/loss` (`mula.data.token_bytes`).

The sums are exact over any layout because the bytes are counted wherever, and as often as, the
cross-entropy is: each rank adds ``ce x tokens`` nats -- ``ce`` the mean over its targets, ``tokens`` the
weight `val/loss` gives it -- and the bytes of its targets times ``tokens / len(targets)``. Data-parallel
ranks add their own batches; the ranks of a context-parallel group each add their slice, weighted by the
whole sequence (``tokens / len(targets)`` = C, for the nats and the bytes alike); tensor-parallel ranks
add the same replicated numbers T times, pipeline stages without the loss add nothing. The ratio of the
two sums over all ranks (torchmetrics' sync, as for `val/loss`) is therefore the ratio over the
validation set.
"""

from __future__ import annotations

import logging
import math
from typing import Protocol, runtime_checkable

import numpy as np
import torch
from torch import Tensor
from torchmetrics import Metric

from mula.training.lightning_compat import KeepsStateDtypes

log = logging.getLogger(__name__)


@runtime_checkable
class TokenizedData(Protocol):
    """A data module that knows the tokenizer its data was prepared with (`MulaDataModule`): what val/bpb
    counts bytes with."""

    @property
    def tokenizer_path(self) -> str | None:
        """The tokenizer file (or named tokenizer) the data was tokenized with, None when unknown."""
        ...


class BitsPerByte(KeepsStateDtypes, Metric):
    """Sums of cross-entropy nats (float32) and target bytes (int64) over batches and ranks; `compute` is
    their ratio in bits per byte (nan when no byte was counted).

    The sums keep their dtypes when the module is cast (`bf16-true` casts the LightningModule, metrics
    included): a bf16 running sum would round every addition."""

    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state("nats", torch.zeros((), dtype=torch.float32), dist_reduce_fx="sum")
        self.add_state("bytes", torch.zeros((), dtype=torch.long), dist_reduce_fx="sum")

    def update(self, nats: Tensor, num_bytes: Tensor) -> None:
        """Add a batch's summed cross-entropy `nats` and the UTF-8 bytes `num_bytes` of the same targets."""
        self.nats += nats.detach().to(self.nats.dtype)
        self.bytes += num_bytes.to(self.bytes.dtype)

    def compute(self) -> Tensor:
        """nats / (ln 2 x bytes) as a float64 CPU scalar (divided on the host: not every device has
        float64); nan when no byte was counted."""
        num_bytes = int(self.bytes)
        value = float(self.nats) / (math.log(2) * num_bytes) if num_bytes else float("nan")
        return torch.tensor(value, dtype=torch.float64)


def token_byte_table(lengths: np.ndarray, vocab_size: int, device: torch.device | str) -> Tensor:
    """int64 [max(len(lengths), vocab_size)] on `device`: the bytes of each token id (the tokenizer's
    `byte_lengths()`), 0 for the model's ids beyond the tokenizer's (no data holds them)."""
    table = torch.zeros(max(len(lengths), vocab_size), dtype=torch.long)
    table[: len(lengths)] = torch.from_numpy(np.asarray(lengths, dtype=np.int64))
    return table.to(device)


def tokenizer_byte_table(reference: str | None, vocab_size: int, device: torch.device | str) -> Tensor | None:
    """`token_byte_table` of the tokenizer `reference` (a data module's `tokenizer_path`); None (val/bpb
    is not logged) without a tokenizer, or with one that is not byte-level or cannot be loaded (said in
    the log)."""
    if reference is None:
        return None
    from mula.data.tokenizer import load_tokenizer  # imported here: a run without data never needs it

    try:
        lengths = load_tokenizer(reference).byte_lengths()
    except (FileNotFoundError, ValueError) as e:
        log.warning("val/bpb is not logged: %s", e)
        return None
    if lengths is None:
        log.warning(
            "val/bpb is not logged: the tokenizer %s is not byte-level (no bytes per token).", reference
        )
        return None
    return token_byte_table(lengths, vocab_size, device)


def target_bytes(table: Tensor, targets: Tensor, tokens: int) -> Tensor:
    """The bytes of `targets` counted as often as their cross-entropy is: ``tokens / len(targets)`` times
    (1, or C for a context-parallel slice weighted by the whole sequence's `tokens`)."""
    copies, rest = divmod(tokens, targets.numel())
    if rest:
        raise ValueError(
            f"{tokens} weighted tokens are not a multiple of the {targets.numel()} targets scored."
        )
    return table[targets].sum() * copies
