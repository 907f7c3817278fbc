"""The global document shuffle of `mula prepare` (mula/data/shuffle.py), its three passes run directly."""

from __future__ import annotations

import numpy as np
import pytest

from mula.data import shuffle

EOS = 0


def _task_docs(tasks: int, per_task: int) -> list[list[np.ndarray]]:
    """Document ``d`` of the source: ``[d + 1] * (1 + d % 3)`` then EOS (ids are unique per document)."""
    docs = [np.array([d + 1] * (1 + d % 3) + [EOS], dtype=np.uint16) for d in range(tasks * per_task)]
    return [docs[t * per_task : (t + 1) * per_task] for t in range(tasks)]


def _shuffled(tmp_path, tasks: list[list[np.ndarray]], seed: int) -> list[int]:
    """Run the three passes; the source's documents (by their first token) in the shuffled order."""
    coarse, fine = shuffle.shuffle_shape(len(tasks))
    for t, docs in enumerate(tasks):
        shuffle.write_scatter(str(tmp_path), t, docs, seed, coarse, "uint16")
    for c in range(coarse):
        shuffle.split_coarse(str(tmp_path), c, len(tasks), fine, seed, EOS, "uint16")
    shuffle.remove_scatter(str(tmp_path), len(tasks))
    order = []
    for b in range(coarse * fine):
        order += [int(d[0]) - 1 for d in shuffle.gather_bucket(str(tmp_path), b, fine, seed, EOS, "uint16")]
        shuffle.remove_split(str(tmp_path), b, fine)
    assert not list(tmp_path.iterdir()), "every intermediate file removed"
    return order


@pytest.mark.parametrize("tasks", [1, 2, 3, 9, 10, 17, 1000, 16384])
def test_shape_covers_the_tasks_with_about_sqrt_coarse_buckets(tasks):
    coarse, fine = shuffle.shuffle_shape(tasks)
    assert coarse * fine >= tasks and coarse * (fine - 1) < tasks  # about one task's tokens per bucket
    assert coarse == int(np.ceil(np.sqrt(tasks)))


def test_reads_grow_as_tasks_times_sqrt_tasks_not_tasks_squared(tmp_path, monkeypatch):
    tasks = _task_docs(16, 40)
    reads = []
    real = np.fromfile
    monkeypatch.setattr(np, "fromfile", lambda f, *a, **k: reads.append(f) or real(f, *a, **k))
    order = _shuffled(tmp_path, tasks, seed=3)
    coarse, fine = shuffle.shuffle_shape(16)
    assert (coarse, fine) == (4, 4)
    # Pass 2 reads one slice of each task per coarse bucket, pass 3 one file per bucket: 16*4 + 16, not 16**2.
    token_reads = [f for f in reads if isinstance(f, str) and f.endswith(".bin")]  # not the .npy offsets
    assert len(token_reads) == 16 * coarse + coarse * fine == 80
    assert sorted(order) == list(range(16 * 40))  # every document once
    assert order != sorted(order)


def test_same_order_for_the_same_seed_another_for_another(tmp_path):
    tasks = _task_docs(5, 30)
    runs = {}
    for name, seed in (("one", 11), ("again", 11), ("other", 12)):
        (tmp_path / name).mkdir()
        runs[name] = _shuffled(tmp_path / name, tasks, seed)
    assert runs["one"] == runs["again"] != runs["other"]


def test_every_document_is_equally_likely_at_every_position(tmp_path):
    # 8 documents in 4 tasks, 800 seeds: each (document, position) pair expected 100 times. A shuffle that
    # kept the order inside a bucket, or drew buckets per task rather than per document, fails the bound.
    tasks = _task_docs(4, 2)
    counts = np.zeros((8, 8), dtype=np.int64)
    neighbours = 0  # the two documents of one task side by side: 1/4 of the time in a uniform permutation
    for seed in range(800):
        order = _shuffled(tmp_path, tasks, seed)
        for position, doc in enumerate(order):
            counts[doc, position] += 1
        neighbours += sum(abs(order.index(2 * t) - order.index(2 * t + 1)) == 1 for t in range(4))
    assert counts.sum() == 6400
    assert counts.min() >= 60 and counts.max() <= 145, counts
    assert 700 <= neighbours <= 900, neighbours  # 3,200 pairs, 800 expected (sd 24)
