"""The planner against measured tensor-parallel training on 4 CPU ranks (gloo, Lightning's Trainer with
`XPUMoEStrategy(tensor_parallel_size=T, sequence_parallel=...)`, torch's AdamW, one launch for every
layout): per rank, `mula.plan.plan_memory` against what `MemoryMetrics` logs after one
optimizer step.

Parameter, gradient and optimizer-state bytes (`mem/param_bytes`, `mem/grad_bytes`, and the local
tensors of AdamW's parameters and moments, counted here) must be equal: the planner sizes every
parameter by the local shard that `strategies.tensor_parallel` gives a rank (`mula.plan.parameters.
tp_local_shape`). Activations (`mem/activation_bytes`, the peak of saved-tensor bytes) within 10 %.

Layouts on the tiny dense model: T = 2 (RMSNorm, QK-norm over split heads, grouped KV heads), the
same with sequence parallelism (norm and residual regions on 1/T of the sequence), T = 4 (the preset's
LayerNorm), T = 2 with SP under attention checkpointing, T = 2 with SP and T = 4 under bf16 autocast;
an MoE block after a dense one at T = 2, with and without SP (the MoE layer routes 1/T of the tokens
through whole experts: strategies/tensor_parallel_moe.py). DeepSeek-V3's multi-head latent attention
(the down projections, latent norms and shared RoPE key whole on every rank, the up projections by heads)
and Qwen3's per-head QK-norm (each rank's heads normalised on their own), each at T = 2, with SP, and with
SP under bf16 autocast with the MoE layers recomputed: there nothing depends on the routing, and the plan
equals the measured bytes (to a few bytes).
Not vacuous: the measured numbers differ between layouts, the T = 1 plan of each misses them, and so
does a plan without SP for the SP layouts.
"""

from __future__ import annotations

import pytest
import torch
from dist_helpers import cpu_trainer, lightning_env, run_distributed

from callbacks import MemoryMetrics
from mula.model.config import resolve_config
from mula.plan import Layout, plan_memory
from strategies import XPUMoEStrategy

WORLD, B, SEQ = 4, 2, 128
# RMSNorm weights (replicated, partial gradients under SP), QK-norm over all heads, GQA
RMS = dict(
    vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
    max_position_embeddings=256, norm="rmsnorm", qk_norm=True,
)  # fmt: skip
TINY = dict(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128,
            max_position_embeddings=256)  # fmt: skip
# an MoE block after a dense one: under TP its layer routes 1/T of the tokens, experts whole
MOE = {**RMS, "num_experts": 4, "top_k": 2, "expert_intermediate_size": 64, "num_dense_layers": 1,
       "num_shared_experts": 1}  # fmt: skip
# DeepSeek-V3's MLA (a q latent; the down projections and latent norms whole on every rank, the up
# projections split by heads), its dense first block and a shared-expert MoE block; small experts, as CPU's
# padded layout gathers their weights or not by the routing's counts (which the planner cannot know)
MLA = dict(vocab_size=512, num_layers=2, max_position_embeddings=256, intermediate_size=128, num_experts=8,
           expert_intermediate_size=16)  # fmt: skip
# Qwen3's per-head QK-norm (each rank normalises its own heads), GQA, head_dim != hidden / heads
QWEN3 = dict(vocab_size=512, num_layers=2, num_dense_layers=1, max_position_embeddings=256, intermediate_size=128,
             num_experts=8, expert_intermediate_size=16)  # fmt: skip
# ((preset, overrides), T, sequence parallel, precision, checkpointing)
DENSE = "mula-tiny-dense"
LAYOUTS = [
    ((DENSE, RMS), 2, False, "32-true", "none"),
    ((DENSE, RMS), 2, True, "32-true", "none"),
    ((DENSE, TINY), 4, False, "32-true", "none"),
    ((DENSE, RMS), 2, True, "32-true", ["attention"]),
    ((DENSE, RMS), 2, True, "bf16-mixed", "none"),
    ((DENSE, TINY), 4, False, "bf16-mixed", "none"),
    ((DENSE, MOE), 2, False, "32-true", "none"),
    ((DENSE, MOE), 2, True, "32-true", "none"),
    (("deepseek-v3-tiny", MLA), 2, False, "32-true", "none"),
    (("deepseek-v3-tiny", MLA), 2, True, "32-true", "none"),
    (("deepseek-v3-tiny", MLA), 2, True, "bf16-mixed", ["moe"]),
    (("qwen3-moe-tiny", QWEN3), 2, False, "32-true", "none"),
    (("qwen3-moe-tiny", QWEN3), 2, True, "32-true", "none"),
    (("qwen3-moe-tiny", QWEN3), 2, True, "bf16-mixed", ["moe"]),
]
KEYS = ("mem/param_bytes", "mem/grad_bytes", "mem/activation_bytes")


class _Steps:
    """One optimizer step's micro-batch for this rank's data-parallel index (TP ranks read the same)."""

    def __init__(self, batch: torch.Tensor) -> None:
        self.batch = batch

    def __iter__(self):
        yield self.batch


