"""Upcycling a dense Mula model into an MoE that computes the same function at step 0 (`mula upcycle`).

Megatron-Core's `--moe-use-upcycling` and arXiv 2410.07524 ("Upcycling Large Language Models into Mixture
of Experts"), as docs/upcycling.md states. The dense SwiGLU of width F is cut into G = F / F_e slices of
the experts' width F_e (G = 1: "plain" upcycling, every expert a copy; G > 1: "granular"); the E experts
are C = E / G copies of the whole MLP, expert e = c * G + j holding slice j of copy c (a "virtual group"
is one copy's G experts). Everything else (embeddings, attention, norms, head) is copied as it is.

Why the output is the dense MLP's (exact conditions, each refused otherwise by `upcycle_refusal`):

* SwiGLU is a sum over its features, so dense(x) = sum_j slice_j(x) and any copy's G experts rebuild it.
* Router rows are one random row per copy, repeated over its G experts: the experts of a virtual group
  tie, so a top-k of K = m * G (top_k a multiple of G) picks m whole virtual groups.
* With `norm_topk_prob` the K combine weights sum to `routed_scaling_factor` r whatever the router
  says: each selected copy's G experts share one weight w_c, so sum_c G * w_c = r, and with G / r folded
  into the experts' down projections the output is sum_c w_c * (G / r) * dense(x) = dense(x). Without it the
  weights' sum depends on the scores, so only an all-zero router (every score equal) with G = 1 (any K
  identical experts will do, ties broken anyhow) preserves the function, with 1 / (r * K * score) folded in.
* Group-limited routing keeps whole virtual groups only when each routing group holds whole ones
  ((E / n_group) % G == 0); shared experts would add to the dense output, so none are allowed.

With the zero router and G > 1 every expert ties and top-k's tie-breaking, not the weights, would
decide which slices a token gets: refused. The transform works on meta tensors too (`--dry_run`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from mula.model.config import MulaConfig

ROUTER_INITS = ("random", "zeros")
# The architecture fields of an MLP: everything else must be equal for weights to carry over unchanged.
_MLP_FIELDS = frozenset(
    MulaConfig.MOE_ARCHITECTURE_FIELDS
    + MulaConfig.DENSE_ARCHITECTURE_FIELDS
    + ("num_experts", "num_shared_experts", "shared_intermediate_size")
)


def granularity(dense: MulaConfig, moe: MulaConfig) -> int:
    """G: how many expert-wide slices the dense MLP is cut into (1: every expert a whole copy)."""
    return dense.intermediate_size // moe.expert_intermediate_size


def upcycle_refusal(dense: MulaConfig, moe: MulaConfig, router_init: str = "random") -> str | None:
    """One sentence saying why `moe` cannot start from `dense`'s function, or None when it can."""
    if router_init not in ROUTER_INITS:
        return f"router_init must be one of {', '.join(ROUTER_INITS)}, got {router_init!r}."
    if dense.is_moe:
        return f"{dense.name} is already an MoE model; upcycling starts from a dense one."
    if not moe.is_moe:
        return f"{moe.name} is dense (num_experts 0); upcycle into an MoE config."
    ours, theirs = dense.architecture(), moe.architecture()
    diff = [
        f"{k}: {ours.get(k)} vs {theirs.get(k)}"
        for k in sorted((set(ours) | set(theirs)) - _MLP_FIELDS)
        if ours.get(k) != theirs.get(k)
    ]
    if diff:
        return (
            f"{dense.name} and {moe.name} differ outside the MLP ({', '.join(diff)}): upcycling copies "
            "every other weight as it is, so set these fields of the MoE config to the dense model's."
        )
    f, fe = dense.intermediate_size, moe.expert_intermediate_size
    if f % fe:
        return (
            f"expert_intermediate_size {fe} does not divide the dense intermediate_size {f}: each expert must "
            "be the whole dense MLP or an equal slice of it."
        )
    g = f // fe
    if moe.num_experts % g or moe.top_k % g:
        return (
            f"With experts 1/{g} of the dense MLP, num_experts ({moe.num_experts}) and top_k ({moe.top_k}) "
            f"must be multiples of {g} so that every token picks whole copies of the dense MLP."
        )
    if moe.num_dense_layers and moe.intermediate_size != f:
        return (
            f"The first {moe.num_dense_layers} dense block(s) keep the dense MLP, so the MoE config's "
            f"intermediate_size must be {f}, not {moe.intermediate_size}."
        )
    if moe.num_shared_experts:
        return "Shared experts would add to the dense MLP's output; upcycle into a config without them."
    if moe.n_group > 1 and (moe.num_experts // moe.n_group) % g:
        return (
            f"Group-limited routing over groups of {moe.num_experts // moe.n_group} experts would split the "
            f"copies of {g} experts; use n_group 1 or groups holding whole copies."
        )
    if moe.routing_mode != "learned":
        return f"routing_mode {moe.routing_mode!r} ignores the router; upcycle with routing_mode 'learned'."
    if not moe.norm_topk_prob and (g > 1 or router_init != "zeros"):
        return (
            "Without norm_topk_prob the combine weights' sum depends on the router's scores, so the MoE "
            "computes the dense function only with router_init zeros and experts as wide as the dense MLP; "
            "set norm_topk_prob true."
        )
    if router_init == "zeros" and g > 1:
        return (
            f"With router_init zeros every expert ties and top-k would pick the {g} slices of the dense MLP "
            "by its tie-breaking, not whole copies; use router_init random."
        )
    return None


def check_upcycle(dense: MulaConfig, moe: MulaConfig, router_init: str = "random") -> None:
    """Raise ValueError with `upcycle_refusal`'s sentence when `dense` cannot be upcycled into `moe`."""
    refusal = upcycle_refusal(dense, moe, router_init)
    if refusal is not None:
        raise ValueError(refusal)


def down_scale(dense: MulaConfig, moe: MulaConfig, router_init: str) -> float:
    """The factor folded into the experts' down projections so that the combined output is the dense one."""
    r = moe.routed_scaling_factor
    if moe.norm_topk_prob:  # K weights summing to r over m copies of G experts: each copy weighs G * w_c
        return granularity(dense, moe) / r
    score = 1.0 / moe.num_experts if moe.router_scoring == "softmax" else 0.5  # an all-zero router's score
    return 1.0 / (r * moe.top_k * score)


def upcycle_state_dict(
    dense: MulaConfig,
    state_dict: dict[str, Tensor],
    moe: MulaConfig,
    router_init: str = "random",
    seed: int = 0,
) -> dict[str, Tensor]:
    """The MoE model's state dict from the dense model's (see the module docstring); checked first.

    Router rows: `router_init` "random" draws one truncated-normal row (std `moe.init_std`, generator
    seeded by `seed`) per copy and repeats it over the copy's G experts; "zeros" gives a uniform router.
    Works on meta tensors (no memory): the dry run of `mula upcycle`.
    """
    check_upcycle(dense, moe, router_init)
    g = granularity(dense, moe)
    copies, fe, scale = (
        moe.num_experts // g,
        moe.expert_intermediate_size,
        down_scale(dense, moe, router_init),
    )
    generator = torch.Generator().manual_seed(seed)
    out: dict[str, Tensor] = {}
    for name, tensor in state_dict.items():
        block = _moe_block_prefix(name, moe)
        if block is None:
            out[name] = tensor
            continue
        if not name.endswith(".mlp.gate_proj.weight"):
            continue  # up and down go with gate below
        gate, up = tensor, state_dict[block + "up_proj.weight"]
        down = state_dict[block + "down_proj.weight"]
        slices = torch.cat((gate.view(g, fe, -1), up.view(g, fe, -1)), dim=1)  # [G, 2F_e, H]
        down_slices = (down.view(down.shape[0], g, fe).transpose(0, 1) * scale).to(down.dtype)  # [G, H, F_e]
        out[block + "experts.gate_up"] = slices.repeat(copies, 1, 1)  # expert c * G + j = slice j
        out[block + "experts.down"] = down_slices.repeat(copies, 1, 1)
        out[block + "router.weight"] = _router_rows(moe, copies, g, router_init, generator, gate)
        if moe.has_router_bias:
            out[block + "router.bias"] = torch.zeros(moe.num_experts, dtype=torch.float32, device=gate.device)
    return out


def _moe_block_prefix(name: str, moe: MulaConfig) -> str | None:
    """`layers.{i}.mlp.` when `name` is a dense MLP weight of a block that is MoE in `moe`, else None."""
    parts = name.split(".")
    if len(parts) == 5 and parts[0] == "layers" and parts[2] == "mlp" and moe.is_moe_layer(int(parts[1])):
        return ".".join(parts[:3]) + "."
    return None


def _router_rows(
    moe: MulaConfig, copies: int, g: int, router_init: str, generator: torch.Generator, like: Tensor
) -> Tensor:
    """[E, H] router weight: one row per copy repeated over its G experts (zeros: all rows zero)."""
    shape = (copies, moe.hidden_size)
    if router_init == "zeros" or like.is_meta:
        rows = torch.zeros(shape, dtype=like.dtype, device=like.device)
    else:
        std = moe.init_std  # as `Router.reset_parameters`: truncated normal at +-3 std
        rows = torch.nn.init.trunc_normal_(torch.empty(shape), 0.0, std, -3 * std, 3 * std, generator)
        rows = rows.to(like.dtype)
    return rows.repeat_interleave(g, dim=0)
