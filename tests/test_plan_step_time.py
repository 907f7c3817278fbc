"""The step-time model and `--search`: the parts follow the formulas of mula/plan/step_time.py, the
search lists only layouts that fit, fastest first."""

from __future__ import annotations

import dataclasses

import pytest

from mula import MulaConfig
from mula.plan import Layout, plan_memory
from mula.plan.command import scaling
from mula.plan.machines import Machine, load_machine
from mula.plan.search import search_layouts
from mula.plan.settings import PlanInputs
from mula.plan.step_overheads import update_bytes
from mula.plan.step_time import comm_volumes, step_time

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
    """P=2 over 2 dense then 2 MoE blocks: the step takes the heavier stage's FLOPs (each block's FLOPs
    from differences of `flops_per_token`, which tests/test_config.py checks against the module; the
    LM head's on the last stage), not half of them."""
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
    head = 6 * config.vocab_size * config.hidden_size
    rate = AURORA.peak_bf16_tflops * 1e12 * AURORA.compute_mfu
    expected = max(2 * dense_block, 2 * moe_block + head) * 3072 * seq / 768 * 2 / rate
    assert t.compute_s == pytest.approx(expected, rel=1e-12)
    # only the MoE stage sends (its 2 blocks), as much as each stage of the all-MoE model
    all_moe = step_time(MulaConfig.from_name("mula-20b-a2b", num_layers=4), layout, AURORA, 3072)
    assert t.all_to_all_s == pytest.approx(all_moe.all_to_all_s)


def _calibrated(**extra) -> Machine:
    """A one-node machine of 4 ranks with every calibrated rate the step-time model reads."""
    curve = {"alpha_s": 1e-4, "beta_s_per_byte": 1e-9, "max_error": 0.03}
    kinds = ("all_to_all", "reduce_scatter", "all_gather", "all_reduce", "send_recv")
    rates = {"step": 0.05, "forward": 0.06, "head_step": 0.2, "head_forward": 0.25}
    calibration = {
        "training_tflops": {"float32": rates, "bfloat16": rates}, "elementwise_gbps": 8.0,
        "loop_s": {"step": 2e-3, "batch": 5e-4}, "error_band": 0.03,
        "collectives": {"intra": {k: {2: curve, 4: curve} for k in kinds}}, **extra,
    }  # fmt: skip
    return dataclasses.replace(AURORA, tiles_per_node=4, calibration=calibration)


TINY = MulaConfig.from_name("mula-tiny-moe")
SMALL = Layout(world_size=4, ep_size=2, micro_batch=2, seq_len=128, micro_batches=4, device_type="cpu",
               shard_optimizer=True, collectives="native")  # fmt: skip


@pytest.mark.parametrize("zero", [1, 2])
def test_the_update_moves_its_shard_through_adamw_and_zeroes_its_gradients(zero: int) -> None:
    """The sharded AdamW's passes over the owned shard (the exact flat layout: mula.plan.memory, tested
    against the optimizer's own byte counts), bytes per element: norm read, fused AdamW (gradient and
    four fp32 words read, three written), the gather's cast copy; plus the gradient buffer's zeroing."""
    layout = SMALL.replace(zero_stage=zero)
    plan = plan_memory(TINY, layout)
    shard = plan.optimizer // 12
    assert update_bytes(TINY, layout) == shard * (4 + 4 * 7 + 4 + 4) + plan.grads
    bf16 = layout.replace(precision="bf16-true", reduce_dtype="bf16")
    shard16 = plan_memory(TINY, bf16).optimizer // 12
    assert update_bytes(TINY, bf16) == shard16 * (2 + 4 * 6 + 2 + 4 + 2) + plan_memory(TINY, bf16).grads
    # replicated torch AdamW: every local parameter, its unfused passes' words in the parameters' dtype
    plain = layout.replace(shard_optimizer=False)
    assert update_bytes(TINY, plain) == _torch_adamw_words_per_element() * plan_memory(TINY, plain).params


