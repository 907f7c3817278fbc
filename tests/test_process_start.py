"""What a process imports at its start, where that multiplies over processes (every `mula` rank, every
tokenizer worker): torchmetrics' optional packages are skipped (mula/commands/lean_torchmetrics.py), and
`mula.checkpoint` is torch-free to import (mula/checkpoint/__init__.py). Each probe is a fresh interpreter.
"""

from __future__ import annotations

import json
import subprocess
import sys

import mula.checkpoint

LEAN_TORCHMETRICS = """
import json, sys
from mula.commands.lean_torchmetrics import HIDDEN, skip_torchmetrics_optional_imports
skip_torchmetrics_optional_imports()
skip_torchmetrics_optional_imports()
import lightning.pytorch, torch, torchmetrics
from lightning_utilities.core.imports import RequirementCache, package_available
skipped = sorted(name for name in HIDDEN if name not in sys.modules)
metric = torchmetrics.MeanMetric()
metric.update(torch.tensor([1.0, 2.0, 6.0]))
import scipy.special
print(json.dumps({
    "skipped": skipped,
    "mean": metric.compute().item(),
    "loader_kept": type(torchmetrics.__loader__).__module__ != "mula.commands.lean_torchmetrics",
    "checks_answer_truly_after": bool(RequirementCache("matplotlib")) and package_available("transformers"),
    "scipy_imports_after": bool(scipy.special.gamma(4.0) == 6.0),
}))
"""

# what a tokenizer worker process of `mula prepare` imports (mula/data/prepare.py's spawned workers)
PREPARE_WORKER = """
import json, sys
import mula.data.prepare
print(json.dumps(sorted(m for m in ("torch", "lightning", "torchmetrics") if m in sys.modules)))
"""


def _probe(code: str):
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_lightning_imports_without_scipy_matplotlib_transformers_and_torchmetrics_still_works():
    assert _probe(LEAN_TORCHMETRICS) == {
        "skipped": ["matplotlib", "scipy", "transformers"],
        "mean": 3.0,
        "loader_kept": True,
        "checks_answer_truly_after": True,
        "scipy_imports_after": True,
    }


def test_a_prepare_worker_imports_no_torch_and_every_checkpoint_name_resolves():
    assert _probe(PREPARE_WORKER) == []
    for name in mula.checkpoint.__all__:  # the lazy names included (here torch is loaded anyway)
        getattr(mula.checkpoint, name)
    assert set(mula.checkpoint.__all__) <= set(dir(mula.checkpoint))
