"""AllToAllDispatcher on 4 gloo CPU processes against a single-process computation of the same layer."""

from __future__ import annotations

import torch
from dist_helpers import run_distributed

from mula.model.kernels import RoutingPlan
from strategies.experts.all_to_all import AllToAllDispatcher, wire_dtype
from strategies.topology import build_topology

H, E_TOTAL, K = 8, 8, 2


def _rank_inputs(rank: int, num_tokens: int, allowed_experts: int) -> tuple[torch.Tensor, ...]:
    """Deterministic per-rank tokens, routing and weights (any process can rebuild any rank's inputs)."""
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(num_tokens, H, generator=g)
    scores = torch.rand(num_tokens, allowed_experts, generator=g)
    topk_idx = scores.topk(K, dim=1).indices
    topk_weight = torch.rand(num_tokens, K, generator=g)
    upstream = torch.randn(num_tokens, H, generator=g)
    return x, topk_idx, topk_weight, upstream


def _expert_weights() -> torch.Tensor:
    return torch.randn(E_TOTAL, H, H, generator=torch.Generator().manual_seed(7))


def _experts(x_sorted: torch.Tensor, grouping: RoutingPlan, w: torch.Tensor) -> torch.Tensor:
    """Per-expert tanh(x @ W_e^T) on rows grouped by expert (a plain sorted plan: the "loop" backend)."""
    assert grouping.layout is None and grouping.row_weight is None
    chunks = torch.split(x_sorted, grouping.counts.tolist())
    return torch.cat([torch.tanh(c @ w[e].t()) for e, c in enumerate(chunks)] + [x_sorted[:0]])


def _reference(x, topk_idx, topk_weight, w):
    """Token-by-token weighted sum of the chosen experts' outputs (no dispatcher involved)."""
    y = torch.zeros_like(x)
    for k in range(K):
        outs = torch.tanh(torch.einsum("nh,noh->no", x, w[topk_idx[:, k]]))
        y = y + topk_weight[:, k : k + 1] * outs
    return y


