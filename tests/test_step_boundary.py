"""mula.training.step_boundary: one report per optimizer step to each observer, none for a resumed run's step."""

from __future__ import annotations

from types import SimpleNamespace

from mula.training.step_boundary import StepBoundary


def _looks(boundary: StepBoundary, steps: list[int]) -> list[bool]:
    """What `crossed` answers at each `on_train_batch_end`, the trainer's global step being `steps[i]`."""
    return [boundary.crossed(SimpleNamespace(global_step=s)) for s in steps]


def test_once_per_step_across_an_accumulation_window():
    boundary = StepBoundary()
    boundary.start(SimpleNamespace(global_step=0))
    # two micro-batches per step: the global step moves at each window's last one
    assert _looks(boundary, [0, 1, 1, 2, 2, 3]) == [False, True, False, True, False, True]
    assert boundary.seen == 3


def test_a_resumed_step_is_not_new_unless_never_started():
    resumed = StepBoundary()
    resumed.start(SimpleNamespace(global_step=100))
    assert _looks(resumed, [100, 101]) == [False, True]
    unstarted = StepBoundary()  # the hang watchdog: its first look is a step
    assert _looks(unstarted, [100, 100, 101]) == [True, False, True]


def test_each_observer_keeps_its_own_view():
    first, second = StepBoundary(), StepBoundary()
    for b in (first, second):
        b.start(SimpleNamespace(global_step=0))
    assert _looks(first, [1]) == [True]
    assert _looks(second, [1]) == [True]  # looking is what consumes a step, per observer
