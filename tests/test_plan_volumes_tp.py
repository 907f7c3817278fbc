"""The step-time model's tensor-parallel volumes against the bytes real runs hand to the collectives
(and the context-parallel group's calls against the functional collectives a real run issues).

4 gloo CPU ranks train the tiny dense model with `XPUMoEStrategy(tensor_parallel_size=T,
sequence_parallel=...)` under Lightning's Trainer, one optimizer step of two accumulated micro-batches:
T = 2 (RMSNorm, QK-norm over split heads, grouped KV heads), T = 2 with sequence parallelism, T = 4
(LayerNorm), T = 2 with SP under attention checkpointing, and bf16 autocast (T = 2 with SP; T = 4 with
everything recomputed). DTensor issues its collectives as torch's
functional collectives (`_c10d_functional` ops: all_reduce, all_gather_into_tensor,
reduce_scatter_tensor), in forward and in backward, some from inside DTensor's own operator handlers
(the vocabulary-parallel loss): a dispatch mode that steps aside for DTensor arguments (as torch's
`CommDebugMode` does) sees each of them on plain tensors, and counts its bus bytes (2(n-1)/n of an
all-reduce's buffer, (n-1)/n of a reduce-scatter's input or an all-gather's output). The model's
`tensor_parallel` volume must equal the counted bytes exactly, and its data-parallel gradient
all-reduce (over the local shards, W / T ranks) the bytes the gradient synchronizer hands to
`all_reduce` (`CollectiveMeter` of tests/test_plan_volumes.py).
"""

from __future__ import annotations

from collections import defaultdict

import lightning.pytorch as L
import pytest
import torch
from dist_helpers import cpu_trainer, lightning_env, run_distributed
from test_plan_volumes import CollectiveMeter
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from mula.model.config import resolve_config
from mula.plan import Layout
from mula.plan.step_time import comm_volumes
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
}


# the functional ops that are collectives (not `wait_tensor` nor the autograd wrappers)
COLLECTIVE_OPS = ("all_reduce", "all_reduce_", "all_gather_into_tensor", "reduce_scatter_tensor")


class FunctionalCollectiveMeter(TorchDispatchMode):
    """Bus bytes of the functional collectives run while entered (DTensor's, in forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0.0
        self.calls: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor turn the op into local ops and collectives first
        out = func(*args, **(kwargs or {}))
        if func.namespace == "_c10d_functional":
            from torch.distributed.distributed_c10d import _resolve_process_group

            name = func._opname
            x = args[0]
            nbytes = x.numel() * x.element_size()
            if name in ("all_reduce", "all_reduce_"):
                n = _resolve_process_group(args[2]).size()
                self.bytes += 2 * nbytes * (n - 1) / n
            elif name == "all_gather_into_tensor":
                self.bytes += nbytes * (args[1] - 1)
            elif name == "reduce_scatter_tensor":
                self.bytes += nbytes * (args[2] - 1) / args[2]
            elif name == "all_to_all_single":  # Ulysses' (context parallelism): calls only, not TP bytes
                pass
            elif name != "wait_tensor" and not name.startswith("_wrap"):
                raise AssertionError(f"uncounted functional collective {func}")
            self.calls[name] += 1
        return out


class _Window(L.Callback):
    """The meters count during training batches (the optimizer step included), not setup."""

    def __init__(self, meter: FunctionalCollectiveMeter, collectives: CollectiveMeter) -> None:
        self.meter, self.collectives = meter, collectives

    def on_train_batch_start(self, *args) -> None:
        self.meter.__enter__()
        self.collectives.active = True

    def on_train_batch_end(self, *args) -> None:
        self.meter.__exit__(None, None, None)
        self.collectives.active = False


class _Micro:
    """This data-parallel rank's MICROS micro-batches (TP ranks read the same)."""

    def __init__(self, dp_rank: int, vocab: int) -> None:
        self.dp_rank, self.vocab = dp_rank, vocab

    def __iter__(self):
        g = torch.Generator().manual_seed(7 + self.dp_rank)
        yield from torch.randint(0, self.vocab, (MICROS * B, SEQ + 1), generator=g).split(B)


