"""`mula bench`'s table: the rates of the timed steps, then memory per rank and the collectives' bytes per
step against `mula plan`."""

from __future__ import annotations

from typing import Any

from mula.units import format_count

MEMORY_ROWS = (
    ("params", "parameters", "params"),
    ("grads", "gradients (at the optimizer step)", "grads"),
    ("optimizer", "optimizer state", "optimizer"),
    ("activations", "activations (most saved for backward)", "activations"),
    ("peak_allocated", "peak allocated (device)", "total"),
)


def format_text(result: dict[str, Any]) -> str:
    """The result of `mula.bench.command` as the table `mula bench` prints."""
    layout = result["layout"]
    sizes = " ".join(f"{k[0].upper()}={layout[f'{k}_size']}" for k in ("ep", "pp", "tp", "cp"))
    times = result["step_time_s"]
    mfu = f"{100 * result['mfu']:.1f} %" if result["mfu"] is not None else "n/a (no peak for this device)"
    moe = f"{100 * result['moe_share']:.0f} %" if result["moe_share"] is not None else "n/a"
    lines = [
        f"mula bench: {result['model']} ({format_count(result['params'])} parameters, "
        f"{format_count(result['active_params'])} active), {result['world_size']} rank(s) on {result['device']}, "
        f"{sizes}, micro-batch {layout['micro_batch']} x {layout['seq_len']} tokens, {layout['micro_batches']} "
        f"micro-batch(es) per step, {result['precision']}{', compiled' if result['compiled'] else ''}, "
        f"checkpointing {layout['checkpointing']}",
        f"{len(result['step_times_s'])} optimizer steps timed after {result['warmup']} warm-up"
        + (
            f"; peak {result['peak_bf16_tflops']:g} TFLOP/s bf16 ({result['machine']})"
            if result["machine"]
            else ""
        ),
        "",
        "| tokens/s per device | step time (s), median [min-max] | model TFLOP/s per device | MFU | MoE layers' share "
        "| host syncs per step |",
        "|---|---|---|---|---|---|",
        f"| {result['tokens_per_s_per_device']:,.0f} | {times['median']:.4f} [{times['min']:.4f}-{times['max']:.4f}] "
        f"| {result['tflops_per_device']:.2f} | {mfu} | {moe} | {_per_step(result['host_syncs_per_step'])} |",
        "",
        host_sync_line(result),
        "",
        f"memory per rank, bytes (the largest rank of pipeline stage {result['planned_stage']}, the one "
        "`mula plan` reports; measured on the step after the timed ones):",
        "",
        "| | measured | `mula plan` | measured / planned |",
        "|---|---|---|---|",
    ]
    for key, label, planned_key in MEMORY_ROWS:
        if key not in result["memory"]:
            continue
        measured, planned = result["memory"][key], result["planned"][planned_key]
        ratio = f"{measured / planned:.3f}" if planned else "n/a"
        label = f"{label} vs planned total" if key == "peak_allocated" else label
        lines.append(f"| {label} | {measured:,} | {planned:,} | {ratio} |")
    return "\n".join([*lines, "", *collective_lines(result)])


def _per_step(value: float | None) -> str:
    return "n/a" if value is None else f"{value:g}"


def host_sync_line(result: dict[str, Any]) -> str:
    """Where the host-sync figure comes from: the steps counted (logging steps excluded), rank 0's syncs by
    op and by `to_host` reason, and what CPU-only code its mark kept out of the count."""
    syncs = result["host_syncs"]
    if result["host_syncs_per_step"] is None:
        why = (
            "not measured for compiled models"
            if syncs["compiled"]
            else f"every step's window holds a logging step (log_every_n_steps={syncs['log_every_n_steps']})"
        )
        return f"host syncs per step: n/a ({why})"
    parts = [f"{k} {v:g}" for kind in ("ops", "reads") for k, v in syncs[kind].items()]
    excluded = ", ".join(f"{k} {v:g}" for k, v in syncs["excluded"].items())
    return (
        f"host syncs per step: {result['host_syncs_per_step']:g}, the largest rank's mean over steps "
        f"{' and '.join(map(str, syncs['steps']))} after the timed ones (logging steps excluded, "
        f"log_every_n_steps={syncs['log_every_n_steps']}, and the step after each, which hands its metrics "
        "to the loggers); "
        f"rank 0: {', '.join(parts) or 'none'}"
        + (f"; CPU-only code excluded by its mark, not counted: {excluded}" if excluded else "")
    )


def collective_lines(result: dict[str, Any]) -> list[str]:
    """The table "collective bytes per step (measured vs planned)": per kind of collective that moved or
    was planned to move anything, the largest rank's bytes sent and received and calls per counted step
    beside the plan's largest pipeline stage, and how many ranks moved exactly their stage's plan."""
    largest, detail = result["collective_bytes_per_step"], result["collectives"]
    if largest is None:
        return [f"collective bytes per step: n/a ({detail['not_measured']})"]
    measured, planned, matched = largest["measured"], largest["planned"], largest["ranks_as_planned"]
    ranks = len(detail["per_rank"])
    lines = [
        f"collective bytes per step (measured vs planned): the largest rank's mean over steps "
        f"{' and '.join(map(str, detail['steps']))}, by kind of collective (bus bytes, `mula.bench.collectives`), "
        "beside `mula plan`'s largest pipeline stage:",
        "",
        "| collective | sent | planned | received | planned | calls | planned | ranks as planned |",
        "|---|---|---|---|---|---|---|---|",
    ]
    kinds = [k for k in measured["calls"] if measured["calls"][k] or planned["calls"][k]]
    for k in kinds:
        cells = [f"{measured[w][k]:,.0f} | {planned[w][k]:,.0f}" for w in ("sent", "received", "calls")]
        lines.append(f"| {k} | {' | '.join(cells)} | {matched[k]}/{ranks} |")
    if not kinds:
        lines.append("| (none: one rank) | 0 | 0 | 0 | 0 | 0 | 0 | - |")
    return lines
