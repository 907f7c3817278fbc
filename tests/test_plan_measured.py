"""The planner against measured numbers on 4 CPU ranks (gloo, one launch for every layout): parameter,
gradient and optimizer-state bytes of the EP-aware sharded optimizer predicted exactly (the values
`MemoryMetrics` and `MoEMetrics` log, computed by the same functions), activations within 10 % of the
saved-tensor bytes, for several (E, ZeRO stage, bf16 weights, reduce dtype, bucket size,
checkpointing) layouts."""

from __future__ import annotations

import pytest
import torch
from dist_helpers import run_distributed

from mula import MulaConfig
from mula.plan import Layout, plan_memory

WORLD, B, T = 4, 4, 128
CONFIG = MulaConfig.from_name("mula-tiny-moe", vocab_size=512, num_layers=2, max_position_embeddings=256)
# (E, precision, zero_stage, reduce_dtype, bucket_numel, checkpointing)
LAYOUTS = [
    (1, "32-true", 1, "fp32", 2**24, "none"),
    (2, "32-true", 1, "fp32", 2**24, ["moe"]),
    (2, "bf16-true", 1, "fp32", 4096, ["attention"]),
    (4, "bf16-true", 2, "bf16", 2**24, "full"),
    (4, "32-true", 2, "fp32", 20000, ["norms"]),
    (2, "bf16-true", 2, "fp32", 50000, ["moe", "attention"]),
]


def _measure(rank: int, world: int) -> list[dict[str, float]]:
    from mula.training.memory_meter import SavedTensorMeter, grad_bytes, param_bytes
    from mula.training.module import MulaLightningModule
    from strategies.experts.expert_parallel import apply_expert_parallel
    from strategies.optim.sharded_optimizer import EPShardedAdamW
    from strategies.topology import build_topology

    out = []
    for ep, precision, zero, reduce, bucket, ckpt in LAYOUTS:
        topo = build_topology(ep)
        torch.manual_seed(0)
        module = MulaLightningModule(CONFIG, decay_steps=10, activation_checkpointing=ckpt)
        module.configure_model()
        apply_expert_parallel(module, topo)  # what XPUMoEStrategy.setup does, in its order
        if precision == "bf16-true":
            module.to(torch.bfloat16)
        adamw = module.configure_optimizers()["optimizer"]
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        dtype = torch.bfloat16 if reduce == "bf16" else torch.float32
        opt = EPShardedAdamW.from_adamw(
            adamw, named, topo, zero_stage=zero, reduce_dtype=dtype, bucket_numel=bucket
        )
        batch = torch.randint(0, CONFIG.vocab_size, (B, T + 1), generator=torch.Generator().manual_seed(rank))
        with SavedTensorMeter(exclude=module.parameters()) as meter:
            loss = module._losses(batch)[0]
        loss.backward()
        opt.reduce_gradients()
        out.append({
            "mem/param_bytes": param_bytes(module), "mem/grad_bytes": grad_bytes(module, opt),
            "mem/activation_bytes": meter.bytes, **opt.metrics(),
        })  # fmt: skip
        opt.step()
        opt.close()
    return out


@pytest.fixture(scope="module")
def measured() -> list[list[dict[str, float]]]:
    return run_distributed(_measure, WORLD)


@pytest.mark.parametrize("index", range(len(LAYOUTS)))
def test_four_ranks_match_the_plan(measured, index: int) -> None:
    ep, precision, zero, reduce, bucket, ckpt = LAYOUTS[index]
    layout = Layout(
        world_size=WORLD, ep_size=ep, micro_batch=B, seq_len=T, precision=precision, checkpointing=ckpt,
        shard_optimizer=True, zero_stage=zero, reduce_dtype=reduce, bucket_numel=bucket, collectives="rooted",
    )  # fmt: skip
    plan = plan_memory(CONFIG, layout)
    for rank, logged in enumerate(measured):
        row = logged[index]
        assert plan.param_tensor_bytes == row["mem/param_bytes"], rank
        assert plan.params == row["optim/param_bytes"], rank
        assert plan.grads == row["mem/grad_bytes"] == row["optim/grad_buffer_bytes"], rank
        assert plan.optimizer == row["optim/state_bytes"], rank
        assert plan.activations == pytest.approx(row["mem/activation_bytes"], rel=0.10), rank


def test_the_exact_numbers_depend_on_the_layout(measured) -> None:
    """The comparison is not vacuous: the layouts give different per-rank bytes."""
    params = {measured[0][i]["mem/param_bytes"] for i in range(len(LAYOUTS))}
    grads = {measured[0][i]["mem/grad_bytes"] for i in range(len(LAYOUTS))}
    assert len(params) >= 4 and len(grads) >= 4
