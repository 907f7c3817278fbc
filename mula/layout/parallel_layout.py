"""The parallel layout of a training job: the size of every dimension, where each rank sits, what it holds.

One object (torchtitan's `ParallelDims` is the model), torch-free, so that the strategy
(`XPUMoEStrategy.setup_environment`) and the planner (`mula plan`) build and validate the very same
thing; the strategy turns it into one named `DeviceMesh` (`strategies.topology.build_mesh`).

Dimensions and rank order, innermost first (DESIGN.md "Parallel layout, in numbers"):

    tp   tensor parallel: T consecutive ranks split every dense layer (one node's fabric); MoE layers
         keep their experts whole and split their tokens over the T ranks
    cp   context parallel (Ulysses, docs/context-parallel.md): C ranks of one TP index (T apart) hold
         1/C of every sequence each and exchange attention heads all-to-all (one node's fabric)
    ep   expert parallel: E ranks of one TP index (T apart) exchange tokens all-to-all (one node's fabric)
    pp   pipeline stage: P stages
    edp  expert-data parallel: the W / (P * E) ranks holding the same experts of the same stage

    rank = (((edp * P + pp) * E + ep) * CP + cp) * TP + tp

CP sits between EP and TP: its all-to-alls (two per attention layer forward, two backward, each
carrying the layer's q/k/v or output) are heavier than the expert all-to-all's share and lighter than
TP's per-layer reductions, so it goes next to TP, inside a node (T x C x E ranks per node at most).

Derived groups: the T ranks of a tensor-parallel group read the same data and each holds 1/T of every
dense layer; the C ranks of a context-parallel group read the same samples, each its slice of the
sequence, and replicate the parameters. A stage's W / (P * T) ranks of one tensor-parallel index are
its replicas (`replica_size`, group "replica", replica rank (edp * E + ep) * C + cp): they hold the
same shards of the stage's dense parameters, and its gradients are reduced and its optimizer state
sharded over them; W / (P * T * C) of them read their own data (`dp_size`, group "dp", data-parallel
index edp * E + ep). Experts are reduced over "edp_cp" (EDP with its CP peers). The pipeline group of a
rank is the P ranks that share its (edp, ep, cp, tp) coordinates.

`DIMS` is the one vocabulary of dimensions: `group_ranks`, `size` and `group_rank` here, and
`strategies.topology.LayoutMesh`'s `group`, `mesh`, `size` and `rank` on the torch side, take these
names, and a size called `<dim>_size` anywhere (here, on the mesh, in the planner's `mula.plan.layout.Layout`)
is `size(dim)`. `rank_holdings` answers which
blocks and experts a rank
holds; the strategy, the schedule, the planner and the benchmarks all ask it.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from dataclasses import dataclass
from typing import Any

from mula.layout.rules import (
    check_batch_split,
    check_capacity,
    check_context_parallel,
    check_degrees,
    check_experts,
    check_micro_batches,
    check_mtp_stages,
    check_tensor_parallel,
    check_world,
    check_zero_stage,
    stage_layer_counts,
    validate_schedule,
    validate_split,
)

# mesh dimensions, outermost first (the order of the DeviceMesh's shape); "cp" is in a layout's mesh
# only when C > 1 (`ParallelLayout.mesh_dims`), so that layouts without it keep their mesh as it was
MESH_DIMS = ("edp", "pp", "ep", "cp", "tp")
# every dimension a rank has a group along (`ParallelLayout.group_ranks`): the mesh's, "edp_cp" (the EDP
# group with its CP peers: who holds the same experts), "replica" (a stage's ranks of one TP index: who
# holds the same dense shards), "dp" (the ranks reading different data) and "world"
DIMS = ("tp", "cp", "ep", "pp", "edp", "edp_cp", "replica", "dp", "world")


@dataclass(frozen=True)
class Coordinates:
    """A rank's position on each dimension (see the module docstring)."""

    edp: int
    pp: int
    ep: int
    cp: int = 0
    tp: int = 0


