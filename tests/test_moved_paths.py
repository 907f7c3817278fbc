"""The module paths of Mula 0.1's flat mula/ keep working for one release (mula/moved_paths.py).

Each old path imports with one FutureWarning naming the new path, and what it gives is the new
module's own objects (class identity holds, so a saved config's classes are Mula's classes). A
config.yaml saved by `mula fit` before the move (tests/fixtures/) trains with `mula fit -c`.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from mula import moved_paths

REPO = Path(__file__).resolve().parents[1]
SAVED_CONFIG = REPO / "tests" / "fixtures" / "config-before-house-move.yaml"


def _module_file(dotted: str) -> Path:
    path = REPO / dotted.replace(".", "/")
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def test_every_old_path_is_gone_from_the_tree_and_names_a_module_that_exists():
    for old, new in moved_paths.MOVED.items():
        assert not _module_file(old).exists(), f"{old} still has a file: the alias would be shadowed"
        assert _module_file(new).exists(), f"{old} -> {new}: no such module"


@pytest.mark.parametrize("old", sorted(moved_paths.MOVED))
def test_an_old_path_imports_with_a_warning_and_gives_the_new_objects(old):
    for name in [m for m in sys.modules if m == old or m.startswith(old + ".")]:
        del sys.modules[name]  # a previous test's import would hide the warning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        alias = importlib.import_module(old)
    new = importlib.import_module(moved_paths.MOVED[old])
    messages = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    assert messages == [
        f"`{old}` is now `{new.__name__}`; the old path works until Mula "
        f"{moved_paths.REMOVED_IN} (in a saved config.yaml, replace the class_path's module)"
    ]
    public = [name for name in vars(new) if not name.startswith("_")]
    assert public
    for name in public:
        assert getattr(alias, name) is getattr(new, name), f"{old}.{name}"


def test_a_submodule_of_a_moved_package_is_its_new_submodule():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        from mula.moe.layer import MoELayer as old
    from mula.model.moe.layer import MoELayer

    assert old is MoELayer
    assert moved_paths.new_path("mula.kernels.permute") == "mula.model.kernels.permute"
    assert moved_paths.new_path("mula.data.loader") is None  # did not move
    assert moved_paths.new_path("mula.moderate") is None  # a prefix of a name is not its package


def test_a_config_saved_before_the_move_trains(tmp_path):
    run_dir = tmp_path / "run"
    saved = tmp_path / "config.yaml"
    text = SAVED_CONFIG.read_text()
    assert "class_path: mula.csv_logger.CSVLogger" in text  # the old path this test is about
    saved.write_text(text.replace("/tmp/premove", str(run_dir)))
    command = [
        sys.executable, "-m", "mula", "fit", "-c", str(saved),
        "--trainer.max_steps=1", "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
        # the demo data, smaller: the saved config's own sources are the whole standard library
        '--data.prepare.sources=[{name: stdlib, paths: ["{stdlib}/[a-c]*.py"], format: text}]',
        "--data.prepare.train_tokenizer.max_documents=100",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline",
           "WANDB_SILENT": "true"}  # fmt: skip
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "`mula.csv_logger` is now `mula.training.csv_logger`" in output
    metrics = list(run_dir.rglob("metrics.csv"))
    assert len(metrics) == 1 and metrics[0].read_text().splitlines()[-1].endswith(
        ",1"
    )  # the old logger wrote step 1
    assert (run_dir / "checkpoints" / "step=000000001.ckpt").exists()
