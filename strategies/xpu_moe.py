"""XPUMoEStrategy: expert parallelism (+ EP-aware optimizer sharding) as a Lightning strategy.

Structure follows Lightning's ModelParallelStrategy: `setup_environment` (process group, EP/EDP
groups) -> `setup` (parallelise the LightningModule's model from the outside: strategies/model_setup.py;
build the optimizer) -> checkpoint hooks (sharded DCP directories that reshard across layouts:
strategies/checkpoint_hooks.py).

Per step (automatic optimisation) the strategy owns the order, in `optimizer_step`: forward with
all-to-all dispatchers -> backward, where gradient buckets start reducing as soon as they are complete
-> reduce (dense over all W ranks, experts over their EDP group) -> the global norm and a non-finite
flag in one all-reduce -> `on_before_optimizer_step` hooks (a callback may veto the update) -> clip
-> update -> zero. The optimizer is built by `build_optimizer`, which the module's
`configure_optimizers` calls. Gradient-accumulation micro-batches do not communicate
(`block_backward_sync`).

With `pipeline_parallel_size` P > 1 the model's blocks are split into P stages (strategies/
pipeline/split.py) and each optimizer step runs as one `torch.distributed.pipelining` schedule
(strategies/pipeline/schedule.py) inside `training_step`: the data module hands over the step's whole
per-rank batch, whose accumulation micro-batches become the pipeline's micro-batches. Gradients are
then reduced per stage (dense over the stage's W/P ranks, experts over its EDP group) and clipped by
the norm over all stages.

YAML: `trainer.strategy: {class_path: strategies.XPUMoEStrategy, init_args: {expert_parallel_size: 4}}`
or `trainer.strategy: xpu_moe` (E = 1).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from concurrent.futures import Future
from contextlib import AbstractContextManager, contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from typing_extensions import override

from mula.cluster_environments import PALSEnvironment, launched_by_mpiexec
from mula.layout.parallel_layout import ParallelLayout
from mula.layout.rules import check_experts, check_sequence_parallel
from mula.layout.run_check import RunSettings, check_run
from mula.layout.sharding_options import check_bucket_size
from mula.model.config import MulaConfig
from mula.training.lightning_compat import (
    _distributed_is_initialized,
    _init_dist_connection,
    _optimizers_to_device,
    _SubprocessScriptLauncher,
    _sync_ddp_if_available,
    sigterm_agreement_on_logging_steps,
)
from mula.training.module import MulaLightningModule, mula_module
from strategies.calibrate import Calibration
from strategies.checkpoint_hooks import CheckpointState, ShardedCheckpointIO
from strategies.devices.accelerator import fix_mixed_precision_device, process_group_backend
from strategies.eval_forward import spread_forward
from strategies.experts.expert_parallel import apply_expert_parallel
from strategies.model_setup import materialize, split_sequences, split_tensors, sync_replicas
from strategies.optimizer_step import OptimizerStep, StepOptions, parse_optimizer_options
from strategies.pipeline.embedding import EmbeddingCopies
from strategies.pipeline.steps import PipelineSteps, microbatches_per_step, stage_model
from strategies.sharded_state import expert_mesh
from strategies.tensor_parallel import TensorParallelLoss
from strategies.topology import LayoutMesh, topology_from_layout


class XPUMoEStrategy(ParallelStrategy):
    """Expert-parallel data-parallel training on Intel GPUs (XPU), NVIDIA GPUs or CPUs.

    The name is the design card's ("the custom XPU MoE strategy"); nothing in it is XPU-only. The
    device decides the accelerator (native `torch.xpu` on Intel GPUs,
    `strategies/devices/accelerator.py`; CUDA and CPU are Lightning's), the collective backend (xccl,
    or oneCCL's "ccl" before torch 2.8, on XPU; nccl on CUDA; gloo on CPU) and the expert kernels
    (`mula/model/kernels/backends.py`: Triton on XPU, torch's grouped GEMM or Triton on CUDA, batched
    GEMMs over padded experts on CPU). Layouts, the sharded optimizer, offload and checkpoints are the
    same code on all three, which is how the CPU test suite proves them equal to one process.

    W ranks form EP groups of `expert_parallel_size` consecutive ranks (tokens are exchanged
    all-to-all inside a group, so E = devices per node keeps that traffic on the node) and EDP groups
    across them. Every rank is a data-parallel rank (its own micro-batch); dense parameters are
    replicated on all ranks, each rank keeps num_experts / E experts.

    The strategy owns its Lightning hooks and hands each one's work to a member built with stated
    inputs: `OptimizerStep` (strategies/optimizer_step.py: the optimizer and the one training step),
    `PipelineSteps` (strategies/pipeline/steps.py: the schedule's steps, when P > 1),
    `TensorParallelLoss` (strategies/tensor_parallel.py: `loss_parallel` around the steps, when T > 1)
    and `ShardedCheckpointIO` (strategies/checkpoint_hooks.py: sharded DCP checkpoints).

    bf16 weights with fp32 masters: `precision: bf16-true` with `shard_optimizer: true` (the sharded
    optimizer, AdamW's or Muon's, always keeps fp32 masters and its fp32 moments in its shard). Lightning builds the model in bf16
    before the optimizer exists, so the masters start from the bf16-rounded initial weights.

    Args:
        expert_parallel_size: E; must divide the world size and the model's number of experts.
        shard_optimizer: `build_optimizer` builds a sharded optimizer (state split once across all
            ranks): `EPShardedAdamW`, or `EPShardedMuon` (strategies/optim/sharded_muon.py, docs/muon.md)
            when the module's optimizer is Muon (`model.optimizer: muon`); False: a `torch.optim.AdamW`
            (a replicated `MulaMuon` for Muon), gradients all-reduced.
        optimizer_options: keyword options of the sharded optimizer (e.g. `zero_stage`, `bucket_numel`,
            `overlap_param_gather`, `offload` (AdamW's only), `reduce_dtype: bf16`).
        bucket_size_mb: gradient bucket size for the unsharded path.
        overlap_grad_reduce: start bucket all-reduces from backward hooks (unsharded path).
        pipeline_parallel_size: P, pipeline stages (rank order: EP innermost, then stages, data
            parallel outermost; W must be divisible by P x E). Each stage is one contiguous run of blocks.
        pipeline_schedule: "1f1b", "interleaved-1f1b" or "gpipe" (torch.distributed.pipelining).
        pipeline_virtual_stages: V, stages per rank with "interleaved-1f1b" (P x V stages in all).
        pipeline_stage_layers: blocks per stage (P x V numbers summing to the model's layers); default
            an even split.
        tensor_parallel_size: T, Megatron-style tensor parallelism (strategies/tensor_parallel.py,
            docs/tensor-parallel.md): T consecutive ranks (innermost, one node's fabric) split every
            attention (by heads), dense MLP, the embedding and the LM head (by vocabulary) and read the
            same data; the data-parallel size is W / (P x T). MoE layers keep their experts whole and
            route 1/T of the tokens on each TP rank (strategies/tensor_parallel_moe.py). T must divide
            the heads, KV heads, dense MLP width and vocabulary (and the sequence, with MoE layers or
            SP); with pipeline stages each stage's modules split over its own TP group. With `shard_optimizer` the flat buffers hold each rank's local
            TP shard, its state sharded over the data-parallel group.
        sequence_parallel: with T > 1, the norms and the residual stream hold 1/T of the sequence
            (reduce-scatter / all-gather around each layer instead of all-reduce).
        context_parallel_size: C, Ulysses context parallelism (strategies/context_parallel.py,
            docs/context-parallel.md): C ranks (between EP and TP in the rank order, one node's fabric)
            read the same samples, each holding 1/C of every sequence; attention exchanges heads for the
            sequence with all-to-alls. C must divide the heads, KV heads and the sequence length; the
            data-parallel size is W / (P x T x C), gradients are averaged over the W / (P x T) replicas.
            With pipeline stages each stage sends its CP rank's slice to the next; with tensor
            parallelism (C x T must divide the heads) Ulysses exchanges each TP rank's heads over its CP
            group; with both at once (C x T x P) each stage's T x C ranks split its layers by heads and
            its sequences by slices (tests/test_context_tensor_pipeline.py, with experts too).
        meta_init: let `configure_model` build on the meta device; each rank then materialises only its
            own experts and initialises them with the model's `reset_parameters` (dense weights are
            broadcast from rank 0). Use for models too large to build whole on one device.
        process_group_backend: override the backend (default: xccl on XPU, nccl on CUDA, gloo on CPU).
        timeout: collective timeout.
    """

    strategy_name = "xpu_moe"

    def __init__(
        self,
        expert_parallel_size: int = 1,
        shard_optimizer: bool = True,
        optimizer_options: dict[str, Any] | None = None,
        bucket_size_mb: float = 25.0,
        overlap_grad_reduce: bool = True,
        meta_init: bool = False,
        pipeline_parallel_size: int = 1,
        pipeline_schedule: str = "1f1b",
        pipeline_virtual_stages: int = 1,
        pipeline_stage_layers: list[int] | None = None,
        tensor_parallel_size: int = 1,
        sequence_parallel: bool = False,
        context_parallel_size: int = 1,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        if cluster_environment is None and launched_by_mpiexec():
            cluster_environment = PALSEnvironment()
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        # the layout's one validation, but for the rule that needs W (`check_world`: W divisible by
        # E x P x T x C), which `setup_environment` adds once the process group says W
        self.layout = ParallelLayout(
            world_size=None,
            ep=int(expert_parallel_size),
            pp=int(pipeline_parallel_size),
            tp=int(tensor_parallel_size),
            cp=int(context_parallel_size),
            schedule=pipeline_schedule,
            virtual_stages=int(pipeline_virtual_stages),
            stage_layers=None if pipeline_stage_layers is None else tuple(pipeline_stage_layers),
        )
        check_sequence_parallel(sequence_parallel, self.layout.tp)
        check_bucket_size(bucket_size_mb)
        # Micro-batches per optimizer step with P > 1, for data that is not a MulaDataModule (whose
        # micro_batch_size the strategy reads itself).
        self.pipeline_microbatches: int | None = None
        self.sequence_parallel = bool(sequence_parallel)
        self.meta_init = meta_init
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._num_nodes = 1
        self.topology: LayoutMesh | None = None
        self._mesh: Any = None
        # the members doing the hooks' work
        self._optimizer_step = OptimizerStep(
            StepOptions(
                shard_optimizer,
                parse_optimizer_options(optimizer_options or {}),
                bucket_size_mb,
                overlap_grad_reduce,
            ),
            layout=lambda: self.layout,
            topology=lambda: self.topology,
            module=lambda: self.lightning_module,
            optimizers=lambda: self.optimizers,
        )
        self._tp_loss = TensorParallelLoss(self.layout.tp)
        self._pipeline: PipelineSteps | None = None  # when P > 1 (built in setup)
        self._checkpoints = ShardedCheckpointIO(self.broadcast)

    # ----- layout ----------------------------------------------------------------------------
    @property
    @override
    def root_device(self) -> torch.device:
        """This process's device."""
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        """Nodes in the job (set by the Trainer)."""
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        """Processes (devices) per node."""
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Every rank of a stage is a data-parallel rank (experts are split, tokens are not), save that
        the T ranks of a tensor-parallel group and the C ranks of a context-parallel group read the same
        data."""
        return {"num_replicas": self.data_parallel_size, "rank": self.data_parallel_rank}

    @property
    def data_parallel_rank(self) -> int:
        """This rank's data-parallel index, rank("dp") (the global rank when P = T = C = 1; the same on
        the T ranks of a tensor-parallel group and the C ranks of a context-parallel group)."""
        if self.topology is None:
            return self.global_rank
        return self.topology.rank("dp")

    @property
    def data_parallel_size(self) -> int:
        """Data-parallel ranks, size("dp"): W / (P x T x C) (the ranks of one pipeline stage, one per TP
        and CP group)."""
        if self.topology is None:
            return self.world_size
        return self.topology.size("dp")

    @property
    def tensor_parallel_size(self) -> int:
        """T, the ranks splitting each layer's tensors (`layout.tp`): the name `MulaStrategy` asks for."""
        return self.layout.tp

    @property
    def process_group_backend(self) -> str | None:
        """The collective backend in use (after setup_environment)."""
        return self._process_group_backend

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """Checkpoints load into the parallelised model and the final optimizer."""
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        """The strategy restores optimizer state itself (sharded, reshardable)."""
        return False

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes
            )

    def set_world_ranks(self) -> None:
        """Tell the cluster environment this process's rank (as DDP does)."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    # ----- environment -----------------------------------------------------------------------
    @override
    def setup_environment(self) -> None:
        """Start the process group and build the EP/EDP groups (fails fast on an invalid layout)."""
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._process_group_backend or process_group_backend(self.root_device)
        assert self.cluster_environment is not None
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type == "cuda":  # NCCL: bind the communicator to this GPU eagerly
            kwargs["device_id"] = self.root_device
        _init_dist_connection(self.cluster_environment, self._process_group_backend, **kwargs)
        world = dist.get_world_size() if _distributed_is_initialized() else 1
        module = mula_module(self.lightning_module)
        self.layout = self.parallel_layout(world, None if module is None else module.config)
        self.topology = topology_from_layout(self.layout, self.root_device.type)
        self._mesh = expert_mesh(self.topology)

    def parallel_layout(self, world_size: int, config: Any = None) -> ParallelLayout:
        """This strategy's layout over `world_size` ranks (`ParallelLayout.with_world_size`: the W rule),
        checked against the model `config` when it is one (`num_layers`, `num_experts`: the stage split,
        the experts, the heads): what `setup_environment` builds, and `mula plan` too (one sentence for a
        layout that cannot run, before any process group or model exists)."""
        layout = self.layout.with_world_size(world_size)
        if isinstance(config, MulaConfig):
            layout.validate(config)
        return layout

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """Build the model on the meta device when `meta_init`, else directly on this rank's device."""
        if self.meta_init:
            with torch.device("meta"), self.precision_plugin.tensor_init_context():
                yield
        else:
            with super().tensor_init_context(empty_init):
                yield

    @property
    def keeps_fp32_master_weights(self) -> bool:
        """Whether bf16/fp16 weights (`precision: bf16-true`) get fp32 masters: the sharded optimizer's."""
        return self.shard_optimizer

    # ----- setup -----------------------------------------------------------------------------
    @override
    def setup(self, trainer: Any) -> None:
        """Parallelise the model, move it to the device, build optimizer and gradient sync."""
        assert self.accelerator is not None and self.model is not None and self.topology is not None
        self.accelerator.setup(trainer)
        fix_mixed_precision_device(self.precision_plugin, self.root_device.type)
        mula = mula_module(self.lightning_module)
        self._check_setup(trainer, mula)
        self._lay_out_model(mula)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _check_setup(self, trainer: Any, mula: MulaLightningModule | None) -> None:
        """Refuse what this run cannot train, before the model is laid out: loss scaling, clipping by value
        with the sharded optimizer, and the run's one validation (`check_run`)."""
        if isinstance(self.precision_plugin, MixedPrecision) and self.precision_plugin.scaler is not None:
            raise ValueError(
                "precision='16-mixed' (loss scaling) is not supported by XPUMoEStrategy; use "
                "precision='bf16-mixed' or 'bf16-true'."
            )
        if self.shard_optimizer and trainer.gradient_clip_val and trainer.gradient_clip_algorithm == "value":
            raise ValueError(
                "gradient_clip_algorithm='value' is not supported with shard_optimizer=True; use 'norm' "
                "(the global norm over all experts) or shard_optimizer=False."
            )
        # the run's one validation, before the model is laid out (the optimizer is built only after that)
        check_run(
            RunSettings(
                self.layout, None if mula is None else mula.config, precision=str(trainer.precision),
                fp32_masters=self.keeps_fp32_master_weights, strategy=type(self).__name__,
                zero_stage=self.optimizer_options.get("zero_stage", 1) if self.shard_optimizer else None,
                offload=self.offloads_optimizer, optimizer="adamw" if mula is None else mula.optimizer,
                sequence_parallel=self.sequence_parallel,
            )
        )  # fmt: skip

    def _lay_out_model(self, mula: MulaLightningModule | None) -> None:
        """Lay the module's model out over this rank's layout, in order: pipeline stages, experts, the
        device, tensor and context parallelism, precision, replicas in step (and, with multi-token
        prediction across stages, the embedding's two copies)."""
        module = self.lightning_module
        assert self.topology is not None
        if self.layout.pp > 1:
            stage_model(module)  # checked first, each setup
            if self._pipeline is None:  # Lightning calls setup again for validate/test after fit
                self._pipeline = PipelineSteps.split(
                    module, self.topology, self.root_device, self.sequence_parallel, self.last_backward_sync
                )
        if apply_expert_parallel(module, self.topology) is None:
            # no MoE layer on this rank: a dense model (refused under E > 1), or a pipeline stage of dense
            # blocks of an MoE model, whose experts live on other stages
            check_experts(0 if mula is None else mula.config.num_experts, self.layout.ep)
        materialize(module, self.root_device)
        if self.layout.tp > 1:
            split_tensors(module, self.topology, self.sequence_parallel)
        if self.layout.cp > 1:
            split_sequences(module, self.topology)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        sync_replicas(module, self.topology)
        if self._pipeline is not None and mula is not None and mula.config.mtp_depth:
            if self._optimizer_step.embedding_copies is None:  # collective: every rank, once
                self._optimizer_step.embedding_copies = EmbeddingCopies(mula.model.embed, self.topology)

    def spread_forward(self) -> Any:
        """The model's forward across this layout's ranks, for downstream evaluation (`DownstreamEval`,
        `mula eval` with a strategy): a `strategies.eval_forward.SpreadForward`."""
        return spread_forward(
            self.lightning_module.model,
            self.topology,
            None if self._pipeline is None else self._pipeline.runner,
            self.root_device,
            self.layout.tp if self.sequence_parallel else 1,
            self._sharded_optimizer(),
        )

    @staticmethod
    def calibration() -> Calibration:
        """What `mula calibrate --strategy strategies.XPUMoEStrategy` times of this strategy on each rank
        (a `mula.calibrate.strategy.StrategyCalibration`): the small model split by its TP, CP and EP
        functions, and its sharded AdamW's gradient reduction (`strategies/calibrate/`)."""
        return Calibration()

    # ----- the optimizer and the training step (`OptimizerStep`) ---------------------------------
    @property
    def shard_optimizer(self) -> bool:
        """Whether `build_optimizer` builds a sharded optimizer, `EPShardedAdamW` or `EPShardedMuon` (the
        constructor's option)."""
        return self._optimizer_step.options.shard_optimizer

    @property
    def optimizer_options(self) -> dict[str, Any]:
        """The sharded optimizer's keyword options, parsed (the constructor's `optimizer_options`)."""
        return self._optimizer_step.options.optimizer_options

    @property
    def offloads_optimizer(self) -> bool:
        """Whether the sharded optimizer keeps its state on the host (`optimizer_options.offload`)."""
        return self.shard_optimizer and bool(self.optimizer_options.get("offload"))

    def build_optimizer(self, params: Any, **adamw_kwargs: Any) -> torch.optim.Optimizer:
        """The optimizer for the module's `configure_optimizers` (MulaLightningModule asks for it): with
        `shard_optimizer` an `EPShardedAdamW` over this rank's (already sliced and materialised)
        parameters, else a `torch.optim.AdamW`; when the module marks param groups as Muon's, an
        `EPShardedMuon`, else a replicated `MulaMuon` (`OptimizerStep.build_optimizer`). `adamw_kwargs`
        are AdamW's (lr, betas, eps, weight_decay), plus Muon's for Muon."""
        return self._optimizer_step.build_optimizer(params, **adamw_kwargs)

    @override
    def setup_optimizers(self, trainer: Any) -> None:
        """The module's optimizers (built through `build_optimizer`), and the gradient synchroniser of
        the unsharded path."""
        super().setup_optimizers(trainer)
        self._optimizer_step.setup()

    @property
    def zeroes_grads_after_step(self) -> bool:
        """Gradients are zeroed at the end of `optimizer_step`, so Lightning's zeroing before a step's
        first backward is not needed (and would wipe a pipeline step's gradients, whose backward passes
        run inside `training_step`): MulaLightningModule.optimizer_zero_grad then does nothing."""
        return True

    @override
    def block_backward_sync(self) -> AbstractContextManager[None]:
        """Gradient-accumulation micro-batch: accumulate locally, communicate nothing."""
        return self._optimizer_step.block_backward_sync()

    def last_backward_sync(self) -> AbstractContextManager[None]:
        """Inside `block_backward_sync`: the backward run in this block is the step's last for the
        parameters it reaches (a pipeline stage's last micro-batch), so their buckets start reducing as
        they complete, and an offloaded optimizer's host updates start with them."""
        return self._optimizer_step.last_backward_sync()

    @override
    def optimizer_step(
        self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any
    ) -> Any:
        """One optimizer step, the same for plain, sharded and pipelined runs (`OptimizerStep.optimizer_step`:
        closure -> reduce -> check -> `on_before_optimizer_step` hooks -> clip, update -> zero)."""
        return self._optimizer_step.optimizer_step(optimizer, closure)

    @property
    def last_grad_norm(self) -> Tensor | None:
        """The last step's global gradient norm (before clipping)."""
        return self._optimizer_step.last_grad_norm

    @property
    def last_grads_finite(self) -> Tensor | None:
        """Whether every gradient of the last step was finite, on all ranks: a 0-dim bool tensor on the
        device (None before the first step)."""
        return self._optimizer_step.last_grads_finite

    @property
    def update_skipped(self) -> Tensor:
        """Whether this step's update is skipped (a non-finite gradient or a callback's veto), a 0-dim
        bool tensor on the device. Final for the module's own `on_before_optimizer_step`, which runs
        after every callback's."""
        return self._optimizer_step.update_skipped

    def skip_optimizer_step(self, reason: str) -> None:
        """Veto this step's update (from an `on_before_optimizer_step` hook, on every rank alike): the
        parameters and optimizer state stay as they are, the gradients are dropped. The caller
        reports the skip."""
        self._optimizer_step.skip_optimizer_step(reason)

    def _sharded_optimizer(self) -> Any:
        """The sharded optimizer in use (`EPShardedAdamW` or `EPShardedMuon`), else None."""
        return self._optimizer_step.sharded_optimizer()

    # ----- the steps' hooks (`TensorParallelLoss` around them, `PipelineSteps` when P > 1) ------------
    @property
    def consumes_whole_step(self) -> bool:
        """With pipeline stages a training batch is the whole step's per-rank batch (read by the data module)."""
        return self.layout.pp > 1

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """The module's training step, its loss vocabulary-parallel under TP; with pipeline stages one
        schedule step over the whole step's batch, returning the step's global mean loss on every rank
        (what the loggers and the anomaly guard see)."""
        with self._tp_loss.context():
            if self._pipeline is None:
                return super().training_step(*args, **kwargs)
            return self._pipeline.training_step(
                args[0] if args else kwargs["batch"],
                self.lightning_module,
                self.precision_plugin,
                self.block_backward_sync,
                lambda batch: microbatches_per_step(
                    batch, self.pipeline_microbatches, self.lightning_module.trainer
                ),
                lambda tensor: self.reduce(tensor, reduce_op="sum"),
            )

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """The module's validation step, its loss vocabulary-parallel under TP; with pipeline stages the
        batch's cross-entropy through the stages, counted on the last."""
        return self._evaluation_step(super().validation_step, *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        """As `validation_step`."""
        return self._evaluation_step(super().test_step, *args, **kwargs)

    def _evaluation_step(self, lightning_step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Lightning's `lightning_step` (validation or test) under `TensorParallelLoss`, or the pipeline's
        forward-only evaluation when P > 1."""
        with self._tp_loss.context():
            if self._pipeline is None:
                return lightning_step(*args, **kwargs)
            return self._pipeline.evaluate(
                args[0] if args else kwargs["batch"], self.lightning_module, self.precision_plugin
            )

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """Backward of the step's loss, under the same context as its forward; with pipeline stages the
        step already ran backward: only the hooks around it run."""
        with self._tp_loss.context():
            if self._pipeline is None:
                return super().backward(closure_loss, optimizer, *args, **kwargs)
            return self._pipeline.backward(closure_loss, self.lightning_module, self.precision_plugin)

    # ----- checkpoints (`ShardedCheckpointIO`) --------------------------------------------------
    def _checkpoint_state(self) -> CheckpointState:
        return CheckpointState(
            module=self.lightning_module,
            optimizers=self.optimizers,
            sharded_optimizer=self._sharded_optimizer(),
            mesh=self._mesh,
            topology=self.topology,
            layout=self.layout,
            world_size=self.world_size,
            is_global_zero=self.is_global_zero,
        )

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Model state with experts as global tensors (for DCP); aliases the live parameters."""
        return self._checkpoints.model_state(self._checkpoint_state())

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """Optimizer state in a layout DCP can reshard (addressed by parameter name)."""
        return self._checkpoints.optimizer_state(self._checkpoint_state(), optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Write a sharded checkpoint directory at `filepath` (collective)."""
        if storage_options is not None:
            raise TypeError(
                "XPUMoEStrategy.save_checkpoint does not take storage_options (it writes DCP shards)."
            )
        self._checkpoints.save(self._checkpoint_state(), checkpoint, filepath)

    def save_checkpoint_async(self, checkpoint: dict[str, Any], filepath: Any, group: Any) -> Future:
        """`save_checkpoint` in the background (collective): staged to host memory when this returns; the
        future completes when this rank's files are written. `group`: the writer's own gloo group."""
        return self._checkpoints.save_async(self._checkpoint_state(), checkpoint, filepath, group)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a sharded checkpoint saved at any (W, E) into this layout; returns Lightning's metadata.
        Checksums left pending before the process group existed are verified first."""
        return self._checkpoints.load(self._checkpoint_state(), checkpoint_path, weights_only)

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

    # ----- collectives -----------------------------------------------------------------------
    @override
    def barrier(self, name: str | None = None) -> None:
        """Synchronise all ranks."""
        if not _distributed_is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        """Send a picklable object from `src` to every rank."""
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src, group=_group.WORLD)
        return box[0]

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        """Reduce a tensor over all ranks (mean by default), as DDP does."""
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def model_to_device(self) -> None:
        """Move the (already sliced) model to this rank's device."""
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def on_train_start(self) -> None:
        """Lightning's per-batch SIGTERM agreement (a host sync per micro-batch) on logging steps only."""
        sigterm_agreement_on_logging_steps(self.lightning_module.trainer)

    # ----- teardown / registry -----------------------------------------------------------------
    @override
    def teardown(self) -> None:
        """Detach hooks and release the device."""
        self._optimizer_step.teardown()
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """`strategy: xpu_moe` (E = 1) in a Trainer or recipe."""
        strategy_registry.register(
            cls.strategy_name, cls, description=cls.__doc__.splitlines()[0], override=True
        )
