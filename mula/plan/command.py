"""`mula plan` and the start-of-run memory check of `mula fit`: read a parsed recipe, plan, print.

    mula plan -c recipes/mula-220b-a10b.yaml -c recipes/strategies/aurora-xpu-moe.yaml \
        --machine aurora --nodes 1024 [--format json] [--search] [--scaling_nodes '[32, 1024]']
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Literal

from mula.layout.rules import micro_batches_per_step
from mula.plan.calibrated import error_band
from mula.plan.collective_kinds import planned_collectives
from mula.plan.layout import Layout
from mula.plan.machines import Machine, load_machine
from mula.plan.memory import MemoryPlan, plan_memory
from mula.plan.settings import PlanInputs, plan_inputs
from mula.plan.step_time import comm_volumes, step_time

GB = 1e9


# The options `mula plan` adds to the trainer/model/data options of `mula fit`: name -> (type, default,
# help). The full parser declares them (`add_plan_arguments`); the light reader checks them
# (`plan_without_lightning`). A bool option is a yes/no flag (--search, --no_search).
PLAN_OPTIONS: dict[str, tuple[Any, Any, str]] = {
    "machine": (
        str | None,
        None,
        "Plan for this machine (recipes/machines/<name>.yaml: aurora, h100, or a path); "
        "default: the recipe's trainer settings on the machine running the command.",
    ),
    "nodes": (int | None, None, "Nodes of --machine (default: trainer.num_nodes)."),
    "format": (Literal["text", "json"], "text", "text or json."),
    "search": (
        bool,
        False,
        "List the layouts (E, P, T and sequence parallelism, C (context parallelism), micro-batch, checkpointing, "
        "ZeRO stage, bf16 weights, optimizer offload) that fit the device and the host, fastest first.",
    ),
    "scaling_nodes": (
        list[int] | None,
        None,
        "Also print weak and strong scaling efficiency from --nodes to each of these node counts.",
    ),
    "device_memory_gb": (
        float | None,
        None,
        "Device memory to plan against, in GB (default: the machine's or this device's).",
    ),
    "dry_run": (
        bool,
        False,
        "Also build one rank of the layout with the recipe's strategy on the meta device over a fake "
        "process group (nothing is allocated) and print its parameter, gradient and optimizer bytes next "
        "to the plan's.",
    ),
    "dry_run_rank": (
        int | None,
        None,
        "The rank --dry_run builds (default: the first rank of the pipeline stage the plan reports).",
    ),
}


def add_plan_arguments(parser: Any) -> None:
    """Declare `PLAN_OPTIONS` on the full (jsonargparse) parser of `mula plan`."""
    from jsonargparse import ActionYesNo

    for name, (tp, default, help) in PLAN_OPTIONS.items():
        if tp is bool:
            parser.add_argument(f"--{name}", action=ActionYesNo, default=default, help=help)
        else:
            parser.add_argument(f"--{name}", type=tp, default=default, help=help)


def plan_without_lightning(argv: list[str]) -> bool:
    """Run `mula plan ARGV` from the light reader (`mula.plan.recipe_reader`: no Lightning, no torch
    with --machine); False, having done nothing, when the full parser must read ARGV."""
    from mula.plan.recipe_reader import read_plan_command

    kwargs = read_plan_command(argv, {name: (tp, default) for name, (tp, default, _) in PLAN_OPTIONS.items()})
    if kwargs is None:
        return False
    run_plan(**kwargs)
    return True


def run_plan(
    trainer: dict[str, Any],
    model: dict[str, Any],
    data: dict[str, Any],
    machine: str | None = None,
    nodes: int | None = None,
    format: str = "text",
    search: bool = False,
    scaling_nodes: list[int] | None = None,
    device_memory_gb: float | None = None,
    dry_run: bool = False,
    dry_run_rank: int | None = None,
    **_unused: Any,
) -> dict[str, Any]:
    """Plan the parsed recipe, print the result (text or JSON) and return it as a dict. With `dry_run`,
    also build one rank on the meta device (`mula.plan.dry_run`); exit status 1 when its bytes differ
    from the plan's."""
    inputs = plan_inputs(
        trainer, model, data, machine=load_machine(machine) if machine else None, nodes=nodes
    )
    if device_memory_gb is not None:
        inputs.device_bytes, inputs.device_note = int(device_memory_gb * GB), "--device_memory_gb"
    if dry_run_rank is not None and not dry_run:
        raise ValueError("--dry_run_rank chooses the rank of --dry_run; give --dry_run too.")
    result = plan_result(inputs)
    if dry_run:
        rank = default_dry_run_rank(inputs.layout, result["stage"]) if dry_run_rank is None else dry_run_rank
        check_dry_run(inputs, trainer, model, rank)
        from mula.plan import dry_run as dry  # torch and Lightning: only for --dry_run

        result["dry_run"] = dry.dry_run(inputs, trainer, model, rank)
    if scaling_nodes:
        result["scaling"] = scaling(inputs, nodes or int(trainer.get("num_nodes") or 1), scaling_nodes)
    if search:
        from mula.plan.search import search_layouts

        result["search"] = search_layouts(inputs)
    print(json.dumps(result, indent=2) if format == "json" else format_text(inputs, result))
    if dry_run and not dry.dry_run_matches(result["dry_run"]):
        raise SystemExit("mula plan: the dry run's bytes differ from the plan's (a bug: please report it).")
    return result


