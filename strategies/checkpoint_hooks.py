"""The checkpoint hooks of `XPUMoEStrategy` (a mixin): sharded DCP directories that reshard across layouts.

Every rank writes its part of one directory (`strategies/sharded_state.py` says what each rank
contributes, `mula/checkpoint/sharded.py` writes it), synchronously or staged to host memory and written
in the background; a checkpoint saved at any (W, E) loads into this layout, weights and optimizer state
in place (so Lightning's own restore of them is a no-op).
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any

from lightning.pytorch.core.optimizer import LightningOptimizer
from typing_extensions import override

from mula.checkpoint.settle import settle
from strategies.sharded_state import (
    checkpoint_parts,
    load_sharded,
    model_state,
    plain_optimizer_state,
    rescale_loop_progress,
    save_sharded,
    start_save_sharded,
)


class ShardedCheckpointHooks:
    """Lightning's checkpoint hooks for a strategy whose checkpoints are sharded DCP directories.

    Expects the host strategy to set `_mesh` (the experts' device mesh) and `topology`, and to provide
    `_sharded_optimizer` (`OptimizerSteps`), `broadcast`, `optimizers`, `lightning_module`,
    `is_global_zero` and `checkpoint_io`.
    """

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Model state with experts as global tensors (for DCP); aliases the live parameters."""
        sharded = self._sharded_optimizer()
        if sharded is not None:
            sharded.wait_for_params()  # parameter all-gathers may still be in flight
        return model_state(self.lightning_module, self._mesh)

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """Optimizer state in a layout DCP can reshard (addressed by parameter name)."""
        optimizer = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        if hasattr(optimizer, "sharded_state_dict"):
            return optimizer.sharded_state_dict()
        names = {id(p): n for n, p in self.lightning_module.named_parameters()}
        return plain_optimizer_state(optimizer, names, self._mesh, self.topology)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Write a sharded checkpoint directory at `filepath` (collective)."""
        if storage_options is not None:
            raise TypeError(
                "XPUMoEStrategy.save_checkpoint does not take storage_options (it writes DCP shards)."
            )
        path, optimizer_states = checkpoint_parts(self, checkpoint, filepath)
        save_sharded(path, checkpoint, optimizer_states, self.is_global_zero)

    def save_checkpoint_async(self, checkpoint: dict[str, Any], filepath: Any, group: Any) -> Future:
        """`save_checkpoint` in the background (collective): staged to host memory when this returns; the
        future completes when this rank's files are written. `group`: the writer's own gloo group."""
        path, optimizer_states = checkpoint_parts(self, checkpoint, filepath)
        return start_save_sharded(path, checkpoint, optimizer_states, self.is_global_zero, group)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a sharded checkpoint saved at any (W, E) into this layout; returns Lightning's metadata.
        Checksums left pending before the process group existed are verified first (`settle`)."""
        path = settle(Path(self.broadcast(str(checkpoint_path))))
        optimizers = [o.optimizer if isinstance(o, LightningOptimizer) else o for o in self.optimizers]
        names = {id(p): n for n, p in self.lightning_module.named_parameters()}
        meta = load_sharded(path, self.lightning_module, self._mesh, optimizers, names, weights_only)
        trainer = self.lightning_module.trainer
        rescale_loop_progress(meta, trainer.accumulate_grad_batches)
        return meta

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """Nothing to do: `load_checkpoint` already loaded the weights in place."""

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """Nothing to do: `load_checkpoint` already loaded the optimizer state."""

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        """Delete a checkpoint directory (rank 0)."""
        if self.is_global_zero:
            self.checkpoint_io.remove_checkpoint(filepath)
