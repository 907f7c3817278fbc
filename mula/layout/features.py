"""The features a training layout combines, one registry, and which combinations the validator accepts.

A user composing a layout (docs/layouts.md) picks parallel dimensions, an optimizer sharding, a
precision, what backward recomputes, compilation, and a model family's attention and routing. Each of
those is a `Feature` here, once. `probe` turns a set of features into one concrete tiny run -- the
strategy's arguments, the model's overrides, the trainer's precision, recompute and compile settings --
and `refusal` asks the validator the strategy and `mula plan` use (`ParallelLayout.validate`, with the
model config, the sharded optimizer's ZeRO stage and the step's batch) whether that run is accepted: the
sentence it stops with, or None. The matrix (`combinations`, `matrix`) is generated from it, so what
docs/layouts.md calls accepted or refused is what a run meets.

Features of one `group` are one setting (a schedule, a ZeRO stage, an attention kind): they never
combine with each other, nor does the full recompute with a part of it (`excluded`). Some features bring another with them: sequence parallelism
needs T, and offload and bf16-true need the sharded optimizer (ZeRO-1 when no stage is named).

The equality runs that cover the accepted combinations are the suite's (tests/layout_coverage.py); the
suite checks that every accepted pair, and every accepted triple of parallel dimensions, is covered.
Torch-free.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from mula.layout.parallel_layout import ParallelLayout
from mula.layout.run_check import RunSettings, check_run
from mula.model.config import resolve_config


@dataclass(frozen=True)
class Feature:
    """One thing a layout turns on: `name` (as docs/layouts.md writes it), `group` (features of one group
    are one setting and exclude each other), `setting` (the recipe words that turn it on) and `summary`."""

    name: str
    group: str
    setting: str
    summary: str


S = "trainer.strategy.init_args."
FEATURES: tuple[Feature, ...] = (
    Feature("E", "E", f"{S}expert_parallel_size", "expert parallelism: experts split over E ranks, tokens all-to-all"),
    Feature("P", "P", f"{S}pipeline_parallel_size", "pipeline stages, the 1F1B schedule"),
    Feature("P-interleaved", "P", f"{S}pipeline_schedule: interleaved-1f1b", "pipeline stages, interleaved 1F1B (2 virtual stages per rank)"),
    Feature("P-GPipe", "P", f"{S}pipeline_schedule: gpipe", "pipeline stages, the GPipe schedule"),
    Feature("T", "T", f"{S}tensor_parallel_size", "tensor parallelism (Megatron): dense layers split over T ranks"),
    Feature("SP", "SP", f"{S}sequence_parallel", "sequence parallelism: T's norms and residual stream split by tokens (needs T)"),
    Feature("C", "C", f"{S}context_parallel_size", "context parallelism (Ulysses): every sequence split over C ranks"),
    Feature("ZeRO-1", "ZeRO", f"{S}shard_optimizer", "the EP-aware sharded optimizer, full gradient buckets"),
    Feature("ZeRO-2", "ZeRO", f"{S}optimizer_options.zero_stage: 2", "the sharded optimizer, gradients reduce-scattered after every backward"),
    Feature("Muon", "optimizer", "model.optimizer: muon", "Muon for the blocks' matrices, AdamW for the rest (sharded by matrix with ZeRO)"),
    Feature("offload", "offload", f"{S}optimizer_options.offload", "optimizer state and update on the host (needs the sharded optimizer)"),
    Feature("bf16-true", "precision", "trainer.precision: bf16-true", "bf16 weights, fp32 masters in the sharded optimizer"),
    Feature("recompute-full", "recompute", "model.activation_checkpointing: full", "every block recomputed in backward"),
    Feature("recompute-moe", "recompute-moe", "model.activation_checkpointing: [moe]", "MoE layers recomputed in backward"),
    Feature("recompute-attention", "recompute-attention", "model.activation_checkpointing: [attention]", "attention recomputed in backward"),
    Feature("recompute-norms", "recompute-norms", "model.activation_checkpointing: [norms]", "norms recomputed in backward"),
    Feature("compile", "compile", "model.compile", "torch.compile of every block"),
    Feature("MLA", "attention", "model.overrides.kv_lora_rank", "multi-head latent attention (DeepSeek-V3)"),
    Feature("QK-norm-per-head", "attention", "model.overrides.qk_norm_per_head", "per-head QK RMSNorm (Qwen3)"),
    Feature("GQA", "kv-heads", "model.overrides.num_kv_heads", "grouped-query attention: fewer key/value heads than query heads (OLMoE-style 4 heads over 2 KV heads)"),
    Feature("DeepSeek-routing", "routing", "model.overrides.router_scoring: sigmoid", "sigmoid scores, group-limited top-k, scaling, router bias (DeepSeek-V3)"),
    Feature("dense-first-blocks", "dense-first", "model.overrides.num_dense_layers", "dense MLPs in the first blocks of an MoE model (DeepSeek-V3)"),
    Feature("MTP", "mtp", "model.overrides.mtp_depth", "multi-token prediction: a module (MoE block) predicting the token 2 ahead (DeepSeek-V3)"),
)  # fmt: skip
BY_NAME = {f.name: f for f in FEATURES}
# the rank dimensions (a P schedule is P); triples of these are checked too
PARALLEL = ("E", "P", "T", "C")
PIPELINES = ("P", "P-interleaved", "P-GPipe")

# the probe's run: a tiny MoE every parallel size of 2 splits (4 heads and KV heads, 4 experts, 4 blocks:
# 2 stages of 2 virtual stages), sequences of SEQ tokens, a global batch of MICROS micro-batches of MICRO
SEQ, MICRO, MICROS = 64, 2, 4
PRESET = "mula-tiny-moe"
BASE: dict[str, Any] = dict(
    vocab_size=256, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=4, intermediate_size=64,
    num_experts=4, top_k=2, expert_intermediate_size=32, max_position_embeddings=SEQ, norm="rmsnorm",
    qk_norm=True, tie_embeddings=False, router_bias_update_rate=1e-3,
)  # fmt: skip
MODEL_FEATURES: dict[str, dict[str, Any]] = {
    "MLA": dict(
        qk_norm=False, num_kv_heads=None, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=8,
    ),
    "QK-norm-per-head": dict(qk_norm_per_head=True, head_dim=16),
    "GQA": dict(num_kv_heads=2),
    "DeepSeek-routing": dict(
        router_scoring="sigmoid", n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5,
        router_bias=True,
    ),
    "dense-first-blocks": dict(num_dense_layers=1),
    "MTP": dict(mtp_depth=1),
}  # fmt: skip
# the block parts activation checkpointing can recompute on their own (any of them together), or all
RECOMPUTE_PARTS = {"recompute-moe": "moe", "recompute-attention": "attention", "recompute-norms": "norms"}


@dataclass(frozen=True)
class Probe:
    """One concrete run that turns on `features` (what an equality run of them trains, and what the
    validator is asked about): `world_size` ranks, `strategy` (XPUMoEStrategy's keyword arguments),
    `overrides` of the `PRESET` model, the trainer's `precision`, the module's `activation_checkpointing`,
    `compile` and `optimizer`; `dp_size` data-parallel ranks (each reads `micro_batches` micro-batches of
    `micro_batch` sequences per step: its share of the step's MICROS * MICRO)."""

    features: frozenset[str]
    world_size: int
    strategy: dict[str, Any] = field(hash=False)
    overrides: dict[str, Any] = field(hash=False)
    precision: str = "32-true"
    activation_checkpointing: str | list[str] = "none"
    compile: bool = False
    optimizer: str = "adamw"

    @property
    def layout(self) -> ParallelLayout:
        """The strategy's layout of this run (its sizes; not validated against a model yet)."""
        s = self.strategy
        return ParallelLayout(
            self.world_size, s.get("expert_parallel_size", 1), s.get("pipeline_parallel_size", 1),
            s.get("tensor_parallel_size", 1), s.get("context_parallel_size", 1), s.get("pipeline_schedule", "1f1b"),
            s.get("pipeline_virtual_stages", 1),
        )  # fmt: skip

    @property
    def dp_size(self) -> int:
        """Ranks reading different data."""
        return self.layout.dp_size

    @property
    def micro_batch(self) -> int:
        """Sequences per micro-batch: MICRO, or fewer where the ranks reading data leave a rank fewer of
        the step's MICROS * MICRO sequences."""
        return min(MICRO, MICROS * MICRO // self.dp_size)

    @property
    def micro_batches(self) -> int:
        """Micro-batches each data-parallel rank accumulates per step."""
        return MICROS * MICRO // (self.dp_size * self.micro_batch)


class Row(frozenset):
    """A set of features with the sizes of some of its parallel dimensions (`sizes`: feature name ->
    ranks, e.g. {"E": 4}; every other dimension named has size 2) and its ranks (`world`, 0: as `probe`
    chooses): a run at sizes the plain probe does not reach. Equal to the plain set of its features
    wherever sets are compared."""

    sizes: dict[str, int]
    world: int

    def __new__(cls, features: Iterable[str], sizes: dict[str, int] | None = None, world: int = 0) -> Row:
        row = super().__new__(cls, closure(features))
        row.sizes, row.world = dict(sizes or {}), world
        named = (row & {"E", "T", "C"}) | ({"P"} if row & set(PIPELINES) else set())
        if not set(row.sizes) <= named:
            raise ValueError(
                f"A row's sizes name its parallel dimensions ({sorted(named)}), got {sorted(row.sizes)}."
            )
        return row

    def __reduce__(self):  # pickled into the ranks of a launch with its sizes
        return Row, (frozenset(self), self.sizes, self.world)


def closure(features: Iterable[str]) -> frozenset[str]:
    """`features` with the ones they bring (SP brings T; offload and bf16-true bring ZeRO-1 when no ZeRO
    stage is named: the sharded optimizer's host update, its fp32 masters); an unknown name or two
    features of one group is one ValueError sentence."""
    names = set(features)
    unknown = sorted(names - BY_NAME.keys())
    if unknown:
        raise ValueError(f"Unknown layout feature(s) {unknown}; known: {[f.name for f in FEATURES]}.")
    if "SP" in names:
        names.add("T")
    if names & {"offload", "bf16-true"} and not names & {"ZeRO-1", "ZeRO-2"}:
        names.add("ZeRO-1")  # offload's host update and bf16's fp32 masters are the sharded optimizer's
    if "recompute-full" in names and names & RECOMPUTE_PARTS.keys():
        raise ValueError("recompute-full recomputes every part already; name it or the parts, not both.")
    if {"MLA", "GQA"} <= names:
        raise ValueError(
            "MLA has one key/value head per query head, so it has no KV heads to group; choose one."
        )
    for group, members in itertools.groupby(
        sorted(names, key=lambda n: BY_NAME[n].group), lambda n: BY_NAME[n].group
    ):
        members = sorted(members)
        if len(members) > 1:
            raise ValueError(f"{' and '.join(members)} are one setting ({group}); choose one.")
    return frozenset(names)


def probe(features: Iterable[str]) -> Probe:
    """The one tiny run of `features` (module docstring): every parallel dimension named has size 2 (or
    a `Row`'s size), on max(4, their product) ranks (or a `Row`'s; the rest data-parallel)."""
    names = closure(features)
    sizes, world = (features.sizes, features.world) if isinstance(features, Row) else ({}, 0)
    size = {"E": 2, "P": 2, "T": 2, "C": 2, **sizes}
    strategy: dict[str, Any] = {}
    pipeline = names & set(PIPELINES)
    args = {"E": "expert_parallel_size", "T": "tensor_parallel_size", "C": "context_parallel_size"}
    for name, arg in args.items():
        if name in names:
            strategy[arg] = size[name]
    if pipeline:
        strategy["pipeline_parallel_size"] = size["P"]
        if "P-interleaved" in pipeline:
            strategy.update(pipeline_schedule="interleaved-1f1b", pipeline_virtual_stages=2)
        elif "P-GPipe" in pipeline:
            strategy["pipeline_schedule"] = "gpipe"
    if "SP" in names:
        strategy["sequence_parallel"] = True
    strategy["shard_optimizer"] = bool(names & {"ZeRO-1", "ZeRO-2"})  # else torch's AdamW
    if strategy["shard_optimizer"]:
        options: dict[str, Any] = {"zero_stage": 2 if "ZeRO-2" in names else 1}
        if "offload" in names:
            options["offload"] = True
        strategy["optimizer_options"] = options
    overrides = dict(BASE)
    for name, extra in MODEL_FEATURES.items():
        if name in names:
            overrides.update(extra)
    parts = [part for name, part in RECOMPUTE_PARTS.items() if name in names]
    recompute: str | list[str] = "full" if "recompute-full" in names else parts or "none"
    product = math.prod(size[name] for name in names & {"E", "T", "C"}) * (size["P"] if pipeline else 1)
    return Probe(
        features=names,
        world_size=world or max(4, product),
        strategy=strategy,
        overrides=overrides,
        precision="bf16-true" if "bf16-true" in names else "32-true",
        activation_checkpointing=recompute,
        compile="compile" in names,
        optimizer="muon" if "Muon" in names else "adamw",
    )  # fmt: skip


def refusal(features: Iterable[str]) -> str | None:
    """The sentence a run of `features` (`probe`) is stopped with (`mula.layout.run_check.check_run`, as
    its strategy, `mula fit` and `mula plan` apply it), or None when it is accepted."""
    try:
        run = probe(features)
        options = run.strategy.get("optimizer_options", {})
        sharded = bool(run.strategy.get("shard_optimizer"))
        check_run(
            RunSettings(
                run.layout, resolve_config(PRESET, run.overrides), seq_len=SEQ, global_batch=MICROS * MICRO,
                micro_batch=run.micro_batch, micro_batches=run.micro_batches, precision=run.precision,
                fp32_masters=sharded, zero_stage=options.get("zero_stage") if sharded else None,
                offload=bool(options.get("offload")), optimizer=run.optimizer,
                sequence_parallel=bool(run.strategy.get("sequence_parallel")),
            )
        )  # fmt: skip
    except ValueError as err:
        return str(err)
    return None


def excluded(a: str, b: str) -> bool:
    """Whether features `a` and `b` are one setting (one group, the full recompute and a part of it, or
    MLA and GQA: MLA's keys and values have one head per query head, so it has no KV heads to group):
    not a combination."""
    full = {a, b} & {"recompute-full"} and {a, b} & RECOMPUTE_PARTS.keys()
    return BY_NAME[a].group == BY_NAME[b].group or bool(full) or {a, b} == {"MLA", "GQA"}


def combinations() -> list[frozenset[str]]:
    """Every pair of features of different groups (SP with T is T with SP: one pair), and every triple of
    parallel dimensions (a P schedule standing for P): what the matrix lists."""
    out = []
    for a, b in itertools.combinations(FEATURES, 2):
        if not excluded(a.name, b.name):
            out.append(frozenset((a.name, b.name)))
    for triple in itertools.combinations(PARALLEL, 3):
        out.append(frozenset(triple))
    return out


def matrix() -> dict[frozenset[str], str | None]:
    """Every combination of `combinations` -> the validator's refusal sentence, or None (accepted)."""
    return {combo: refusal(combo) for combo in combinations()}
