"""The checkpoints of `XPUMoEStrategy` (its `ShardedCheckpointIO` member): sharded DCP directories that
reshard across layouts.

Every rank writes its part of one directory (`strategies/sharded_state.py` says what each rank
contributes, `mula/checkpoint/sharded.py` writes it), synchronously or staged to host memory and written
in the background; a checkpoint saved at any (W, E) loads into this layout, weights and optimizer state
in place (so Lightning's own restore of them is a no-op).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning.pytorch.core.optimizer import LightningOptimizer

from mula.checkpoint.settle import settle
from mula.layout.parallel_layout import ParallelLayout
from mula.training.strategy_contract import ShardedOptimizer
from strategies.sharded_state import (
    checkpoint_parts,
    load_sharded,
    model_state,
    plain_optimizer_state,
    rescale_loop_progress,
    save_sharded,
    start_save_sharded,
)


@dataclass(frozen=True)
class CheckpointState:
    """What a checkpoint reads of the strategy, taken when the hook is called."""

    module: Any  # the LightningModule: its parameters, its trainer
    optimizers: list[Any]  # the strategy's optimizers (Lightning's wrappers or not)
    sharded_optimizer: Any  # the `EPShardedAdamW` in use, else None
    mesh: Any  # the experts' device mesh (`strategies.sharded_state.expert_mesh`)
    topology: Any  # the layout's `LayoutMesh`
    layout: ParallelLayout
    world_size: int
    is_global_zero: bool


class ShardedCheckpointIO:
    """Save and load sharded DCP checkpoint directories (a member of XPUMoEStrategy).

    Input, stated at construction: `broadcast`, the strategy's collective that returns rank 0's object
    on every rank (a checkpoint's path is rank 0's). Each call takes the strategy's `CheckpointState`.
    It gives the model's state with experts as global tensors (`model_state`), each optimizer's state
    addressed by parameter name (`optimizer_state`), writes a directory synchronously (`save`) or staged
    to host memory and written in the background (`save_async`), and loads one saved at any layout in
    place (`load`).
    """

    def __init__(self, broadcast: Callable[[Any], Any]) -> None:
        self._broadcast = broadcast

    def model_state(self, state: CheckpointState) -> dict[str, Any]:
        """Model state with experts as global tensors (for DCP); aliases the live parameters."""
        if state.sharded_optimizer is not None:
            state.sharded_optimizer.wait_for_params()  # parameter all-gathers may still be in flight
        return model_state(state.module, state.mesh)

    def optimizer_state(self, state: CheckpointState, optimizer: Any) -> dict[str, Any]:
        """Optimizer state in a layout DCP can reshard (addressed by parameter name)."""
        optimizer = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        if isinstance(optimizer, ShardedOptimizer):
            return optimizer.sharded_state_dict()
        names = {id(p): n for n, p in state.module.named_parameters()}
        return plain_optimizer_state(optimizer, names, state.mesh, state.topology)

    def _parts(
        self, state: CheckpointState, checkpoint: dict[str, Any], filepath: Any
    ) -> tuple[Path, list[Any]]:
        """The directory (collective: rank 0's name wins) and the optimizer states taken out of `checkpoint`."""
        path = Path(self._broadcast(str(filepath)))
        return path, checkpoint_parts(checkpoint, state.layout, state.world_size, state.module)

    def save(self, state: CheckpointState, checkpoint: dict[str, Any], filepath: Any) -> None:
        """Write a sharded checkpoint directory at `filepath` (collective)."""
        path, optimizer_states = self._parts(state, checkpoint, filepath)
        save_sharded(path, checkpoint, optimizer_states, state.is_global_zero)

    def save_async(
        self, state: CheckpointState, checkpoint: dict[str, Any], filepath: Any, group: Any
    ) -> Future:
        """`save` in the background (collective): staged to host memory when this returns; the future
        completes when this rank's files are written. `group`: the writer's own gloo group."""
        path, optimizer_states = self._parts(state, checkpoint, filepath)
        return start_save_sharded(path, checkpoint, optimizer_states, state.is_global_zero, group)

    def load(self, state: CheckpointState, checkpoint_path: Any, weights_only: bool | None) -> dict[str, Any]:
        """Load a sharded checkpoint saved at any (W, E) into this layout; returns Lightning's metadata.
        Checksums left pending before the process group existed are verified first (`settle`)."""
        path = settle(Path(self._broadcast(str(checkpoint_path))))
        optimizers = [o.optimizer if isinstance(o, LightningOptimizer) else o for o in state.optimizers]
        names = {id(p): n for n, p in state.module.named_parameters()}
        meta = load_sharded(path, state.module, state.mesh, optimizers, names, weights_only)
        rescale_loop_progress(meta, state.module.trainer.accumulate_grad_batches)
        return meta