@dataclass(frozen=True)
class Holdings:
    """What one rank holds of a model.

    stages: the pipeline stages (of P x V) it runs, looped placement (s, s + P, ...); blocks_per_stage:
    the global block indices of each of those stages (the last stage's run ends with the multi-token
    prediction modules' blocks, `mtp_blocks`, which run after the final norm, as Megatron places them);
    blocks: all of them, in order; first/last: it holds the embedding (stage 0) / the final norm and LM
    head (the last stage, with the MTP modules and, under P > 1, a copy of the embedding they read);
    experts: the global indices of the experts it holds in every MoE block (a contiguous run of
    num_experts / E).
    """

    stages: tuple[int, ...]
    blocks_per_stage: tuple[range, ...]
    experts: range
    first: bool
    last: bool
    mtp_blocks: range = range(0)

    @property
    def blocks(self) -> list[int]:
        """Global indices of every block this rank holds (the MTP blocks included)."""
        return [i for run in self.blocks_per_stage for i in run]

    def main_blocks(self, stage: int) -> list[int]:
        """The blocks of the `stage`-th of this rank's stages that run in the main model (its MTP blocks,
        `mtp_blocks`, left out: they run after the final norm)."""
        return [i for i in self.blocks_per_stage[stage] if i not in self.mtp_blocks]


