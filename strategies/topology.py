"""Process-group layout for expert parallelism: EP groups of consecutive ranks, EDP groups across them.

With W ranks and expert-parallel size E (EDP = W / E):

    EP group  p: ranks [p*E, ..., p*E + E - 1]   (all-to-all of tokens; consecutive ranks so that on a
                                                  machine with E devices per node it stays inside a node)
    EDP group q: ranks [q, q + E, q + 2E, ...]    (ranks that hold the same experts: expert gradients
                                                  are averaged here, never over the whole world)

Local expert j on EP rank p is global expert p * E_local + j.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist


def validate_layout(world_size: int, ep_size: int, num_experts: int | None = None) -> None:
    """Raise one ValueError sentence naming the numbers if (W, E, experts) is not a valid EP layout."""
    if ep_size < 1:
        raise ValueError(f"expert_parallel_size must be at least 1, got {ep_size}.")
    if ep_size > world_size:
        raise ValueError(
            f"expert_parallel_size={ep_size} is larger than the world size {world_size}; "
            f"use at most {world_size} ranks per expert-parallel group."
        )
    if world_size % ep_size != 0:
        raise ValueError(
            f"The world size {world_size} is not divisible by expert_parallel_size={ep_size}; "
            "choose an expert-parallel size that divides the number of ranks."
        )
    if num_experts is not None and num_experts % ep_size != 0:
        raise ValueError(
            f"The model has {num_experts} experts, which is not divisible by expert_parallel_size={ep_size}; "
            "choose an expert-parallel size that divides the number of experts."
        )


@dataclass
class ExpertParallelTopology:
    """This rank's place in the (EDP x EP) layout and the process groups it communicates in.

    Groups are None when running without torch.distributed (a single process); code paths then skip
    communication because every group has size 1.
    """

    world_size: int
    rank: int
    ep_size: int
    edp_size: int
    ep_rank: int
    edp_rank: int
    ep_group: Any = None
    edp_group: Any = None
    world_group: Any = None

    def local_expert_range(self, num_experts: int) -> range:
        """Global indices of the experts this rank holds (contiguous block of num_experts / ep_size)."""
        validate_layout(self.world_size, self.ep_size, num_experts)
        per_rank = num_experts // self.ep_size
        return range(self.ep_rank * per_rank, (self.ep_rank + 1) * per_rank)

    def ep_group_ranks(self) -> list[int]:
        """Global ranks of this rank's EP group, in EP-rank order."""
        base = (self.rank // self.ep_size) * self.ep_size
        return list(range(base, base + self.ep_size))

    def edp_group_ranks(self) -> list[int]:
        """Global ranks of this rank's EDP group, in EDP-rank order."""
        return list(range(self.ep_rank, self.world_size, self.ep_size))


def layout_ranks(world_size: int, ep_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """All EP groups and all EDP groups (lists of global ranks) for a (W, E) layout."""
    validate_layout(world_size, ep_size)
    ep_groups = [list(range(start, start + ep_size)) for start in range(0, world_size, ep_size)]
    edp_groups = [list(range(p, world_size, ep_size)) for p in range(ep_size)]
    return ep_groups, edp_groups


def build_topology(ep_size: int) -> ExpertParallelTopology:
    """Create the EP and EDP process groups for this job (collective: every rank must call it).

    Without an initialised process group this describes a single process (W = 1) and requires E = 1.
    """
    if not (dist.is_available() and dist.is_initialized()):
        validate_layout(1, ep_size)
        return ExpertParallelTopology(world_size=1, rank=0, ep_size=1, edp_size=1, ep_rank=0, edp_rank=0)
    world_size, rank = dist.get_world_size(), dist.get_rank()
    ep_groups, edp_groups = layout_ranks(world_size, ep_size)
    ep_group = edp_group = None
    # new_group is collective over the world: every rank creates every group in the same order.
    for ranks in ep_groups:
        group = _new_group(ranks, world_size)
        if rank in ranks:
            ep_group = group
    for ranks in edp_groups:
        group = _new_group(ranks, world_size)
        if rank in ranks:
            edp_group = group
    return ExpertParallelTopology(
        world_size=world_size,
        rank=rank,
        ep_size=ep_size,
        edp_size=world_size // ep_size,
        ep_rank=rank % ep_size,
        edp_rank=rank // ep_size,
        ep_group=ep_group,
        edp_group=edp_group,
        world_group=dist.group.WORLD,
    )


def _new_group(ranks: list[int], world_size: int) -> Any:
    # A group spanning the world is the world group itself: saves a communicator.
    if len(ranks) == world_size:
        return dist.group.WORLD
    return dist.new_group(ranks)