def _dispatch_worker(rank: int, world: int, ep_size: int, tokens: list[int], allowed: int) -> dict:
    topo = build_topology(ep_size)
    local = topo.local_expert_range(E_TOTAL)
    w_full = _expert_weights()
    w_local = w_full[local.start : local.stop].clone().requires_grad_(True)
    x, idx, wt, upstream = _rank_inputs(rank, tokens[rank], allowed)
    x.requires_grad_(True)
    wt.requires_grad_(True)
    dispatcher = AllToAllDispatcher(
        E_TOTAL, topo.size("ep"), topo.rank("ep"), topo.group("ep"), backend="loop"
    )
    x_sorted, grouping, state = dispatcher.dispatch(x, idx, wt)
    counts = grouping.counts
    assert counts.shape == (E_TOTAL // ep_size,) and int(counts.sum()) == x_sorted.shape[0]
    y = dispatcher.combine(_experts(x_sorted, grouping, w_local), state)
    (y * upstream).sum().backward()

    # Reference: this rank's output from its own data; expert gradient = sum over the EP group's data.
    w_ref = w_full.clone().requires_grad_(True)
    x_ref = x.detach().clone().requires_grad_(True)
    wt_ref = wt.detach().clone().requires_grad_(True)
    y_ref = _reference(x_ref, idx, wt_ref, w_ref)
    (y_ref * upstream).sum().backward()
    w_grad_ref = torch.zeros_like(w_full)
    for peer in topo.group_ranks("ep"):
        if peer == rank:
            w_grad_ref += w_ref.grad
            continue
        px, pidx, pwt, pup = _rank_inputs(peer, tokens[peer], allowed)
        wp = w_full.clone().requires_grad_(True)
        (_reference(px, pidx, pwt, wp) * pup).sum().backward()
        w_grad_ref += wp.grad
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(wt.grad, wt_ref.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w_local.grad, w_grad_ref[local.start : local.stop], rtol=1e-5, atol=1e-5)
    return {"received": int(counts.sum()), "bytes_sent": dispatcher.bytes_sent}


def test_all_to_all_matches_single_process_ep4_and_ep2() -> None:
    tokens = [5, 7, 3, 6]
    for ep_size in (4, 2):
        results = run_distributed(_dispatch_worker, 4, ep_size, tokens, E_TOTAL)
        assert all(r["bytes_sent"] > 0 for r in results)


def test_rank_receiving_or_sending_no_tokens() -> None:
    # Experts 6 and 7 (EP rank 3 at E=4) are never chosen, and rank 2 has no tokens at all.
    results = run_distributed(_dispatch_worker, 4, 4, [4, 6, 0, 5], 6)
    assert results[3]["received"] == 0
    assert results[2]["bytes_sent"] > 0  # counts still go out from an empty rank


def _autocast_worker(rank: int, world: int) -> dict:
    """fp32 tokens under bf16 autocast (what bf16-mixed hands the MoE layer): rows travel as bf16."""
    topo = build_topology(2)
    local = topo.local_expert_range(E_TOTAL)
    w_local = _expert_weights()[local.start : local.stop].clone().requires_grad_(True)
    x, idx, wt, upstream = _rank_inputs(rank, 6, E_TOTAL)
    x.requires_grad_(True)
    dispatcher = AllToAllDispatcher(
        E_TOTAL, topo.size("ep"), topo.rank("ep"), topo.group("ep"), backend="loop"
    )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        x_sorted, grouping, state = dispatcher.dispatch(x, idx, wt)
        counts = grouping.counts
        dispatch_bytes = dispatcher.bytes_sent
        y = dispatcher.combine(_experts(x_sorted, grouping, w_local), state)
    combine_bytes = dispatcher.bytes_sent - dispatch_bytes
    (y * upstream).sum().backward()
    # Rows whose expert lives on the other EP rank leave this rank (in dispatch and again in combine).
    owner = idx.reshape(-1) // (E_TOTAL // topo.size("ep"))
    remote_rows = int((owner != topo.rank("ep")).sum())
    received_remote = int(counts.sum()) - int((owner == topo.rank("ep")).sum())
    count_bytes = (topo.size("ep") - 1) * (E_TOTAL // topo.size("ep")) * 8
    return {
        "x_sorted_dtype": x_sorted.dtype,
        "y_dtype": y.dtype,
        "grad_dtype": x.grad.dtype,
        "dispatch_bytes": dispatch_bytes,
        "expected_dispatch": count_bytes + remote_rows * H * 2,
        "combine_bytes": combine_bytes,
        "expected_combine": received_remote * H * 2,
        "backward_bytes": dispatcher.bytes_sent - dispatch_bytes - combine_bytes,
    }


def test_dispatch_sends_bf16_rows_under_autocast() -> None:
    for r in run_distributed(_autocast_worker, 2):
        # on the wire bf16, but the layer sees its own dtype in and out
        assert r["x_sorted_dtype"] == r["y_dtype"] == r["grad_dtype"] == torch.float32
        assert r["dispatch_bytes"] == r["expected_dispatch"]  # rows * hidden * 2, plus the counts
        assert r["combine_bytes"] == r["expected_combine"]
        # Backward sends the gradients of both exchanges, also as bf16 rows.
        assert r["backward_bytes"] == r["expected_combine"] + r["expected_dispatch"] - (E_TOTAL // 2) * 8


def test_wire_dtype_follows_autocast_else_input() -> None:
    x = torch.randn(2, 3)
    assert wire_dtype(x) == torch.float32
    assert wire_dtype(x.to(torch.bfloat16)) == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert wire_dtype(x) == torch.bfloat16


def _mula_autocast_loss(rank: int, world: int, ep_size: int) -> float:
    """The tiny Mula MoE's loss on this rank's tokens under bf16 autocast (fp32 weights, as bf16-mixed)."""
    from mula import Mula, MulaConfig
    from strategies.experts.expert_parallel import apply_expert_parallel

    cfg = MulaConfig.from_name(
        "mula-tiny-moe", vocab_size=64, hidden_size=16, num_layers=1, num_heads=2, num_experts=4, top_k=2,
        expert_intermediate_size=16, max_position_embeddings=32,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Mula(cfg)
    if ep_size > 1:
        apply_expert_parallel(model, build_topology(ep_size))
    tokens = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(rank))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(tokens[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return float(loss)


def test_mula_moe_under_autocast_with_expert_parallelism() -> None:
    """bf16 rows on the wire, fp32 in and out of the layer: the experts' kernels accept them and the
    loss matches the single-process autocast loss within bf16 rounding."""
    losses = run_distributed(_mula_autocast_loss, 2, 2)
    for rank, loss in enumerate(losses):
        torch.testing.assert_close(loss, _mula_autocast_loss(rank, 1, 1), rtol=1e-2, atol=0)
