"""Expert-parallel state in sharded checkpoints: which tensors a rank contributes, and loading them back.

The directory format (DCP shards + `meta.pt`) is `mula.checkpoint.sharded`; this module decides what
goes into it for `XPUMoEStrategy`:

* "state_dict": the LightningModule's state dict under its usual keys. Dense tensors are saved once
  (DCP de-duplicates replicas). Each stacked expert tensor is saved as one *global* [E_total, ...]
  tensor: a DTensor sharded on dim 0 over the EP mesh dimension and replicated over EDP, so expert g
  is stored at row g whatever the layout it was saved from, and DCP reads any other layout's rows.
* "optimizer_0": the optimizer state in a layout that reshards the same way -- the sharded
  optimizer's own `sharded_state_dict()`, or for a plain torch optimizer its per-parameter state keyed
  by parameter name with expert moments wrapped like the weights.

Tensor-parallel parameters and their AdamW moments are DTensors already and go in as the global
tensors they are. So a run saved at (W=4, E=4) resumes at (W=2, E=2), at W=1, or the reverse, and one
saved at T=2 resumes at T=1 and the reverse.
`mula.checkpoint.consolidate_checkpoint` turns the directory into a single-file checkpoint.
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn

from mula.checkpoint.sharded import (
    DCP_METADATA_FILE,
    MODEL_KEY,
    SHARDED_META_FILE,
    is_sharded_checkpoint,
    read_sharded_meta,
    saved_keys,
    start_sharded_write,
    write_sharded_checkpoint,
)
from mula.model.moe import is_expert_param
from mula.training.strategy_contract import ShardedOptimizer
from strategies.topology import LayoutMesh, gather_groups_over_stages, names_cover


def expert_mesh(topology: LayoutMesh) -> Any:
    """The 2-D (edp, ep) sub-mesh of the job's mesh describing where expert rows live: this rank's
    stage (None when E = 1: experts are whole). Expert g of a layer is row g whatever (W, E, P)."""
    if topology.size("ep") == 1:
        return None
    if topology.mesh() is None:
        raise ValueError("Expert parallelism needs a topology built from the job's DeviceMesh.")
    return topology.mesh()["edp", "ep"]


def _as_global(tensor: Tensor, mesh: Any) -> Any:
    """Wrap a local expert slice [E_local, ...] as the global [E_total, ...] tensor it is a part of."""
    if mesh is None:
        return tensor
    from torch.distributed.tensor import DTensor, Replicate, Shard

    return DTensor.from_local(tensor, mesh, [Replicate(), Shard(0)], run_check=False)


def model_state(module: nn.Module, mesh: Any) -> dict[str, Any]:
    """The module's state dict with expert tensors as global DTensors; values alias the live tensors
    (detached), so `dcp.load` into it loads the model in place."""
    out: dict[str, Any] = {}
    for name, value in module.state_dict(keep_vars=True).items():
        tensor = value.detach()
        out[name] = _as_global(tensor, mesh) if is_expert_param(name) else tensor
    return out


def plain_optimizer_state(
    optimizer: torch.optim.Optimizer, names: dict[int, str], mesh: Any, topology: LayoutMesh
) -> dict[str, Any]:
    """A torch optimizer's per-parameter state keyed by parameter name, expert moments as global tensors."""
    state: dict[str, Any] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = names[id(p)]
            entry = {}
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, Tensor) and value.dim() > 0 and is_expert_param(name):
                    value = _as_global(value, mesh)
                entry[key] = value
            if entry:
                state[name] = entry
    # A tuple is a leaf for DCP: the hyperparameters are stored as one small pickled object.
    groups = tuple(
        gather_groups_over_stages(
            [
                {
                    **{k: v for k, v in g.items() if k != "params"},
                    "param_names": [names[id(p)] for p in g["params"]],
                }
                for g in optimizer.param_groups
            ],
            topology,
        )
    )
    return {"state": state, "param_groups": groups}


