"""The step-time model and `--search`: the parts follow the formulas of mula/plan/step_time.py, the
search lists only layouts that fit, fastest first."""

from __future__ import annotations

import pytest

from mula import MulaConfig
from mula.plan import Layout, plan_memory
from mula.plan.command import scaling
from mula.plan.machines import load_machine
from mula.plan.search import search_layouts
from mula.plan.settings import PlanInputs
from mula.plan.step_time import step_time

AURORA = load_machine("aurora")
CONFIG = MulaConfig.from_name("mula-20b-a2b")
BASE = Layout(world_size=384, ep_size=12, seq_len=2048, micro_batches=8, precision="bf16-true",
              device_type="xpu", shard_optimizer=True)  # fmt: skip


def test_compute_is_the_model_flops_at_the_assumed_efficiency() -> None:
    t = step_time(CONFIG, BASE, AURORA, 3072)
    tokens = 3072 * 2048
    expected = (
        CONFIG.flops_per_token(2048) * tokens / 384 / (AURORA.peak_bf16_tflops * 1e12 * AURORA.compute_mfu)
    )
    assert t.compute_s == pytest.approx(expected)
    assert t.tokens_per_s == pytest.approx(tokens / t.step_time_s)
    assert t.mfu == pytest.approx(t.compute_s / t.step_time_s * AURORA.compute_mfu)
    assert t.pipeline_s == 0.0


def test_all_to_all_grows_with_the_group_and_leaves_the_node() -> None:
    assert step_time(CONFIG, BASE.replace(ep_size=1), AURORA, 3072).all_to_all_s == 0.0
    e4, e12 = (step_time(CONFIG, BASE.replace(ep_size=e), AURORA, 3072).all_to_all_s for e in (4, 12))
    assert e12 / e4 == pytest.approx((11 / 12) / (3 / 4))  # (E-1)/E of the rows leave the rank
    off_node = step_time(CONFIG, BASE.replace(ep_size=24), AURORA, 3072).all_to_all_s
    assert off_node > e12 * AURORA.intra_node_gbps / AURORA.inter_node_gbps * 0.9
    recompute = step_time(CONFIG, BASE.replace(checkpointing=["moe"]), AURORA, 3072)
    assert recompute.all_to_all_s == pytest.approx(e12 * 6 / 4)  # the recompute re-runs dispatch and combine


def test_recompute_costs_a_forward_and_the_bubble_follows_1f1b() -> None:
    plain, full = (step_time(CONFIG, BASE.replace(checkpointing=c), AURORA, 3072) for c in ("none", "full"))
    assert 1.2 < full.compute_s / plain.compute_s < 1.34  # about one more forward of the blocks (< 1/3)
    piped = step_time(CONFIG, BASE.replace(pp_size=4, micro_batches=32), AURORA, 3072)
    bubble = 3 / 32 * (piped.compute_s + piped.all_to_all_s)
    assert bubble < piped.pipeline_s < 1.1 * bubble + 1.0
    inter = step_time(CONFIG, BASE.replace(pp_size=4, micro_batches=32, pp_schedule="interleaved-1f1b",
                                           pp_virtual_stages=2), AURORA, 3072)  # fmt: skip
    assert inter.pipeline_s < piped.pipeline_s


def test_zero2_reduces_every_micro_batch() -> None:
    one, two = (step_time(CONFIG, BASE.replace(zero_stage=z, micro_batches=8), AURORA, 3072) for z in (1, 2))
    assert two.grad_sync_s >= one.grad_sync_s


def test_weak_scaling_keeps_per_rank_work_and_strong_scaling_shrinks_it() -> None:
    inputs = PlanInputs(CONFIG, BASE, 3072, AURORA.device_bytes, "", AURORA)
    rows = scaling(inputs, 32, [64, 128, 512])
    assert all(0.5 < r["weak_efficiency"] <= 1.0 for r in rows)
    assert rows[0]["strong_efficiency"] is not None and rows[0]["strong_efficiency"] <= 1.0
    assert rows[-1]["strong_efficiency"] is None  # 3072 sequences < one per rank of 6144


