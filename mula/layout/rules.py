"""What a parallel layout (sizes, pipeline stages, schedule, ZeRO stage, batch split) must satisfy to run.

Every layout sentence lives here, once, under its key in `SENTENCES` (`mula.layout.sentences`).
`mula.layout.parallel_layout.ParallelLayout.validate` runs the checks for the strategy
(`XPUMoEStrategy.setup_environment`) and the planner (`mula plan`, `--search`) alike, so both accept
and refuse the same layouts with the same sentence; the data module checks its batch split with
`check_batch_split`, the strategy's constructor and the planner's `Layout` their sequence parallelism
with `check_sequence_parallel`, sharded Muon its offload with `check_optimizer`. Torch-free.

Each check raises one ValueError sentence naming the setting to change.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mula.layout.sentences import Sentences

SCHEDULES = ("1f1b", "interleaved-1f1b", "gpipe")

# key -> the sentence (tests/test_cli_refusals.py runs a `mula fit` command line for each)
SENTENCES = Sentences({
    "at-least-1": "{name} must be at least 1, got {size}.",
    "world-below-1": "The world size must be at least 1, got {world_size}.",
    "ep-above-world": (
        "expert_parallel_size={ep_size} is larger than the world size {world_size}; "
        "use at most {world_size} ranks per expert-parallel group."
    ),
    "world-not-divisible-by-size": (
        "The world size {world_size} is not divisible by {size}; choose a size that divides the number of ranks."
    ),
    "world-not-divisible-by-sizes": (
        "The world size {world_size} is not divisible by {sizes} = {product}; choose sizes whose product "
        "divides the number of ranks."
    ),
    "ep-of-dense-model": (
        "expert_parallel_size={ep_size} needs an MoE model, but this model has no experts; "
        "use expert_parallel_size=1 (or DDP) for dense models."
    ),
    "experts-not-divisible": (
        "The model has {num_experts} experts, which is not divisible by expert_parallel_size={ep_size}; "
        "choose an expert-parallel size that divides the number of experts."
    ),
    "tp-split": (
        "The model's {count} {what} are not divisible by tensor_parallel_size={tp_size}; choose "
        "a tensor-parallel size that divides them."
    ),
    "cp-split": (
        "The model's {count} {what} are not divisible by {by}; choose sizes whose product divides "
        "them (each CP rank attends over its share of its TP rank's heads)."
    ),
    "capacity-with-split-tokens": (
        "capacity_factor is not yet available with {by}, which splits a micro-batch's tokens (the "
        "capacity counts them all); leave capacity_factor unset."
    ),
    "muon-with-tp": (
        "model.optimizer=muon is not available with tensor_parallel_size={tp_size} (Newton-Schulz needs "
        "each whole matrix, and a tensor-parallel rank holds a slice of it); use tensor_parallel_size=1."
    ),
    "muon-offload": (
        "model.optimizer=muon does not offload its state to the host (the host update is AdamW's); "
        "set optimizer_options.offload=false."
    ),
    "sequence-split": (
        "The sequence length {seq_len} is not divisible by context_parallel_size={cp_size}; choose a "
        "sequence length that splits into equal slices."
    ),
    "sequence-parallel-without-tp": "sequence_parallel=True needs tensor_parallel_size > 1.",
    "unknown-schedule": "pipeline_schedule must be one of {schedules}, got {schedule!r}.",
    "virtual-stages-schedule": (
        "pipeline_virtual_stages={virtual_stages} needs pipeline_schedule 'interleaved-1f1b' "
        "(got {schedule!r}, which runs one stage per rank)."
    ),
    "virtual-stages-without-stages": "pipeline_virtual_stages={virtual_stages} needs pipeline_parallel_size > 1.",
    "stage-layers-length": (
        "pipeline_stage_layers has {entries} entries but the pipeline has {stages} stages "
        "(pipeline_parallel_size x pipeline_virtual_stages); give one layer count per stage."
    ),
    "stage-without-layers": "pipeline_stage_layers {counts} has a stage without layers; every stage needs one.",
    "stage-layers-sum": "pipeline_stage_layers {counts} sums to {total} but the model has {num_layers} layers.",
    "more-stages-than-layers": (
        "The model has {num_layers} layers, fewer than its {stages} pipeline stages "
        "(pipeline_parallel_size x pipeline_virtual_stages); use fewer stages."
    ),
    "tied-embeddings-across-stages": (
        "tie_embeddings shares the embedding with the LM head, which sit on different pipeline stages; "
        "use pipeline_parallel_size=1 or an untied model."
    ),
    "mtp-across-stages": (
        "mtp_depth={mtp_depth} with pipeline_parallel_size={pp_size} needs shard_optimizer=false (only "
        "the unsharded optimizer keeps the last stage's embedding copy in step yet)."
    ),
    "global-aux-loss-across-stages": (
        "aux_loss_scope='global' is not available with pipeline_parallel_size={pp_size}; use "
        "aux_loss_scope='micro_batch' (or router_bias_update_rate, which works with pipeline stages)."
    ),
    "fewer-micro-batches-than-stages": (
        "pipeline_schedule {schedule!r} needs at least pipeline_parallel_size={pp_size} micro-batches "
        "per step, but the step has {micro_batches}; lower data.micro_batch_size or use gpipe."
    ),
    "interleaved-rounds": (
        "pipeline_schedule 'interleaved-1f1b' runs micro-batches in rounds of pipeline_parallel_size="
        "{pp_size}; {micro_batches} micro-batches per step are not a whole number of {rounds} rounds."
    ),
    "zero-2-across-stages": (
        "optimizer_options.zero_stage=2 reduces after every backward pass, which a pipeline step "
        "interleaves with forwards; use zero_stage 1 with pipeline_parallel_size > 1."
    ),
    "batch-split": (
        "global_batch_size {global_batch} is not divisible by data-parallel world size {dp_world} "
        "x micro_batch_size {micro_batch}; choose sizes so that it is."
    ),
    "master-weights": (
        "trainer.precision={precision} holds half-precision weights and {strategy} keeps no fp32 masters "
        "(updates would round away); use shard_optimizer: true or --trainer.precision=bf16-mixed."
    ),
})  # fmt: skip


def check_degrees(ep_size: int, pp_size: int, tp_size: int = 1, cp_size: int = 1) -> None:
    """Refuse a parallel size below 1."""
    for name, size in (("expert_parallel_size", ep_size), ("pipeline_parallel_size", pp_size),
                       ("tensor_parallel_size", tp_size), ("context_parallel_size", cp_size)):  # fmt: skip
        if size < 1:
            raise SENTENCES.refuse("at-least-1", name=name, size=size)


def check_world(world_size: int, ep_size: int, pp_size: int, tp_size: int = 1, cp_size: int = 1) -> None:
    """Refuse W ranks that cannot hold P stages of E-rank expert-parallel groups of C-rank context-parallel
    groups of T-rank tensor-parallel groups (one sentence naming the sizes that are not 1)."""
    if world_size < 1:
        raise SENTENCES.refuse("world-below-1", world_size=world_size)
    if ep_size > world_size and pp_size == tp_size == cp_size == 1:
        raise SENTENCES.refuse("ep-above-world", ep_size=ep_size, world_size=world_size)
    sizes = [(name, size) for name, size in (("context_parallel_size", cp_size), ("tensor_parallel_size", tp_size),
             ("pipeline_parallel_size", pp_size), ("expert_parallel_size", ep_size)) if size > 1]  # fmt: skip
    product = cp_size * tp_size * pp_size * ep_size
    if world_size % product:
        named = " x ".join(f"{name}={size}" for name, size in sizes)
        if len(sizes) > 1:
            raise SENTENCES.refuse(
                "world-not-divisible-by-sizes", world_size=world_size, sizes=named, product=product
            )
        raise SENTENCES.refuse("world-not-divisible-by-size", world_size=world_size, size=named)


def check_experts(num_experts: int, ep_size: int) -> None:
    """Refuse expert parallelism of a dense model, or E that does not divide the experts."""
    if num_experts == 0 and ep_size > 1:
        raise SENTENCES.refuse("ep-of-dense-model", ep_size=ep_size)
    if num_experts % ep_size != 0:
        raise SENTENCES.refuse("experts-not-divisible", num_experts=num_experts, ep_size=ep_size)


def check_tensor_parallel(config: Any, tp_size: int) -> None:
    """Refuse tensor parallelism where it is not available yet, or a model whose heads, KV heads, dense
    MLP width or vocabulary T does not divide (`config`: a `MulaConfig`; None checks the layout alone).
    MoE layers are accepted: their experts stay whole and their tokens are split over the T ranks;
    pipeline stages too (each stage's modules split over its own TP group); so are Qwen3's per-head
    QK-norm (`qk_norm_per_head`: its one head_dim weight stays replicated over TP, its partial gradients
    summed over the TP group) and DeepSeek-V3's multi-head latent attention (`kv_lora_rank`: the
    low-rank down projections replicated, the up projections split by heads)."""
    if tp_size == 1 or config is None:
        return
    # MoE layers keep their experts whole (their tokens are split): only dense MLPs split their features
    dense_mlps = config.num_moe_layers < config.num_blocks
    # MLA's keys and values have one head per query head after kv_b_proj
    kv_heads = config.num_heads if config.kv_lora_rank is not None else config.kv_heads
    sizes = [("attention heads", config.num_heads), ("key/value heads", kv_heads),
             ("MLP features (intermediate_size)", config.intermediate_size if dense_mlps else 0),
             ("vocabulary entries", config.vocab_size)]  # fmt: skip
    for what, count in sizes:
        if count % tp_size:
            raise SENTENCES.refuse("tp-split", count=count, what=what, tp_size=tp_size)


def check_context_parallel(config: Any, cp_size: int, tp_size: int = 1) -> None:
    """Refuse context parallelism where it is not available yet, or a model whose attention heads (or
    key/value heads) C x T does not divide (`config`: a `MulaConfig`; None checks the layout alone).
    C composes with pipeline stages (each stage sends its CP rank's slice of the sequence to the next),
    with tensor parallelism (Ulysses exchanges the TP rank's heads over its CP group) and with both at
    once (each stage's T x C ranks split its layers by heads and its sequences by slices)."""
    if cp_size == 1 or config is None:
        return
    # MLA's keys and values have one head per query head after kv_b_proj
    kv_heads = config.num_heads if config.kv_lora_rank is not None else config.kv_heads
    split = cp_size * tp_size
    for what, count in (("attention heads", config.num_heads), ("key/value heads", kv_heads)):
        if count % split:
            by = f"context_parallel_size={cp_size}" + (
                f" x tensor_parallel_size={tp_size}" if tp_size > 1 else ""
            )
            raise SENTENCES.refuse("cp-split", count=count, what=what, by=by)


def check_capacity(config: Any, tp_size: int, cp_size: int) -> None:
    """Refuse an expert capacity where a micro-batch's tokens are split over ranks (T or C > 1): each
    rank would count its share, so the drops would not be one process's (`mula.model.kernels.capacity`)."""
    if config is None or config.capacity_factor is None:
        return
    split = [f"{name}={size}" for name, size in (("tensor_parallel_size", tp_size),
             ("context_parallel_size", cp_size)) if size > 1]  # fmt: skip
    if split:
        raise SENTENCES.refuse("capacity-with-split-tokens", by=" x ".join(split))


def check_optimizer(optimizer: str, tp_size: int, offload: bool) -> None:
    """Refuse Muon (`model.optimizer: muon`) where its update cannot run: Newton-Schulz orthogonalises
    whole matrices, and a tensor-parallel rank holds a slice of each dense one; the offloaded host update
    is AdamW's. (Sharded, `shard_optimizer: true`, it runs: strategies/optim/sharded_muon.py.)"""
    if optimizer != "muon":
        return
    if tp_size > 1:
        raise SENTENCES.refuse("muon-with-tp", tp_size=tp_size)
    if offload:
        raise SENTENCES.refuse("muon-offload")


def check_master_weights(precision: str, fp32_masters: bool, strategy: str) -> None:
    """Refuse bf16/fp16 weights that no optimizer keeps fp32 master weights for: under `precision:
    bf16-true` Lightning holds the weights in bf16, and a plain AdamW would update them in bf16, where
    most updates at pretraining learning rates are below one ulp of the weight and are lost. `strategy`:
    the strategy's class name, for the sentence."""
    if precision in ("bf16-true", "16-true") and not fp32_masters:
        raise SENTENCES.refuse("master-weights", precision=precision, strategy=strategy)


def check_sequence_split(seq_len: int, cp_size: int) -> None:
    """Refuse a sequence the C ranks of a context-parallel group cannot split into equal slices."""
    if seq_len % cp_size:
        raise SENTENCES.refuse("sequence-split", seq_len=seq_len, cp_size=cp_size)


def check_sequence_parallel(sequence_parallel: bool, tp_size: int) -> None:
    """Refuse sequence parallelism without tensor parallelism: it splits T's norms and residual stream."""
    if sequence_parallel and tp_size == 1:
        raise SENTENCES.refuse("sequence-parallel-without-tp")


def validate_schedule(schedule: str, pp_size: int, virtual_stages: int) -> None:
    """Refuse an unknown schedule or virtual stages it cannot run."""
    if schedule not in SCHEDULES:
        raise SENTENCES.refuse("unknown-schedule", schedules=", ".join(SCHEDULES), schedule=schedule)
    if virtual_stages < 1:
        raise SENTENCES.refuse("at-least-1", name="pipeline_virtual_stages", size=virtual_stages)
    if virtual_stages > 1 and schedule != "interleaved-1f1b":
        raise SENTENCES.refuse("virtual-stages-schedule", virtual_stages=virtual_stages, schedule=schedule)
    if pp_size == 1 and virtual_stages > 1:
        raise SENTENCES.refuse("virtual-stages-without-stages", virtual_stages=virtual_stages)


def stage_layer_counts(num_layers: int, num_stages: int, explicit: Sequence[int] | None = None) -> list[int]:
    """Blocks per stage: `explicit` (checked), else an even split with the remainder on the first stages."""
    if explicit is not None:
        counts = [int(c) for c in explicit]
        if len(counts) != num_stages:
            raise SENTENCES.refuse("stage-layers-length", entries=len(counts), stages=num_stages)
        if min(counts) < 1:
            raise SENTENCES.refuse("stage-without-layers", counts=counts)
        if sum(counts) != num_layers:
            raise SENTENCES.refuse(
                "stage-layers-sum", counts=counts, total=sum(counts), num_layers=num_layers
            )
        return counts
    if num_layers < num_stages:
        raise SENTENCES.refuse("more-stages-than-layers", num_layers=num_layers, stages=num_stages)
    base, extra = divmod(num_layers, num_stages)
    return [base + (1 if s < extra else 0) for s in range(num_stages)]


def validate_split(
    config: Any, pp_size: int, virtual_stages: int, explicit: Sequence[int] | None
) -> list[int]:
    """Blocks per stage for a model config (`num_layers`, `tie_embeddings`, `aux_loss_scope`); one
    ValueError sentence for a split that cannot work."""
    if pp_size > 1 and config.tie_embeddings:
        raise SENTENCES.refuse("tied-embeddings-across-stages")
    if pp_size > 1 and config.aux_loss_scope == "global":
        # its all-reduce runs inside each MoE layer's forward over all ranks, but stages run their
        # layers at different times: the ranks would wait on each other's different collectives
        raise SENTENCES.refuse("global-aux-loss-across-stages", pp_size=pp_size)
    return stage_layer_counts(config.num_layers, pp_size * virtual_stages, explicit)


def check_micro_batches(schedule: str, pp_size: int, n_microbatches: int) -> None:
    """Refuse a step whose number of micro-batches the schedule cannot run."""
    if pp_size > 1 and schedule != "gpipe" and n_microbatches < pp_size:
        raise SENTENCES.refuse(
            "fewer-micro-batches-than-stages",
            schedule=schedule,
            pp_size=pp_size,
            micro_batches=n_microbatches,
        )
    rounds = max(1, n_microbatches // pp_size)
    if schedule == "interleaved-1f1b" and n_microbatches % rounds:
        raise SENTENCES.refuse(
            "interleaved-rounds", pp_size=pp_size, micro_batches=n_microbatches, rounds=rounds
        )


def check_mtp_stages(config: Any, pp_size: int, zero_stage: int | None) -> None:
    """Multi-token prediction across pipeline stages keeps the last stage's copy of the embedding in step
    with the first stage's by summing their reduced gradients (strategies/pipeline/embedding.py), which
    the unsharded optimizer's whole gradients allow; the sharded optimizer's (`zero_stage` not None)
    shards of them differ between the stages."""
    if pp_size > 1 and zero_stage is not None and config is not None and config.mtp_depth:
        raise SENTENCES.refuse("mtp-across-stages", mtp_depth=config.mtp_depth, pp_size=pp_size)


def check_zero_stage(pp_size: int, zero_stage: int) -> None:
    """ZeRO-2 reduces after every backward pass, which a pipeline step interleaves with forwards."""
    if pp_size > 1 and zero_stage == 2:
        raise SENTENCES.refuse("zero-2-across-stages")


def micro_batches_per_step(global_batch: int, dp_world: int, micro_batch: int, *, check: bool = True) -> int:
    """Micro-batches each data-parallel rank runs per optimizer step (its gradient accumulation, or its
    pipeline's micro-batches). The split is checked first; `check=False` (the planner, which checks the
    whole layout afterwards in the order a run meets the rules) gives at least 1 instead."""
    if check:
        check_batch_split(global_batch, dp_world, micro_batch)
    return max(1, global_batch // (dp_world * micro_batch))


def check_batch_split(global_batch: int, dp_world: int, micro_batch: int) -> None:
    """The global batch must split into whole micro-batches on every data-parallel rank."""
    if global_batch % (dp_world * micro_batch):
        raise SENTENCES.refuse(
            "batch-split", global_batch=global_batch, dp_world=dp_world, micro_batch=micro_batch
        )
