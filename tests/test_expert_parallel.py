"""Expert parallelism on 4 gloo CPU processes vs a single process (tiny MoE, fp32, fixed global batches).

The reference is one process running the same W micro-batches with gradient accumulation (loss / W
each), which is what data parallelism computes. Checked for E in {1, 2, 4} (and E=2 without overlap),
by the suite's equality rule (tests/equality.py): per-step losses and global gradient norms, then the
parameters after the last step (a rank's experts against the same experts of the reference); and the
first step's gradients, before any update, every expert's and every dense parameter's. A deliberately
wrong layout (expert gradients reduced over the whole world) must fail.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_helpers import run_distributed
from equality import ADAMW_EPS, LoopRecord, assert_same_training, assert_same_weights, seeded

from mula import Mula, MulaConfig
from mula.model.moe import is_expert_param
from strategies.experts.expert_parallel import apply_expert_parallel
from strategies.optim.grad_sync import GradientSynchronizer, clip_grad_norm_
from strategies.topology import LayoutMesh, build_topology

WORLD, MICRO, SEQ, STEPS, MAX_NORM = 4, 2, 16, 3, 0.5
CONFIG = MulaConfig.from_name(
    "mula-tiny-moe", vocab_size=256, hidden_size=32, num_layers=2, num_heads=2, num_experts=8, top_k=2,
    expert_intermediate_size=32, max_position_embeddings=64,
)  # fmt: skip


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seeded(1234))
    return [torch.randint(0, CONFIG.vocab_size, (WORLD * MICRO, SEQ + 1), generator=g) for _ in range(STEPS)]


def _loss(model: Mula, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's loss and its [MoE layers, E] tokens per expert."""
    out = model(batch[:, :-1])
    ce = F.cross_entropy(out.logits.flatten(0, 1), batch[:, 1:].flatten())
    loss = ce + CONFIG.router_aux_loss_coef * out.aux_loss + CONFIG.router_z_loss_coef * out.z_loss
    return loss, out.tokens_per_expert.detach()


def _model() -> Mula:
    torch.manual_seed(seeded(0))
    return Mula(CONFIG)


def _optimizer(model: Mula) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=ADAMW_EPS)


def _reference() -> dict:
    """One process: per step the loss, the norm, the global expert counts and the near ties (what
    `equality.assert_same_training` reads); the first step's gradients and the final parameters."""
    model = _model()
    opt = _optimizer(model)
    record, first_grads = LoopRecord(near_ties_of=(model, CONFIG)), None
    for batch in _batches():
        opt.zero_grad(set_to_none=True)
        for micro in batch.split(MICRO):
            loss, tokens = _loss(model, micro)
            (loss / WORLD).backward()
            record.add(loss.item() / WORLD, tokens)
        if first_grads is None:
            first_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        record.end_step(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
        opt.step()
    return {**record.as_dict(), "grads": first_grads, "params": dict(model.state_dict())}


class _WorldAsExpertGroup(LayoutMesh):
    """A mesh whose expert group ("edp_cp") is every replica: the bug `wrong_expert_group` plants."""

    def size(self, dim: str) -> int:
        """The replicas' size for "edp_cp", else the layout's."""
        return super().size("replica" if dim == "edp_cp" else dim)

    def rank(self, dim: str) -> int:
        """The replica rank for "edp_cp", else the layout's."""
        return super().rank("replica" if dim == "edp_cp" else dim)

    def group_ranks(self, dim: str) -> list[int]:
        """Every replica for "edp_cp", else the layout's."""
        return super().group_ranks("replica" if dim == "edp_cp" else dim)


def _train_ep(rank: int, ep_size: int, wrong_expert_group: bool = False, overlap: bool = True) -> dict:
    topo = build_topology(ep_size)
    if wrong_expert_group:  # the classic bug: treat the whole world as the expert-data-parallel group
        groups = {dim: topo.group(dim) for dim in ("ep", "replica", "world")}
        topo = _WorldAsExpertGroup(
            topo.layout, topo.rank("world"), groups={**groups, "edp_cp": dist.group.WORLD}
        )
    model = _model()
    apply_expert_parallel(model, topo)
    named = list(model.named_parameters())
    sync = GradientSynchronizer(named, topo, bucket_size_mb=0.01, overlap=overlap)
    opt = _optimizer(model)
    record, first_grads = LoopRecord(), None
    for batch in _batches():
        opt.zero_grad(set_to_none=True)
        loss, tokens = _loss(model, batch.split(MICRO)[rank])
        loss.backward()
        sync.finish()
        if first_grads is None:
            first_grads = {n: p.grad.clone() for n, p in named}
        record.add(loss.item() / WORLD, tokens)
        record.end_step(clip_grad_norm_(named, MAX_NORM, topo))  # the global loss and counts
        opt.step()
    return {
        **record.as_dict(),
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


def _assert_matches(run: dict, ref: dict, what: str) -> None:
    """The equality rule: every step, each routed as the reference; the first step's gradients (before
    any update); the weights after the last step."""
    assert_same_training(run, ref, what=what)
    for name, grad in run["grads"].items():
        torch.testing.assert_close(
            grad, _expected(name, ref["grads"][name], run["local"]), rtol=1e-4, atol=1e-7
        )
    want = {name: _expected(name, ref["params"][name], run["local"]) for name in run["params"]}
    assert_same_weights(run["params"], want, what=what)


def test_expert_parallel_matches_single_process() -> None:
    ref = _reference()
    results = run_distributed(_worker, WORLD)
    for rank, runs in enumerate(results):
        for key in (1, 2, 4, "no_overlap"):
            _assert_matches(runs[key], ref, what=f"E={key} rank {rank}")
        assert runs[4]["local"] == [2 * rank, 2 * rank + 1]
        assert runs[1]["buckets"] >= 2  # small buckets: several dense and expert buckets in flight
        # Reducing expert gradients over the world mixes different experts: detected.
        wrong = runs["wrong"]
        for name, grad in wrong["grads"].items():
            if is_expert_param(name):
                expected = _expected(name, ref["grads"][name], wrong["local"])
                assert (grad - expected).norm() > 0.1 * expected.norm(), name
