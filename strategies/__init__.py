"""Parallelism for Mula: expert parallelism, pipeline stages and EP-aware optimizer sharding as a
Lightning strategy.

Importing this package registers `XPUMoEStrategy` as `strategy: xpu_moe` and `XPUAccelerator` as
`accelerator: xpu` with Lightning, so recipes can name them.
"""

from lightning.pytorch.strategies import StrategyRegistry

from mula.cluster_environments import PALSEnvironment
from strategies.devices.accelerator import XPUAccelerator, process_group_backend
from strategies.devices.accelerator import register as _register_accelerator
from strategies.experts.all_to_all import AllToAllDispatcher
from strategies.experts.expert_parallel import apply_expert_parallel
from strategies.optim.grad_sync import GradientSynchronizer, clip_grad_norm_
from strategies.pipeline.schedule import PipelineRunner
from strategies.pipeline.split import split_model
from strategies.topology import LayoutMesh, build_topology, topology_from_layout
from strategies.xpu_moe import XPUMoEStrategy

_register_accelerator()
XPUMoEStrategy.register_strategies(StrategyRegistry)

__all__ = [
    "AllToAllDispatcher",
    "LayoutMesh",
    "GradientSynchronizer",
    "PALSEnvironment",
    "PipelineRunner",
    "XPUAccelerator",
    "XPUMoEStrategy",
    "apply_expert_parallel",
    "build_topology",
    "clip_grad_norm_",
    "process_group_backend",
    "split_model",
    "topology_from_layout",
]