def _plain_optimizer_template(
    optimizer: torch.optim.Optimizer, names: dict[int, str], mesh: Any, saved_keys: set[str]
) -> dict[str, Any]:
    """Tensors to load a plain optimizer's saved state into (allocated where the state is still empty)."""
    state: dict[str, Any] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = names[id(p)]
            kinds = sorted(
                k.rsplit(".", 1)[1] for k in saved_keys if k.startswith(f"optimizer_0.state.{name}.")
            )
            if not kinds:
                continue
            current = optimizer.state.setdefault(p, {})
            for kind in kinds:
                if kind not in current:
                    # AdamW-style state: scalar `step`, moments shaped like the parameter
                    current[kind] = (
                        torch.zeros((), dtype=torch.float32) if kind == "step" else torch.zeros_like(p)
                    )
            state[name] = {
                k: (_as_global(v, mesh) if v.dim() > 0 and is_expert_param(name) else v)
                for k, v in current.items()
                if k in kinds
            }
    return {"state": state, "param_groups": None}  # None: filled with the saved tuple by dcp.load


def checkpoint_parts(checkpoint: dict[str, Any], layout: Any, world_size: int, module: Any) -> list[Any]:
    """What `XPUMoEStrategy` saves of `checkpoint`: the optimizer states, taken out of it, and the
    metadata recording the `layout` (a `ParallelLayout`) over `world_size` ranks it was saved at, with
    the `module`'s trainer's `accumulate_grad_batches`."""
    optimizer_states = checkpoint.pop("optimizer_states", [])
    trainer = module.trainer if module is not None else None
    checkpoint["xpu_moe_layout"] = {
        "world_size": world_size,
        "expert_parallel_size": layout.ep,
        "pipeline_parallel_size": layout.pp,
        "tensor_parallel_size": layout.tp,
        "context_parallel_size": layout.cp,
        "accumulate_grad_batches": None if trainer is None else trainer.accumulate_grad_batches,
    }
    return optimizer_states


def save_sharded(
    path: Path, checkpoint: dict[str, Any], optimizer_states: list[Any], is_global_zero: bool
) -> None:
    """Write a sharded checkpoint directory (collective). `checkpoint["state_dict"]` comes from
    `model_state`; the rest of `checkpoint` (Lightning's loops, schedulers, ...) goes to meta.pt."""
    state = {MODEL_KEY: checkpoint.pop(MODEL_KEY)}
    state.update({f"optimizer_{i}": s for i, s in enumerate(optimizer_states)})
    write_sharded_checkpoint(path, state, checkpoint, is_global_zero)


def start_save_sharded(
    path: Path, checkpoint: dict[str, Any], optimizer_states: list[Any], is_global_zero: bool, group: Any
) -> Future:
    """`save_sharded` in the background (`mula.checkpoint.sharded.start_sharded_write`): the tensors are
    staged to host memory before this returns; the future completes when this rank's files are written."""
    state = {MODEL_KEY: checkpoint.pop(MODEL_KEY)}
    state.update({f"optimizer_{i}": s for i, s in enumerate(optimizer_states)})
    return start_sharded_write(path, state, checkpoint, is_global_zero, group)