def default_dry_run_rank(layout: Layout, stage: int) -> int:
    """The first rank of pipeline stage `stage`: the layout's rank at that stage and index 0 of every
    other dimension (the strategy's rank order, `ParallelLayout.rank`)."""
    return layout.parallel.rank(pp=stage)


def check_dry_run(inputs: PlanInputs, trainer: dict[str, Any], model: dict[str, Any], rank: int) -> None:
    """One sentence (ValueError) when `--dry_run` cannot build `rank` of this plan, before any work."""
    world = inputs.layout.world_size
    if not 0 <= rank < world:
        raise ValueError(
            f"--dry_run_rank={rank} is not a rank of the planned {world} ranks (0 to {world - 1})."
        )
    strategy = trainer.get("strategy")
    if not isinstance(strategy, dict) or "class_path" not in strategy:
        raise ValueError(
            "--dry_run builds the recipe's strategy from its trainer.strategy.class_path; this recipe names "
            f"{strategy!r}."
        )
    if int(trainer.get("max_steps") or -1) <= 0 and model.get("decay_steps") is None:
        raise ValueError(
            "--dry_run builds the recipe's optimizer and learning-rate schedule, whose cosine ends at "
            "trainer.max_steps or model.decay_steps; this recipe sets neither (set one, as the paper recipes do)."
        )
    if not inputs.layout.shard_optimizer:
        raise ValueError(
            "--dry_run measures the sharded optimizer's buffers (torch's AdamW allocates its state only at "
            "the first step); set trainer.strategy.init_args.shard_optimizer=true."
        )


def plan_result(inputs: PlanInputs) -> dict[str, Any]:
    """The plan of `inputs` as the JSON object `mula plan --format json` prints."""
    mem = plan_memory(inputs.config, inputs.layout)
    host = inputs.host_fit(mem.host_bytes)
    time = (
        step_time(inputs.config, inputs.layout, inputs.machine, inputs.global_batch)
        if inputs.machine
        else None
    )
    return {
        "model": inputs.config.name,
        "layout": layout_summary(inputs.layout),
        "per_rank_bytes": mem.per_rank_bytes(),
        "param_tensor_bytes": mem.param_tensor_bytes,
        "host_bytes": mem.host_bytes,
        "stage": mem.stage,
        "activation_micro_batches": mem.activation_micro_batches,
        "device_bytes": inputs.device_bytes,
        "device": inputs.device_note,
        **host,
        "fits": mem.total <= inputs.device_bytes and host["host_fits"] is not False,
        "step_time_s": time.step_time_s if time else None,
        "tokens_per_s": time.tokens_per_s if time else None,
        "mfu": time.mfu if time else None,
        "step_time_parts_s": time.as_dict() if time else None,
        # bytes each pipeline rank (first stage first) sends per step, by collective (needs no machine)
        "comm_bytes_per_step": [dataclasses.asdict(v) for v in comm_volumes(inputs.config, inputs.layout)],
        # the same by kind of collective, bytes sent and received and calls: what `mula bench` measures
        "collective_bytes_per_step": planned_collectives(inputs.config, inputs.layout),
        "calibration": _calibration_summary(inputs.machine),
    }


def _calibration_summary(machine: Machine | None) -> dict[str, Any] | None:
    """Where a calibrated machine's prices come from and the error band its fits claim."""
    if machine is None or not machine.calibration:
        return None
    cal = machine.calibration
    keys = ("measured_at", "host", "world_size", "backend")
    return {k: cal.get(k) for k in keys} | {"error_band": error_band(machine)}


def layout_summary(layout: Layout) -> dict[str, Any]:
    """The layout fields a reader compares (JSON-friendly)."""
    keys = (
        "world_size",
        "ep_size",
        "pp_size",
        "pp_schedule",
        "tp_size",
        "cp_size",
        "micro_batch",
        "seq_len",
        "micro_batches",
        "precision",
        "checkpointing",
        "shard_optimizer",
        "zero_stage",
        "reduce_dtype",
        "offload",
    )
    return {k: getattr(layout, k) for k in keys}


