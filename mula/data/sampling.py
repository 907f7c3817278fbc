"""The order of training windows: a pure function of (seed, sample position), independent of the world size.

Each source s has N_s windows of ``seq_len + 1`` tokens. A fixed, seed-independent permutation of them holds
out ``v_s`` validation windows (the first v_s of the permutation) and leaves ``n_s = N_s - v_s`` for training.

A *mixture epoch* has ``L = sum_s k_s`` samples with ``k_s = round(weight_s * n_s)``: weight 1 takes each
source in its natural proportion, 2 takes it twice (upsampling). Sample position ``i`` lies in mixture epoch
``e = i // L``; a seeded permutation of ``[0, L)`` (one per e) turns ``i % L`` into a slot, the slot range
``[C_s, C_s + k_s)`` picks source s, and the slot becomes position ``p = e * k_s + (slot - C_s)`` of that
source's own stream. The source stream runs through its training windows in a fresh seeded permutation per
pass. Every sample in a mixture epoch is therefore drawn with exact proportions and without repetition
inside a pass over a source.

Permutations of arbitrarily large ranges are computed index by index with a keyed Feistel network plus
cycle walking (a bijection of ``[0, n)``), so nothing proportional to the corpus is ever materialised.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence

import numpy as np

_U64 = np.uint64
_ROUNDS = 6


def _mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser: a fast, well-mixed bijective hash of uint64 values."""
    x = x ^ (x >> _U64(30))
    x = x * _U64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> _U64(27))
    x = x * _U64(0x94D049BB133111EB)
    return x ^ (x >> _U64(31))


def derive_key(*parts: int) -> int:
    """Combine integers (seed, source id, epoch, ...) into one 64-bit key."""
    h = np.array([0x9E3779B97F4A7C15], dtype=_U64)
    for p in parts:
        h = _mix64(h ^ np.array([p & 0xFFFFFFFFFFFFFFFF], dtype=_U64))
    return int(h[0])


def name_key(name: str) -> int:
    """A stable integer for a source name (so keys do not change when other sources are added)."""
    return zlib.crc32(name.encode())


