"""`mula plan`'s light reader (mula.plan.recipe_reader) against the full LightningCLI parser.

For every shipped recipe composition, the header commands of the paper recipes and a set of
composition rules (section blocks, dotted keys, includes, strategy class changes, mapping values),
the planner inputs read without Lightning equal those the full parser gives; what the reader cannot
read exactly goes to the full parser; and the fast path imports neither Lightning nor torch.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from test_recipes import PAPER, RECIPES, ROOT

import mula.plan.command as plan_command
from mula.plan.command import PLAN_OPTIONS
from mula.plan.machines import load_machine
from mula.plan.recipe_reader import header_command, read_plan_command
from mula.plan.settings import plan_inputs

OPTIONS = {name: (tp, default) for name, (tp, default, _) in PLAN_OPTIONS.items()}


@pytest.fixture(autouse=True)
def _cli_argv(monkeypatch):
    """The CLI is driven through `args`; pytest's own argv must not look like CLI arguments."""
    monkeypatch.setattr("sys.argv", ["mula"])


def full_parse(argv: list[str], monkeypatch) -> dict[str, Any]:
    """What the LightningCLI parser hands `run_plan` for `mula plan ARGV`."""
    from mula.commands.lightning_cli import plan

    captured: dict[str, Any] = {}
    monkeypatch.setattr(plan_command, "run_plan", lambda **kwargs: captured.update(kwargs))
    plan(argv)
    return captured


def planned(kwargs: dict[str, Any]) -> Any:
    """The planner's inputs for parsed arguments (or the error it raises), and the plan options."""
    machine = load_machine(kwargs["machine"]) if kwargs["machine"] else None
    try:
        inputs: Any = plan_inputs(
            kwargs["trainer"], kwargs["model"], kwargs["data"], machine=machine, nodes=kwargs["nodes"]
        )
    except (ValueError, TypeError) as e:
        inputs = f"{type(e).__name__}: {e}"
    return inputs, {name: kwargs[name] for name in PLAN_OPTIONS}


def assert_read_alike(argv: list[str], monkeypatch) -> None:
    fast = read_plan_command(argv, OPTIONS)
    assert fast is not None, f"the light reader gave up on {argv}"
    assert planned(fast) == planned(full_parse(argv, monkeypatch))


def _compositions() -> list[list[str]]:
    # ddp.yaml names Lightning's DDPStrategy, whose options only the full parser knows
    strategies = [p for p in sorted((RECIPES / "strategies").glob("*.yaml")) if p.name != "ddp.yaml"]
    out = [["-c", str(p)] for p in sorted(RECIPES.glob("mula-*.yaml"))]
    out += [["-c", str(RECIPES / "mula-tiny-moe.yaml"), "-c", str(s)] for s in strategies]
    out += [["-c", str(RECIPES / "mula-220b-a10b.yaml"), "-c", str(s)] for s in strategies]
    return out


