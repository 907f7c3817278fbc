"""`mula plan --dry_run`: build one rank of the planned layout on the meta device and measure it.

The recipe's strategy (instantiated from its `class_path`, as `mula fit` does) runs its whole setup
for one chosen rank of the full world -- process groups and device mesh, stage split, expert slicing,
materialisation, replica sync, the optimizer with its sharded layout, checkpoint state dicts -- over
torch's fake process-group backend (collectives return at once, nothing is sent) with every tensor on
the meta device (nothing is allocated). torchtitan checks its configs the same way
(`--comm.mode fake_backend`). The rank's parameter, gradient and optimizer bytes are then read from
the optimizer's own reporting methods and printed next to the planner's numbers for that rank's
pipeline stage: they must be equal.

The steps are those of `Trainer.fit` up to the first training step (Lightning's `Trainer._run`):
`strategy.connect`, `strategy.setup_environment`, `configure_model` inside the strategy's init
contexts, `strategy.setup`. `mula` imports no strategy here: the recipe names it, as for `mula fit`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as L
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.cli import instantiate_class
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch.distributed.tensor import DTensor
from typing_extensions import override

from mula.plan.memory import plan_stage, stage_params
from mula.plan.parameters import model_parameters
from mula.plan.settings import PlanInputs
from mula.torch_compat import fake_store
from mula.training.module import MulaLightningModule
from mula.training.strategy_contract import OptimizerBytes, ShardedOptimizer

# what the dry run measures and compares: its name -> the plan's MemoryPlan field
MEASURED = {
    "params": "params",
    "grads": "grads",
    "optimizer": "optimizer",
    "param tensors": "param_tensor_bytes",
    "host optimizer": "host_optimizer_bytes",
}


def dry_run(
    inputs: PlanInputs, trainer: dict[str, Any], model: dict[str, Any], rank: int, measure: bool = True
) -> dict[str, Any]:
    """Build rank `rank` of the planned layout on the meta device over a fake process group and return
    its measured bytes next to the plan's (`MEASURED`), plus its place in the layout, the checkpoint
    state's shape and the seconds it took. `measure=False`: only build it (any optimizer; a layout the
    strategy refuses raises its sentence) and return its place."""
    layout = inputs.layout
    per_node = (
        inputs.machine.tiles_per_node if inputs.machine else max(1, layout.world_size // _nodes(trainer))
    )
    start = time.perf_counter()
    with _fake_world(rank, layout.world_size):
        env = DryRunEnvironment(rank, layout.world_size, per_node)
        strategy_config = trainer["strategy"]
        init_args = {**(strategy_config.get("init_args") or {}), "process_group_backend": "fake"}
        strategy = instantiate_class(
            (), {**strategy_config, "init_args": {**init_args, "cluster_environment": env}}
        )
        pl_trainer = L.Trainer(
            accelerator=MetaAccelerator(),
            strategy=strategy,
            devices=per_node,
            num_nodes=layout.world_size // per_node,
            precision=layout.precision,
            max_steps=int(trainer.get("max_steps") or -1),
            logger=False,
            callbacks=[],
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        module = MulaLightningModule(**model)
        pl_trainer.state.fn = TrainerFn.FITTING
        module.trainer = pl_trainer
        # Trainer._run's order up to the first step: connect, environment, configure_model, setup
        strategy.connect(module)
        strategy.setup_environment()
        with strategy.tensor_init_context(), strategy.model_sharded_context():
            with pl_trainer.precision_plugin.module_init_context():
                module.configure_model()
        strategy.setup(pl_trainer)
        try:
            if not measure:
                return {"rank": rank, "world_size": layout.world_size, "stage": strategy.topology.rank("pp")}
            measured, checkpoint = _measure(strategy, module)
        finally:
            strategy.teardown()
        topo = strategy.topology
        place = {
            "rank": rank,
            "world_size": layout.world_size,
            "stage": topo.rank("pp"),
            "ep_rank": topo.rank("ep"),
            "edp_rank": topo.rank("edp_cp"),
            "allocated_bytes": _allocated(module),
        }
    seconds = time.perf_counter() - start
    plan = plan_stage(inputs.config, layout, place["stage"])
    rows = {k: {"dry_run": measured[k], "plan": getattr(plan, field)} for k, field in MEASURED.items()}
    held = layout.stage_holdings(inputs.config)[place["stage"]]
    specs = stage_params(
        model_parameters(inputs.config, tuple(layout.no_decay)), held.blocks, held.first, held.last
    )
    planned_global = sum(math.prod(p.shape) for p in specs)
    rows["checkpoint elements"] = {"dry_run": checkpoint["global_elements"], "plan": planned_global}
    return {**place, "seconds": seconds, "bytes": rows, "checkpoint": checkpoint}


def dry_run_matches(result: dict[str, Any]) -> bool:
    """True when every measured number equals the plan's."""
    return all(row["dry_run"] == row["plan"] for row in result["bytes"].values())