def _local_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the parameters and the optimizer's state tensors this rank holds (DTensors' local shards)."""
    from strategies.optim.grad_reduce import local_tensor

    total = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            tensors = [p] + [v for v in optimizer.state.get(p, {}).values() if torch.is_tensor(v) and v.dim()]
            total += sum(local_tensor(t).numel() * local_tensor(t).element_size() for t in tensors)
    return total


def _measure(rank: int, world: int, layouts: list) -> list[dict[str, float]]:
    from mula.training.module import MulaLightningModule

    lightning_env(rank, world)
    out = []
    for (preset, overrides), tp, sp, precision, ckpt in layouts:
        strategy = XPUMoEStrategy(tensor_parallel_size=tp, sequence_parallel=sp, shard_optimizer=False)
        torch.manual_seed(0)
        module = MulaLightningModule(
            preset, overrides=overrides, decay_steps=10, activation_checkpointing=ckpt
        )
        trainer = cpu_trainer(
            world, strategy, max_steps=1, accumulate_grad_batches=1, callbacks=[MemoryMetrics()],
            precision=precision, log_every_n_steps=1,
        )  # fmt: skip
        gen = torch.Generator().manual_seed(rank // tp)
        batch = torch.randint(0, overrides["vocab_size"], (B, SEQ + 1), generator=gen)
        trainer.fit(module, _Steps(batch))
        row = {k: float(v) for k, v in trainer.callback_metrics.items() if k in KEYS}
        out.append({**row, "state": _local_state_bytes(trainer.optimizers[0])})
    return out


@pytest.fixture(scope="module")
def measured() -> list[list[dict[str, float]]]:
    return run_distributed(_measure, WORLD, LAYOUTS)


def _plan(index: int, tp: int | None = None, sp: bool | None = None):
    """The plan of layout `index` (with another T or sequence-parallel setting when given)."""
    (preset, overrides), t, seq_par, precision, ckpt = LAYOUTS[index]
    t = t if tp is None else tp
    layout = Layout(
        world_size=WORLD, tp_size=t, sequence_parallel=(seq_par if sp is None else sp) and t > 1,
        micro_batch=B, seq_len=SEQ, precision=precision, checkpointing=ckpt, shard_optimizer=False,
        collectives="rooted",
    )  # fmt: skip
    return plan_memory(resolve_config(preset, overrides), layout)


@pytest.mark.parametrize("index", range(len(LAYOUTS)))
def test_every_rank_matches_the_plan(measured, index: int) -> None:
    plan = _plan(index)
    for rank, logged in enumerate(measured):
        row, where = logged[index], f"{LAYOUTS[index][1:]} rank {rank}"
        assert plan.param_tensor_bytes == row["mem/param_bytes"], where
        assert plan.grads == row["mem/grad_bytes"], where
        assert plan.params + plan.optimizer == row["state"], where  # torch AdamW's two moments
        assert plan.activations == pytest.approx(row["mem/activation_bytes"], rel=0.10), where
        if LAYOUTS[index][4] == ["moe"]:
            # with the MoE layers recomputed nothing depends on the routing: attention and the rest exact
            assert abs(plan.activations - row["mem/activation_bytes"]) <= 8, where


def test_tensor_parallelism_decides_the_numbers(measured) -> None:
    """Not vacuous: the layouts give different bytes, a plan that ignores T misses every one, and one that
    ignores sequence parallelism misses the activations of the SP layouts."""
    rows = [measured[0][i] for i in range(len(LAYOUTS))]
    assert len({row["mem/activation_bytes"] for row in rows}) == len(LAYOUTS)
    dense = [row for row, layout in zip(rows, LAYOUTS) if layout[0][0] == DENSE and layout[0][1] is not MOE]
    assert len({row["mem/param_bytes"] for row in dense}) == 2  # T = 2 and T = 4
    for index, row in enumerate(rows):
        flat = _plan(index, tp=1)
        assert flat.param_tensor_bytes != row["mem/param_bytes"]
        assert flat.activations != pytest.approx(row["mem/activation_bytes"], rel=0.10), LAYOUTS[index][1:]
        if LAYOUTS[index][2]:
            whole = _plan(index, sp=False).activations
            assert whole != pytest.approx(row["mem/activation_bytes"], rel=0.10), LAYOUTS[index][1:]


def test_plan_and_fit_read_tensor_parallel_recipes() -> None:
    """`mula plan` plans T > 1 from a recipe (per-rank shards, data parallelism W / T) instead of refusing
    it, and `mula fit`'s start-of-run memory check runs under TP: a device too small stops the run."""
    from mula.plan.command import check_fit_memory
    from mula.plan.settings import plan_inputs

    def trainer(tp: int, sp: bool) -> dict:
        args = {"tensor_parallel_size": tp, "sequence_parallel": sp, "shard_optimizer": False}
        return {"devices": 4, "accelerator": "cpu",
                "strategy": {"class_path": "strategies.XPUMoEStrategy", "init_args": args}}  # fmt: skip

    model, data = (
        {"config": "mula-tiny-dense"},
        {"global_batch_size": 8, "seq_len": 16, "micro_batch_size": 2},
    )
    inputs = plan_inputs(trainer(2, True), model, data)
    assert (inputs.layout.tp_size, inputs.layout.sequence_parallel, inputs.layout.replica_size) == (
        2,
        True,
        2,
    )
    assert inputs.layout.micro_batches == 2  # 8 sequences over 2 data-parallel ranks of micro-batch 2
    flat = plan_memory(inputs.config, plan_inputs(trainer(1, False), model, data).layout)
    split = plan_memory(inputs.config, inputs.layout)
    # every weight but the (parameter-free) LayerNorms is split: exactly half
    assert 2 * split.param_tensor_bytes == flat.param_tensor_bytes
    with pytest.raises(ValueError, match="predicted .* GB per rank"):
        check_fit_memory(trainer(2, False), model, data, world_size=4, device_memory_gb=1e-6)
    check_fit_memory(trainer(2, False), model, data, world_size=4, device_memory_gb=64)
    with pytest.raises(ValueError, match="sequence_parallel=True needs tensor_parallel_size > 1"):
        plan_inputs(trainer(1, True), model, data)