@pytest.mark.parametrize("argv", _compositions(), ids=lambda a: "+".join(Path(p).stem for p in a[1::2]))
def test_shipped_recipe_compositions_read_alike(argv, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert_read_alike(argv + ["--machine=aurora"], monkeypatch)


@pytest.mark.parametrize("name", PAPER)
def test_paper_recipe_header_commands_read_alike(name, monkeypatch):
    monkeypatch.chdir(ROOT)
    argv = header_command((RECIPES / f"{name}.yaml").read_text(), "mula plan")
    assert_read_alike(argv, monkeypatch)
    assert_read_alike(argv + ["--search", "--scaling_nodes=[64, 128]", "--format", "json"], monkeypatch)


@pytest.mark.parametrize("path", sorted((RECIPES / "long-context").glob("*.yaml")), ids=lambda p: p.stem)
def test_long_context_recipe_header_commands_read_alike(path, monkeypatch):
    """The long-context recipes include a paper recipe from a subdirectory (`config: ../...`)."""
    monkeypatch.chdir(ROOT)
    assert_read_alike(header_command(path.read_text(), "mula plan"), monkeypatch)


FILES = {
    "base.yaml": """
        trainer:
          max_steps: 5
          devices: 2
          precision: bf16-true
          strategy:
            class_path: strategies.XPUMoEStrategy
            init_args: {expert_parallel_size: 2, optimizer_options: {zero_stage: 1, reduce_dtype: fp32}}
        model:
          config: mula-tiny-moe
          overrides: {num_layers: 4, router_aux_loss_coef: 0.02}
          activation_checkpointing: [moe]
        data:
          data_dir: d
          seq_len: 64
          micro_batch_size: 2
          global_batch_size: 32
    """,
    "nest.yaml": "trainer: {devices: 4}\ndata: {micro_batch_size: 1}",
    "sub/dotted.yaml": "config: ../base.yaml\ntrainer.devices: 4\ntrainer.strategy.init_args.expert_parallel_size: 4\ndata.seq_len: 128",
    "pipe.yaml": "trainer:\n  strategy:\n    class_path: strategies.XPUMoEStrategy\n    init_args: {pipeline_parallel_size: 2}",
    "pipe_no_class.yaml": "trainer:\n  strategy:\n    init_args: {pipeline_parallel_size: 2, pipeline_schedule: gpipe}",
    "ddp.yaml": "trainer:\n  strategy:\n    class_path: lightning.pytorch.strategies.DDPStrategy",
    "dicts.yaml": "model: {overrides: {num_layers: 2}}\ntrainer: {strategy: {init_args: {optimizer_options: {zero_stage: 2}}}}",
    "dotted_dict.yaml": "model.overrides: {num_layers: 2}",
    "include_with_block.yaml": "config: base.yaml\ntrainer: {devices: 4}",
    "typo.yaml": "trainer: {devcies: 4}",
    "typo_strategy.yaml": "trainer.strategy.init_args.expert_paralel_size: 4",
}


@pytest.fixture
def recipe_dir(tmp_path, monkeypatch):
    for name, text in FILES.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(textwrap.dedent(text))
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize(
    "argv",
    [
        "-c base.yaml",
        "-c base.yaml -c nest.yaml",  # a later section block merges key by key
        "-c sub/dotted.yaml",  # an include relative to the including file, then dotted keys
        "-c base.yaml -c pipe.yaml",  # same strategy class: init_args merge
        "-c base.yaml -c pipe_no_class.yaml",
        "-c base.yaml -c ddp.yaml -c pipe.yaml",  # a class change starts from the new class's defaults
        "-c base.yaml -c dicts.yaml",  # mapping values are replaced as a whole
        "-c base.yaml -c dotted_dict.yaml",
        "-c base.yaml --model.overrides.num_layers=2 --trainer.strategy.optimizer_options.zero_stage=2",
        "-c base.yaml --model.overrides={num_layers:\\ 2}",
        "-c base.yaml --trainer.strategy.expert_parallel_size=1 --trainer.devices 4 --data.seq_len 32",
        "-c base.yaml --trainer.strategy.init_args.pipeline_parallel_size=2 --trainer.strategy.init_args.expert_parallel_size=1",
        "-c base.yaml --trainer.strategy=ddp --trainer.precision=bf16-mixed",
        "--config base.yaml --config=nest.yaml --model.activation_checkpointing=full --data.global_batch_size=64",
        "-c base.yaml --machine aurora --nodes=2 --no_search --format=json --device_memory_gb=16",
    ],
)
def test_composition_rules_read_alike(argv, recipe_dir, monkeypatch):
    import shlex

    assert_read_alike(shlex.split(argv), monkeypatch)


@pytest.mark.parametrize(
    "argv",
    [
        "-c base.yaml --help",
        "-c base.yaml --print_config",
        "-c base.yaml --trainer.devcies=4",  # unknown keys, in a flag or a file: the full parser says so
        "-c base.yaml -c typo.yaml",
        "-c base.yaml -c typo_strategy.yaml",
        "-c base.yaml --data.seq_len=abc",  # a value of the wrong type
        "-c base.yaml --data.micro_batch_size=true",
        "-c base.yaml --model.verify_init_weights=false",  # set by a link from --verify
        "-c nest.yaml",  # data.data_dir is required
        "-c missing.yaml",
        "-c base.yaml -c ddp.yaml",  # another strategy class: its options are the full parser's
        "-c include_with_block.yaml",  # jsonargparse replaces the section there
        "-c base.yaml --format=xml",
        "-c base.yaml --search false",
        "-c base.yaml extra",
    ],
)
def test_what_the_reader_does_not_read_goes_to_the_full_parser(argv, recipe_dir):
    import shlex

    assert read_plan_command(shlex.split(argv), OPTIONS) is None


def test_fast_plan_imports_neither_lightning_nor_torch_and_reports_bad_input():
    argv = header_command((RECIPES / "mula-220b-a10b.yaml").read_text(), "mula plan")
    code = textwrap.dedent(
        f"""
        import sys
        from mula.commands.entry import main
        main(["plan", *{argv!r}, "--format=json"])
        assert "lightning" not in sys.modules and "torch" not in sys.modules, "imported"
        """
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    plan = json.loads(run.stdout)
    assert plan["model"] == "mula-220b-a10b" and plan["fits"]
    bad = [sys.executable, "-m", "mula", "plan", *argv, "--trainer.strategy.init_args.expert_parallel_size=7"]
    run = subprocess.run(bad, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.startswith("mula: error: ") and len(run.stderr.strip().splitlines()) == 1, run.stderr


TINY = ["-c", str(RECIPES / "mula-tiny-moe.yaml")]
FIT_EXTRA = ["--trainer.devices=1", "--data.seq_len=64", "--ckpt_path=null", "--memory_check=false"]


def fit_sections(argv: list[str]) -> dict[str, dict[str, Any]]:
    """The trainer/model/data sections `mula fit ARGV` parses (classes instantiated, nothing run)."""
    from test_recipes import _Probe

    cli = _Probe(args=["fit", *argv])
    return {k: cli.config.fit[k].as_dict() for k in ("trainer", "model", "data")}


FIT_OPTIONS = ["ckpt_path", "restart_from_scratch", "memory_check", "device_memory_gb"]


def test_fit_check_finds_no_difference_on_a_shipped_recipe(tmp_path, monkeypatch):
    from mula.plan.reader_check import reader_mismatch

    monkeypatch.chdir(tmp_path)
    argv = TINY + FIT_EXTRA
    assert read_plan_command(argv, {name: (object, None) for name in FIT_OPTIONS}) is not None
    assert reader_mismatch(argv, fit_sections(argv), FIT_OPTIONS, world_size=1) is None


def _misreading(monkeypatch):
    """Make the light reader read data.seq_len one token longer than jsonargparse does."""
    import mula.plan.recipe_reader as reader

    real = reader.read_plan_command

    def misread(argv, options):
        out = real(argv, options)
        if out is not None:
            out["data"]["seq_len"] += 1
        return out

    monkeypatch.setattr(reader, "read_plan_command", misread)


def test_fit_check_reports_a_difference_as_a_bug(tmp_path, monkeypatch):
    from mula.plan.reader_check import reader_mismatch

    monkeypatch.chdir(tmp_path)
    argv = TINY + FIT_EXTRA
    _misreading(monkeypatch)
    message = reader_mismatch(argv, fit_sections(argv), FIT_OPTIONS, world_size=1)
    assert message is not None and message.startswith("bug in mula's recipe reader")
    assert "layout.seq_len: 65 here, 64 in mula fit" in message


def test_mula_fit_compares_once_at_start_and_warns_on_a_difference(tmp_path, monkeypatch):
    """End to end: `mula fit` runs the check before its run-directory lock; a deliberate misreading warns,
    the real reader does not (the run goes on either way: fit uses jsonargparse's parse)."""
    import warnings

    import mula.plan.reader_check as reader_check
    from mula.commands.entry import main

    class Reached(Exception):
        pass

    def lock(*_args):
        raise Reached

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("mula.commands.lightning_cli.lock_run_dir_before_launch", lock)
    calls = []
    real = reader_check.reader_mismatch
    monkeypatch.setattr(reader_check, "reader_mismatch", lambda *a: calls.append(a) or real(*a))
    argv = ["fit", *TINY, *FIT_EXTRA, "--trainer.enable_progress_bar=false"]
    with warnings.catch_warnings(record=True) as caught, pytest.raises(Reached):
        warnings.simplefilter("always")
        main(argv)
    assert len(calls) == 1 and not [w for w in caught if "recipe reader" in str(w.message)]
    _misreading(monkeypatch)
    with pytest.warns(UserWarning, match="bug in mula's recipe reader") as caught, pytest.raises(Reached):
        main(argv)
    assert "layout.seq_len" in str(caught[-1].message)


def test_jsonargparse_pin_is_the_requirement_and_another_release_goes_to_the_full_parser(monkeypatch):
    import importlib.metadata
    import re

    import jsonargparse
    from packaging.specifiers import SpecifierSet

    import mula.plan.recipe_reader as reader

    (requirement,) = re.findall(
        r'^\s*"jsonargparse\[signatures\]([^"]*)",$', (ROOT / "pyproject.toml").read_text(), re.M
    )
    assert SpecifierSet(requirement) == SpecifierSet(reader.TESTED_JSONARGPARSE)
    assert jsonargparse.__version__ in SpecifierSet(reader.TESTED_JSONARGPARSE)
    argv = TINY + ["--machine=aurora"]
    assert read_plan_command(argv, OPTIONS) is not None
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "4.54.0")
    reader.tested_jsonargparse.cache_clear()
    try:
        assert read_plan_command(argv, OPTIONS) is None
    finally:
        reader.tested_jsonargparse.cache_clear()


@pytest.mark.parametrize("device", ["xpu", "cuda"])
def test_planning_a_device_this_machine_lacks_without_a_machine_file_is_one_sentence(device, monkeypatch):
    """Without --machine the plan reads this machine's devices; a recipe for devices it lacks is refused
    in one sentence naming --machine (it was torch's "not compiled with XPU enabled" traceback)."""
    import torch

    monkeypatch.setattr(getattr(torch, device), "is_available", lambda: False)
    with pytest.raises(
        ValueError, match=f"runs on {device} devices, which this machine does not have.*--machine"
    ):
        plan_inputs({"accelerator": device, "devices": 2}, {"config": "mula-tiny-moe"}, {})