def format_dry_run(result: dict[str, Any]) -> str:
    """The dry run's table: measured and planned bytes of the rank, and whether they match."""
    r = result
    ck = r["checkpoint"]
    lines = [
        f"dry run: rank {r['rank']} of {r['world_size']} (pipeline stage {r['stage']}, EP rank {r['ep_rank']}, "
        f"EDP rank {r['edp_rank']}) on the meta device over a fake process group, {r['seconds']:.1f} s, "
        f"{r['allocated_bytes']} bytes allocated",
        f"  {'':<22}{'dry run':>18}{'mula plan':>18}  match",
    ]
    for name, row in r["bytes"].items():
        ok = "yes" if row["dry_run"] == row["plan"] else "NO"
        lines.append(f"  {name:<22}{row['dry_run']:>18,}{row['plan']:>18,}  {ok}")
    lines.append(
        f"  checkpoint: model {ck['model_tensors']} tensors ({ck['model_dtensors']} DTensors), "
        f"optimizer {ck['optimizer_tensors']} sharded tensors ({ck['optimizer_local_elements']:,} elements on this rank)"
    )
    return "\n".join(lines)


def _measure(strategy: Any, module: Any) -> tuple[dict[str, int], dict[str, int]]:
    """The rank's bytes from the optimizer's reporting methods and the shape of its checkpoint state."""
    optimizer = strategy.optimizers[0]
    optimizer = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
    if not isinstance(optimizer, OptimizerBytes):
        raise ValueError(
            f"--dry_run reads the optimizer's param_bytes(), grad_buffer_bytes() and state_bytes(); "
            f"{type(optimizer).__name__} has none (use the sharded optimizer: shard_optimizer=true)."
        )
    # this rank's tensors: a tensor-parallel DTensor parameter holds its local shard (numel() is global)
    shards = [p.to_local() if isinstance(p, DTensor) else p for p in module.parameters()]
    tensors = sum(t.numel() * t.element_size() for t in shards)
    # device and host apart: with offload the plan's optimizer row is what stays on the device
    sharded = isinstance(optimizer, ShardedOptimizer)
    measured = {
        "params": optimizer.param_bytes(),
        "grads": optimizer.grad_buffer_bytes(),
        "optimizer": optimizer.device_state_bytes() if sharded else optimizer.state_bytes(),
        "param tensors": tensors,
        "host optimizer": optimizer.host_bytes() if sharded else 0,
    }
    model_state = strategy.lightning_module_state_dict()
    opt_state = strategy.optimizer_state(optimizer)["state"]
    # the global tensor a checkpoint stores per parameter: DTensors carry their global shape
    params = {n for n, _ in module.named_parameters()}
    global_elements = sum(v.numel() for k, v in model_state.items() if k in params)
    local = sum(
        t.to_local().numel() if isinstance(t, DTensor) else t.numel()
        for s in opt_state.values()
        for t in s.values()
    )
    checkpoint = {
        "model_tensors": len(model_state),
        "model_dtensors": sum(isinstance(v, DTensor) for v in model_state.values()),
        "global_elements": global_elements,
        "optimizer_tensors": sum(len(s) for s in opt_state.values()),
        "optimizer_local_elements": local,
    }
    return measured, checkpoint


