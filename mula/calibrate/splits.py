"""What `mula calibrate` times of the tensor-, context- and expert-parallel splits: the same small model
whole and split by the strategy's own functions over a group of a node, forward + backward of one
micro-batch, interleaved (`mula.plan.split_compute` turns the pair into the split's compute factor).

The split functions are the strategy's (`strategies.tensor_parallel.apply_tensor_parallel`,
`strategies.context_parallel.apply_context_parallel`, and `apply_expert_parallel` for the experts:
there each rank keeps its own tokens, and the split's cost is its all-to-alls and permutations), named
here as a recipe names its strategy: `mula` imports no strategy module, it resolves these names when it
measures.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F

from mula.calibrate.measure import busy_times, small_model_config
from mula.layout.rules import check_context_parallel, check_tensor_parallel
from mula.model.config import MulaConfig

APPLY = {
    "tp": "strategies.tensor_parallel:apply_tensor_parallel",
    "cp": "strategies.context_parallel:apply_context_parallel",
    "ep": "strategies.experts.expert_parallel:apply_expert_parallel",
    "ep_topology": "strategies.topology:ExpertParallelTopology",
}


def resolve_name(name: str) -> Callable[..., Any]:
    """The strategy function or class "module:attribute" names, imported when it is measured."""
    module, attr = name.split(":")
    return getattr(importlib.import_module(module), attr)


def splits_for(config: MulaConfig, group: int, seq_len: int) -> list[str]:
    """The split kinds (`mula.plan.split_compute.SPLIT_KINDS`) a group of `group` ranks can run this model
    at `seq_len` tokens: the heads (and key/value heads) must divide by it, and where the sequence is
    split (sequence parallelism, an MoE layer's tokens under TP, Ulysses' slices) the sequence too."""
    kinds = []
    even = seq_len % group == 0
    try:
        check_tensor_parallel(config, group)
    except ValueError:
        pass
    else:
        if even or not config.is_moe:
            kinds.append("tp")
        if even:
            kinds.append("tp_sp")
    try:
        check_context_parallel(config, group)
    except ValueError:
        pass
    else:
        if even:
            kinds.append("cp")
    if config.is_moe and config.num_experts % group == 0:
        kinds.append("ep")
    return kinds


def split_training_seconds(
    config: MulaConfig, kind: str, micro_batch: int, seq_len: int, dtype: torch.dtype, device: torch.device,
    group: Any, group_rank: int, group_size: int, reps: int,
) -> dict[str, float]:  # fmt: skip
    """{"whole": s, "split": s, ...}: one micro-batch's forward + backward of the small model
    (`small_model_config`) whole on this rank and split `kind` over `group` (this rank its
    `group_rank`-th of `group_size`), timed in turns; every rank of the group must call it. With the
    small model's shape (num_layers, micro_batch, seq_len), which the planner needs to price the split's
    own collectives."""
    from torch.distributed.device_mesh import DeviceMesh

    from mula.model.transformer import Mula

    small = small_model_config(config)
    torch.manual_seed(0)  # the same weights on every rank of the group, as DTensor expects
    whole = Mula(small).to(device=device, dtype=dtype)
    split = Mula(small).to(device=device, dtype=dtype)
    # the same tokens too (TP and CP ranks share a micro-batch), but an EP rank routes its own
    torch.manual_seed(group_rank if kind == "ep" else 0)
    ids = torch.randint(0, small.vocab_size, (micro_batch, seq_len + 1), device=device)
    context: Callable[[], Any] = nullcontext
    if kind in ("tp", "tp_sp"):
        from torch.distributed.tensor.parallel import loss_parallel

        mesh = DeviceMesh.from_group(group, device.type)
        resolve_name(APPLY["tp"])(split, mesh, sequence_parallel=kind == "tp_sp")
        context = loss_parallel
    elif kind == "cp":
        resolve_name(APPLY["cp"])(split, group, group_rank, group_size)
    else:
        topology = resolve_name(APPLY["ep_topology"])(
            world_size=group_size, rank=group_rank, ep_size=group_size, edp_size=1, ep_rank=group_rank,
            edp_rank=0, ep_group=group,
        )  # fmt: skip
        resolve_name(APPLY["ep"])(split, topology)

    def step(model: Any) -> None:
        shard = model.sequence_shard
        with context():
            out = model(shard.take(ids[:, :-1]))
            ce = F.cross_entropy(out.logits.float().flatten(0, 1), shard.take(ids[:, 1:]).flatten())
            if hasattr(ce, "full_tensor"):  # vocabulary-parallel logits: a replicated DTensor loss
                ce = ce.full_tensor()
            loss = ce + small.router_aux_loss_coef * out.aux_loss + small.router_z_loss_coef * out.z_loss
            loss.backward()  # the gradients accumulate, as over a step's micro-batches

    seconds = busy_times({"whole": lambda: step(whole), "split": lambda: step(split)}, device, reps, group)
    return {**seconds, "num_layers": small.num_layers, "micro_batch": micro_batch, "seq_len": seq_len}
