"""The registry of layout features judges a run as `mula fit` does (docs/layouts.md is what a user meets).

Every combination of the matrix (`mula.layout.features.combinations`) is turned into a `mula fit` command
line -- the tiny MoE recipe, the probe's ranks, XPUMoEStrategy with the probe's arguments, its model
overrides, precision, recompute, compile and optimizer, its sequence and batch -- and read as `mula fit`
reads it before training: the recipe reader and `mula.plan.settings.plan_inputs` (the start-of-run
check, `check_runnable`), then rank 0 of the layout built up to the end of the strategy's `setup` on the
meta device over torch's fake process group (`mula.plan.dry_run`: `setup_environment`, the model, the
strategy's `setup` with its `check_run`, the optimizer). Offload's probes stop after the start-of-run
check: its host buffers cannot be filled from meta tensors, so `--dry_run` does not build them yet. A combination the registry refuses must stop
there with the registry's sentence; one it accepts must build. A registry that validated less than a
run (bf16-true without the sharded optimizer was "accepted" by the matrix and refused by `mula fit`)
fails here.
"""

from __future__ import annotations

import json

import pytest
from test_recipes import RECIPES

from mula.layout.features import MICRO, MICROS, SEQ, combinations, probe, refusal
from mula.plan.command import PLAN_OPTIONS
from mula.plan.dry_run import dry_run
from mula.plan.recipe_reader import read_plan_command
from mula.plan.settings import plan_inputs

OPTIONS = {name: (tp, default) for name, (tp, default, _) in PLAN_OPTIONS.items()}
COMBINATIONS = combinations()


def command_line(features) -> list[str]:
    """`mula fit`'s arguments for the probe of `features` (module docstring)."""
    run = probe(features)
    strategy = "--trainer.strategy.init_args."
    return [
        "-c", str(RECIPES / "mula-tiny-moe.yaml"), "--trainer.accelerator=cpu",
        f"--trainer.devices={run.world_size}", "--trainer.num_nodes=1",
        "--trainer.strategy.class_path=strategies.XPUMoEStrategy", f"--trainer.precision={run.precision}",
        f"--model.overrides={json.dumps(run.overrides)}",
        f"--model.activation_checkpointing={json.dumps(run.activation_checkpointing)}",
        f"--model.compile={json.dumps(run.compile)}", f"--model.optimizer={run.optimizer}",
        f"--data.seq_len={SEQ}", f"--data.micro_batch_size={run.micro_batch}",
        f"--data.global_batch_size={MICROS * MICRO}",
        *(f"{strategy}{name}={json.dumps(value)}" for name, value in run.strategy.items()),
    ]  # fmt: skip


def judged_by_the_command_line(features) -> str | None:
    """The sentence `mula fit`'s reading of `features`' command line stops with, or None when rank 0 of its
    layout builds through the strategy's setup."""
    kwargs = read_plan_command(command_line(features), OPTIONS)
    assert kwargs is not None, sorted(features)  # the reader reads every probe's command line
    try:
        inputs = plan_inputs(kwargs["trainer"], kwargs["model"], kwargs["data"])
        result = dry_run(inputs, kwargs["trainer"], kwargs["model"], 0, measure=False)
    except ValueError as err:
        return str(err)
    assert result["rank"] == 0
    return None


@pytest.mark.parametrize("index", range(len(COMBINATIONS)), ids=[",".join(sorted(c)) for c in COMBINATIONS])
def test_the_command_line_judges_a_combination_as_the_registry(index: int) -> None:
    combo = COMBINATIONS[index]
    assert judged_by_the_command_line(combo) == refusal(combo)


def test_a_registry_that_accepts_what_a_run_refuses_is_caught(monkeypatch) -> None:
    """Planted: the registry of before, whose bf16-true brought no sharded optimizer and whose validation
    never asked for fp32 masters, accepts a run `mula fit` refuses."""
    import dataclasses

    import mula.layout.features as features

    real_closure, real_check = features.closure, features.check_run
    monkeypatch.setattr(features, "closure", lambda names: frozenset(set(real_closure(names)) - {"ZeRO-1"}))
    monkeypatch.setattr(
        features, "check_run", lambda run: real_check(dataclasses.replace(run, fp32_masters=True))
    )
    combo = frozenset({"bf16-true", "P"})
    assert refusal(combo) is None  # the old registry accepts it ...
    assert "keeps no fp32 masters" in judged_by_the_command_line(combo)  # ... the command line does not