def _measure(rank: int, world: int) -> dict[str, dict[str, float]]:
    from mula.training.module import MulaLightningModule

    lightning_env(rank, world)
    collectives = CollectiveMeter(32)
    collectives.install()
    out = {}
    for name, (overrides, tp, sp, ckpt, precision) in LAYOUTS.items():
        meter = FunctionalCollectiveMeter()
        collectives.bytes.clear()
        strategy = XPUMoEStrategy(tensor_parallel_size=tp, sequence_parallel=sp, shard_optimizer=False)
        torch.manual_seed(0)
        module = MulaLightningModule(
            "mula-tiny-dense", overrides=overrides, decay_steps=10, activation_checkpointing=ckpt
        )
        trainer = cpu_trainer(
            world, strategy, max_steps=1, accumulate_grad_batches=MICROS,
            callbacks=[_Window(meter, collectives)], precision=precision,
        )  # fmt: skip
        trainer.fit(module, _Micro(rank // tp, overrides["vocab_size"]))
        out[name] = {
            "tensor_parallel": meter.bytes,
            "tensor_parallel_calls": sum(n for k, n in meter.calls.items() if k in COLLECTIVE_OPS),
            "grad_reduce": collectives.bytes.get("grad_reduce", 0.0),
        }
    return out


@pytest.fixture(scope="module")
def measured() -> list[dict[str, dict[str, float]]]:
    return run_distributed(_measure, WORLD)


def _volumes(name: str):
    overrides, tp, sp, ckpt, precision = LAYOUTS[name]
    layout = Layout(
        world_size=WORLD, tp_size=tp, sequence_parallel=sp, micro_batch=B, seq_len=SEQ, micro_batches=MICROS,
        precision=precision, checkpointing=ckpt, shard_optimizer=False, collectives="rooted",
    )  # fmt: skip
    (volumes,) = comm_volumes(resolve_config("mula-tiny-dense", overrides), layout)
    return volumes


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_tensor_parallel_volumes_match_the_bytes_sent(measured, name: str) -> None:
    volumes = _volumes(name)
    for rank, runs in enumerate(measured):
        got = runs[name]
        assert volumes.tensor_parallel == pytest.approx(got["tensor_parallel"], rel=1e-9), (rank, got)
        assert volumes.grad_reduce == pytest.approx(got["grad_reduce"], rel=1e-9), (rank, got)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_tensor_parallel_calls_match_the_collectives_issued(measured, name: str) -> None:
    """The calls the model prices at the all-reduce's latency: every functional collective DTensor and
    the MoE layer's token split issue, forward, backward, recomputed forward and the partial gradients'
    sums (a lost per-layer call, a per-micro-batch count taken per step, fail it)."""
    volumes = _volumes(name)
    for rank, runs in enumerate(measured):
        assert volumes.tensor_parallel_calls == runs[name]["tensor_parallel_calls"], (rank, runs[name])


def test_the_layouts_move_different_bytes(measured) -> None:
    """Not vacuous: every layout moves tensor-parallel bytes, each a different amount."""
    sent = [measured[0][name]["tensor_parallel"] for name in LAYOUTS]
    assert all(s > 0 for s in sent) and len(set(sent)) == len(LAYOUTS)


# context parallelism over 2 of the ranks (DP = 2) of the MoE model: its functional collectives
CP_LAYOUTS = {"C=2 MoE": "none", "C=2 MoE, moe recomputed": ["moe"]}


def _measure_cp(rank: int, world: int) -> dict[str, int]:
    from mula.training.module import MulaLightningModule

    lightning_env(rank, world)
    collectives = CollectiveMeter(32)
    collectives.install()
    out = {}
    for name, ckpt in CP_LAYOUTS.items():
        meter = FunctionalCollectiveMeter()
        strategy = XPUMoEStrategy(context_parallel_size=2, shard_optimizer=False)
        torch.manual_seed(0)
        module = MulaLightningModule(
            "mula-tiny-dense", overrides=MOE, decay_steps=10, activation_checkpointing=ckpt
        )
        trainer = cpu_trainer(
            world, strategy, max_steps=1, accumulate_grad_batches=MICROS,
            callbacks=[_Window(meter, collectives)], precision="32-true",
        )  # fmt: skip
        trainer.fit(module, _Micro(rank // 2, MOE["vocab_size"]))
        out[name] = sum(n for k, n in meter.calls.items() if k in (*COLLECTIVE_OPS, "all_to_all_single"))
    return out


def test_context_parallel_calls_match_the_collectives_issued() -> None:
    """Ulysses' all-to-alls and the router-loss totals' all-gathers and reduce-scatters: every
    functional collective a C = 2 MoE step issues, the forward recomputed or not."""
    measured = run_distributed(_measure_cp, WORLD)
    for name, ckpt in CP_LAYOUTS.items():
        layout = Layout(
            world_size=WORLD, cp_size=2, micro_batch=B, seq_len=SEQ, micro_batches=MICROS,
            checkpointing=ckpt, shard_optimizer=False, collectives="rooted",
        )  # fmt: skip
        (volumes,) = comm_volumes(resolve_config("mula-tiny-dense", MOE), layout)
        assert volumes.context_parallel_calls > 0
        for rank, runs in enumerate(measured):
            assert volumes.context_parallel_calls == runs[name], (rank, name, runs[name])
