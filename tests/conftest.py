"""Test isolation shared by the whole suite."""

import os

import pytest


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
