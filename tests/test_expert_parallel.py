"""Expert parallelism on 4 gloo CPU processes vs a single process (tiny MoE, fp32, fixed global batches).

The reference is one process running the same W micro-batches with gradient accumulation (loss / W
each), which is what data parallelism computes. Checked for E in {1, 2, 4}: per-step losses, the
global gradient norm, every expert's and every dense parameter's gradient, and the parameters after
the last step. A deliberately wrong layout (expert gradients reduced over the whole world) must fail.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_helpers import run_distributed

from mula import Mula, MulaConfig
from mula.moe import is_expert_param
from strategies.experts.expert_parallel import apply_expert_parallel
from strategies.optim.grad_sync import GradientSynchronizer, clip_grad_norm_
from strategies.topology import build_topology

WORLD, MICRO, SEQ, STEPS, MAX_NORM = 4, 2, 16, 3, 0.5
CONFIG = MulaConfig.from_name(
    "mula-tiny-moe", vocab_size=256, hidden_size=32, num_layers=2, num_heads=2, num_experts=8, top_k=2,
    expert_intermediate_size=32, max_position_embeddings=64,
)  # fmt: skip


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(0, CONFIG.vocab_size, (WORLD * MICRO, SEQ + 1), generator=g) for _ in range(STEPS)]


def _loss(model: Mula, batch: torch.Tensor) -> torch.Tensor:
    out = model(batch[:, :-1])
    ce = F.cross_entropy(out.logits.flatten(0, 1), batch[:, 1:].flatten())
    return ce + CONFIG.router_aux_loss_coef * out.aux_loss + CONFIG.router_z_loss_coef * out.z_loss


def _model() -> Mula:
    torch.manual_seed(0)
    return Mula(CONFIG)


def _optimizer(model: Mula) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _reference() -> dict:
    model = _model()
    opt = _optimizer(model)
    losses, norms, first_grads = [], [], None
    for batch in _batches():
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for micro in batch.split(MICRO):
            loss = _loss(model, micro) / WORLD
            loss.backward()
            total += loss.item()
        if first_grads is None:
            first_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
        losses.append(total)
    return {"losses": losses, "norms": norms, "grads": first_grads, "params": dict(model.state_dict())}


def _train_ep(rank: int, ep_size: int, wrong_expert_group: bool = False, overlap: bool = True) -> dict:
    topo = build_topology(ep_size)
    if wrong_expert_group:  # the classic bug: treat the whole world as the expert-data-parallel group
        topo = dataclasses.replace(topo, edp_group=dist.group.WORLD, edp_size=topo.world_size)
    model = _model()
    apply_expert_parallel(model, topo)
    named = list(model.named_parameters())
    sync = GradientSynchronizer(named, topo, bucket_size_mb=0.01, overlap=overlap)
    opt = _optimizer(model)
    losses, norms, first_grads = [], [], None
    for batch in _batches():
        opt.zero_grad(set_to_none=True)
        loss = _loss(model, batch.split(MICRO)[rank])
        loss.backward()
        sync.finish()
        if first_grads is None:
            first_grads = {n: p.grad.clone() for n, p in named}
        norms.append(clip_grad_norm_(named, MAX_NORM, topo).item())
        opt.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        losses.append(mean_loss.item() / WORLD)
    return {
        "losses": losses,
        "norms": norms,
        "grads": first_grads,
        "params": dict(model.state_dict()),
        "local": list(topo.local_expert_range(CONFIG.num_experts)),
        "buckets": sync.num_buckets,
    }


def _worker(rank: int, world: int) -> dict:
    runs = {ep: _train_ep(rank, ep) for ep in (1, 2, 4)}
    runs["no_overlap"] = _train_ep(rank, 2, overlap=False)
    runs["wrong"] = _train_ep(rank, 2, wrong_expert_group=True)
    return runs


def _expected(name: str, full: torch.Tensor, local: list[int]) -> torch.Tensor:
    return full[local[0] : local[-1] + 1] if is_expert_param(name) else full


def _assert_matches(run: dict, ref: dict) -> None:
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(run["norms"]), torch.tensor(ref["norms"]), rtol=1e-5, atol=0)
    for name, grad in run["grads"].items():
        torch.testing.assert_close(
            grad, _expected(name, ref["grads"][name], run["local"]), rtol=1e-4, atol=1e-7
        )
    for name, value in run["params"].items():
        torch.testing.assert_close(
            value, _expected(name, ref["params"][name], run["local"]), rtol=1e-4, atol=1e-5
        )


def test_expert_parallel_matches_single_process() -> None:
    ref = _reference()
    results = run_distributed(_worker, WORLD)
    for rank, runs in enumerate(results):
        for key in (1, 2, 4, "no_overlap"):
            _assert_matches(runs[key], ref)
        assert runs[4]["local"] == [2 * rank, 2 * rank + 1]
        assert runs[1]["buckets"] >= 2  # small buckets: several dense and expert buckets in flight
        # Reducing expert gradients over the world mixes different experts: detected.
        wrong = runs["wrong"]
        for name, grad in wrong["grads"].items():
            if is_expert_param(name):
                expected = _expected(name, ref["grads"][name], wrong["local"])
                assert (grad - expected).norm() > 0.1 * expected.norm(), name