def scaling(inputs: PlanInputs, base_nodes: int, node_counts: list[int]) -> list[dict[str, Any]]:
    """Weak (global batch grows with the ranks) and strong (fixed global batch) scaling efficiency from
    `base_nodes` to each of `node_counts`, for the recipe's layout on its machine."""
    if inputs.machine is None:
        raise ValueError("--scaling_nodes needs --machine (bandwidths and peak FLOP/s come from it).")
    per_node = inputs.machine.tiles_per_node
    base_layout = inputs.layout.replace(world_size=base_nodes * per_node)
    base = step_time(inputs.config, base_layout, inputs.machine, inputs.global_batch)
    rows = []
    for n in node_counts:
        w = n * per_node
        ratio = w / base_layout.world_size
        weak_batch = int(inputs.global_batch * ratio)
        weak = step_time(inputs.config, base_layout.replace(world_size=w), inputs.machine, weak_batch)
        dp = base_layout.replace(world_size=w).dp_size  # W / (P * T * C)
        strong_eff = None
        if inputs.global_batch >= base_layout.micro_batch * dp:  # every rank still has a micro-batch
            m = micro_batches_per_step(inputs.global_batch, dp, base_layout.micro_batch, check=False)
            strong = step_time(
                inputs.config,
                base_layout.replace(world_size=w, micro_batches=m),
                inputs.machine,
                inputs.global_batch,
            )
            strong_eff = base.step_time_s / strong.step_time_s / ratio
        rows.append(
            {
                "nodes": n,
                "ranks": w,
                "weak_efficiency": (weak.tokens_per_s / w) / (base.tokens_per_s / base_layout.world_size),
                "weak_tokens_per_s": weak.tokens_per_s,
                "strong_efficiency": strong_eff,
            }
        )
    return rows


def _gb(x: float) -> str:
    return f"{x / GB:8.2f} GB"


