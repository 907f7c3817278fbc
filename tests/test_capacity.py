"""Expert capacity and token dropping (`capacity_factor`, `drop_policy`; mula/model/kernels/capacity.py).

* The drop rule against a plain-torch reference written from its statement (a loop over experts): which
  choices each policy keeps, ties included, and the MoE layer's output and gradients (kept weights not
  renormalised, a dropped choice contributing nothing). Planted bugs (renormalised kept weights, ties
  broken the other way) fail it.
* Expert parallelism: at E2 (2 gloo processes, one micro-batch each) the training equals one process
  accumulating the same micro-batches, by the suite's equality rule (capacity counted per micro-batch
  of a data-parallel rank, over the model's experts); the E2 dispatcher's forward and backward read
  nothing on the host (fixed blocks). P2 x E2 is the covering array's row machinery with a capacity.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from composition import assert_row_matches, fit_row
from dist_helpers import run_distributed
from equality import ADAMW_EPS, LoopRecord, assert_same_training, assert_same_weights, seeded
from test_expert_parallel import _loss  # the tiny MoE's loss and counts (the same router coefficients)

from mula import Mula, MulaConfig
from mula.host_sync import HostSyncMeter
from mula.model.kernels import capacity as capacity_kernels
from mula.model.kernels.capacity import Capacity, plan_capacity
from mula.model.moe import MoELayer, is_expert_param
from strategies.experts.expert_parallel import apply_expert_parallel
from strategies.topology import build_topology

MICRO, SEQ, STEPS = 2, 16, 3
CONFIG = MulaConfig.from_name(
    "mula-tiny-moe", vocab_size=256, hidden_size=32, num_layers=2, num_heads=2, num_experts=8, top_k=2,
    expert_intermediate_size=32, max_position_embeddings=64, capacity_factor=1.0,
)  # fmt: skip


def reference_keep(
    topk_idx: torch.Tensor, weight: torch.Tensor, num_experts: int, cap: Capacity
) -> torch.Tensor:
    """[N, K] bool, the rule as stated: per expert, its choices ordered by weight (descending, ties to the
    lower flat position n*K + k) or by position alone; the first C kept."""
    n, k = topk_idx.shape
    slots = min(math.ceil(n * k / num_experts * cap.factor), n)
    keep = torch.zeros(n, k, dtype=torch.bool)
    for e in range(num_experts):
        choices = [(t, s) for t in range(n) for s in range(k) if int(topk_idx[t, s]) == e]
        if cap.policy == "probs":
            choices.sort(key=lambda ts: (-float(weight[ts]), ts[0] * k + ts[1]))
        for t, s in choices[:slots]:
            keep[t, s] = True
    return keep


def plan_keep(plan) -> torch.Tensor:
    """[N, K] bool: the choices a capacity plan gives a row."""
    n, k = plan.num_tokens, plan.top_k
    return (plan.unsort < plan.layout.rows).view(n, k)


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_the_plan_keeps_what_the_rule_says_ties_included(policy: str) -> None:
    g = torch.Generator().manual_seed(seeded(3))
    n, k, e = 24, 2, 4
    topk_idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
    # weights on a coarse grid: many exact ties, which position must break
    weight = torch.randint(0, 4, (n, k), generator=g).float() / 4
    for factor in (0.5, 1.0, 1.3, 4.0):
        cap = Capacity(factor, policy)
        plan = plan_capacity(topk_idx, weight, e, cap)
        assert torch.equal(plan_keep(plan), reference_keep(topk_idx, weight, e, cap)), factor


def _reference_layer(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """The routed output of x [N, H] in plain torch: sum over kept choices of weight * expert(x)."""
    route = layer.router(x)
    keep = reference_keep(route.topk_idx, route.topk_weight.detach(), layer.num_experts, layer.capacity)
    gate_up, down = layer.experts.gate_up, layer.experts.down
    inter = down.shape[2]
    y = torch.zeros_like(x)
    for e in range(layer.num_experts):
        hidden = F.silu(x @ gate_up[e, :inter].t()) * (x @ gate_up[e, inter:].t())
        out = hidden @ down[e].t()
        w = (route.topk_weight * ((route.topk_idx == e) & keep)).sum(dim=1, keepdim=True)
        y = y + w * out
    return y


def _grads(layer: MoELayer, fn, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    layer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    y = fn(x)
    y.square().sum().backward()
    grads = {name: p.grad.clone() for name, p in layer.named_parameters() if p.grad is not None}
    return y.detach(), {"x": x.grad, **grads}


def _layer_vs_reference(policy: str, factor: float) -> tuple[tuple, tuple]:
    config = MulaConfig(**{**CONFIG.__dict__, "capacity_factor": factor, "drop_policy": policy})
    torch.manual_seed(seeded(5))
    layer = MoELayer(config)
    x = torch.randn(2 * SEQ, config.hidden_size)
    mine = _grads(layer, lambda t: layer.routed(t, *_route(layer, t))[0], x)
    return mine, _grads(layer, lambda t: _reference_layer(layer, t), x)


def _route(layer: MoELayer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    route = layer.router(x)
    return route.topk_idx, route.topk_weight


def _assert_same(mine: tuple, ref: tuple) -> None:
    torch.testing.assert_close(mine[0], ref[0], rtol=1e-5, atol=1e-7)
    assert mine[1].keys() == ref[1].keys()
    for name, grad in mine[1].items():
        torch.testing.assert_close(
            grad, ref[1][name], rtol=1e-4, atol=1e-8, msg=lambda m, n=name: f"{n}: {m}"
        )


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_the_layer_drops_as_the_plain_torch_reference(policy: str) -> None:
    for factor in (0.5, 1.0):
        mine, ref = _layer_vs_reference(policy, factor)
        _assert_same(mine, ref)


def test_planted_renormalisation_and_tie_break_fail_the_reference(monkeypatch) -> None:
    real_plan = capacity_kernels.plan_capacity

    def renormalised(topk_idx, topk_weight, num_experts, cap):
        keep = plan_keep(real_plan(topk_idx, topk_weight, num_experts, cap))
        kept = topk_weight * keep
        return real_plan(topk_idx, kept / kept.sum(dim=1, keepdim=True).clamp_min(1e-9), num_experts, cap)

    import mula.model.moe.dispatcher as dispatcher

    monkeypatch.setattr(dispatcher, "plan_capacity", renormalised)
    mine, ref = _layer_vs_reference("probs", 0.5)
    with pytest.raises(AssertionError):
        _assert_same(mine, ref)
    monkeypatch.undo()
    # ties broken towards the later position
    monkeypatch.setattr(capacity_kernels, "keep_order", _later_first)
    g = torch.Generator().manual_seed(seeded(3))
    topk_idx = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(24)])
    weight = torch.randint(0, 4, (24, 2), generator=g).float() / 4
    cap = Capacity(0.5, "probs")
    assert not torch.equal(
        plan_keep(plan_capacity(topk_idx, weight, 4, cap)), reference_keep(topk_idx, weight, 4, cap)
    )


def _later_first(topk_idx, topk_weight, num_experts, policy):
    flat = topk_idx.reshape(-1).long()
    m = flat.numel()
    key = topk_weight.reshape(-1) * (m + 1) + torch.arange(m) / m  # later position first among ties
    by_weight = torch.argsort(key, descending=True, stable=True)
    return by_weight.index_select(0, torch.argsort(flat.index_select(0, by_weight), stable=True))


def test_capacity_settings_are_checked_in_one_sentence() -> None:
    for bad in (0, -1.0, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="capacity_factor must be None"):
            MulaConfig.from_name("mula-tiny-moe", capacity_factor=bad)
    with pytest.raises(ValueError, match="drop_policy must be one of"):
        MulaConfig.from_name("mula-tiny-moe", capacity_factor=1.0, drop_policy="random")


# ----- expert parallelism ----------------------------------------------------------------------------
def _batches(world: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seeded(1234))
    return [torch.randint(0, CONFIG.vocab_size, (world * MICRO, SEQ + 1), generator=g) for _ in range(STEPS)]


def _train(world: int, rank: int | None, ep_size: int = 1) -> dict:
    """One process accumulating the `world` micro-batches (rank None), or data-parallel rank `rank`."""
    from strategies.optim.grad_sync import GradientSynchronizer, clip_grad_norm_

    torch.manual_seed(seeded(0))
    model = Mula(CONFIG)
    topo = None
    if rank is not None:
        topo = build_topology(ep_size)
        apply_expert_parallel(model, topo)
    named = list(model.named_parameters())
    sync = None if topo is None else GradientSynchronizer(named, topo, bucket_size_mb=0.01)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=ADAMW_EPS)
    record = LoopRecord(near_ties_of=(model, CONFIG) if rank is None else None)
    dropped = []
    for batch in _batches(world):
        opt.zero_grad(set_to_none=True)
        micros = batch.split(MICRO) if rank is None else [batch.split(MICRO)[rank]]
        for micro in micros:
            loss, tokens = _loss(model, micro)
            (loss / (world if rank is None else 1)).backward()
            record.add(loss.item() / world, tokens)
        if sync is not None:
            sync.finish()
            norm = clip_grad_norm_(named, 0.5, topo)
        else:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        record.end_step(norm)
        opt.step()
    for _, layer in ((n, m) for n, m in model.named_modules() if isinstance(m, MoELayer)):
        dropped.append(layer.drops.totals(torch.device("cpu")))
    local = range(CONFIG.num_experts) if topo is None else topo.local_expert_range(CONFIG.num_experts)
    return {**record.as_dict(), "params": dict(model.state_dict()), "local": list(local), "dropped": dropped}


def _syncs_at_e2(rank: int) -> dict:
    torch.manual_seed(seeded(0))
    model = Mula(CONFIG)
    apply_expert_parallel(model, build_topology(2))
    batch = _batches(2)[0].split(MICRO)[rank]
    with HostSyncMeter("cpu") as meter:
        loss, _ = _loss(model, batch)
        loss.backward()
    return meter.counts()


def _worker(rank: int, world: int) -> dict:
    return {"e2": _train(world, rank, ep_size=2), "syncs": _syncs_at_e2(rank)}


def test_capacity_at_e2_equals_one_process_and_reads_nothing_on_the_host() -> None:
    ref = _train(2, None)
    # the reference really drops: else this compares dropless runs
    assert all(float(d[0]) > 0.05 * float(d[1]) for d in ref["dropped"])
    results = run_distributed(_worker, 2)
    for rank, result in enumerate(results):
        run = result["e2"]
        assert_same_training(run, ref, what=f"E2 rank {rank}")
        lo, hi = run["local"][0], run["local"][-1] + 1
        want = {
            n: (ref["params"][n][lo:hi] if is_expert_param(n) else ref["params"][n]) for n in run["params"]
        }
        assert_same_weights(run["params"], want, what=f"E2 rank {rank}")
        # no count exchange, no split read, nothing the CPU kernel plans on the host
        assert result["syncs"] == {"ops": {}, "reads": {}, "excluded": {}}, result["syncs"]
    # the ranks together dropped exactly the reference's choices, layer by layer
    dropped = [sum(r["e2"]["dropped"][i] for r in results) for i in range(len(ref["dropped"]))]
    for got, want in zip(dropped, ref["dropped"]):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


CAPACITY = {"capacity_factor": 1.0, "drop_policy": "position"}


def _row_worker(rank: int, world: int, features) -> dict:
    return fit_row(features, rank, overrides=CAPACITY)


def test_capacity_at_p2_e2_equals_one_process() -> None:
    features = frozenset({"P", "E"})
    ref = fit_row(features, overrides=CAPACITY)
    for rank, run in enumerate(run_distributed(_row_worker, 4, features)):
        assert_row_matches(run, ref, features, what=f"P2 x E2 rank {rank}")


def test_hf_configs_have_no_capacity_export_drops_it_import_leaves_none() -> None:
    from mula.hf.config import config_from_hf, config_to_hf

    plain = MulaConfig(**{**CONFIG.__dict__, "capacity_factor": None})
    exported = config_to_hf(CONFIG)
    assert exported == config_to_hf(plain)
    assert config_from_hf(exported).capacity_factor is None
