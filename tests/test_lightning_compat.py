"""mula.lightning_compat: the private Lightning names resolve, and the tested range is the one required."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import lightning
from packaging.specifiers import SpecifierSet

from mula import lightning_compat

ROOT = Path(__file__).resolve().parents[1]


def test_tested_range_is_the_requirement_and_holds_the_installed_lightning():
    (requirement,) = re.findall(
        r'^\s*"lightning([^"]*)",$', (ROOT / "pyproject.toml").read_text(), re.MULTILINE
    )
    assert SpecifierSet(requirement) == SpecifierSet(lightning_compat.TESTED_LIGHTNING)
    assert lightning.__version__ in SpecifierSet(lightning_compat.TESTED_LIGHTNING)


def test_private_names_are_the_lightning_objects():
    for name in lightning_compat.__all__:
        assert getattr(lightning_compat, name) is not None
    env = object()
    trainer = SimpleNamespace(_accelerator_connector=SimpleNamespace(cluster_environment=env))
    assert lightning_compat.cluster_environment(trainer) is env
    real = lightning.pytorch.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    assert lightning_compat.cluster_environment(real) is not None
