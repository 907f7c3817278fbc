"""A PNG of each task's accuracy over training tokens seen, from a run's `<checkpoint>.eval.json` records."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# plotted per task (lm-eval's acc and acc_norm; OLMo's acc, len_norm or f1); perplexity tasks have none
# and are not plotted
ACCURACY_METRICS = ("acc", "acc_norm", "len_norm", "f1")
NORMALISED = ("acc_norm", "len_norm")  # drawn dashed


def accuracy_series(records: list[dict[str, Any]]) -> dict[str, list[tuple[float, float]]]:
    """{"<task> <metric>": [(x, value), ...]} with x = tokens seen (the step where tokens are not recorded).

    Records without a step (a weights file) are left out; points are sorted by x.
    """
    use_tokens = all(r.get("tokens_seen") is not None for r in records)
    series: dict[str, list[tuple[float, float]]] = {}
    for record in records:
        if record.get("step") is None:
            continue
        x = record["tokens_seen"] if use_tokens else record["step"]
        for task, entry in record["tasks"].items():
            for metric in ACCURACY_METRICS:
                if metric in entry["metrics"]:
                    series.setdefault(f"{task} {metric}", []).append((x, entry["metrics"][metric]))
    return {name: sorted(points) for name, points in sorted(series.items())}


def plot_accuracy(records: list[dict[str, Any]], path: Path) -> bool:
    """Write the plot to `path` (PNG); False, and nothing written, when there is no point to plot."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    series = accuracy_series(records)
    if not series:
        return False
    use_tokens = all(r.get("tokens_seen") is not None for r in records)
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    FigureCanvasAgg(fig)  # no pyplot: no global figure state, no display needed
    ax = fig.add_subplot()
    for name, points in series.items():
        xs, ys = zip(*points)
        ax.plot(xs, ys, marker="o", linestyle="--" if name.endswith(NORMALISED) else "-", label=name)
    ax.set_xlabel("training tokens seen" if use_tokens else "optimizer step")
    ax.set_ylabel("accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return True
