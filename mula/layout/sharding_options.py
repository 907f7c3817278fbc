"""Options of the EP-aware sharded optimizer (``strategies.optim.sharded_optimizer.EPShardedAdamW``),
and the unsharded path's bucket size (`check_bucket_size`).

Torch-free, so that the optimizer and the planner (`mula plan`, which reads a recipe's
``optimizer_options`` into the same object) share one definition, defaults and checks; each refusal
sentence once, under its key in `SENTENCES` (`mula.layout.sentences`).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, fields
from typing import Any

from mula.layout.sentences import Sentences

# key -> the sentence (tests/test_cli_refusals.py runs a `mula fit` command line for each)
SENTENCES = Sentences({
    "reduce-dtype": "reduce_dtype must be a floating-point dtype ({dtypes}), got {dtype!r}.",
    "zero-stage": "zero_stage must be 1 or 2, got {zero_stage}.",
    "bucket-numel": "bucket_numel and align must be positive, got {bucket_numel}, {align}.",
    "max-grad-norm": "max_grad_norm must be positive or None, got {max_grad_norm}.",
    "at-least-0": "{name} must be >= 0, got {value}.",
    "tail-buckets-without-offload": (
        "offload_tail_buckets keeps some buckets on the device under offload; set offload: true."
    ),
    "collectives": "collectives must be 'auto', 'native' or 'rooted', got {collectives!r}.",
    "unknown-option": (
        "Unknown EPShardedAdamW option {name!r}{hint}; the options are the fields of "
        "mula.layout.sharding_options.ShardingOptions."
    ),
    "bucket-size": "bucket_size_mb must be positive, got {bucket_size_mb}.",
})  # fmt: skip

# a recipe's names for the gradient dtype -> torch's attribute name; the bytes of one element
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp64": "float64"}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


def dtype_name(dtype: Any) -> str:
    """Torch's attribute name of a floating-point dtype given as a torch dtype or a recipe's string
    ("bf16", "bfloat16", "torch.bfloat16"); one ValueError sentence for anything else."""
    name = str(dtype).removeprefix("torch.")
    name = _DTYPE_ALIASES.get(name, name)
    if name not in DTYPE_BYTES:
        raise SENTENCES.refuse("reduce-dtype", dtypes=", ".join(DTYPE_BYTES), dtype=dtype)
    return name


@dataclass
class ShardingOptions:
    """Knobs of EPShardedAdamW (all keyword arguments of the constructor and of ``from_adamw``).

    bucket_numel: elements per communication bucket (a larger parameter gets its own bucket).
    align: every parameter and every rank's shard starts at a multiple of this many elements.
    zero_stage: 1 keeps a full flat gradient buffer per bucket (gradients reduced once per
        optimizer step; accumulation with ``no_sync`` is free); 2 keeps gradients only as shards
        (a full bucket buffer lives only while its reduce-scatter is in flight; every backward,
        accumulation micro-batches included, reduce-scatters).
    overlap_grad_reduce: launch reduce-scatters from backward hooks; False reduces everything in
        ``reduce_gradients()`` (then ``p.grad`` stays readable until then).
    overlap_param_gather: leave the all-gathers in flight when ``step()`` returns and wait for each
        bucket in a forward pre-hook of the modules owning its parameters (needs ``module``).
    offload: keep master weights and moments in host memory and run the update on the CPU
        (SuperOffload's speculation, strategies/optim/offload.py): each bucket's host update starts as
        soon as its gradient reduction is launched in the step's last backward and is validated (kept,
        or undone exactly and recomputed / skipped) once the global norm and finite flag are known.
    offload_tail_buckets: with ``offload``, the last this-many buckets (the last reductions of backward,
        the first layers' parameters) keep their state on the device and update there: no host update
        would have backward left to overlap with.
    offload_speculation: with ``offload``, start the host updates during backward (True) or only in
        ``step()`` after backward (False: the benchmark's comparison; same results, and 12 bytes per
        element less host memory: speculation keeps a copy of the state slices it may have to restore).
    max_grad_norm: if set, ``step()`` clips to it unless ``clip_grad_norm_`` was already called.
    clip_after_step: no clipping during the first this-many optimizer steps (warmup); the norm is
        still computed and reported.
    reduce_dtype: dtype gradients are accumulated and reduced in (``fp32`` or ``bf16`` in a
        recipe's ``optimizer_options``; a torch dtype is accepted too), kept as torch's attribute
        name (``torch_dtype`` in ``strategies.optim.sharded_optimizer`` turns it back). fp32, the default, accumulates bf16 gradients
        (micro-batches, and the sum over ranks) without rounding them at every addition, at twice
        the buffer memory and wire bytes of bf16; bf16 reduces on the wire in bf16. Master weights
        and moments are fp32 whatever this and the parameters' dtype are.
    ep_aware: False shards dense state over EDP only (the EP-unaware comparison layout of the
        benchmark); dense gradients are then all-reduced over the world.
    collectives: "native" uses reduce-scatter and all-gather (NCCL/XCCL implement them optimally);
        "rooted" runs one reduce / broadcast per shard, rooted at the shard's owner (same traffic;
        gloo's reduce_scatter and all_gather are 2-6x slower than that on CPU); "auto" picks rooted
        for gloo, native otherwise.
    """

    bucket_numel: int = 2**24
    align: int = 16
    zero_stage: int = 1
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = False
    offload: bool = False
    offload_speculation: bool = True
    offload_tail_buckets: int = 0
    max_grad_norm: float | None = None
    clip_after_step: int = 0
    reduce_dtype: str = "float32"
    ep_aware: bool = True
    collectives: str = "auto"

    def __post_init__(self) -> None:
        if self.zero_stage not in (1, 2):
            raise SENTENCES.refuse("zero-stage", zero_stage=self.zero_stage)
        if self.bucket_numel < 1 or self.align < 1:
            raise SENTENCES.refuse("bucket-numel", bucket_numel=self.bucket_numel, align=self.align)
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise SENTENCES.refuse("max-grad-norm", max_grad_norm=self.max_grad_norm)
        if self.offload_tail_buckets < 0:
            raise SENTENCES.refuse("at-least-0", name="offload_tail_buckets", value=self.offload_tail_buckets)
        if self.offload_tail_buckets and not self.offload:
            raise SENTENCES.refuse("tail-buckets-without-offload")
        if self.clip_after_step < 0:
            raise SENTENCES.refuse("at-least-0", name="clip_after_step", value=self.clip_after_step)
        if self.collectives not in ("auto", "native", "rooted"):
            raise SENTENCES.refuse("collectives", collectives=self.collectives)
        self.reduce_dtype = dtype_name(self.reduce_dtype)

    @property
    def reduce_bytes(self) -> int:
        """Bytes of one gradient-buffer element (`reduce_dtype`)."""
        return DTYPE_BYTES[self.reduce_dtype]

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> ShardingOptions:
        """Build from keyword arguments, naming any unknown one."""
        known = [f.name for f in fields(cls)]
        for name in kwargs:
            if name not in known:
                close = difflib.get_close_matches(name, known, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise SENTENCES.refuse("unknown-option", name=name, hint=hint)
        return cls(**kwargs)


def check_bucket_size(bucket_size_mb: float) -> None:
    """Refuse a gradient bucket of the unsharded path (`XPUMoEStrategy(bucket_size_mb=...)`) that holds nothing."""
    if bucket_size_mb <= 0:
        raise SENTENCES.refuse("bucket-size", bucket_size_mb=bucket_size_mb)
