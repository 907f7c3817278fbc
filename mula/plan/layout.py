"""What the memory planner needs to know about a run besides the model: ranks, parallel sizes,
micro-batch, precision, checkpointing and the sharded optimizer's options.

`Layout` is plain data (no torch objects); `mula.plan.settings` builds one from a parsed `mula fit`
configuration, tests and `--search` build them directly. Its parallel part is the strategy's own
`mula.layout.parallel_layout.ParallelLayout` (`Layout.parallel`), validated by the same rules.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

from mula.layout.parallel_layout import Holdings, ParallelLayout
from mula.layout.rules import SENTENCES, check_sequence_parallel
from mula.layout.sharding_options import ShardingOptions
from mula.model.param_names import check_muon_ns_dtype

_OPTIONS = ShardingOptions()  # the sharded optimizer's defaults
# Layout fields that are ShardingOptions fields of the same name (`Layout.sharding`)
SHARDING_FIELDS = ("zero_stage", "reduce_dtype", "bucket_numel", "align", "ep_aware", "offload",
                   "offload_tail_buckets", "offload_speculation", "overlap_param_gather", "collectives")  # fmt: skip

# trainer.precision -> (parameter bytes, matmul/activation bytes); "mixed" keeps fp32 weights and
# residual stream and runs the matmuls in 16 bits under autocast.
PRECISIONS = {
    "32-true": (4, 4), "32": (4, 4), "64-true": (8, 8),
    "bf16-true": (2, 2), "16-true": (2, 2), "bf16-mixed": (4, 2), "16-mixed": (4, 2),
    "bf16": (4, 2), "16": (4, 2), "64": (8, 8),
}  # fmt: skip


@dataclass
class Layout:
    """One rank's view of a training layout.

    world_size: W ranks; ep_size: E (expert-parallel group size, divides W / P and the experts);
    pp_size: P pipeline stages (one node per stage in Optimus' rank order); pp_schedule and
    pp_virtual_stages: the pipeline schedule; pp_stage_layers: layers per stage (None: even split).
    tp_size: T tensor-parallel ranks (innermost) splitting every dense layer (`strategies.tensor_parallel`);
    sequence_parallel: the norm and residual regions on 1/T of the sequence (needs T > 1).
    cp_size: C context-parallel ranks (Ulysses, `strategies.context_parallel`), each holding 1/C of
    every sequence (`local_seq_len`) and attending over all of it for 1/C of the heads.
    These eight make `parallel`, the `ParallelLayout` the strategy builds for the same settings; every
    size this record names `<dim>_size` is `parallel.size(dim)` (`mula.layout.parallel_layout.DIMS`).
    micro_batch, seq_len: one micro-batch's sequences and tokens per sequence; micro_batches: per
    optimizer step on each data-parallel rank (gradient accumulation, or the pipeline's micro-batches).
    precision: Lightning's `trainer.precision` string. checkpointing: `model.activation_checkpointing`.
    device_type: "cpu" or an accelerator ("cuda", "xpu"): some kernels save different tensors.
    shard_optimizer: the EP-aware sharded AdamW (`strategies.XPUMoEStrategy`); False: torch AdamW with
    replicated state (DDP, single device). `SHARDING_FIELDS` are `ShardingOptions` fields, with its
    defaults, and make `sharding`, the options the optimizer would be built with (checked by it);
    collectives: as resolved for the device, "native" (reduce-scatter/all-gather: NCCL/XCCL) or
    "rooted" (gloo on CPU). no_decay, optimizer: `model.no_decay` and `model.optimizer` ("adamw" or
    "muon": its matrices keep one fp32 momentum, `mula.training.muon`); muon_ns_steps: Muon's
    Newton-Schulz iterations (`model.muon_ns_steps`), priced in the step time, and muon_ns_dtype what
    it runs in (`model.muon_ns_dtype`: its FLOP rate, and sharded Muon's two collectives' bytes).
    async_checkpoint: `FaultTolerantCheckpoint(async_save=True)`, whose staging
    copy of each rank's checkpoint state lives in host memory.
    """

    world_size: int = 1
    ep_size: int = 1
    pp_size: int = 1
    pp_schedule: str = "1f1b"
    pp_virtual_stages: int = 1
    pp_stage_layers: list[int] | None = None
    tp_size: int = 1
    sequence_parallel: bool = False
    cp_size: int = 1
    micro_batch: int = 1
    seq_len: int = 2048
    micro_batches: int = 1
    precision: str = "32-true"
    checkpointing: str | list[str] = "none"
    device_type: str = "cpu"
    shard_optimizer: bool = False
    zero_stage: int = _OPTIONS.zero_stage
    reduce_dtype: str = _OPTIONS.reduce_dtype
    bucket_numel: int = _OPTIONS.bucket_numel
    align: int = _OPTIONS.align
    ep_aware: bool = _OPTIONS.ep_aware
    offload: bool = _OPTIONS.offload
    offload_tail_buckets: int = _OPTIONS.offload_tail_buckets
    offload_speculation: bool = _OPTIONS.offload_speculation
    overlap_param_gather: bool = _OPTIONS.overlap_param_gather
    collectives: str = "native"
    async_checkpoint: bool = False
    no_decay: list[str] = field(default_factory=lambda: ["embed.weight"])
    optimizer: str = "adamw"
    muon_ns_steps: int = 5
    muon_ns_dtype: str = "bfloat16"
    parallel: ParallelLayout = field(init=False, repr=False, compare=False)
    sharding: ShardingOptions = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"Unknown precision {self.precision!r}; known: {', '.join(PRECISIONS)}.")
        self.parallel = ParallelLayout(
            world_size=self.world_size,
            ep=self.ep_size,
            pp=self.pp_size,
            tp=self.tp_size,
            cp=self.cp_size,
            schedule=self.pp_schedule,
            virtual_stages=self.pp_virtual_stages,
            stage_layers=None if self.pp_stage_layers is None else tuple(self.pp_stage_layers),
        )
        check_sequence_parallel(self.sequence_parallel, self.tp_size)
        check_muon_ns_dtype(self.muon_ns_dtype)
        for name, size in (("micro_batch", self.micro_batch), ("seq_len", self.seq_len)):
            if int(size) < 1:
                raise SENTENCES.refuse("at-least-1", name=name, size=size)
        self.sharding = ShardingOptions(**{name: getattr(self, name) for name in SHARDING_FIELDS})

    @property
    def param_bytes(self) -> int:
        """Bytes of one parameter element on the device."""
        return PRECISIONS[self.precision][0]

    @property
    def compute_bytes(self) -> int:
        """Bytes of one element of a matmul input or output (the autocast dtype under mixed precision)."""
        return PRECISIONS[self.precision][1]

    @property
    def reduce_bytes(self) -> int:
        """Bytes of one gradient-buffer element of the sharded optimizer (`reduce_dtype`)."""
        return self.sharding.reduce_bytes

    @property
    def replica_size(self) -> int:
        """Ranks of one pipeline stage and tensor-parallel index (W / (P * T)): the dense parameters'
        replicas, their gradients' reduction group (context-parallel peers included): `parallel.size("replica")`."""
        return self.parallel.replica_size

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks, each reading its own micro-batches (W / (P * T * C)): `parallel.size("dp")`."""
        return self.parallel.dp_size

    @property
    def edp_cp_size(self) -> int:
        """Ranks holding the same experts (W / (P * E * T), context-parallel peers included):
        `parallel.size("edp_cp")`."""
        return self.parallel.size("edp_cp")

    @property
    def local_seq_len(self) -> int:
        """Tokens of each sequence one rank holds (seq_len / C)."""
        return self.seq_len // self.cp_size

    def stage_holdings(self, config: Any) -> list[Holdings]:
        """What a rank of each pipeline stage holds of `config` (`ParallelLayout.rank_holdings` of the
        stage's first rank; the stage's other ranks hold the same blocks and other experts). The blocks of
        the multi-token prediction modules (`mtp_depth`, after the model's) are the last stage's, which
        also holds a copy of the embedding for them (`mula.memory.stage_params`)."""
        return list(_stage_holdings(self.parallel, config.num_layers, config.num_experts, config.mtp_depth))

    def replace(self, **changes: object) -> Layout:
        """A copy with `changes` applied (validated again)."""
        return dataclasses.replace(self, **changes)


@functools.lru_cache(maxsize=256)
def _stage_holdings(
    par: ParallelLayout, num_layers: int, num_experts: int, mtp_depth: int = 0
) -> tuple[Holdings, ...]:
    """`Layout.stage_holdings`, cached: the planner asks it dozens of times per layout, and
    `mula plan --search` of a 128-stage pipeline over thousands of layouts."""
    return tuple(par.rank_holdings(par.rank(pp=s), num_layers, num_experts, mtp_depth) for s in range(par.pp))


def check_runnable(config: Any, layout: Layout, global_batch: int) -> None:
    """Refuse, with the sentence `mula fit` would stop with, a layout the strategy or the data module
    cannot run (`mula.layout.run_check.check_run`: the stage split, the experts, ZeRO-2 under pipeline
    stages, a global batch that does not split into whole micro-batches, too few micro-batches for the
    schedule, a sequence the context-parallel ranks cannot split evenly, bf16 weights without fp32
    masters, Muon where it cannot run)."""
    from mula.layout.run_check import RunSettings, check_run

    check_run(
        RunSettings(
            layout.parallel, config, seq_len=layout.seq_len, global_batch=global_batch,
            micro_batch=layout.micro_batch, micro_batches=layout.micro_batches, precision=layout.precision,
            fp32_masters=layout.shard_optimizer, strategy="the recipe's strategy",
            zero_stage=layout.zero_stage if layout.shard_optimizer else None,
            offload=layout.shard_optimizer and layout.offload, optimizer=layout.optimizer,
            sequence_parallel=layout.sequence_parallel,
        )
    )  # fmt: skip
