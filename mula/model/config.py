"""Model configuration: one dataclass for dense and MoE Mula models; the named presets are `mula/model/presets.py`.

The parameter and FLOP counts are computed from the config alone (no module is built), so
MFU and memory planning work for the 220B model on a laptop; `tests/test_config.py` checks them
against the real module's `numel` on the meta device.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

# The names of the choices and the rules of a config are mula/model/config_checks.py's; the names are
# re-exported here, where the kernels import them.
from mula.model.config_checks import AUX_LOSS_SCOPES as AUX_LOSS_SCOPES
from mula.model.config_checks import BACKENDS as BACKENDS
from mula.model.config_checks import NORMS as NORMS
from mula.model.config_checks import ROUTER_SCORINGS as ROUTER_SCORINGS
from mula.model.config_checks import ROUTING_MODES as ROUTING_MODES
from mula.model.config_checks import check_backend_name as check_backend_name
from mula.model.config_checks import check_config
from mula.model.presets import PRESETS  # the named presets, data with their sources (re-exported)


@dataclass
class MulaConfig:
    """Architecture of a Mula model (decoder-only transformer, dense or MoE).

    Defaults describe Mula-7B-A1B (= OLMoE-1B-7B-0924). `num_experts == 0` means a dense model whose
    MLP is a SwiGLU of width `intermediate_size`; otherwise every layer's MLP is a dropless MoE of
    `num_experts` SwiGLU experts of width `expert_intermediate_size`, `top_k` of them per token --
    except the first `num_dense_layers` blocks of an MoE model, whose MLP is the dense SwiGLU of width
    `intermediate_size` (DeepSeek-V3's `first_k_dense_replace`; 0 for every preset).

    `norm="layernorm"` is OLMo-1B's non-parametric LayerNorm (no weight, no bias); `"rmsnorm"` has a
    weight. With `qk_norm`, q and k are normalised (same norm kind) over the whole projection
    (`num_heads*head_dim` and `num_kv_heads*head_dim`), as OLMoE does, before RoPE; with
    `qk_norm_per_head` too, each head's `head_dim` features are normalised on their own, by one norm
    weight of `head_dim` shared by the heads, as Qwen3 does.

    DeepSeek-V3 family (each off by default): `num_shared_experts` SwiGLU experts of width
    `shared_expert_intermediate_size` (None = `expert_intermediate_size`) that every token goes through,
    added to the routed output (stored as one SwiGLU of the summed width, as DeepSeek does); and
    multi-head latent attention (`mula.model.mla`) when `kv_lora_rank` is set: keys and values from a
    `kv_lora_rank` latent, queries from a `q_lora_rank` latent (None = a plain q projection, as
    DeepSeek-V2-Lite), per-head query/key widths `qk_nope_head_dim` + `qk_rope_head_dim` (RoPE on the
    latter only, one RoPE key shared by all heads) and value width `v_head_dim`. MLA ignores `head_dim`,
    `num_kv_heads` and `qk_norm` (its latents have their own RMSNorms).

    Routing (MoE; every option off by default, `mula.model.moe.router`): `router_scoring` "softmax" (OLMoE,
    Qwen3-MoE) or "sigmoid" (DeepSeek-V3); group-limited routing over `n_group` equal groups of experts
    of which each token may use `topk_group` (1 and 1: no limit); the kept scores renormalised to sum
    to 1 with `norm_topk_prob`; the combine weights multiplied by `routed_scaling_factor`. `router_bias`
    keeps the per-expert selection bias buffer (DeepSeek-V3's `e_score_correction_bias`) even when
    `router_bias_update_rate` is 0, i.e. frozen (imported DeepSeek-V3 weights); a positive
    `router_bias_update_rate` implies it and updates it after every step.
    """

    name: str = "custom"
    vocab_size: int = 50304
    hidden_size: int = 2048
    num_layers: int = 16
    num_heads: int = 16
    num_kv_heads: int | None = None
    head_dim: int | None = None
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    norm: str = "rmsnorm"
    norm_eps: float = 1e-5
    qk_norm: bool = True
    qk_norm_per_head: bool = False
    intermediate_size: int = 8192
    num_experts: int = 64
    top_k: int = 8
    expert_intermediate_size: int = 1024
    norm_topk_prob: bool = False
    router_scoring: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    router_bias: bool = False
    num_dense_layers: int = 0
    router_aux_loss_coef: float = 0.01
    router_z_loss_coef: float = 0.001
    init_std: float = 0.02
    tie_embeddings: bool = False
    expert_backend: str = "auto"
    # Router balancing (training settings, not architecture): see `mula.model.moe.balancing`.
    router_bias_update_rate: float = 0.0
    aux_loss_scope: str = "micro_batch"
    routing_mode: str = "learned"
    # Capacity and token dropping (`mula.model.kernels.capacity`; training settings, not architecture):
    # None = dropless. Else each expert takes at most ceil(capacity_factor * N * top_k / num_experts) of
    # the N tokens' choices of a micro-batch on this data-parallel rank; `drop_policy` says which it
    # keeps ("probs": its highest combine weights, "position": the first in token order).
    capacity_factor: float | None = None
    drop_policy: str = "probs"
    # DeepSeek-V3 family: shared experts and multi-head latent attention (off by default)
    num_shared_experts: int = 0
    shared_expert_intermediate_size: int | None = None
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # Multi-token prediction (DeepSeek-V3 section 2.2, `mula.model.mtp`; off by default): `mtp_depth`
    # sequential modules, module k predicting the token k + 1 ahead; the loss adds `mtp_loss_weight`
    # times the mean of their cross-entropies
    mtp_depth: int = 0
    mtp_loss_weight: float = 0.3

    # The fields that define the function the weights compute (shapes and structure): a checkpoint
    # loads into a model only when these agree. The others are training settings (loss weights, init,
    # kernel choice, name) or a limit that RoPE does not store in the weights (max_position_embeddings),
    # so a run may change them when it starts from imported or earlier weights.
    ARCHITECTURE_FIELDS: ClassVar[tuple[str, ...]] = (
        "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "rope_theta",
        "norm", "norm_eps", "qk_norm", "qk_norm_per_head", "tie_embeddings", "num_experts",
    )  # fmt: skip
    # ... plus, by kind of MLP, the fields that only one kind uses
    MOE_ARCHITECTURE_FIELDS: ClassVar[tuple[str, ...]] = (
        "top_k",
        "expert_intermediate_size",
        "norm_topk_prob",
        "router_scoring",
        "n_group",
        "topk_group",
        "routed_scaling_factor",
        "num_dense_layers",
    )
    DENSE_ARCHITECTURE_FIELDS: ClassVar[tuple[str, ...]] = ("intermediate_size",)
    # ... and, with MLA (`kv_lora_rank` set), its shapes
    MLA_ARCHITECTURE_FIELDS: ClassVar[tuple[str, ...]] = (
        "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    )  # fmt: skip

    # ... and, with multi-token prediction, its depth (each module holds a block and its own weights)
    MTP_ARCHITECTURE_FIELDS: ClassVar[tuple[str, ...]] = ("mtp_depth",)

    def __post_init__(self) -> None:
        check_config(self)  # one sentence for the first rule broken (mula/model/config_checks.py)

    # ----- resolved values ------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        """True when the MLPs are mixtures of experts."""
        return self.num_experts > 0

    def is_moe_layer(self, index: int) -> bool:
        """True when block `index` has an MoE MLP (an MoE model's blocks from `num_dense_layers` on)."""
        return self.is_moe and index >= self.num_dense_layers

    @property
    def has_router_bias(self) -> bool:
        """True when every router holds the selection bias buffer (`router_bias`, or bias balancing on)."""
        return self.router_bias or self.router_bias_update_rate > 0

    @property
    def num_blocks(self) -> int:
        """Transformer blocks of the model: the `num_layers` main ones, then one per MTP module
        (`Mula.layers[num_layers + k]` is MTP module k's block, DeepSeek-V3's `model.layers.61`)."""
        return self.num_layers + self.mtp_depth

    @property
    def num_moe_layers(self) -> int:
        """Blocks with an MoE MLP (the MTP modules' included); the router losses are means over these."""
        return self.num_blocks - self.num_dense_layers if self.is_moe else 0

    def moe_layer_row(self, index: int) -> int:
        """Row of MoE block `index` (global block index) in per-MoE-layer tensors such as
        `MulaOutput.tokens_per_expert`: the MoE blocks in order, the dense first blocks skipped."""
        if not self.is_moe_layer(index):
            raise ValueError(f"Block {index} is not an MoE block of this model.")
        return index - self.num_dense_layers

    @property
    def is_mla(self) -> bool:
        """True when attention is multi-head latent attention (`kv_lora_rank` set)."""
        return self.kv_lora_rank is not None

    @property
    def rope_dim(self) -> int:
        """Features RoPE rotates per head: `qk_rope_head_dim` under MLA, else the whole head."""
        return self.qk_rope_head_dim if self.is_mla else self.head_size

    @property
    def qk_head_size(self) -> int:
        """Per-head width of queries and keys (MLA: `qk_nope_head_dim + qk_rope_head_dim`)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.is_mla else self.head_size

    @property
    def v_head_size(self) -> int:
        """Per-head width of values and of the attention output (MLA: `v_head_dim`)."""
        return self.v_head_dim if self.is_mla else self.head_size

    @property
    def shared_intermediate_size(self) -> int:
        """Width of the one SwiGLU holding all shared experts (0 without shared experts)."""
        width = self.shared_expert_intermediate_size or self.expert_intermediate_size
        return self.num_shared_experts * width

    @property
    def kv_heads(self) -> int:
        """Number of key/value heads (`num_kv_heads`, or `num_heads` when unset)."""
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def head_size(self) -> int:
        """Per-head dimension (`head_dim`, or `hidden_size // num_heads` when unset)."""
        return self.hidden_size // self.num_heads if self.head_dim is None else self.head_dim

    def architecture(self) -> dict[str, Any]:
        """The architecture fields (see `ARCHITECTURE_FIELDS`) with defaults resolved (`num_kv_heads`
        None -> `num_heads`, `head_dim` None -> `hidden_size // num_heads`): two configs whose
        architectures are equal hold interchangeable weights."""
        kind = self.MOE_ARCHITECTURE_FIELDS if self.is_moe else self.DENSE_ARCHITECTURE_FIELDS
        if self.is_moe and self.num_dense_layers:
            kind = kind + self.DENSE_ARCHITECTURE_FIELDS  # the dense first blocks' MLP width
        if self.is_mla:
            kind = kind + self.MLA_ARCHITECTURE_FIELDS
        if self.mtp_depth:  # only when set: older checkpoints' architectures stay as they were
            kind = kind + self.MTP_ARCHITECTURE_FIELDS
        arch = {name: getattr(self, name) for name in self.ARCHITECTURE_FIELDS + kind}
        arch.update(num_kv_heads=self.kv_heads, head_dim=self.head_size)
        if self.num_shared_experts:  # only when set: older checkpoints' architectures stay as they were
            arch.update(
                num_shared_experts=self.num_shared_experts,
                shared_intermediate_size=self.shared_intermediate_size,
            )
        return arch

    def architecture_differences(self, other: MulaConfig) -> list[str]:
        """'field: theirs vs ours' for each architecture field where `other` differs from this config."""
        ours, theirs = self.architecture(), other.architecture()
        return [
            f"{k}: {theirs.get(k)} vs {ours.get(k)}"
            for k in sorted(set(ours) | set(theirs))
            if ours.get(k) != theirs.get(k)
        ]

    # ----- presets -----------------------------------------------------------------------------
    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> MulaConfig:
        """The preset called `name` (see `PRESETS`), with any field replaced by `overrides`."""
        if name not in PRESETS:
            raise ValueError(f"Unknown Mula preset {name!r}; valid names: {', '.join(PRESETS)}.")
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"Unknown MulaConfig field(s) {unknown} in overrides for {name!r}.")
        return cls(**{**PRESETS[name], **overrides})

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MulaConfig:
        """Rebuild a config from `dataclasses.asdict(config)` (e.g. read from a checkpoint)."""
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"Unknown MulaConfig field(s) {unknown}; was this written by a newer Mula?")
        return cls(**d)

    # ----- counting ----------------------------------------------------------------------------
    def _norm_params(self, dim: int) -> int:
        return dim if self.norm == "rmsnorm" else 0  # layernorm is non-parametric (OLMo-1B)

    def _attn_matmul_params(self) -> int:
        return sum(numel(shape) for _, shape in self._attn_shapes() if len(shape) == 2)

    def _attn_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name under the block's `attn.`, shape) of the attention's parameters, in module order."""
        h, heads = self.hidden_size, self.num_heads
        if self.is_mla:  # mula.model.mla.LatentAttention (transformers' DeepseekV3Attention names)
            q_out, kv_rank = heads * self.qk_head_size, int(self.kv_lora_rank or 0)
            if self.q_lora_rank is None:
                shapes = [("q_proj.weight", (q_out, h))]
            else:
                r = self.q_lora_rank
                shapes = [
                    ("q_a_proj.weight", (r, h)),
                    ("q_a_layernorm.weight", (r,)),
                    ("q_b_proj.weight", (q_out, r)),
                ]
            return shapes + [
                ("kv_a_proj_with_mqa.weight", (kv_rank + self.qk_rope_head_dim, h)),
                ("kv_a_layernorm.weight", (kv_rank,)),
                ("kv_b_proj.weight", (heads * (self.qk_nope_head_dim + self.v_head_dim), kv_rank)),
                ("o_proj.weight", (h, heads * self.v_head_dim)),
            ]
        q, kv = heads * self.head_size, self.kv_heads * self.head_size
        shapes = [
            ("q_proj.weight", (q, h)),
            ("k_proj.weight", (kv, h)),
            ("v_proj.weight", (kv, h)),
            ("o_proj.weight", (h, q)),
        ]
        for name, dim in zip(("q_norm.weight", "k_norm.weight"), self.qk_norm_dims()):
            if self._norm_params(dim):
                shapes.append((name, (dim,)))
        return shapes

    def _expert_params(self) -> int:
        return 3 * self.hidden_size * self.expert_intermediate_size

    def _layer_params(self, experts: int, moe: bool) -> int:
        """Parameters of one block, MoE (`moe`, counting `experts` experts) or dense."""
        attn = sum(numel(shape) for _, shape in self._attn_shapes())  # with QK-norm or MLA's latent norms
        return attn + 2 * self._norm_params(self.hidden_size) + self._mlp_matmul_params(experts, moe)

    def qk_norm_dims(self) -> tuple[int, ...]:
        """Features of the q and k norms' weights: () without QK-norm, (head_dim, head_dim) per head,
        else the whole projections (num_heads * head_dim, num_kv_heads * head_dim)."""
        if not self.qk_norm:
            return ()
        if self.qk_norm_per_head:
            return (self.head_size, self.head_size)
        return (self.num_heads * self.head_size, self.kv_heads * self.head_size)

    def _mlp_matmul_params(self, experts: int, moe: bool) -> int:
        """Matmul parameters of one block's MLP: router + `experts` experts if `moe`, else the SwiGLU."""
        if moe:  # router, experts, and the shared experts every token goes through
            shared = 3 * self.hidden_size * self.shared_intermediate_size
            return self.num_experts * self.hidden_size + experts * self._expert_params() + shared
        return 3 * self.hidden_size * self.intermediate_size

    def _blocks_params(self, experts: int) -> int:
        """Parameters of all blocks, counting `experts` experts per MoE block."""
        dense = self.num_blocks - self.num_moe_layers
        return self.num_moe_layers * self._layer_params(experts, True) + dense * self._layer_params(0, False)

    def _outer_params(self) -> int:
        emb = self.vocab_size * self.hidden_size
        mtp = self.mtp_depth * (3 * self._norm_params(self.hidden_size) + self._mtp_proj_params())
        return emb * (1 if self.tie_embeddings else 2) + self._norm_params(self.hidden_size) + mtp

    def _mtp_proj_params(self) -> int:
        """An MTP module's `eh_proj`: [embedding; hidden] (2h) -> h."""
        return 2 * self.hidden_size * self.hidden_size

    def num_mtp_params(self) -> int:
        """Parameters of the MTP modules (their blocks, norms and projections; the embedding and the
        output head are the main model's, shared): 0 without multi-token prediction."""
        if not self.mtp_depth:
            return 0
        block = self._layer_params(self.num_experts, self.is_moe_layer(self.num_layers))
        return self.mtp_depth * (block + 3 * self._norm_params(self.hidden_size) + self._mtp_proj_params())

    def parameter_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of every parameter of the `Mula` model, in its `named_parameters()` order.

        Stacked experts are one [num_experts, ...] tensor per weight; a tied LM head is the embedding
        (listed once, as PyTorch lists shared parameters). The planner lays out the optimizer's flat
        buffers from this list without building a module; `tests/test_config.py` checks it against the
        real module on the meta device.
        """
        h, v = self.hidden_size, self.vocab_size
        shapes: list[tuple[str, tuple[int, ...]]] = [("embed.weight", (v, h))]

        def norm(name: str, dim: int) -> None:
            if self._norm_params(dim):
                shapes.append((f"{name}.weight", (dim,)))

        for i in range(self.num_blocks):
            p = f"layers.{i}."
            norm(p + "attn_norm", h)
            shapes += [(p + "attn." + name, shape) for name, shape in self._attn_shapes()]
            norm(p + "mlp_norm", h)
            if self.is_moe_layer(i):
                e, f = self.num_experts, self.expert_intermediate_size
                shapes += [
                    (p + "mlp.router.weight", (e, h)),
                    (p + "mlp.experts.gate_up", (e, 2 * f, h)),
                    (p + "mlp.experts.down", (e, h, f)),
                ]
                if self.num_shared_experts:
                    shapes += _swiglu_shapes(p + "mlp.shared_experts.", h, self.shared_intermediate_size)
            else:
                shapes += _swiglu_shapes(p + "mlp.", h, self.intermediate_size)
        norm("norm", h)
        if not self.tie_embeddings:
            shapes.append(("lm_head.weight", (v, h)))
        for k in range(self.mtp_depth):  # mula.model.mtp.MTPModule, in its module order
            norm(f"mtp.{k}.enorm", h)
            norm(f"mtp.{k}.hnorm", h)
            shapes.append((f"mtp.{k}.eh_proj.weight", (h, 2 * h)))
            norm(f"mtp.{k}.norm", h)
        return shapes

    def num_params(self) -> int:
        """Total number of parameters (tied embeddings counted once)."""
        return self._blocks_params(self.num_experts) + self._outer_params()

    def num_active_params(self) -> int:
        """Parameters used per token: all but the `num_experts - top_k` unrouted experts per MoE layer."""
        return self._blocks_params(self.top_k) + self._outer_params()

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token (forward + backward) at context length `seq_len`.

        `6 * N + 12 * num_layers * (num_heads * head_dim) * seq_len` (Kaplan et al. / PaLM appendix B),
        where N counts the matmul parameters a token goes through: attention projections, the dense
        MLP or the router plus `top_k` experts (and the shared experts), and the LM head (even when
        tied). Embedding lookups and norms are not matmuls and are left out. The second term is the
        attention score and value matmuls (QK^T and AV, forward + backward, no causal discount):
        `6 * num_layers * attention_core_width * seq_len`, which under MLA weighs the query/key width
        (`qk_nope_head_dim + qk_rope_head_dim`) and the value width per head separately;
        `num_heads * head_dim` is `hidden_size` for the OLMo/OLMoE-shaped presets, twice it for Qwen3-MoE's.
        Each multi-token prediction module adds its block, its `eh_proj` and one more pass through the LM
        head (every position counted, as the modules compute them).
        """
        matmul = sum(self.layer_matmul_params(i) for i in range(self.num_blocks))
        matmul += (1 + self.mtp_depth) * self.vocab_size * self.hidden_size
        matmul += self.mtp_depth * self._mtp_proj_params()
        attn = 6 * self.num_blocks * self.attention_core_width * seq_len
        return 6 * matmul + attn

    @property
    def attention_core_width(self) -> int:
        """`num_heads * (qk_head_size + v_head_size)`: QK^T and AV cost 2 * this FLOPs per token and key
        in the forward (`2 * num_heads * head_dim` without MLA)."""
        return self.num_heads * (self.qk_head_size + self.v_head_size)

    def layer_matmul_params(self, index: int) -> int:
        """Matmul parameters a token goes through in block `index`: attention projections and the
        dense MLP or the router plus `top_k` experts (`flops_per_token`'s N, per block)."""
        return self._attn_matmul_params() + self._mlp_matmul_params(self.top_k, self.is_moe_layer(index))


def numel(shape: tuple[int, ...]) -> int:
    """Elements of a tensor of `shape`."""
    n = 1
    for d in shape:
        n *= d
    return n


def _swiglu_shapes(prefix: str, hidden: int, width: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of a SwiGLU MLP's gate, up and down projections (`mula.mlp.MLP`) under `prefix`."""
    return [
        (prefix + "gate_proj.weight", (width, hidden)),
        (prefix + "up_proj.weight", (width, hidden)),
        (prefix + "down_proj.weight", (hidden, width)),
    ]


def resolve_config(
    config: str | MulaConfig | dict[str, Any], overrides: dict[str, Any] | None = None
) -> MulaConfig:
    """A `MulaConfig` from a preset name, a config or a dict of its fields, with `overrides` applied."""
    overrides = dict(overrides or {})
    if isinstance(config, str):
        return MulaConfig.from_name(config, **overrides)
    if isinstance(config, dict):
        config = MulaConfig.from_dict(config)
    if not isinstance(config, MulaConfig):
        raise TypeError(f"model config must be a preset name or a MulaConfig, got {type(config).__name__}.")
    unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(MulaConfig)})
    if unknown:
        raise ValueError(f"Unknown MulaConfig field(s) {unknown} in overrides.")
    return dataclasses.replace(config, **overrides)
