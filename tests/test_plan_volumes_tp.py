"""The step-time model's tensor- and context-parallel volumes against the bytes real runs hand to the
collectives.

4 gloo CPU ranks train the tiny dense model with `XPUMoEStrategy(tensor_parallel_size=T,
sequence_parallel=...)` under Lightning's Trainer, one optimizer step of two accumulated micro-batches:
T = 2 (RMSNorm, QK-norm over split heads, grouped KV heads), T = 2 with sequence parallelism, T = 4
(LayerNorm), T = 2 with SP under attention checkpointing, and bf16 autocast (T = 2 with SP; T = 4 with
everything recomputed), an MoE model at T = 2 with and without SP; and C = 2 (Ulysses) of the MoE model.
DTensor issues its collectives as torch's functional collectives (`_c10d_functional` ops: all_reduce,
all_gather_into_tensor, reduce_scatter_tensor), in forward and in backward, some from inside DTensor's
own operator handlers (the vocabulary-parallel loss); Ulysses its all-to-alls and the router-loss
totals' all-gathers. `mula.bench.collectives.CollectiveMeter` (the meter `mula bench` reports with)
counts them and the eager collectives by kind, in bus bytes each way (2(n-1)/n of an all-reduce's
buffer, (n-1)/n of a reduce-scatter's input or an all-gather's output, what an all-to-all sends to and
receives from other ranks); `mula.plan.collective_kinds.planned_collectives` must equal every kind's
bytes and calls exactly: the model's `tensor_parallel` volume, its data-parallel gradient all-reduce
(over the local shards, W / T ranks), the Ulysses and router-loss volumes, the step's small all-reduces.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from dist_helpers import cpu_trainer, lightning_env, run_distributed

from mula.bench.collectives import CollectiveSteps
from mula.model.config import resolve_config
from mula.plan import Layout
from mula.plan.collective_kinds import KINDS, planned_collectives
from strategies import XPUMoEStrategy

WORLD, B, SEQ, MICROS = 4, 2, 32, 2
RMS = dict(
    vocab_size=256, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64,
    max_position_embeddings=64, norm="rmsnorm", qk_norm=True,
)  # fmt: skip
TINY = dict(vocab_size=256, hidden_size=32, num_layers=3, num_heads=4, intermediate_size=64)
# an MoE model (uniform routing): its layers route 1/T of the tokens, the router losses summed over TP
MOE = dict(
    RMS, num_experts=4, top_k=2, expert_intermediate_size=32, routing_mode="uniform", num_dense_layers=1,
    num_layers=3,
)  # fmt: skip
SEQUENCE_MOE = dict(MOE, aux_loss_scope="sequence")
# name: (overrides, T, sequence parallel, checkpointing, precision)
LAYOUTS = {
    "T=2": (RMS, 2, False, "none", "32-true"),
    "T=2 SP": (RMS, 2, True, "none", "32-true"),
    "T=4 LayerNorm": (TINY, 4, False, "none", "32-true"),
    "T=2 SP, attention recomputed": (RMS, 2, True, ["attention"], "32-true"),
    "T=2 SP, bf16 autocast": (RMS, 2, True, "none", "bf16-mixed"),
    "T=4 two blocks, bf16 autocast, full recompute": (
        {**TINY, "num_layers": 2},
        4,
        False,
        "full",
        "bf16-mixed",
    ),
    "T=2 MoE": (MOE, 2, False, "none", "32-true"),
    "T=2 SP MoE, moe recomputed": (MOE, 2, True, ["moe"], "32-true"),
    # the sequence-wise balance loss sums [B, E] probabilities and counts over the TP group
    "T=2 MoE, sequence-wise balance": (SEQUENCE_MOE, 2, False, "none", "32-true"),
}


class _Micro:
    """This data-parallel rank's MICROS micro-batches (TP ranks read the same)."""

    def __init__(self, dp_rank: int, vocab: int) -> None:
        self.dp_rank, self.vocab = dp_rank, vocab

    def __iter__(self):
        g = torch.Generator().manual_seed(7 + self.dp_rank)
        yield from torch.randint(0, self.vocab, (MICROS * B, SEQ + 1), generator=g).split(B)


