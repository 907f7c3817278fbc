"""Run a function in N CPU processes joined by a gloo process group (test helper, not a library).

Processes come from a forkserver that has already imported torch and Lightning, so each launch costs
a fork (~0.1 s) instead of a fresh interpreter importing torch (~10 s for 4 processes on 2 cores).
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port that is free right now on localhost."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lightning_env(rank: int, world: int) -> None:
    """Tell Lightning this process is rank `rank` of `world`, already started (it must not launch its own)."""
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world), RANK=str(rank))


def cpu_trainer(
    world: int,
    strategy: Any,
    *,
    max_steps: int,
    accumulate_grad_batches: int,
    callbacks: list[Any],
    save_dir: str | None = None,
    **kwargs: Any,
) -> Any:
    """The quiet Lightning Trainer the multi-rank tests compare runs with: `world` CPU ranks under
    `strategy` (one process when it is None), no logger, no distributed sampler (the tests hand each rank
    its batches), and a checkpoint every 2 steps into `save_dir` when given. `kwargs` go to the Trainer."""
    import lightning.pytorch as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    if save_dir is not None:
        callbacks = [*callbacks, ModelCheckpoint(dirpath=save_dir, save_top_k=-1, every_n_train_steps=2)]
    return L.Trainer(
        accelerator="cpu",
        devices=world if strategy is not None else 1,
        strategy=strategy if strategy is not None else "auto",
        max_steps=max_steps,
        accumulate_grad_batches=accumulate_grad_batches,
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=save_dir is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        **kwargs,
    )


# Only effective before the first forkserver launch in this interpreter; later calls are harmless.
multiprocessing.set_forkserver_preload(
    ["torch", "torch.distributed", "lightning.pytorch", "mula", "strategies"]
)


def _worker(rank: int, world_size: int, port: int, out_dir: str, fn: Callable, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    # rendezvous through a file of this launch, not the port: a port found free can be taken by another
    # process (a previous test's closing connections) before rank 0 binds it ("Connection reset by peer")
    store = Path(out_dir) / "rendezvous"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        torch.save({"ok": True, "result": result}, Path(out_dir) / f"rank{rank}.pt")
    except BaseException:
        torch.save({"ok": False, "error": traceback.format_exc()}, Path(out_dir) / f"rank{rank}.pt")
        raise
    finally:
        dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int, *args: Any) -> list[Any]:
    """Call fn(rank, world_size, *args) in world_size spawned processes; return each rank's result.

    fn must be a module-level function (it is pickled by reference). A failing rank re-raises here
    with its traceback.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        try:
            mp.start_processes(
                _worker,
                args=(world_size, free_port(), out_dir, fn, args),
                nprocs=world_size,
                join=True,
                start_method="forkserver",
            )
        except Exception as spawn_error:
            errors = []
            for rank in range(world_size):
                path = Path(out_dir) / f"rank{rank}.pt"
                if path.exists():
                    record = torch.load(path, weights_only=False)
                    if not record["ok"]:
                        errors.append(f"rank {rank} failed:\n{record['error']}")
            if errors:
                raise AssertionError("\n".join(errors)) from spawn_error
            raise
        return [
            torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False)["result"] for r in range(world_size)
        ]


def whole_params(module: torch.nn.Module, topology: Any) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of `module` (the router bias included) as one process holds it: DTensors
    gathered whole, this rank's experts gathered over its EP group (`topology`: the strategy's LayoutMesh,
    None for one process). Collective over the EP group."""
    from torch.distributed.tensor import DTensor

    from mula.model.moe import is_expert_param

    params = {}
    for name, p in [*module.named_parameters(), *module.named_buffers()]:
        full = p.full_tensor() if isinstance(p, DTensor) else p.detach()
        if is_expert_param(name) and topology is not None and topology.size("ep") > 1:
            parts = [torch.empty_like(full) for _ in range(topology.size("ep"))]
            dist.all_gather(parts, full.contiguous(), group=topology.group("ep"))
            full = torch.cat(parts)
        params[name] = full.detach().clone()
    return params


def assert_plan_bytes(plan: Any, per_rank: list[dict]) -> None:
    """`mula plan`'s parameter, gradient and optimizer bytes equal each rank's measured ones (`per_rank`:
    each rank's {"memory": {...}} with the sharded optimizer's byte counts and the memory meter's)."""
    for rank, rank_out in enumerate(per_rank):
        row = rank_out["memory"]
        assert plan.param_tensor_bytes == row["params"], rank
        assert plan.params == row["optim/param_bytes"], rank
        assert plan.grads == row["grads"] == row["optim/grad_buffer_bytes"], rank
        assert plan.optimizer == row["optim/state_bytes"], rank
