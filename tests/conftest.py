"""Test isolation shared by the whole suite, and its one thread per process."""

import os

import pytest

# The suite runs in two pytest-xdist workers on the CI's two cores (README: `-n 2`), each test's ranks and
# subprocesses beside the other worker's. A process with an OpenMP team of two waits at every barrier for
# a core the other worker holds (a 50-step `mula fit` took 157 s instead of 20): every test process, and
# every process it starts, runs one intra-op thread, as the multi-rank tests' ranks always did. Set before
# any test module imports torch; a user's own OMP_NUM_THREADS wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True)
def _restore_environment():
    """Give every test the environment the previous one started with.

    In-process `mula fit` runs set process-wide variables (Lightning's `seed_everything` exports
    PL_GLOBAL_SEED, which strategies re-apply in `setup_environment`); without this, a later test's
    ranks would re-seed with another test's seed and initialise a different model than its reference.
    """
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