def _measure(rank: int, world: int) -> dict[str, dict[str, dict[str, float]]]:
    from mula.training.module import MulaLightningModule

    lightning_env(rank, world)
    out = {}
    for name, (overrides, tp, sp, ckpt, precision) in LAYOUTS.items():
        counted = CollectiveSteps([1])
        strategy = XPUMoEStrategy(tensor_parallel_size=tp, sequence_parallel=sp, shard_optimizer=False)
        torch.manual_seed(0)
        module = MulaLightningModule(
            "mula-tiny-dense", overrides=overrides, decay_steps=10, activation_checkpointing=ckpt
        )
        trainer = cpu_trainer(
            world, strategy, max_steps=1, accumulate_grad_batches=MICROS, callbacks=[counted],
            precision=precision,
        )  # fmt: skip
        trainer.fit(module, _Micro(rank // tp, overrides["vocab_size"]))
        out[name] = counted.counts[1]
    return out


@pytest.fixture(scope="module")
def measured() -> list[dict[str, dict[str, float]]]:
    return run_distributed(_measure, WORLD)


def _layout(name: str) -> Layout:
    overrides, tp, sp, ckpt, precision = LAYOUTS[name]
    return Layout(
        world_size=WORLD, tp_size=tp, sequence_parallel=sp, micro_batch=B, seq_len=SEQ, micro_batches=MICROS,
        precision=precision, checkpointing=ckpt, shard_optimizer=False, collectives="rooted",
    )  # fmt: skip


def assert_planned(
    got: dict[str, dict[str, float]], planned: dict[str, dict[str, float]], where: Any
) -> None:
    """Bytes sent and received and calls of every kind of collective as planned (`mula bench`'s columns)."""
    for way in ("sent", "received", "calls"):
        for kind in KINDS:
            expected = planned[way][kind]
            assert got[way][kind] == pytest.approx(expected, rel=1e-9, abs=0), (
                where,
                way,
                kind,
                got[way][kind],
            )


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_tensor_parallel_collectives_match_the_plan(measured, name: str) -> None:
    """The functional collectives DTensor and the MoE layer's token split issue (bytes: `comm_volumes`'
    `tensor_parallel`; calls: forward, backward, recomputed forward and the partial gradients' sums --
    a lost per-layer call, a per-micro-batch count taken per step, fail it), the data-parallel gradient
    all-reduce over the local shards (W / T ranks) and the step's small all-reduces, per kind."""
    (planned,) = planned_collectives(resolve_config("mula-tiny-dense", LAYOUTS[name][0]), _layout(name))
    for rank, runs in enumerate(measured):
        assert_planned(runs[name], planned, (name, rank))


def test_the_layouts_move_different_bytes(measured) -> None:
    """Not vacuous: every layout moves tensor-parallel bytes, each a different amount."""
    sent = [measured[0][name]["sent"]["functional"] for name in LAYOUTS]
    assert all(s > 0 for s in sent) and len(set(sent)) == len(LAYOUTS)


# context parallelism over 2 of the ranks (DP = 2) of the MoE model: its functional collectives
# name: (overrides, checkpointing)
CP_LAYOUTS = {
    "C=2 MoE": (MOE, "none"),
    "C=2 MoE, moe recomputed": (MOE, ["moe"]),
    "C=2 MoE, sequence-wise balance": (SEQUENCE_MOE, "none"),
}


def _measure_cp(rank: int, world: int) -> dict[str, dict[str, dict[str, float]]]:
    from mula.training.module import MulaLightningModule

    lightning_env(rank, world)
    out = {}
    for name, (overrides, ckpt) in CP_LAYOUTS.items():
        counted = CollectiveSteps([1])
        strategy = XPUMoEStrategy(context_parallel_size=2, shard_optimizer=False)
        torch.manual_seed(0)
        module = MulaLightningModule(
            "mula-tiny-dense", overrides=overrides, decay_steps=10, activation_checkpointing=ckpt
        )
        trainer = cpu_trainer(
            world, strategy, max_steps=1, accumulate_grad_batches=MICROS, callbacks=[counted],
            precision="32-true",
        )  # fmt: skip
        trainer.fit(module, _Micro(rank // 2, MOE["vocab_size"]))
        out[name] = counted.counts[1]
    return out


def test_context_parallel_collectives_match_the_plan() -> None:
    """Ulysses' all-to-alls (`functional_all_to_all`) and the router-loss totals' all-gathers and
    reduce-scatters (`functional`): every functional collective a C = 2 MoE step issues, bytes and
    calls, the forward recomputed or not, and the eager gradient and norm all-reduces beside them."""
    measured = run_distributed(_measure_cp, WORLD)
    for name, (overrides, ckpt) in CP_LAYOUTS.items():
        layout = Layout(
            world_size=WORLD, cp_size=2, micro_batch=B, seq_len=SEQ, micro_batches=MICROS,
            checkpointing=ckpt, shard_optimizer=False, collectives="rooted",
        )  # fmt: skip
        (planned,) = planned_collectives(resolve_config("mula-tiny-dense", overrides), layout)
        assert planned["sent"]["functional_all_to_all"] > 0 and planned["sent"]["functional"] > 0
        for rank, runs in enumerate(measured):
            assert_planned(runs[name], planned, (name, rank))