@dataclass(frozen=True)
class ParallelLayout:
    """Sizes of every parallel dimension of a W-rank job and its pipeline schedule.

    world_size: W (None: not known yet, as in a strategy before its process group exists); ep: E,
    expert-parallel group size; pp: P, pipeline stages; tp: T, tensor-parallel group size; cp: C,
    context-parallel group size (Ulysses); schedule, virtual_stages (V per rank), stage_layers (P x V
    block counts, None: an even split): the pipeline. Construction runs `validate` (the sizes, the
    schedule and, when W is known, W); `with_world_size` fills W in and checks the rule that needs it.
    """

    world_size: int | None = 1
    ep: int = 1
    pp: int = 1
    tp: int = 1
    cp: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    stage_layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.stage_layers is not None:
            object.__setattr__(self, "stage_layers", tuple(int(c) for c in self.stage_layers))
        self.validate()

    # ----- validation ----------------------------------------------------------------------------
    def validate(
        self,
        config: Any = None,
        *,
        micro_batches: int | None = None,
        zero_stage: int | None = None,
        global_batch: int | None = None,
        micro_batch: int | None = None,
    ) -> None:
        """Raise the one ValueError sentence (`mula.layout.rules`) of the first rule this layout breaks.

        Without arguments: the sizes, the schedule and W (`check_world`, skipped while W is None; the
        batch split needs W too). With a model `config` (`num_layers`,
        `num_experts`, `tie_embeddings`, `aux_loss_scope`): the stage split and the experts too; with
        `micro_batches` (per optimizer step and data-parallel rank), `zero_stage` (of the sharded
        optimizer) and `global_batch` with `micro_batch` (sequences): the step as well.
        """
        check_degrees(self.ep, self.pp, self.tp, self.cp)
        validate_schedule(self.schedule, self.pp, self.virtual_stages)
        if config is not None:
            validate_split(config, self.pp, self.virtual_stages, self.stage_layers)
        if self.world_size is not None:
            check_world(self.world_size, self.ep, self.pp, self.tp, self.cp)
        check_tensor_parallel(config, self.tp)
        check_context_parallel(config, self.cp, self.tp)
        check_capacity(config, self.tp, self.cp)
        if config is not None:
            check_experts(int(config.num_experts), self.ep)
        # the order a run meets them: the data module's batch split, the optimizer, the first step
        if global_batch is not None and micro_batch is not None:
            check_batch_split(global_batch, self.dp_size, micro_batch)
        if zero_stage is not None:
            check_zero_stage(self.pp, zero_stage)
            check_mtp_stages(config, self.pp, zero_stage)
        if micro_batches is not None:
            check_micro_batches(self.schedule, self.pp, micro_batches)

    def with_world_size(self, world_size: int) -> ParallelLayout:
        """This layout over `world_size` ranks, checked against them (`check_world`, the one rule of the
        sizes that needs W); the other rules already held when this layout was built."""
        check_world(world_size, self.ep, self.pp, self.tp, self.cp)
        layout = object.__new__(ParallelLayout)
        for f in dataclasses.fields(self):
            object.__setattr__(layout, f.name, getattr(self, f.name))
        object.__setattr__(layout, "world_size", world_size)
        return layout

    def check_micro_batches(self, micro_batches: int) -> None:
        """Refuse a step of `micro_batches` the schedule cannot run."""
        check_micro_batches(self.schedule, self.pp, micro_batches)

    # ----- sizes ---------------------------------------------------------------------------------
    @property
    def world(self) -> int:
        """W, refusing a layout whose world size is not known yet."""
        if self.world_size is None:
            raise ValueError(
                "This layout's world size is not known yet (a strategy learns it when its process group starts)."
            )
        return self.world_size

    @property
    def stage_size(self) -> int:
        """Ranks of one pipeline stage (W / P)."""
        return self.world // self.pp

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks of a stage, each reading its own data (W / (P * TP * CP)): size("dp")."""
        return self.world // (self.pp * self.tp * self.cp)

    @property
    def edp_size(self) -> int:
        """Data-parallel ranks holding the same experts of the same stage (W / (P * E * TP * CP)): size("edp")."""
        return self.dp_size // self.ep

    @property
    def replica_size(self) -> int:
        """Ranks of a stage holding the same dense shards, over which its gradients are reduced and its
        optimizer state sharded: the data-parallel ranks and their context-parallel peers (W / (P * TP)):
        size("replica")."""
        return self.dp_size * self.cp

    def size(self, dim: str) -> int:
        """Ranks of a group along `dim` (one of `DIMS`)."""
        sizes = {"tp": self.tp, "cp": self.cp, "ep": self.ep, "pp": self.pp}
        if dim in sizes:
            return sizes[dim]
        if dim == "edp":
            return self.edp_size
        if dim == "edp_cp":
            return self.edp_size * self.cp
        if dim == "replica":
            return self.replica_size
        if dim == "dp":
            return self.dp_size
        if dim == "world":
            return self.world
        raise ValueError(_unknown(dim))

    @property
    def num_stages(self) -> int:
        """Pipeline stages in all (P x V)."""
        return self.pp * self.virtual_stages

    def mesh_dims(self) -> tuple[str, ...]:
        """The DeviceMesh's dimension names, outermost first: `MESH_DIMS`, "cp" only when C > 1."""
        return tuple(d for d in MESH_DIMS if d != "cp" or self.cp > 1)

    def mesh_shape(self) -> tuple[int, ...]:
        """The DeviceMesh's shape over `mesh_dims()`, outermost first."""
        sizes = {"edp": self.edp_size, "pp": self.pp, "ep": self.ep, "cp": self.cp, "tp": self.tp}
        return tuple(sizes[d] for d in self.mesh_dims())

    # ----- ranks ---------------------------------------------------------------------------------
    def coordinates(self, rank: int) -> Coordinates:
        """Where global `rank` sits on every dimension."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is not one of the {self.world_size} ranks.")
        rank, tp = divmod(rank, self.tp)
        rank, cp = divmod(rank, self.cp)
        rank, ep = divmod(rank, self.ep)
        edp, pp = divmod(rank, self.pp)
        return Coordinates(edp=edp, pp=pp, ep=ep, cp=cp, tp=tp)

    def rank(self, edp: int = 0, pp: int = 0, ep: int = 0, cp: int = 0, tp: int = 0) -> int:
        """The global rank at these coordinates (the inverse of `coordinates`)."""
        return (((edp * self.pp + pp) * self.ep + ep) * self.cp + cp) * self.tp + tp

    def group_rank(self, dim: str, rank: int) -> int:
        """Global `rank`'s index in its group along `dim` (one of `DIMS`): its coordinate on a mesh dimension;
        on "replica" (edp * E + ep) * C + cp, on "dp" edp * E + ep, on "edp_cp" edp * C + cp."""
        c = self.coordinates(rank)
        if dim == "world":
            return rank
        if dim == "edp_cp":
            return c.edp * self.cp + c.cp
        if dim == "replica":
            return (c.edp * self.ep + c.ep) * self.cp + c.cp
        if dim == "dp":
            return c.edp * self.ep + c.ep
        if dim in MESH_DIMS:
            return int(getattr(c, dim))
        raise ValueError(_unknown(dim))

    def group_ranks(self, dim: str, rank: int) -> list[int]:
        """Global ranks of `rank`'s group along `dim` (one of `DIMS`: "tp", "cp", "ep", "pp", "edp";
        "edp_cp": the EDP group and its CP peers, which hold the same experts; "replica": the stage's
        ranks of `rank`'s tensor-parallel index; "dp": the replicas of `rank`'s context-parallel index,
        each reading its own data; "world"), in group order (`group_rank`)."""
        c = self.coordinates(rank)
        if dim == "world":
            return list(range(self.world))
        if dim == "dp":
            return [self.rank(d, c.pp, e, c.cp, c.tp) for d in range(self.edp_size) for e in range(self.ep)]
        if dim == "replica":
            return [
                self.rank(d, c.pp, e, x, c.tp)
                for d in range(self.edp_size)
                for e in range(self.ep)
                for x in range(self.cp)
            ]
        if dim == "ep":
            return [self.rank(c.edp, c.pp, e, c.cp, c.tp) for e in range(self.ep)]
        if dim == "edp":
            return [self.rank(d, c.pp, c.ep, c.cp, c.tp) for d in range(self.edp_size)]
        if dim == "edp_cp":
            return [self.rank(d, c.pp, c.ep, x, c.tp) for d in range(self.edp_size) for x in range(self.cp)]
        if dim == "cp":
            return [self.rank(c.edp, c.pp, c.ep, x, c.tp) for x in range(self.cp)]
        if dim == "pp":
            return [self.rank(c.edp, s, c.ep, c.cp, c.tp) for s in range(self.pp)]
        if dim == "tp":
            return [self.rank(c.edp, c.pp, c.ep, c.cp, t) for t in range(self.tp)]
        raise ValueError(_unknown(dim))

    def all_groups(self, dim: str) -> list[list[int]]:
        """Every group along `dim` (each a list of global ranks), ordered by their first rank."""
        groups: dict[int, list[int]] = {}
        for r in range(self.world):
            ranks = self.group_ranks(dim, r)
            groups.setdefault(min(ranks), ranks)
        return [groups[k] for k in sorted(groups)]

    # ----- what a rank holds ---------------------------------------------------------------------
    def stage_blocks(self, num_layers: int) -> list[range]:
        """The global blocks of each of the P x V stages (`stage_layers`, else an even split with the
        remainder on the first stages)."""
        return list(_stage_runs(num_layers, self.num_stages, self.stage_layers))

    def experts_of(self, rank: int, num_experts: int) -> range:
        """Global indices of the experts global `rank` holds in each MoE block: its EP rank's contiguous
        run of num_experts / E (empty for a dense model)."""
        check_experts(num_experts, self.ep)
        per_rank = num_experts // self.ep
        ep = self.coordinates(rank).ep
        return range(ep * per_rank, (ep + 1) * per_rank)

    def rank_holdings(self, rank: int, num_layers: int, num_experts: int = 0, mtp_depth: int = 0) -> Holdings:
        """Which stages, blocks and experts global `rank` holds of a model of `num_layers` blocks,
        `num_experts` experts per MoE block (0: dense) and `mtp_depth` multi-token prediction modules
        (their blocks `num_layers`, ... on the last stage). The one answer to that question."""
        c = self.coordinates(rank)
        runs = list(self.stage_blocks(num_layers))
        runs[-1] = range(runs[-1].start, runs[-1].stop + mtp_depth)  # the MTP blocks follow the last
        stages = tuple(c.pp + v * self.pp for v in range(self.virtual_stages))
        last = self.num_stages - 1 in stages
        return Holdings(
            stages=stages,
            blocks_per_stage=tuple(runs[s] for s in stages),
            experts=self.experts_of(rank, num_experts),
            first=0 in stages,
            last=last,
            mtp_blocks=range(num_layers, num_layers + mtp_depth) if last else range(0),
        )

    def embedding_ranks(self, rank: int) -> list[int]:
        """The ranks holding a copy of the embedding in global `rank`'s pipeline group under multi-token
        prediction: its first stage's (the model's input) and its last stage's (the MTP modules' input),
        whose gradients are summed so that both copies take the same update (Megatron's embedding group).
        One rank without pipeline stages."""
        ranks = self.group_ranks("pp", rank)
        return sorted({ranks[0], ranks[-1]})


def _unknown(dim: str) -> str:
    """The sentence refusing a dimension name that is not one of `DIMS`."""
    return f"Unknown layout dimension {dim!r}; use one of {', '.join(DIMS)}."


@functools.lru_cache(maxsize=1024)
def _stage_runs(num_layers: int, num_stages: int, stage_layers: tuple[int, ...] | None) -> tuple[range, ...]:
    """Each stage's run of global blocks; cached because `mula plan --search` asks it of every rank of
    every candidate layout (a 128-stage pipeline otherwise costs P^2 per question)."""
    counts = stage_layer_counts(num_layers, num_stages, stage_layers)
    starts = itertools.accumulate(counts, initial=0)
    return tuple(range(a, a + c) for a, c in zip(starts, counts))
