"""`mula report RUN_DIR`: a run's plots as PNG files from its CSV files alone (no W&B needed).

Reads `metrics.csv` (Lightning's CSVLogger: a `step` column, one column per metric, empty cells where
a row does not log a metric) and, for MoE runs with the `ExpertLoad` callback, `moe_load.csv` (step,
layer, expert, tokens). Writes one PNG per subject that the run logged: losses, learning rate,
tokens/s, MFU, the expert load heatmap (`plot_expert_load`, also what the callback saves during
training), the fraction of choices an expert capacity dropped (`moe/.../dropped_fraction`), and the downstream evaluations `DownstreamEval` logged in-loop (`DOWNSTREAM_PLOTS`): each task's
accuracy (`eval/<task>/acc`, `acc_norm`, OLMo's `len_norm`) and OLMo's bits per byte of the answers
(`eval/<task>/bpb`). matplotlib runs on its Agg backend: no display is needed.
"""

from __future__ import annotations

import csv
import os
import re
from collections import defaultdict
from pathlib import Path

from mula.downstream.plot import ACCURACY_METRICS

METRICS_FILE = "metrics.csv"
LOAD_FILE = "moe_load.csv"
LOAD_COLUMNS = ("step", "layer", "expert", "tokens")
# with an expert capacity: each MoE layer's fraction of dropped choices per logged step (`ExpertLoad`)
DROPPED_FILE = "moe_dropped.csv"
DROPPED_COLUMNS = ("step", "layer", "dropped_fraction")

# file name -> (title, y label, metric keys drawn on it)
PLOTS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "losses.png": (
        "Losses",
        "loss",
        ("train/loss", "train/ce_loss", "val/loss", "train/aux_loss", "train/z_loss"),
    ),
    "lr.png": ("Learning rate", "lr", ("train/lr",)),
    "tokens_per_sec.png": ("Throughput", "tokens/s", ("train/tokens_per_sec",)),
    "mfu.png": ("Model FLOPs utilisation", "MFU", ("train/mfu",)),
}
# metric suffix -> (title, y label) of `<suffix>.png`, which draws every `moe/...<suffix>` metric (each layer's)
MOE_SUFFIX_PLOTS: dict[str, tuple[str, str]] = {
    "load_imbalance": ("Load imbalance (max / mean tokens per expert)", "ratio"),
    "dropped_fraction": ("Choices dropped by the expert capacity", "fraction"),
}
# file name -> (title, y label, the metrics `eval/<task>/<metric>` drawn on it, every task's)
DOWNSTREAM_PLOTS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "downstream.png": ("Downstream evaluation (in-loop)", "accuracy", ACCURACY_METRICS),
    "downstream_bpb.png": ("Downstream bits per byte of the answers (in-loop)", "bits per byte", ("bpb",)),
}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, whatever the environment's display
    import matplotlib.pyplot as plt

    return plt


