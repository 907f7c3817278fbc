"""The planner's reference cases: the layouts published runs used, read as their code reads them.

Optimus (Scalable Pretraining of Large MoE models on Aurora; the Optimus-LM training scripts):
`run_experiment.sh`'s `BATCH_SIZE` is the batch per data x expert-parallel rank, so the global batch
is DP x EP x BATCH_SIZE (3,072 sequences at 256 nodes), and `MICRO_BATCH_SIZE` defaults to 1: the
paper's 100B-A7B ran E = 12, P = 4 with 4 micro-batches of one 2,048-token sequence per step, its
220B-A10B E = 12, P = 8 with 8, both on 256 Aurora nodes, and its 384 -> 12,288-tile curve grows the
global batch with the data-parallel size (weak scaling). In Mula's terms the W / P ranks of a stage
are the data-parallel ranks (expert parallelism splits them further), each running
`batch_per_rank` micro-batches of one sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

from mula.plan.layout import Layout


@dataclass(frozen=True)
class ReferenceRun:
    """One published run's model and layout on its machine; `layout` rebuilds it at any node count
    with the same batch per rank (weak scaling), `global_batch` says the batch that makes."""

    model: str
    machine: str
    nodes: int
    tiles_per_node: int
    ep_size: int
    pp_size: int
    batch_per_rank: int  # sequences per data x expert-parallel rank and step
    micro_batch: int = 1
    seq_len: int = 2048
    source: str = ""

    def global_batch(self, nodes: int | None = None) -> int:
        """Sequences per optimizer step at `nodes` (the published count by default)."""
        ranks = (nodes or self.nodes) * self.tiles_per_node
        return ranks // self.pp_size * self.batch_per_rank

    def layout(self, nodes: int | None = None, checkpointing: str | list[str] = "none") -> Layout:
        """The run's layout at `nodes` (bf16 weights, fp32 masters in the sharded optimizer, ZeRO-1)."""
        return Layout(
            world_size=(nodes or self.nodes) * self.tiles_per_node,
            ep_size=self.ep_size,
            pp_size=self.pp_size,
            micro_batch=self.micro_batch,
            micro_batches=self.batch_per_rank // self.micro_batch,
            seq_len=self.seq_len,
            precision="bf16-true",
            checkpointing=checkpointing,
            device_type="xpu",
            shard_optimizer=True,
        )


_OPTIMUS = "Optimus-LM run_experiment.sh (BATCH_SIZE per DP x EP rank, MICRO_BATCH_SIZE=1), 256 Aurora nodes"

OPTIMUS_RUNS = {
    "mula-100b-a7b": ReferenceRun("mula-100b-a7b", "aurora", 256, 12, ep_size=12, pp_size=4, batch_per_rank=4, source=_OPTIMUS),
    "mula-220b-a10b": ReferenceRun("mula-220b-a10b", "aurora", 256, 12, ep_size=12, pp_size=8, batch_per_rank=8, source=_OPTIMUS),
}  # fmt: skip
