"""`mula fit`'s check of the light recipe reader against jsonargparse, once per run: the planner inputs
each parse gives, compared (`reader_mismatch`). Beside both the reader (`recipe_reader.py`) and the
planner's inputs (`settings.py`, which reads the strategy's defaults through the reader), so neither
of those two imports the other back.
"""

from __future__ import annotations

from typing import Any

from mula.plan import recipe_reader
from mula.plan.settings import plan_inputs


def reader_mismatch(
    argv: list[str], parsed: dict[str, dict[str, Any]], options: list[str], world_size: int
) -> str | None:
    """None when this reader reads the `mula fit` command line `argv` (without `fit`) into the planner
    inputs jsonargparse's `parsed` sections (trainer, model, data) give, or leaves `argv` to the full
    parser; otherwise one sentence naming the inputs that differ: a bug in this reader.

    `options`: the other top-level options of `mula fit` (`--ckpt_path`, ...), which the planner ignores.
    """
    light = recipe_reader.read_plan_command(argv, {name: (object, None) for name in options})
    if light is None:
        return None
    ours, theirs = planner_view(light, world_size), planner_view(parsed, world_size)
    differ = sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
    if not differ:
        return None
    shown = "; ".join(f"{k}: {ours.get(k)!r} here, {theirs.get(k)!r} in mula fit" for k in differ[:5])
    return (
        f"bug in mula's recipe reader (mula/plan/recipe_reader.py): it reads this command line differently "
        f"from jsonargparse ({shown}), so `mula plan` with it plans other settings than `mula fit` runs; "
        f"please report it with the command line. mula fit itself uses jsonargparse's parse."
    )


def planner_view(sections: dict[str, dict[str, Any]], world_size: int) -> dict[str, Any]:
    """What the planner takes from parsed trainer/model/data sections, flat: the model config's and the
    layout's fields, the global batch (or the sentence the planner refuses them with)."""
    try:
        inputs = plan_inputs(sections["trainer"], sections["model"], sections["data"], world_size=world_size)
    except (ValueError, TypeError) as e:
        return {"error": f"{type(e).__name__}: {e}"}
    view: dict[str, Any] = {"global_batch": inputs.global_batch}
    for name in ("config", "layout"):
        view.update({f"{name}.{k}": v for k, v in vars(getattr(inputs, name)).items()})
    return view