def load_sharded(
    path: Path,
    module: nn.Module,
    mesh: Any,
    optimizers: list[torch.optim.Optimizer],
    names: dict[int, str],
    weights_only: bool | None = None,
) -> dict[str, Any]:
    """Load a sharded checkpoint into the (already parallelised) module and optimizers, in place.

    Works whatever (W, E) the checkpoint was saved at. Returns the Lightning metadata dict.
    """
    if not is_sharded_checkpoint(path):
        raise ValueError(
            f"{path} is not a sharded XPUMoEStrategy checkpoint directory (no {DCP_METADATA_FILE} and {SHARDED_META_FILE}); "
            "to start from a weights file use the module's init_weights instead."
        )
    saved = saved_keys(path)
    model = model_state(module, mesh)
    missing = sorted(k for k in model if f"{MODEL_KEY}.{k}" not in saved)
    if missing:
        raise ValueError(
            f"Checkpoint {path} has no entry for {len(missing)} model tensor(s), e.g. {missing[0]}."
        )
    state: dict[str, Any] = {MODEL_KEY: model}
    sharded_opts: dict[str, Any] = {}
    for i, opt in enumerate(optimizers):
        key = f"optimizer_{i}"
        if not any(k.startswith(key + ".") for k in saved):
            raise ValueError(
                f"Checkpoint {path} holds no optimizer state; resume it with fit from weights instead."
            )
        if isinstance(opt, ShardedOptimizer):
            if not any(k.startswith(f"{key}.step") for k in saved):
                raise ValueError(
                    f"Checkpoint {path} was saved without shard_optimizer; resume with shard_optimizer=False."
                )
            sharded_opts[key] = state[key] = opt.sharded_state_dict()
            # checked before dcp.load, which would fail on the first missing key with a dump of every
            # rank's traceback (a CheckpointException, a BaseException): AdamW's state into Muon or back
            absent = next(
                (
                    (entry.name, kind)
                    for entry in opt.entries
                    for kind in opt.state_kinds(entry)
                    if f"{key}.state.{entry.name}.{kind}" not in saved
                ),
                None,
            )
            if absent is not None:
                raise ValueError(
                    f"Checkpoint {path} has no optimizer {absent[1]} for parameter {absent[0]}: it was saved "
                    "by another optimizer, and model.optimizer must be the one the checkpoint was trained with."
                )
        else:
            if any(k.startswith(f"{key}.step") for k in saved):
                raise ValueError(
                    f"Checkpoint {path} was saved with shard_optimizer; resume with shard_optimizer=True."
                )
            state[key] = _plain_optimizer_template(opt, names, mesh, saved)
    dcp.load(state, checkpoint_id=path)
    for i, opt in enumerate(optimizers):
        key = f"optimizer_{i}"
        if key in sharded_opts:
            opt.load_sharded_state_dict(sharded_opts[key])
        else:
            _apply_param_groups(opt, state[key]["param_groups"], path, names)
    return read_sharded_meta(path, weights_only=weights_only is not False)


def _apply_param_groups(
    optimizer: torch.optim.Optimizer, groups: Any, path: Path, names: dict[int, str]
) -> None:
    """Restore a plain optimizer's hyperparameters (lr, betas, ...) saved next to its state."""
    if groups is None or len(groups) < len(optimizer.param_groups):
        raise ValueError(f"Checkpoint {path} has a different number of optimizer param groups.")
    mine_names = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    if not names_cover([list(g["param_names"]) for g in groups], mine_names):
        raise ValueError(f"Checkpoint {path} optimizer param groups name other parameters than this model's.")
    for mine, theirs in zip(optimizer.param_groups, groups):
        mine.update({k: v for k, v in theirs.items() if k not in ("params", "param_names")})


def rescale_loop_progress(meta: dict[str, Any], accumulate_grad_batches: int) -> None:
    """Make Lightning's restored micro-batch counters agree with this run's gradient accumulation.

    Lightning decides where an optimizer step ends from the number of micro-batches it has seen in
    the epoch. Resuming at another world size changes micro-batches per step (accumulate_grad_batches
    = global / (W * micro)), so the counters saved at the old layout are converted: k steps of A_old
    micro-batches become k steps of A_new. Counters that are not whole steps are left alone.
    """
    layout = meta.get("xpu_moe_layout") or {}
    old = layout.get("accumulate_grad_batches")
    progress = meta.get("loops", {}).get("fit_loop", {}).get("epoch_loop.batch_progress")
    if not old or old == accumulate_grad_batches or progress is None:
        return
    counters = [progress[part] for part in ("total", "current") if part in progress]
    if any(v % old for c in counters for v in c.values()):
        return  # saved mid-accumulation: nothing consistent to convert to
    for c in counters:
        for key, value in c.items():
            c[key] = value // old * accumulate_grad_batches
