"""What a newcomer sees (issue 49): the demo's start of training shows no wrong figure and no warning that
every run would print.

Lightning's model summary counted FLOPs by running an example input that MulaLightningModule does not
have, so it printed `Total FLOPs: 0`; `mula fit` now shows the model's training FLOPs per optimizer step
(`mula.training.model_summary.StepFlopsSummary`). Lightning's WandbLogger gave `wandb.init` an
`anonymous` argument on every run, which wandb answers with "The anonymous setting has no effect"; it is
left out now (`mula.training.lightning_compat.leave_wandb_anonymous_unset`); the saved config is copied
into the W&B run instead of `wandb.save`'s symlink, which wandb announced on every run; and Lightning's
own use of torch's deprecated `LeafSpec` no longer prints its FutureWarning
(`lightning_compat.silence_lightning_deprecations`). One short run of the demo
recipe, with W&B offline and not silenced (as a user runs it; the other tests set WANDB_SILENT).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from lightning.pytorch.utilities.model_summary import get_human_readable_count
from test_cli import FAST, TINY_MOE

from mula.model.config import MulaConfig

SEQ_LEN, GLOBAL_BATCH = 64, 8  # FAST's data settings
ONE_STEP = ["--trainer.max_steps=1", "--trainer.limit_val_batches=0"]


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="the demo's W&B logger needs wandb")
def test_the_demo_shows_its_flops_per_step_and_no_wandb_warning(tmp_path: Path) -> None:
    assert f"--data.seq_len={SEQ_LEN}" in FAST and f"--data.global_batch_size={GLOBAL_BATCH}" in FAST
    env = {**os.environ, "WANDB_MODE": "offline"}
    for name in ("WANDB_SILENT", "MULA_TRACEBACK"):
        env.pop(name, None)
    run = subprocess.run(
        [sys.executable, "-m", "mula", "fit", "-c", str(TINY_MOE), *FAST, *ONE_STEP],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-3000:]
    config = MulaConfig.from_name("mula-tiny-moe")
    flops = get_human_readable_count(config.flops_per_token(SEQ_LEN) * GLOBAL_BATCH * SEQ_LEN)
    # rich's summary prints `Total FLOPs: 5.1 B`, the plain one `5.1 B     Total Flops`
    totals = [line for line in output.splitlines() if "total flops" in line.lower()]
    assert totals and all(flops in line for line in totals), (flops, totals)
    assert (
        f"FLOPs per optimizer step: {flops} (forward and backward of {GLOBAL_BATCH * SEQ_LEN:,} tokens"
        in output
    )
    assert "anonymous setting has no effect" not in output, output[-3000:]
    assert "Symlinked" not in output, output[-3000:]  # the config is copied into the W&B run, not symlinked
    assert "LeafSpec" not in output, output[-3000:]  # Lightning's own use of a deprecated torch name
    assert "wandb" in output  # the W&B logger ran (offline), so its warning had the chance to appear