def format_text(inputs: PlanInputs, result: dict[str, Any]) -> str:
    """The human-readable plan."""
    lay, per = inputs.layout, result["per_rank_bytes"]
    opt = (
        f"sharded AdamW ZeRO-{lay.zero_stage} (reduce {lay.reduce_dtype}"
        + (", state on the host" if lay.offload else "")
        + (f", {lay.offload_tail_buckets} tail bucket(s) on the device" if lay.offload_tail_buckets else "")
        + ")"
        if lay.shard_optimizer
        else "replicated AdamW"
    )
    if lay.optimizer == "muon":  # the blocks' matrices train with Muon, the rest with AdamW
        opt = opt.replace("AdamW", "Muon + AdamW")
    lines = [
        f"mula plan: {inputs.config.name}, {lay.world_size} ranks ({inputs.device_note}): E={lay.ep_size}, "
        f"P={lay.pp_size} ({lay.pp_schedule}), "
        + (f"T={lay.tp_size}{' with SP' if lay.sequence_parallel else ''}, " if lay.tp_size > 1 else "")
        + (f"C={lay.cp_size} ({lay.local_seq_len} tokens per rank), " if lay.cp_size > 1 else "")
        + f"micro-batch {lay.micro_batch} x {lay.seq_len} tokens, "
        f"{lay.micro_batches} micro-batch(es) per step, {lay.precision}, checkpointing {lay.checkpointing}, {opt}",
        f"per rank (pipeline stage {result['stage']}):",
    ]
    for key in ("params", "grads", "optimizer", "activations", "buffers"):
        note = (
            f"  ({result['activation_micro_batches']} micro-batch(es) in flight)"
            if key == "activations"
            else ""
        )
        lines.append(f"  {key:<12}{_gb(per[key])}{note}")
    total, dev = per["total"], result["device_bytes"]
    verdict = "fits" if result["fits"] else "does NOT fit"
    margin = f"{(dev - total) / GB:.2f} GB free" if result["fits"] else f"{(total - dev) / GB:.2f} GB over"
    lines.append(f"  {'total':<12}{_gb(total)} of {dev / GB:.2f} GB: {verdict}, {margin}")
    if result["host_bytes"]:
        lines.append(
            f"  host (offloaded optimizer state, async checkpoint staging): {_gb(result['host_bytes'])} per rank"
        )
    if result["host_bytes"] and result["host_fits"] is not None:
        node, have = result["host_bytes_per_node"], result["host_memory_per_node"]
        verdict = "fits" if result["host_fits"] else "does NOT fit"
        lines.append(f"  host per node: {_gb(node)} of {have / GB:.2f} GB: {verdict}")
    rows = result["comm_bytes_per_step"]
    sent = [{k: v for k, v in r.items() if k != "grad_rounds" and not k.endswith("_calls")} for r in rows]
    busiest = max(sent, key=lambda r: sum(r.values()))
    lines.append(
        "sent per step (busiest rank): "
        + ", ".join(f"{k.replace('_', ' ')} {_gb(v).strip()}" for k, v in busiest.items())
    )
    calls = rows[sent.index(busiest)]
    lines.append(
        "messages per step (that rank): "
        + ", ".join(
            f"{k[: -len('_calls')].replace('_', ' ')} {v:,.0f}"
            for k, v in calls.items()
            if k.endswith("_calls")
        )
    )
    if result["step_time_s"] is not None:
        parts = result["step_time_parts_s"]
        lines.append(
            f"step time {result['step_time_s']:.3f} s (compute {parts['compute_s']:.3f}, all-to-all "
            f"{parts['all_to_all_s']:.3f}, grad sync {parts['grad_sync_s']:.3f}, param gather "
            f"{parts['param_gather_s']:.3f}, pipeline {parts['pipeline_s']:.3f}, tensor parallel "
            f"{parts['tensor_parallel_s']:.3f}, context parallel {parts['context_parallel_s']:.3f}, "
            f"update {parts['optimizer_s']:.3f}, loop {parts['loop_s']:.3f}), "
            f"{result['tokens_per_s']:,.0f} tokens/s, "
            f"MFU {100 * result['mfu']:.1f} %"
        )
        if result.get("calibration"):
            cal = result["calibration"]
            lines.append(
                f"priced with the calibration measured {cal['measured_at']} on {cal['host']} ({cal['world_size']} "
                f"ranks, {cal['backend']}): its latency/bandwidth curves fit their points within "
                f"+-{100 * cal['error_band']:.0f} %"
            )
    else:
        lines.append("step time: give --machine (peak FLOP/s and bandwidths come from a machine file)")
    for row in result.get("scaling", []):
        strong = "n/a" if row["strong_efficiency"] is None else f"{100 * row['strong_efficiency']:.1f} %"
        lines.append(
            f"scaling to {row['nodes']} nodes ({row['ranks']} ranks): weak {100 * row['weak_efficiency']:.1f} %, strong {strong}"
        )
    for row in result.get("search", []):
        lines.append("fits: " + ", ".join(f"{k}={v}" for k, v in row.items()))
    if "dry_run" in result:
        from mula.plan.dry_run import format_dry_run

        lines.append(format_dry_run(result["dry_run"]))
    return "\n".join(lines)


def memory_check_message(plan: MemoryPlan, device_bytes: int, device_note: str, layout: Layout) -> str | None:
    """One sentence when the plan does not fit the device (None when it fits)."""
    if plan.total <= device_bytes:
        return None
    parts = ", ".join(f"{k} {v / GB:.1f}" for k, v in plan.per_rank_bytes().items() if k != "total")
    tries = []
    if layout.precision not in ("bf16-true", "16-true"):
        tries.append("trainer.precision=bf16-true with the sharded optimizer")
    if layout.checkpointing != "full":
        tries.append("--model.activation_checkpointing=full (or [moe, attention])")
    if layout.micro_batch > 1:
        tries.append("a smaller data.micro_batch_size")
    if layout.shard_optimizer and layout.zero_stage == 1:
        tries.append("optimizer_options.zero_stage=2")
    tries.append("more ranks or expert parallelism (`mula plan --search` lists layouts that fit)")
    return (
        f"predicted {plan.total / GB:.1f} GB per rank on a {device_bytes / GB:.1f} GB device ({device_note}; {parts} GB "
        f"of params, grads, optimizer, activations, buffers): try {'; '.join(tries)}; or --memory_check=false to start anyway."
    )


def check_fit_memory(
    trainer: dict[str, Any],
    model: dict[str, Any],
    data: dict[str, Any],
    world_size: int,
    device_memory_gb: float | None,
) -> None:
    """The start-of-run check of `mula fit`: raise ValueError (exit 2) when the plan exceeds the device."""
    inputs = plan_inputs(trainer, model, data, world_size=world_size)
    if device_memory_gb is not None:
        inputs.device_bytes, inputs.device_note = int(device_memory_gb * GB), "--device_memory_gb"
    plan = plan_memory(inputs.config, inputs.layout)
    message = memory_check_message(plan, inputs.device_bytes, inputs.device_note, inputs.layout)
    if message is not None:
        raise ValueError(message)
