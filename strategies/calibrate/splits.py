"""What `mula calibrate` times of the tensor-, context- and expert-parallel splits: the same small model
whole and split by this package's own functions over a group of a node, forward + backward of one
micro-batch, interleaved (`mula.plan.split_compute` turns the pair into the split's compute factor).

The split functions are the strategy's: `apply_tensor_parallel`, `apply_context_parallel`, and
`apply_expert_parallel` for the experts (there each rank keeps its own tokens, and the split's cost is
its all-to-alls and permutations). Which kinds a group runs is `mula.calibrate.splits.splits_for`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from mula.calibrate.measure import busy_times, small_model_config
from mula.layout.parallel_layout import ParallelLayout
from mula.model.config import MulaConfig
from mula.model.transformer import Mula
from strategies.context_parallel import apply_context_parallel
from strategies.experts.expert_parallel import apply_expert_parallel
from strategies.tensor_parallel import apply_tensor_parallel
from strategies.topology import LayoutMesh


def split_training_seconds(
    config: MulaConfig, kind: str, micro_batch: int, seq_len: int, dtype: torch.dtype, device: torch.device,
    group: Any, group_rank: int, group_size: int, reps: int,
) -> dict[str, float]:  # fmt: skip
    """{"whole": s, "split": s, ...}: one micro-batch's forward + backward of the small model
    (`small_model_config`) whole on this rank and split `kind` over `group` (this rank its
    `group_rank`-th of `group_size`), timed in turns; every rank of the group must call it. With the
    small model's shape (num_layers, micro_batch, seq_len), which the planner needs to price the split's
    own collectives."""
    small = small_model_config(config)
    torch.manual_seed(0)  # the same weights on every rank of the group, as DTensor expects
    whole = Mula(small).to(device=device, dtype=dtype)
    split = Mula(small).to(device=device, dtype=dtype)
    # the same tokens too (TP and CP ranks share a micro-batch), but an EP rank routes its own
    torch.manual_seed(group_rank if kind == "ep" else 0)
    ids = torch.randint(0, small.vocab_size, (micro_batch, seq_len + 1), device=device)
    context: Callable[[], Any] = nullcontext
    if kind in ("tp", "tp_sp"):
        mesh = DeviceMesh.from_group(group, device.type)
        apply_tensor_parallel(split, mesh, sequence_parallel=kind == "tp_sp")
        context = loss_parallel
    elif kind == "cp":
        apply_context_parallel(split, group, group_rank, group_size)
    else:
        # one EP group of `group_size` ranks
        layout = ParallelLayout(world_size=group_size, ep=group_size)
        topology = LayoutMesh(layout, group_rank, groups={"ep": group})
        apply_expert_parallel(split, topology)

    def step(model: Any) -> None:
        shard = model.sequence_shard
        with context():
            out = model(shard.take(ids[:, :-1]))
            ce = F.cross_entropy(out.logits.float().flatten(0, 1), shard.take(ids[:, 1:]).flatten())
            if isinstance(ce, DTensor):  # vocabulary-parallel logits: a replicated DTensor loss
                ce = ce.full_tensor()
            loss = ce + small.router_aux_loss_coef * out.aux_loss + small.router_z_loss_coef * out.z_loss
            loss.backward()  # the gradients accumulate, as over a step's micro-batches

    seconds = busy_times({"whole": lambda: step(whole), "split": lambda: step(split)}, device, reps, group)
    return {**seconds, "num_layers": small.num_layers, "micro_batch": micro_batch, "seq_len": seq_len}
