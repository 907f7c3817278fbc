"""From a parsed `mula fit` configuration (the `trainer`, `model` and `data` sections, as plain dicts) to
the planner's inputs: the model config, the `Layout`, the global batch and the device's memory.

`mula plan` and the start-of-run check of `mula fit` both go through `plan_inputs`, so they read a
recipe the same way. Strategy settings are read from `trainer.strategy`'s init_args with
`XPUMoEStrategy`'s defaults, read from its `__init__` signature (`recipe_reader.signatures`, torch-
free), and `optimizer_options` with `ShardingOptions`' (through `Layout`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from mula.layout.rules import micro_batches_per_step
from mula.layout.sharding_options import ShardingOptions
from mula.model.config import MulaConfig, resolve_config
from mula.plan.layout import SHARDING_FIELDS, Layout, check_runnable
from mula.plan.machines import Machine
from mula.plan.recipe_reader import signatures

# the XPUMoEStrategy arguments the planner reads (their defaults come from its signature)
_STRATEGY_ARGS = ("expert_parallel_size", "shard_optimizer", "pipeline_parallel_size", "pipeline_schedule",
                  "pipeline_virtual_stages", "pipeline_stage_layers", "optimizer_options",
                  "tensor_parallel_size", "sequence_parallel", "context_parallel_size")  # fmt: skip


@dataclass
class PlanInputs:
    """Everything a plan needs: model, layout, global batch (sequences), device memory and where it came from."""

    config: MulaConfig
    layout: Layout
    global_batch: int
    device_bytes: int
    device_note: str
    machine: Machine | None

    def host_fit(self, host_bytes: int) -> dict[str, Any]:
        """Host memory of a node's ranks (`host_bytes` each: an offloaded optimizer's) against the
        machine's host memory per node: host_bytes_per_node, host_memory_per_node (None when no machine
        file says) and host_fits (None when unknown)."""
        machine = self.machine
        have = machine.host_bytes_per_node if machine is not None else None
        ranks = min(machine.tiles_per_node, self.layout.world_size) if machine is not None else 1
        node = host_bytes * ranks
        return {
            "host_bytes_per_node": node,
            "host_memory_per_node": have,
            "host_fits": None if have is None else node <= have,
        }


def _strategy(trainer: dict[str, Any]) -> dict[str, Any] | None:
    """XPUMoEStrategy's settings (defaults filled in), or None for another strategy."""
    strategy = trainer.get("strategy") or "auto"
    if isinstance(strategy, str):
        if strategy != "xpu_moe":
            return None
        strategy = {}
    elif "XPUMoEStrategy" not in str(strategy.get("class_path", "")):
        return None
    defaults = signatures()["strategy"]
    return {**{name: defaults[name] for name in _STRATEGY_ARGS}, **(strategy.get("init_args") or {})}


def _async_checkpoint(trainer: dict[str, Any]) -> bool:
    """Whether the recipe's `callbacks.FaultTolerantCheckpoint` saves asynchronously (`async_save`) with a
    strategy that can (XPUMoEStrategy): its staging copy lives in host memory."""
    callbacks = trainer.get("callbacks") or []
    callbacks = callbacks if isinstance(callbacks, list) else [callbacks]
    return _strategy(trainer) is not None and any(
        isinstance(c, dict)
        and str(c.get("class_path", "")).endswith("FaultTolerantCheckpoint")
        and bool((c.get("init_args") or {}).get("async_save", False))
        for c in callbacks
    )


def _local_device_type(accelerator: Any) -> str:
    """The device `trainer.accelerator` resolves to on this machine."""
    name = str(accelerator or "auto")
    if name in ("cpu", "cuda", "xpu"):
        return name
    if name == "gpu":
        return "cuda"
    import torch  # only to look for this machine's devices: a plan for --machine never imports it

    from mula.torch_compat import xpu_available

    if xpu_available():
        return "xpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def _devices_per_node(devices: Any, device_type: str) -> int:
    """`trainer.devices` as a count ("auto": every device of this machine, one process on CPU)."""
    if isinstance(devices, (list, tuple)):
        return len(devices)
    if devices in (None, "auto", -1, "-1"):
        if device_type == "cpu":
            return 1
        import torch

        return getattr(torch, device_type).device_count()
    if isinstance(devices, str) and "," in devices:
        return len([d for d in devices.split(",") if d.strip()])
    return int(devices)