def find_metrics(run_dir: str | os.PathLike) -> Path:
    """metrics.csv of a run: `run_dir/metrics.csv`, else that of its newest `version_N` directory."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"Run directory {run_dir} does not exist.")
    if (run_dir / METRICS_FILE).is_file():
        return run_dir / METRICS_FILE
    versions = [
        (int(m.group(1)), p)
        for p in run_dir.iterdir()
        if (m := re.fullmatch(r"version_(\d+)", p.name)) and (p / METRICS_FILE).is_file()
    ]
    if not versions:
        raise FileNotFoundError(f"{run_dir} holds no {METRICS_FILE} (nor a version_N/{METRICS_FILE}).")
    return max(versions)[1] / METRICS_FILE


def read_metrics(path: str | os.PathLike) -> dict[str, list[tuple[int, float]]]:
    """metrics.csv -> {metric: [(step, value), ...]} in file order, empty cells skipped."""
    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            step = row.get("step", "")
            if not step:
                continue
            for key, value in row.items():
                if key != "step" and key is not None and value not in ("", None):
                    series[key].append((int(float(step)), float(value)))
    return dict(series)


def read_expert_load(path: str | os.PathLike) -> dict[int, dict[int, dict[int, int]]]:
    """moe_load.csv -> {step: {layer: {expert: tokens}}}."""
    load: dict[int, dict[int, dict[int, int]]] = defaultdict(lambda: defaultdict(dict))
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            load[int(row["step"])][int(row["layer"])][int(row["expert"])] = int(row["tokens"])
    return load


def plot_series(series: dict[str, list[tuple[int, float]]], title: str, ylabel: str, path: Path) -> None:
    """One line per metric against the optimizer step."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    for key, points in series.items():
        steps, values = zip(*points)
        ax.plot(steps, values, label=key, marker="." if len(points) < 30 else None)
    ax.set(title=title, xlabel="step", ylabel=ylabel)
    ax.grid(alpha=0.3)
    if len(series) > 1:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_expert_load(load_csv: str | os.PathLike, path: str | os.PathLike) -> Path:
    """Heatmap PNG of moe_load.csv: the last step's layer x expert load, and every expert's load over steps.

    Load is tokens / mean tokens per expert of the layer (1 = its fair share); the second panel has one
    column per (layer, expert), layer-major, and one row per logged step.
    """
    import numpy as np

    load = read_expert_load(load_csv)
    if not load:
        raise ValueError(f"{load_csv} holds no expert counts.")
    steps = sorted(load)
    layers = sorted({layer for s in steps for layer in load[s]})
    experts = sorted({e for s in steps for layer in load[s].values() for e in layer})
    grid = np.zeros((len(steps), len(layers), len(experts)))
    for i, s in enumerate(steps):
        for j, layer in enumerate(layers):
            for k, e in enumerate(experts):
                grid[i, j, k] = load[s].get(layer, {}).get(e, 0)
    share = grid / np.maximum(grid.mean(axis=2, keepdims=True), 1e-9)
    plt = _pyplot()
    fig, (now, history) = plt.subplots(1, 2, figsize=(12, 4.5), dpi=100)
    vmax = max(2.0, float(share.max()))
    im = now.imshow(share[-1], aspect="auto", cmap="viridis", vmin=0.0, vmax=vmax)
    now.set(title=f"Expert load at step {steps[-1]} (tokens / mean)", xlabel="expert", ylabel="layer")
    now.set_yticks(range(len(layers)), [str(layer) for layer in layers])
    fig.colorbar(im, ax=now)
    flat = share.reshape(len(steps), -1)
    history.imshow(
        flat,
        aspect="auto",
        cmap="viridis",
        vmin=0.0,
        vmax=vmax,
        interpolation="nearest",
        extent=(-0.5, flat.shape[1] - 0.5, steps[-1], steps[0]),
    )
    history.set(
        title="Load over steps (experts, layer by layer)", xlabel="layer x experts + expert", ylabel="step"
    )
    for j in range(1, len(layers)):
        history.axvline(j * len(experts) - 0.5, color="white", linewidth=0.5)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


def _eval_metric(key: str) -> str | None:
    """The metric of a downstream evaluation key `eval/<task>/<metric>` (None for any other key)."""
    parts = key.split("/")
    return parts[-1] if len(parts) >= 3 and parts[0] == "eval" else None


def write_report(run_dir: str | os.PathLike, output: str | os.PathLike | None = None) -> list[Path]:
    """Write the run's plots into `output` (default `<metrics dir>/plots`); returns the PNG paths."""
    metrics = find_metrics(run_dir)
    series = read_metrics(metrics)
    if not series:
        raise ValueError(f"{metrics} holds no metrics yet.")
    out = Path(output) if output is not None else metrics.parent / "plots"
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, (title, ylabel, keys) in PLOTS.items():
        drawn = {k: series[k] for k in keys if series.get(k)}
        if drawn:
            plot_series(drawn, title, ylabel, out / name)
            written.append(out / name)
    for suffix, (title, ylabel) in MOE_SUFFIX_PLOTS.items():
        drawn = {k: v for k, v in series.items() if k.startswith("moe/") and k.endswith(suffix)}
        if drawn:
            plot_series(drawn, title, ylabel, out / f"{suffix}.png")
            written.append(out / f"{suffix}.png")
    for name, (title, ylabel, names) in DOWNSTREAM_PLOTS.items():
        drawn = {k: v for k, v in series.items() if _eval_metric(k) in names}
        if drawn:
            plot_series(drawn, title, ylabel, out / name)
            written.append(out / name)
    load_csv = metrics.parent / LOAD_FILE
    if load_csv.is_file() and load_csv.stat().st_size > 0:
        written.append(plot_expert_load(load_csv, out / "expert_load.png"))
    return written