def _torch_adamw_words_per_element() -> int:
    """Words per parameter element torch.optim.AdamW's step (defaults, weight decay on as Mula's) reads
    and writes, counted from the aten operations it runs on a parameter of 4096 elements: each
    operation's distinct tensor inputs of that size read, its outputs written."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    n = 4096
    words = 0

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            nonlocal words
            out = func(*args, **(kwargs or {}))
            big = lambda t: isinstance(t, torch.Tensor) and t.numel() == n  # noqa: E731
            reads = {t.data_ptr() for t in tree_leaves((args, kwargs)) if big(t)}
            words += len(reads) + sum(1 for t in tree_leaves(out) if big(t))
            return out

    param = torch.nn.Parameter(torch.randn(n))
    optimizer = torch.optim.AdamW([param], lr=1e-3, weight_decay=0.1)
    param.grad = torch.randn(n)
    optimizer.step()  # the first step creates the state
    words = 0
    with Count():
        optimizer.step()
    return words


def test_update_and_loop_are_priced_only_with_a_calibration() -> None:
    machine = _calibrated()
    t = step_time(TINY, SMALL, machine, 16)
    assert t.optimizer_s == pytest.approx(update_bytes(TINY, SMALL) / 8e9)
    # per step, per micro-batch (Lightning's batches: 4 here), the gradient-norm all-reduce's latency
    assert t.loop_s == pytest.approx(2e-3 + 4 * 5e-4 + 1e-4)
    piped = SMALL.replace(ep_size=1, pp_size=2)
    assert step_time(TINY, piped, machine, 16).loop_s == pytest.approx(
        2e-3 + 5e-4 + 1e-4
    )  # one batch per step
    parts = {k: v for k, v in t.as_dict().items() if k not in ("step_time_s", "tokens_per_s", "mfu")}
    assert t.step_time_s == pytest.approx(sum(parts.values()))
    plain = step_time(TINY, SMALL, AURORA, 16)
    assert plain.optimizer_s == plain.loop_s == 0.0


def test_blocks_and_the_lm_head_each_at_their_calibrated_rate() -> None:
    """Compute: each block's FLOPs at the block rate, the LM head's (the last stage's) at the rest's, the
    recomputed forward at the forward rate; per rank of a stage."""
    machine = _calibrated()
    seq, tokens = SMALL.seq_len, 16 * SMALL.seq_len
    core = 6 * TINY.attention_core_width * seq
    blocks = [6 * TINY.layer_matmul_params(i) + core for i in range(TINY.num_layers)]
    head = 6 * TINY.vocab_size * TINY.hidden_size
    assert TINY.flops_per_token(seq) == sum(blocks) + head
    t = step_time(TINY, SMALL, machine, 16)
    assert t.compute_s == pytest.approx(tokens / 4 * (sum(blocks) / 0.05e12 + head / 0.2e12))
    full = step_time(TINY, SMALL.replace(checkpointing="full"), machine, 16)
    forward = sum(
        2 * TINY.layer_matmul_params(i) + 2 * TINY.attention_core_width * seq for i in range(TINY.num_layers)
    )
    assert full.compute_s - t.compute_s == pytest.approx(tokens / 4 * forward / 0.06e12)
    piped = step_time(TINY, SMALL.replace(ep_size=1, pp_size=2), machine, 16)  # the head's stage is slower
    half = TINY.num_layers // 2
    assert piped.compute_s == pytest.approx(tokens / 2 * (sum(blocks[half:]) / 0.05e12 + head / 0.2e12))


def test_tensor_and_context_parallel_calls_at_the_functional_call_price() -> None:
    """T's and C's calls (DTensor's and Ulysses' functional collectives, counted in a real run by
    tests/test_plan_volumes_tp.py) each at the calibrated price of a call between computes, when the
    calibration has one, else at their collective's latency; their bytes at its bandwidth either way."""
    dense = MulaConfig.from_name("mula-tiny-dense")
    tp = Layout(world_size=2, tp_size=2, micro_batch=2, seq_len=128, micro_batches=2, device_type="cpu")
    cp = tp.replace(tp_size=1, cp_size=2)
    for layout, part in ((tp, "tensor_parallel"), (cp, "context_parallel")):
        (v,) = comm_volumes(dense, layout)
        calls = getattr(v, part + "_calls")
        assert calls > 0
        latency = step_time(dense, layout, _calibrated(), 4)
        assert getattr(latency, part + "_s") == pytest.approx(calls * 1e-4 + 1e-9 * getattr(v, part))
        priced = step_time(dense, layout, _calibrated(functional_call_s={2: 3e-3}), 4)
        assert getattr(priced, part + "_s") == pytest.approx(calls * 3e-3 + 1e-9 * getattr(v, part))


def test_gradient_reduction_overlaps_backward_on_accelerators_only() -> None:
    """On CPU ranks gloo reduces on the cores that compute: the whole reduction counts; on an
    accelerator it hides behind the last micro-batch's backward."""
    machine = _calibrated()
    layout = SMALL.replace(ep_size=1)
    cpu = step_time(TINY, layout, machine, 16)
    (v,) = comm_volumes(TINY, layout)
    whole = v.grad_reduce_calls * 1e-4 + 1e-9 * v.grad_reduce
    assert cpu.grad_sync_s == pytest.approx(whole)
    xpu = step_time(TINY, layout.replace(device_type="xpu"), machine, 16)
    assert xpu.grad_sync_s == pytest.approx(max(0.0, whole - xpu.compute_s * 2 / 3 / layout.micro_batches))
    assert xpu.grad_sync_s < cpu.grad_sync_s


def test_an_offloaded_update_leaves_the_device_pass() -> None:
    """With optimizer offload only the device-resident tail buckets' shard goes through the device's
    AdamW pass (the host updates the rest during backward)."""
    layout = SMALL.replace(offload=True, offload_tail_buckets=0)
    plan = plan_memory(TINY, layout)
    assert plan.optimizer == 0
    assert update_bytes(TINY, layout) == plan.grads  # the gradient buffer is still zeroed
    assert update_bytes(TINY, layout) < update_bytes(TINY, SMALL)