def permute(indices: np.ndarray, n: int, key: int) -> np.ndarray:
    """Apply a keyed pseudo-random permutation of ``[0, n)`` to ``indices`` (all in ``[0, n)``).

    The same (n, key) always gives the same permutation; different keys give unrelated ones.
    """
    idx = np.asarray(indices, dtype=np.int64)
    if n <= 1:
        return np.zeros_like(idx)
    bits = max(2, (n - 1).bit_length())
    bits += bits & 1  # balanced halves
    half = _U64(bits // 2)
    mask = _U64((1 << (bits // 2)) - 1)
    round_keys = _mix64(
        np.array([key], dtype=_U64) + np.arange(1, _ROUNDS + 1, dtype=_U64) * _U64(0x9E3779B97F4A7C15)
    )

    def feistel(x: np.ndarray) -> np.ndarray:
        left, right = x >> half, x & mask
        for rk in round_keys:
            left, right = right, left ^ (_mix64(right ^ rk) & mask)
        return (left << half) | right

    out = idx.astype(_U64)
    todo = np.ones(out.shape, dtype=bool)
    # Cycle walking: re-encrypt values that land outside [0, n); the domain is < 4n, so this ends fast.
    while todo.any():
        out[todo] = feistel(out[todo])
        todo[todo] = out[todo] >= _U64(n)
    return out.astype(np.int64)


def _largest_remainder(total: int, shares: Sequence[float]) -> list[int]:
    """Split an integer total in proportion to shares, rounding so that the parts sum to the total."""
    s = sum(shares)
    if total <= 0 or s <= 0:
        return [0] * len(shares)
    exact = [total * x / s for x in shares]
    parts = [math.floor(x) for x in exact]
    order = sorted(range(len(shares)), key=lambda i: exact[i] - parts[i], reverse=True)
    for i in order[: total - sum(parts)]:
        parts[i] += 1
    return parts


class MixtureOrder:
    """Maps sample positions to (source, window) for training, and lists the validation windows.

    Args:
        names: Source names (keys of the per-source permutations).
        windows: N_s, the number of windows of each source.
        weights: Mixture weight of each source relative to its natural size (see the module docstring).
        val_samples: Total number of held-out validation windows, split over sources in mixture proportion.
        seed: Seed of the training order (the validation split does not depend on it).
    """

    def __init__(
        self,
        names: Sequence[str],
        windows: Sequence[int],
        weights: Sequence[float],
        val_samples: int,
        seed: int,
    ) -> None:
        if not (len(names) == len(windows) == len(weights)) or not names:
            raise ValueError("names, windows and weights must be non-empty and of equal length.")
        if val_samples < 0:
            raise ValueError(f"val_samples must be >= 0, got {val_samples}.")
        self.names = list(names)
        self.windows = [int(w) for w in windows]
        self.weights = [float(w) for w in weights]
        self.seed = int(seed)
        self.val_counts = _largest_remainder(val_samples, [w * n for w, n in zip(self.weights, self.windows)])
        self.train_counts = [n - v for n, v in zip(self.windows, self.val_counts)]
        for name, n, v, w in zip(self.names, self.windows, self.val_counts, self.weights):
            if w > 0 and n - v < 1:
                raise ValueError(
                    f"source {name!r} has {n} windows, too few to hold out {v} for validation and still train; "
                    "lower val_samples or seq_len, or prepare more data."
                )
        self.per_epoch = [
            max(1, round(w * n)) if w > 0 else 0 for w, n in zip(self.weights, self.train_counts)
        ]
        self.epoch_length = sum(self.per_epoch)
        if self.epoch_length == 0:
            raise ValueError("every source has mixture weight 0; nothing to train on.")
        self._ends = np.cumsum(self.per_epoch)
        self._starts = self._ends - np.asarray(self.per_epoch)
        self._name_keys = [name_key(n) for n in self.names]

    def proportions(self) -> dict[str, float]:
        """Fraction of training samples drawn from each source."""
        return {n: k / self.epoch_length for n, k in zip(self.names, self.per_epoch)}

    def _split(self, s: int, local: np.ndarray) -> np.ndarray:
        """Window ids of positions in the fixed (seed-independent) train/val split permutation of source s."""
        return permute(local, self.windows[s], derive_key(0x5A11D, self._name_keys[s]))

    def train(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Source ids and window ids of the given (non-negative) training sample positions."""
        pos = np.asarray(positions, dtype=np.int64)
        epoch, offset = np.divmod(pos, self.epoch_length)
        slot = np.empty_like(pos)
        for e in np.unique(epoch):
            sel = epoch == e
            slot[sel] = permute(offset[sel], self.epoch_length, derive_key(self.seed, 0x313, int(e)))
        source = np.searchsorted(self._ends, slot, side="right")
        per_epoch = np.asarray(self.per_epoch, dtype=np.int64)
        stream = epoch * per_epoch[source] + (slot - self._starts[source])
        window = np.empty_like(pos)
        for s in np.unique(source):
            n_s = self.train_counts[s]
            sel_s = source == s
            passes, within = np.divmod(stream[sel_s], n_s)
            local = np.empty_like(within)
            for u in np.unique(passes):
                sel_u = passes == u
                local[sel_u] = permute(within[sel_u], n_s, derive_key(self.seed, self._name_keys[s], int(u)))
            window[sel_s] = self._split(int(s), self.val_counts[s] + local)
        return source, window

    def val(self) -> tuple[np.ndarray, np.ndarray]:
        """Source ids and window ids of all validation windows (source by source)."""
        sources, windows = [], []
        for s, v in enumerate(self.val_counts):
            if v:
                sources.append(np.full(v, s, dtype=np.int64))
                windows.append(self._split(s, np.arange(v, dtype=np.int64)))
        if not sources:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        return np.concatenate(sources), np.concatenate(windows)
