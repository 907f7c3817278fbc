"""MoEMetrics' `optim/state_bytes` for unsharded optimizers: what this rank holds, a tensor-parallel DTensor
counted by its local shard (2 gloo ranks, a parameter split in halves, torch AdamW after one step)."""

from __future__ import annotations

import torch
from dist_helpers import run_distributed
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from callbacks.moe_metrics import _state_bytes


def _bytes_after_one_step(rank: int, world: int) -> int:
    mesh = init_device_mesh("cpu", (world,))
    weight = torch.nn.Parameter(distribute_tensor(torch.ones(8, 4), mesh, [Shard(0)]))
    plain = torch.nn.Parameter(torch.ones(3))  # replicated: held whole by every rank
    opt = torch.optim.AdamW([weight, plain], lr=0.1, foreach=False)
    weight.grad = distribute_tensor(torch.ones(8, 4), mesh, [Shard(0)])
    plain.grad = torch.ones(3)
    opt.step()
    return _state_bytes(opt)


def test_state_bytes_count_local_shards() -> None:
    # per rank: the weight's half (4 x 4 fp32) and its two moments, the 3-element parameter and its moments
    expected = 3 * (4 * 4 * 4) + 3 * (3 * 4)
    assert run_distributed(_bytes_after_one_step, 2) == [expected, expected]
