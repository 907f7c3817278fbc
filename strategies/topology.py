"""Process-group layout: EP groups of consecutive ranks, EDP groups across them, pipeline stages.

With W ranks and expert-parallel size E (EDP = W / E):

    EP group  p: ranks [p*E, ..., p*E + E - 1]   (all-to-all of tokens; consecutive ranks so that on a
                                                  machine with E devices per node it stays inside a node)
    EDP group q: ranks [q, q + E, q + 2E, ...]    (ranks that hold the same experts: expert gradients
                                                  are averaged here, never over the whole world)

Local expert j on EP rank p is global expert p * E_local + j.

With P pipeline stages (Optimus' order: EP innermost, then pipeline stages, data parallel outermost)
global rank g = d * (P * E) + s * E + e for data-parallel index d, stage s and EP rank e. Each stage
is then a (W/P)-rank "data-parallel world" laid out exactly as above (stage-local rank d * E + e):
`world_size`, `rank` and `world_group` of a topology describe that world (the ranks replicating the
stage's dense parameters), `stage_ranks` maps its local ranks to global ones, and the PP group
(ranks [d*P*E + e + s*E for s]) carries activations between stages and the global gradient norm.
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
    pp_size: int = 1
    pp_rank: int = 0
    pp_group: Any = None  # this rank's pipeline group (one rank per stage), None when P = 1
    stage_ranks: list[int] | None = None  # global rank of each stage-local rank; None: the identity

    def to_global(self, local_rank: int) -> int:
        """The global rank of a rank of this (stage's) data-parallel world."""
        return local_rank if self.stage_ranks is None else self.stage_ranks[local_rank]

    def world_ranks(self) -> list[int]:
        """Global ranks of this (stage's) data-parallel world, in local-rank order."""
        return [self.to_global(r) for r in range(self.world_size)]

    def local_expert_range(self, num_experts: int) -> range:
        """Global indices of the experts this rank holds (contiguous block of num_experts / ep_size)."""
        validate_layout(self.world_size, self.ep_size, num_experts)
        per_rank = num_experts // self.ep_size
        return range(self.ep_rank * per_rank, (self.ep_rank + 1) * per_rank)

    def ep_group_ranks(self) -> list[int]:
        """Global ranks of this rank's EP group, in EP-rank order."""
        base = (self.rank // self.ep_size) * self.ep_size
        return [self.to_global(r) for r in range(base, base + self.ep_size)]

    def edp_group_ranks(self) -> list[int]:
        """Global ranks of this rank's EDP group, in EDP-rank order."""
        return [self.to_global(r) for r in range(self.ep_rank, self.world_size, self.ep_size)]


def validate_pipeline_layout(world_size: int, ep_size: int, pp_size: int) -> None:
    """Raise one ValueError sentence naming the numbers if W ranks cannot hold P stages of E-rank EP groups."""
    if pp_size < 1:
        raise ValueError(f"pipeline_parallel_size must be at least 1, got {pp_size}.")
    if pp_size == 1:
        validate_layout(world_size, ep_size)
        return
    if world_size % (pp_size * ep_size) != 0:
        raise ValueError(
            f"The world size {world_size} is not divisible by pipeline_parallel_size={pp_size} x "
            f"expert_parallel_size={ep_size} = {pp_size * ep_size}; choose sizes whose product divides the number of ranks."
        )


def global_rank(dp_index: int, stage: int, ep_rank: int, ep_size: int, pp_size: int) -> int:
    """The global rank of (data-parallel index, pipeline stage, EP rank): EP innermost, DP outermost."""
    return dp_index * pp_size * ep_size + stage * ep_size + ep_rank


def stage_ranks(world_size: int, ep_size: int, pp_size: int, stage: int) -> list[int]:
    """Global ranks of pipeline stage `stage`, in stage-local rank order (d * E + e)."""
    dp = world_size // (pp_size * ep_size)
    return [global_rank(d, stage, e, ep_size, pp_size) for d in range(dp) for e in range(ep_size)]


def layout_ranks(world_size: int, ep_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """All EP groups and all EDP groups (lists of global ranks) for a (W, E) layout."""
    validate_layout(world_size, ep_size)
    ep_groups = [list(range(start, start + ep_size)) for start in range(0, world_size, ep_size)]
    edp_groups = [list(range(p, world_size, ep_size)) for p in range(ep_size)]
    return ep_groups, edp_groups


def build_topology(ep_size: int, pp_size: int = 1) -> ExpertParallelTopology:
    """Create the EP, EDP (and, with P > 1, stage and pipeline) process groups for this job.

    Collective: every rank must call it. Without an initialised process group this describes a
    single process (W = 1) and requires E = P = 1.
    """
    if not (dist.is_available() and dist.is_initialized()):
        validate_layout(1, ep_size)
        validate_pipeline_layout(1, ep_size, pp_size)
        return ExpertParallelTopology(world_size=1, rank=0, ep_size=1, edp_size=1, ep_rank=0, edp_rank=0)
    world_size, rank = dist.get_world_size(), dist.get_rank()
    validate_pipeline_layout(world_size, ep_size, pp_size)
    stage_size = world_size // pp_size
    stages = [stage_ranks(world_size, ep_size, pp_size, s) for s in range(pp_size)]
    stage = next(s for s, ranks in enumerate(stages) if rank in ranks)
    local = stages[stage].index(rank)
    # new_group is collective over the world: every rank creates every group in the same order.
    stage_group = ep_group = edp_group = pp_group = None
    for s, ranks in enumerate(stages):
        group = _new_group(ranks, world_size)
        if s == stage:
            stage_group = group
        ep_groups, edp_groups = layout_ranks(stage_size, ep_size)
        for local_ranks in ep_groups:
            group = _new_group([ranks[r] for r in local_ranks], world_size)
            if rank in [ranks[r] for r in local_ranks]:
                ep_group = group
        for local_ranks in edp_groups:
            group = _new_group([ranks[r] for r in local_ranks], world_size)
            if rank in [ranks[r] for r in local_ranks]:
                edp_group = group
    if pp_size > 1:
        for local_rank in range(stage_size):
            ranks = [stages[s][local_rank] for s in range(pp_size)]
            group = _new_group(ranks, world_size)
            if rank in ranks:
                pp_group = group
    return ExpertParallelTopology(
        world_size=stage_size,
        rank=local,
        ep_size=ep_size,
        edp_size=stage_size // ep_size,
        ep_rank=local % ep_size,
        edp_rank=local // ep_size,
        ep_group=ep_group,
        edp_group=edp_group,
        world_group=stage_group,
        pp_size=pp_size,
        pp_rank=stage,
        pp_group=pp_group,
        stage_ranks=None if pp_size == 1 else stages[stage],
    )


def _new_group(ranks: list[int], world_size: int) -> Any:
    # A group spanning the world is the world group itself: saves a communicator.
    if len(ranks) == world_size:
        return dist.group.WORLD
    return dist.new_group(ranks)


def reduce_over_stages(tensor: Any, topology: ExpertParallelTopology, op: Any = None) -> Any:
    """Sum (or `op`) a per-stage total over the pipeline group, in place: every stage then holds the
    whole model's value (e.g. the squared gradient norm). A no-op with one stage."""
    if topology.pp_size > 1:
        dist.all_reduce(tensor, op=op if op is not None else dist.ReduceOp.SUM, group=topology.pp_group)
    return tensor


def gather_groups_over_stages(
    groups: list[dict[str, Any]], topology: ExpertParallelTopology
) -> list[dict[str, Any]]:
    """Optimizer param groups (hyperparameters plus "param_names") of the whole model: per group
    index, the hyperparameters of the first stage that has it and the names of every stage, in stage
    order. What a checkpoint records, so that any stage of any layout can check itself against it
    (collective over the pipeline group; the identity with one stage)."""
    if topology.pp_size == 1:
        return groups
    every: list[Any] = [None] * topology.pp_size
    dist.all_gather_object(every, groups, group=topology.pp_group)
    merged: list[dict[str, Any]] = []
    for stage_groups in every:
        for i, group in enumerate(stage_groups):
            if i == len(merged):
                merged.append({**group, "param_names": []})
            merged[i]["param_names"] = [*merged[i]["param_names"], *group["param_names"]]
    return merged


def names_cover(saved: list[list[str]], mine: list[list[str]]) -> bool:
    """True if every param group of `mine` is, in order, part of the same group of `saved` (a stage's
    groups hold some of the whole model's parameters, an unsplit model's all of them)."""
    if len(saved) < len(mine):
        return False
    for theirs, ours in zip(saved, mine):
        wanted = set(ours)
        if [n for n in theirs if n in wanted] != list(ours):
            return False
    return True
