"""The model's parameters as the optimizer sees them: names, shapes and param groups, in its order.

Read from `MulaConfig.parameter_shapes` (the module's `named_parameters()` order, checked against the
real module in tests/test_config.py) and split into param groups by the same `no_decay` rule as
`MulaLightningModule.param_groups`, so the planner sees exactly the order in which `EPShardedAdamW`
registers parameters, and therefore lays out exactly the same flat buckets. Nothing is built or
allocated, and torch is not imported: `mula plan` stays fast for the 220B model.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass

from mula.model.config import MulaConfig, numel
from mula.model.param_names import is_expert_param, is_muon_param, is_no_decay

# the LightningModule holds the Mula model as `.model`: the optimizer's names carry this prefix
_MODULE_PREFIX = "model."


@dataclass(frozen=True)
class ParamSpec:
    """One parameter of the full (unsliced) model: optimizer name, shape, param group, layer."""

    name: str
    shape: tuple[int, ...]
    group: int
    layer: int | None  # the block index, None for the embedding, final norm and LM head
    tp_replicated: bool = False  # whole on every TP rank whatever its name (Qwen3's per-head QK-norm weights)
    muon: bool = False  # trained by Muon (`model.optimizer: muon`, `is_muon_param`), else by AdamW

    @property
    def numel(self) -> int:
        """Elements of the full parameter."""
        return numel(self.shape)

    @functools.cached_property
    def is_expert(self) -> bool:
        """Stacked expert weights [num_experts, ...]: sliced over the EP group, sharded over EDP."""
        return is_expert_param(self.name)


_LAYER = re.compile(r"\.layers\.(\d+)\.")

# The dimension `strategies.tensor_parallel` splits each parameter along over the T ranks (a DTensor
# Shard(dim)), by the name's ending: vocabulary rows of the embedding and the LM head, output features
# of the column-parallel q/k/v and gate/up projections (and of the QK-norm weights, split like the heads)
# and of MLA's q_b/kv_b up projections, input features of the row-parallel o_proj and down_proj. Everything
# else (the block norms, MLA's down projections and latent norms) is replicated, and so are the QK-norm
# weights of `qk_norm_per_head` (one head_dim vector shared by the heads).
TP_SPLIT_DIMS = {
    "embed.weight": 0, "lm_head.weight": 0,
    "attn.q_proj.weight": 0, "attn.k_proj.weight": 0, "attn.v_proj.weight": 0, "attn.o_proj.weight": 1,
    "attn.q_norm.weight": 0, "attn.k_norm.weight": 0,
    "attn.q_b_proj.weight": 0, "attn.kv_b_proj.weight": 0,
    "mlp.gate_proj.weight": 0, "mlp.up_proj.weight": 0, "mlp.down_proj.weight": 1,
}  # fmt: skip


def tp_local_shape(
    name: str, shape: tuple[int, ...], tp_size: int, replicated: bool = False
) -> tuple[int, ...]:
    """The shape of the local shard of parameter `name` (full `shape`) on the first of `tp_size`
    tensor-parallel ranks: DTensor's Shard(dim) keeps ceil(n / T) rows of the split dimension there
    (`check_tensor_parallel` makes T divide every split dimension, so every rank holds as many);
    `shape` itself when `replicated` (`ParamSpec.tp_replicated`)."""
    if tp_size == 1 or replicated:
        return shape
    for suffix, dim in TP_SPLIT_DIMS.items():
        if name == suffix or name.endswith("." + suffix):
            return (*shape[:dim], -(-shape[dim] // tp_size), *shape[dim + 1 :])
    return shape


def model_parameters(
    config: MulaConfig, no_decay: tuple[str, ...] = ("embed.weight",), optimizer: str = "adamw"
) -> list[ParamSpec]:
    """Every trainable parameter of `config`'s model in the sharded optimizer's registration order."""
    return list(_cached(tuple(sorted(dataclasses.asdict(config).items())), tuple(no_decay), optimizer))


@functools.lru_cache(maxsize=16)
def _cached(config_items: tuple, no_decay: tuple[str, ...], optimizer: str) -> tuple[ParamSpec, ...]:
    config = MulaConfig(**dict(config_items))
    shapes = config.parameter_shapes()
    per_head = ("attn.q_norm.weight", "attn.k_norm.weight") if config.qk_norm_per_head else ()
    # param_groups: decayed parameters (group 0), then those matching no_decay (group 1, when named);
    # with Muon these are AdamW's, and Muon's matrices follow in the same split (groups 2 and 3)
    kinds = (False, True) if optimizer == "muon" else (False,)
    groups = []
    for muon in kinds:
        mine = [(n, s) for n, s in shapes if muon == (optimizer == "muon" and is_muon_param(n, s))]
        groups.append([(n, s, muon) for n, s in mine if not is_no_decay(n, no_decay)])
        if no_decay:
            groups.append([(n, s, muon) for n, s in mine if is_no_decay(n, no_decay)])
    out = []
    for gi, group in enumerate(groups):
        for name, shape, muon in group:
            match = _LAYER.search("." + name)
            layer = int(match.group(1)) if match else None
            out.append(ParamSpec(_MODULE_PREFIX + name, shape, gi, layer, name.endswith(per_head), muon))
    return tuple(out)
