"""What a parallel layout (sizes, pipeline stages, schedule, ZeRO stage, batch split) must satisfy to run.

Every layout sentence lives here, once. `mula.layout.parallel_layout.ParallelLayout.validate` runs them for
the strategy (`XPUMoEStrategy.setup_environment`) and the planner (`mula plan`, `--search`) alike, so
both accept and refuse the same layouts with the same sentence; the data module checks its batch split
with `check_batch_split`. Torch-free.

Each check raises one ValueError sentence naming the setting to change.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

SCHEDULES = ("1f1b", "interleaved-1f1b", "gpipe")


def check_degrees(ep_size: int, pp_size: int, tp_size: int = 1, cp_size: int = 1) -> None:
    """Refuse a parallel size below 1."""
    for name, size in (("expert_parallel_size", ep_size), ("pipeline_parallel_size", pp_size),
                       ("tensor_parallel_size", tp_size), ("context_parallel_size", cp_size)):  # fmt: skip
        if size < 1:
            raise ValueError(f"{name} must be at least 1, got {size}.")


def check_world(world_size: int, ep_size: int, pp_size: int, tp_size: int = 1, cp_size: int = 1) -> None:
    """Refuse W ranks that cannot hold P stages of E-rank expert-parallel groups of C-rank context-parallel
    groups of T-rank tensor-parallel groups (one sentence naming the sizes that are not 1)."""
    if world_size < 1:
        raise ValueError(f"The world size must be at least 1, got {world_size}.")
    if ep_size > world_size and pp_size == tp_size == cp_size == 1:
        raise ValueError(
            f"expert_parallel_size={ep_size} is larger than the world size {world_size}; "
            f"use at most {world_size} ranks per expert-parallel group."
        )
    sizes = [(name, size) for name, size in (("context_parallel_size", cp_size), ("tensor_parallel_size", tp_size),
             ("pipeline_parallel_size", pp_size), ("expert_parallel_size", ep_size)) if size > 1]  # fmt: skip
    product = cp_size * tp_size * pp_size * ep_size
    if world_size % product:
        named = " x ".join(f"{name}={size}" for name, size in sizes)
        if len(sizes) > 1:
            named += f" = {product}"
        raise ValueError(
            f"The world size {world_size} is not divisible by {named}; choose "
            f"{'sizes whose product divides' if len(sizes) > 1 else 'a size that divides'} the number of ranks."
        )


def check_experts(num_experts: int, ep_size: int) -> None:
    """Refuse expert parallelism of a dense model, or E that does not divide the experts."""
    if num_experts == 0 and ep_size > 1:
        raise ValueError(
            f"expert_parallel_size={ep_size} needs an MoE model, but this model has no experts; "
            "use expert_parallel_size=1 (or DDP) for dense models."
        )
    if num_experts % ep_size != 0:
        raise ValueError(
            f"The model has {num_experts} experts, which is not divisible by expert_parallel_size={ep_size}; "
            "choose an expert-parallel size that divides the number of experts."
        )


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
    dense_mlps = config.num_moe_layers < config.num_layers
    # MLA's keys and values have one head per query head after kv_b_proj
    kv_heads = config.num_heads if getattr(config, "kv_lora_rank", None) is not None else config.kv_heads
    sizes = [("attention heads", config.num_heads), ("key/value heads", kv_heads),
             ("MLP features (intermediate_size)", config.intermediate_size if dense_mlps else 0),
             ("vocabulary entries", config.vocab_size)]  # fmt: skip
    for what, count in sizes:
        if count % tp_size:
            raise ValueError(
                f"The model's {count} {what} are not divisible by tensor_parallel_size={tp_size}; choose "
                "a tensor-parallel size that divides them."
            )


def check_context_parallel(config: Any, cp_size: int, tp_size: int = 1) -> None:
    """Refuse context parallelism where it is not available yet, or a model whose attention heads (or
    key/value heads) C x T does not divide (`config`: a `MulaConfig`; None checks the layout alone).
    C composes with pipeline stages (each stage sends its CP rank's slice of the sequence to the next),
    with tensor parallelism (Ulysses exchanges the TP rank's heads over its CP group) and with both at
    once (each stage's T x C ranks split its layers by heads and its sequences by slices)."""
    if cp_size == 1 or config is None:
        return
    # MLA's keys and values have one head per query head after kv_b_proj
    kv_heads = config.num_heads if getattr(config, "kv_lora_rank", None) is not None else config.kv_heads
    split = cp_size * tp_size
    for what, count in (("attention heads", config.num_heads), ("key/value heads", kv_heads)):
        if count % split:
            by = f"context_parallel_size={cp_size}" + (
                f" x tensor_parallel_size={tp_size}" if tp_size > 1 else ""
            )
            raise ValueError(
                f"The model's {count} {what} are not divisible by {by}; choose sizes whose product divides "
                "them (each CP rank attends over its share of its TP rank's heads)."
            )


def check_compile(compile_blocks: bool, tp_size: int) -> None:
    """Refuse `model.compile` with tensor parallelism: torch.compile cannot trace the blocks' DTensor
    weights in the tested torch releases (dynamo stops building its fake copy of a tensor-parallel
    weight: "Attempted to set the storage of a tensor on device cpu to a storage on different device
    meta"), so such a run would stop at its first step."""
    if compile_blocks and tp_size > 1:
        raise ValueError(
            f"model.compile is not yet available with tensor_parallel_size={tp_size} (torch.compile cannot "
            "trace the tensor-parallel blocks' DTensor weights); train T > 1 eagerly, or compile at T = 1."
        )


def check_optimizer(optimizer: str, tp_size: int, offload: bool) -> None:
    """Refuse Muon (`model.optimizer: muon`) where its update cannot run: Newton-Schulz orthogonalises
    whole matrices, and a tensor-parallel rank holds a slice of each dense one; the offloaded host update
    is AdamW's. (Sharded, `shard_optimizer: true`, it runs: strategies/optim/sharded_muon.py.)"""
    if optimizer != "muon":
        return
    if tp_size > 1:
        raise ValueError(
            f"model.optimizer=muon is not available with tensor_parallel_size={tp_size} (Newton-Schulz needs "
            "each whole matrix, and a tensor-parallel rank holds a slice of it); use tensor_parallel_size=1."
        )
    if offload:
        raise ValueError(
            "model.optimizer=muon does not offload its state to the host (the host update is AdamW's); "
            "set optimizer_options.offload=false."
        )


def check_sequence_split(seq_len: int, cp_size: int) -> None:
    """Refuse a sequence the C ranks of a context-parallel group cannot split into equal slices."""
    if seq_len % cp_size:
        raise ValueError(
            f"The sequence length {seq_len} is not divisible by context_parallel_size={cp_size}; choose a "
            "sequence length that splits into equal slices."
        )


def validate_schedule(schedule: str, pp_size: int, virtual_stages: int) -> None:
    """Refuse an unknown schedule or virtual stages it cannot run."""
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline_schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}.")
    if virtual_stages < 1:
        raise ValueError(f"pipeline_virtual_stages must be at least 1, got {virtual_stages}.")
    if virtual_stages > 1 and schedule != "interleaved-1f1b":
        raise ValueError(
            f"pipeline_virtual_stages={virtual_stages} needs pipeline_schedule 'interleaved-1f1b' "
            f"(got {schedule!r}, which runs one stage per rank)."
        )
    if pp_size == 1 and virtual_stages > 1:
        raise ValueError(f"pipeline_virtual_stages={virtual_stages} needs pipeline_parallel_size > 1.")


def stage_layer_counts(num_layers: int, num_stages: int, explicit: Sequence[int] | None = None) -> list[int]:
    """Blocks per stage: `explicit` (checked), else an even split with the remainder on the first stages."""
    if explicit is not None:
        counts = [int(c) for c in explicit]
        if len(counts) != num_stages:
            raise ValueError(
                f"pipeline_stage_layers has {len(counts)} entries but the pipeline has {num_stages} stages "
                "(pipeline_parallel_size x pipeline_virtual_stages); give one layer count per stage."
            )
        if min(counts) < 1:
            raise ValueError(
                f"pipeline_stage_layers {counts} has a stage without layers; every stage needs one."
            )
        if sum(counts) != num_layers:
            raise ValueError(
                f"pipeline_stage_layers {counts} sums to {sum(counts)} but the model has {num_layers} layers."
            )
        return counts
    if num_layers < num_stages:
        raise ValueError(
            f"The model has {num_layers} layers, fewer than its {num_stages} pipeline stages "
            "(pipeline_parallel_size x pipeline_virtual_stages); use fewer stages."
        )
    base, extra = divmod(num_layers, num_stages)
    return [base + (1 if s < extra else 0) for s in range(num_stages)]


def validate_split(
    config: Any, pp_size: int, virtual_stages: int, explicit: Sequence[int] | None
) -> list[int]:
    """Blocks per stage for a model config (`num_layers`, `tie_embeddings`, `aux_loss_scope`); one
    ValueError sentence for a split that cannot work."""
    if pp_size > 1 and config.tie_embeddings:
        raise ValueError(
            "tie_embeddings shares the embedding with the LM head, which sit on different pipeline stages; "
            "use pipeline_parallel_size=1 or an untied model."
        )
    if pp_size > 1 and getattr(config, "aux_loss_scope", "micro_batch") == "global":
        # its all-reduce runs inside each MoE layer's forward over all ranks, but stages run their
        # layers at different times: the ranks would wait on each other's different collectives
        raise ValueError(
            f"aux_loss_scope='global' is not available with pipeline_parallel_size={pp_size}; use "
            "aux_loss_scope='micro_batch' (or router_bias_update_rate, which works with pipeline stages)."
        )
    return stage_layer_counts(config.num_layers, pp_size * virtual_stages, explicit)


def check_micro_batches(schedule: str, pp_size: int, n_microbatches: int) -> None:
    """Refuse a step whose number of micro-batches the schedule cannot run."""
    if pp_size > 1 and schedule != "gpipe" and n_microbatches < pp_size:
        raise ValueError(
            f"pipeline_schedule {schedule!r} needs at least pipeline_parallel_size={pp_size} micro-batches "
            f"per step, but the step has {n_microbatches}; lower data.micro_batch_size or use gpipe."
        )
    rounds = max(1, n_microbatches // pp_size)
    if schedule == "interleaved-1f1b" and n_microbatches % rounds:
        raise ValueError(
            f"pipeline_schedule 'interleaved-1f1b' runs micro-batches in rounds of pipeline_parallel_size="
            f"{pp_size}; {n_microbatches} micro-batches per step are not a whole number of {rounds} rounds."
        )


def check_zero_stage(pp_size: int, zero_stage: int) -> None:
    """ZeRO-2 reduces after every backward pass, which a pipeline step interleaves with forwards."""
    if pp_size > 1 and zero_stage == 2:
        raise ValueError(
            "optimizer_options.zero_stage=2 reduces after every backward pass, which a pipeline step "
            "interleaves with forwards; use zero_stage 1 with pipeline_parallel_size > 1."
        )


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
        raise ValueError(
            f"global_batch_size {global_batch} is not divisible by data-parallel world size {dp_world} "
            f"x micro_batch_size {micro_batch}; choose sizes so that it is."
        )