def test_search_lists_fitting_layouts_fastest_first() -> None:
    config = MulaConfig.from_name("mula-220b-a10b")
    inputs = PlanInputs(config, BASE.replace(micro_batches=8), 3072, AURORA.device_bytes, "", AURORA)
    rows = search_layouts(inputs, limit=50)
    assert rows and all(r["total_gb"] * 1e9 <= AURORA.device_bytes + 1e7 for r in rows)
    times = [r["step_time_s"] for r in rows]
    assert times == sorted(times)
    # the shipped layout (E=12, no stages, no recompute, ZeRO-1) does not fit, so it is not listed
    assert plan_memory(config, BASE).total > AURORA.device_bytes
    shipped = {
        "E": 12,
        "P": 1,
        "micro_batch": 1,
        "checkpointing": "none",
        "zero_stage": 1,
        "bf16_weights": True,
    }
    assert not any(all(r[k] == v for k, v in shipped.items()) for r in rows)


def test_communication_times_are_the_measured_volumes_over_the_bandwidths() -> None:
    """The time parts price `comm_volumes` (checked against real runs in test_plan_volumes.py)."""
    from mula.plan.step_time import comm_volumes

    layout = BASE.replace(pp_size=4, micro_batches=32)
    t = step_time(CONFIG, layout, AURORA, 3072)
    volumes = comm_volumes(CONFIG, layout)
    assert len(volumes) == 4
    intra, inter = AURORA.intra_node_gbps * 1e9, AURORA.inter_node_gbps * 1e9
    assert t.all_to_all_s == pytest.approx(max(v.all_to_all for v in volumes) / intra)  # E=12: one node
    assert t.param_gather_s == pytest.approx(max(v.param_gather for v in volumes) / inter)  # 96 ranks
    bubble = 3 / 32 * (t.compute_s + t.all_to_all_s)
    assert t.pipeline_s == pytest.approx(bubble + max(v.pipeline for v in volumes) / inter)
    # the end stages send one way, the middle ones both: activations forward, gradients backward
    assert volumes[1].pipeline == volumes[2].pipeline == 2 * volumes[0].pipeline == 2 * volumes[3].pipeline


def test_dense_first_blocks_weigh_their_own_flops_in_the_slowest_stage() -> None:
    """P=2 over 2 dense then 2 MoE blocks: the step takes the heavier stage's share of the blocks' FLOPs
    (each block's FLOPs from differences of `flops_per_token`, which tests/test_config.py checks
    against the module), not half of them."""
    seq = BASE.seq_len
    kw = {"num_layers": 4, "num_dense_layers": 2, "intermediate_size": 16384}
    config = MulaConfig.from_name("mula-20b-a2b", **kw)

    def flops(**changes) -> int:
        return MulaConfig.from_name("mula-20b-a2b", **changes).flops_per_token(seq)

    moe_block = flops(num_layers=2) - flops(num_layers=1)
    dense_block = flops(num_layers=2, num_dense_layers=1, intermediate_size=16384) - flops(num_layers=1)
    assert dense_block > moe_block  # so the dense stage is the slower one
    layout = BASE.replace(pp_size=2, world_size=768, micro_batches=16)
    t = step_time(config, layout, AURORA, 3072)
    share = 2 * max(dense_block, moe_block) / (2 * dense_block + 2 * moe_block)
    rate = AURORA.peak_bf16_tflops * 1e12 * AURORA.compute_mfu
    expected = config.flops_per_token(seq) * 3072 * seq / 768 * (share * 2) / rate
    assert t.compute_s == pytest.approx(expected, rel=1e-12)
    # only the MoE stage sends (its 2 blocks), as much as each stage of the all-MoE model
    all_moe = step_time(MulaConfig.from_name("mula-20b-a2b", num_layers=4), layout, AURORA, 3072)
    assert t.all_to_all_s == pytest.approx(all_moe.all_to_all_s)