def _check_local_device(device_type: str) -> None:
    """Planning without --machine reads this machine's devices: refuse a device type it does not have."""
    if device_type in ("cuda", "xpu"):
        import torch

        if not getattr(torch, device_type).is_available():
            raise ValueError(
                f"the recipe runs on {device_type} devices, which this machine does not have; plan for the "
                f"machine that has them with --machine (e.g. --machine recipes/machines/aurora.yaml)."
            )


def local_device_bytes(device_type: str, local_ranks: int) -> tuple[int, str]:
    """(bytes, description) of one device of this machine; on CPU the host RAM shared by its ranks."""
    if device_type in ("cuda", "xpu"):
        import torch

        props = getattr(torch, device_type).get_device_properties(0)
        return int(props.total_memory), f"{device_type} device {props.name}"
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return ram // max(1, local_ranks), f"CPU: host RAM divided over {local_ranks} local rank(s)"


def plan_inputs(
    trainer: dict[str, Any],
    model: dict[str, Any],
    data: dict[str, Any],
    *,
    machine: Machine | None = None,
    nodes: int | None = None,
    world_size: int | None = None,
) -> PlanInputs:
    """Read a parsed recipe. With `machine`, plan for `nodes` of it (default: the recipe's num_nodes) at
    one rank per device; without, for the recipe's own trainer settings on this machine (`world_size`
    overrides the ranks, as a running Trainer knows them)."""
    config = resolve_config(model.get("config", "mula-tiny-moe"), model.get("overrides"))
    num_nodes = int(nodes or trainer.get("num_nodes") or 1)
    if machine is not None:
        device_type, per_node = machine.device_type, machine.tiles_per_node
        device_bytes, note = machine.device_bytes, f"{machine.name} tile"
    else:
        device_type = _local_device_type(trainer.get("accelerator"))
        _check_local_device(device_type)
        per_node = _devices_per_node(trainer.get("devices"), device_type)
        device_bytes, note = local_device_bytes(device_type, per_node)
    world = world_size or per_node * num_nodes
    strategy = _strategy(trainer)
    micro, seq = int(data.get("micro_batch_size") or 1), int(data.get("seq_len") or 2048)
    global_batch = int(data.get("global_batch_size") or micro * world)
    kwargs: dict[str, Any] = {}
    if strategy is not None:
        options = strategy.get("optimizer_options") or {}
        ShardingOptions.from_kwargs(**options)  # the sentence the optimizer would stop with
        kwargs = {
            "ep_size": int(strategy["expert_parallel_size"]),
            "shard_optimizer": bool(strategy["shard_optimizer"]),
            "pp_size": int(strategy["pipeline_parallel_size"]),
            "pp_schedule": strategy["pipeline_schedule"],
            "pp_virtual_stages": int(strategy["pipeline_virtual_stages"]),
            "pp_stage_layers": strategy["pipeline_stage_layers"],
            "tp_size": int(strategy["tensor_parallel_size"]),
            "sequence_parallel": bool(strategy["sequence_parallel"]),
            "cp_size": int(strategy["context_parallel_size"]),
            **{name: options[name] for name in SHARDING_FIELDS if name in options},
        }
        if kwargs.get("collectives", "auto") == "auto":
            kwargs["collectives"] = "rooted" if device_type == "cpu" else "native"
    layout = Layout(
        world_size=world,
        micro_batch=micro,
        seq_len=seq,
        precision=str(trainer.get("precision") or "32-true"),
        checkpointing=model.get("activation_checkpointing") or "none",
        device_type=device_type,
        no_decay=list(model.get("no_decay") or ["embed.weight"]),
        optimizer=str(model.get("optimizer") or "adamw"),
        muon_ns_steps=int(model.get("muon_ns_steps") or 5),
        muon_ns_dtype=str(model.get("muon_ns_dtype") or "bfloat16"),
        async_checkpoint=_async_checkpoint(trainer),
        **kwargs,
    )
    # the step's micro-batches on each of the layout's data-parallel ranks (W / (P * T * C))
    layout = layout.replace(
        micro_batches=micro_batches_per_step(global_batch, layout.dp_size, micro, check=False)
    )
    check_runnable(config, layout, global_batch)
    return PlanInputs(config, layout, global_batch, device_bytes, note, machine)