def _allocated(module: Any) -> int:
    """Bytes of the module's parameters and buffers that are not on the meta device (0 in a dry run)."""
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors if not t.is_meta)


def _nodes(trainer: dict[str, Any]) -> int:
    return int(trainer.get("num_nodes") or 1)


@contextmanager
def _fake_world(rank: int, world_size: int) -> Iterator[None]:
    """torch.distributed initialised with the fake backend as rank `rank` of `world_size`; Lightning's
    rank-zero state is restored afterwards (the strategy sets it to the dry run's rank)."""
    if dist.is_initialized():
        raise ValueError("--dry_run needs a process without torch.distributed initialised.")
    saved = getattr(rank_zero_only, "rank", 0), getattr(utils_rank_zero_only, "rank", 0)
    dist.init_process_group("fake", store=fake_store(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        rank_zero_only.rank, utils_rank_zero_only.rank = saved


class MetaAccelerator(Accelerator):
    """Lightning accelerator whose devices are the meta device: tensors have shapes and no storage."""

    @override
    def setup_device(self, device: torch.device) -> None:
        """Nothing to select; refuse anything but the meta device."""
        if device.type != "meta":
            raise ValueError(f"MetaAccelerator runs on the meta device, got {device}.")

    @override
    def teardown(self) -> None:
        """Nothing to release."""

    @staticmethod
    @override
    def parse_devices(devices: Any) -> int:
        """Devices per node, as a count."""
        return int(devices)

    @staticmethod
    @override
    def get_parallel_devices(devices: Any) -> list[torch.device]:
        """One meta device per local rank."""
        return [torch.device("meta")] * int(devices)

    @staticmethod
    @override
    def auto_device_count() -> int:
        """One device when `devices` is not given."""
        return 1

    @staticmethod
    @override
    def is_available() -> bool:
        """The meta device always exists."""
        return True

    @staticmethod
    @override
    def name() -> str:
        """What Lightning calls it."""
        return "meta"

    @override
    def get_device_stats(self, device: Any) -> dict[str, Any]:
        """No statistics: nothing runs."""
        return {}


class DryRunEnvironment(ClusterEnvironment):
    """Rank `rank` of `world_size` processes, `per_node` per node (node by node), launched by nobody."""

    def __init__(self, rank: int, world_size: int, per_node: int) -> None:
        self._rank, self._world_size, self._per_node = rank, world_size, per_node

    @property
    @override
    def creates_processes_externally(self) -> bool:
        """Lightning must not launch processes: the dry run is this one."""
        return True

    @property
    @override
    def main_address(self) -> str:
        """Unused by the fake backend."""
        return "localhost"

    @property
    @override
    def main_port(self) -> int:
        """Unused by the fake backend."""
        return 0

    @staticmethod
    @override
    def detect() -> bool:
        """Never picked automatically."""
        return False

    @override
    def world_size(self) -> int:
        """The planned world size."""
        return self._world_size

    @override
    def set_world_size(self, size: int) -> None:
        """The strategy sets nodes x devices per node: the same number."""
        if size != self._world_size:
            raise ValueError(f"The dry run's world is {self._world_size} ranks, the strategy set {size}.")

    @override
    def global_rank(self) -> int:
        """The rank being built."""
        return self._rank

    @override
    def set_global_rank(self, rank: int) -> None:
        """The strategy sets node rank x devices per node + local rank: the same number."""
        if rank != self._rank:
            raise ValueError(f"The dry run builds rank {self._rank}, the strategy set {rank}.")

    @override
    def local_rank(self) -> int:
        """Its index on its node."""
        return self._rank % self._per_node

    @override
    def node_rank(self) -> int:
        """Its node."""
        return self._rank // self._per_node
