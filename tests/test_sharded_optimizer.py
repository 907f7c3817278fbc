"""EPShardedAdamW on 4 (and 2) gloo CPU processes vs single-process torch.optim.AdamW (fp32).

Stand-in model: dense parameters plus stacked expert parameters [E, ...] (names contain ".experts."),
softly gated (every expert weighted by a softmax: no top-k choice, so no routing flip). Every rank
keeps a full replica only to compute its gradients; the optimizer sees what expert parallelism would
give it: dense parameters whole, experts sliced to the rank's global block, and per-rank gradients as
expert parallelism produces them (dense: the gradient of the rank's own loss; experts: summed over the
EP group, as the all-to-all backward does). The reference is one process running AdamW on the whole
global batch with the same LambdaLR schedule and clipping.

Checked, by the weights of the suite's equality rule (tests/equality.py, AdamW eps `ADAMW_EPS`):
parameters after several steps for E in {1, 2, 4} with and without clipping, ZeRO-2 with
accumulation, offload, overlapped all-gather, no-hook reduction, the EP-unaware layout; state bytes =
12 * P / W + stated padding; checkpoint saved at (W=4, E=2) and loaded at (4, 4), (4, 1), (2, 1),
(2, 2) gives the same next step; a wrong layout (experts reduced over the world) fails (a negative
control: relative error above 1e-3); and the tiny Mula MoE with the real all-to-all dispatcher (top-k
routing: the whole rule, per-step losses and gradient norms, then the weights).
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from dist_helpers import run_distributed
from equality import ADAMW_EPS, LoopRecord, assert_same_training, assert_same_weights, seeded
from torch import nn

from mula.layout.flat_buffers import ParamEntry, plan_buckets
from mula.layout.parallel_layout import ParallelLayout
from mula.model.moe import is_expert_param
from strategies.optim.sharded_optimizer import EPShardedAdamW
from strategies.topology import LayoutMesh, build_topology

E_TOTAL, HIDDEN, INTER, LAYERS = 4, 8, 12, 2
ROWS, STEPS, LR, CLIP = 16, 4, 1e-2, 0.05


class Experts(nn.Module):
    """Stacked SwiGLU-free experts: w_in [E, I, H], w_out [E, H, I]."""

    def __init__(self, num: int) -> None:
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(num, INTER, HIDDEN) * 0.3)
        self.w_out = nn.Parameter(torch.randn(num, HIDDEN, INTER) * 0.3)

    def forward(self, x: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        h = F.silu(torch.einsum("nh,eih->nei", x, self.w_in))
        return (gates.unsqueeze(-1) * torch.einsum("nei,ehi->neh", h, self.w_out)).sum(1)


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(HIDDEN, E_TOTAL, bias=False)
        self.experts = Experts(E_TOTAL)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.router(x).softmax(-1))


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.mlp = MoE()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + torch.tanh(self.proj(self.norm(x)))
        return x + self.mlp(x)


class StandIn(nn.Module):
    """Dense input/output projections around LAYERS dense+MoE layers (the full, unsliced model)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(seeded(0))
        self.embed = nn.Linear(HIDDEN, HIDDEN)
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
        self.head = nn.Linear(HIDDEN, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class Node(nn.Module):
    """A parameter container mirroring the full model's module tree (so names and submodules match);
    its forward touches every parameter, which fires the optimizer's forward pre-hooks."""

    def forward(self) -> torch.Tensor:
        total = sum((p.sum() for p in self._parameters.values()), torch.zeros(()))
        return total + sum((child() for child in self.children()), torch.zeros(()))


def _local_params(full: nn.Module, ep_rank: int, ep_size: int) -> Node:
    """This rank's parameters: dense ones whole, experts sliced to global block ep_rank."""
    root = Node()
    for name, p in full.named_parameters():
        *path, leaf = name.split(".")
        node = root
        for part in path:
            if not hasattr(node, part):
                node.add_module(part, Node())
            node = getattr(node, part)
        value = _slice(name, p.detach(), ep_rank, ep_size).clone()
        node.register_parameter(leaf, nn.Parameter(value))
    return root


def _slice(name: str, full: torch.Tensor, ep_rank: int, ep_size: int) -> torch.Tensor:
    if not is_expert_param(name):
        return full
    per = full.shape[0] // ep_size
    return full[ep_rank * per : (ep_rank + 1) * per]


def _groups(named: list[tuple[str, nn.Parameter]]) -> list[dict]:
    decay = [p for n, p in named if p.dim() >= 2]
    no_decay = [p for n, p in named if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def _schedule(step: int) -> float:
    return min(1.0, (step + 1) / 3)  # linear warmup over 3 steps, then constant


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seeded(100 + step))
    return torch.randn(ROWS, HIDDEN, generator=g), torch.randn(ROWS, 4, generator=g)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x), y)


def _reference(steps: int, clip: float | None, clip_after: int = 0) -> list[dict[str, torch.Tensor]]:
    """Single-process AdamW on the whole global batch; parameters after each step."""
    model = StandIn()
    named = list(model.named_parameters())
    opt = torch.optim.AdamW(_groups(named), lr=LR, eps=ADAMW_EPS)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule)
    out = []
    for step in range(steps):
        opt.zero_grad()
        _loss(model, *_batch(step)).backward()
        if clip is not None and step >= clip_after:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        sched.step()
        out.append({n: p.detach().clone() for n, p in named})
    return out


@dataclasses.dataclass
class Run:
    """One distributed training run of the stand-in."""

    ep_size: int
    clip: float | None = None
    accum: int = 1
    options: dict = dataclasses.field(default_factory=dict)
    wrong_layout: bool = False  # reduce experts over the whole world: must NOT match


class Trainer:
    """Drives the optimizer the way the strategy does, with gradients from a full replica."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.topo = build_topology(run.ep_size)
        topo_for_opt = self.topo
        if run.wrong_layout:
            # E = 1 with the whole world as the expert group
            topo_for_opt = LayoutMesh(
                ParallelLayout(world_size=self.topo.size("world")),
                self.topo.rank("world"),
                groups={"replica": self.topo.group("replica"), "edp_cp": dist.group.WORLD},
                meshes={"world": self.topo.mesh("world")},
            )
        self.replica = StandIn()
        self.local = _local_params(self.replica, self.topo.rank("ep"), self.topo.size("ep"))
        self.named = list(self.local.named_parameters())
        options = dict(run.options)
        if options.pop("with_module", False):
            options["module"] = self.local
        self.opt = self.optimizer(topo_for_opt, options)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, _schedule)
        self.steps = 0

    def optimizer(self, topology: LayoutMesh, options: dict) -> EPShardedAdamW:
        """The optimizer under test over this rank's parameters (tests/test_sharded_muon.py: Muon's)."""
        return EPShardedAdamW(_groups(self.named), self.named, topology, lr=LR, eps=ADAMW_EPS, **options)

    def replica_grads(self, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
        """The gradient a rank contributes for its micro-batch (x, y), per parameter of its replica
        (tests/test_sharded_muon.py puts it on a grid)."""
        self.replica.zero_grad()
        (_loss(self.replica, x, y) / self.run.accum).backward()
        return [p.grad for p in self.replica.parameters()]

    def _sync_replica(self) -> None:
        if self.opt.options.overlap_param_gather:
            with torch.no_grad():
                self.local()  # a forward: its pre-hooks wait for the all-gathers
        with torch.no_grad():
            for (name, p), (_, q) in zip(self.replica.named_parameters(), self.named):
                if is_expert_param(name) and self.topo.size("ep") > 1:
                    parts = [torch.empty_like(q) for _ in range(self.topo.size("ep"))]
                    dist.all_gather(parts, q.detach().contiguous(), group=self.topo.group("ep"))
                    p.copy_(torch.cat(parts))
                else:
                    p.copy_(q)

    def _grads(self, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
        grads = []
        for (name, _), g in zip(self.replica.named_parameters(), self.replica_grads(x, y), strict=True):
            if is_expert_param(name) and self.topo.size("ep") > 1:
                dist.all_reduce(g, group=self.topo.group("ep"))  # what the all-to-all backward delivers
            grads.append(_slice(name, g, self.topo.rank("ep"), self.topo.size("ep")).contiguous())
        return grads

    def train_step(self) -> None:
        self._sync_replica()
        x, y = _batch(self.steps)
        w, r = self.topo.size("replica"), self.topo.rank("replica")
        xs, ys = x.chunk(w)[r].chunk(self.run.accum), y.chunk(w)[r].chunk(self.run.accum)
        self.opt.zero_grad()
        for i, (xm, ym) in enumerate(zip(xs, ys)):
            grads = self._grads(xm, ym)
            params = [p for _, p in self.named]
            if i < self.run.accum - 1:
                with self.opt.no_sync():
                    torch.autograd.backward(params, grads)
            else:
                torch.autograd.backward(params, grads)
        if self.run.clip is not None:
            self.opt.clip_grad_norm_(self.run.clip)
        self.opt.step()
        self.sched.step()
        self.steps += 1

    def params(self) -> dict[str, torch.Tensor]:
        self.opt.wait_for_params()
        return {n: p.detach().clone() for n, p in self.named}


def _assert_same_weights(
    params: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], ep_rank: int, ep_size: int, what: str
) -> None:
    """The equality rule's weights (`equality.assert_same_weights`): this rank's parameters against the
    reference's, experts sliced to the rank's block."""
    want = {name: _slice(name, ref[name], ep_rank, ep_size) for name in params}
    assert_same_weights(params, want, what=what)


def _max_rel_error(params: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], topo) -> float:
    """The largest per-tensor relative distance from the reference (the negative control's measure)."""
    worst = 0.0
    for name, value in params.items():
        expected = _slice(name, ref[name], topo.rank("ep"), topo.size("ep"))
        worst = max(worst, ((value - expected).norm() / expected.norm()).item())
    return worst


def _expected_state(trainer: Trainer) -> dict:
    """Exact per-rank shares of the parameter elements: dense / W + local experts / EDP."""
    topo = trainer.topo
    dense = sum(p.numel() for n, p in trainer.named if not is_expert_param(n))
    expert_local = sum(p.numel() for n, p in trainer.named if is_expert_param(n))
    return {
        "dense": dense,
        "expert_total": expert_local * topo.size("ep"),
        "share": dense / topo.size("replica") + expert_local / topo.size("edp_cp"),
    }


RUNS = {
    "e1": Run(1),
    "e1_clip": Run(1, clip=CLIP),
    "e2": Run(2),
    "e2_clip": Run(2, clip=CLIP),
    "e4": Run(4),
    "e4_clip": Run(4, clip=CLIP),
    "e2_zero2_accum_clipwarmup": Run(2, clip=CLIP, accum=2, options={"zero_stage": 2, "clip_after_step": 2}),
    "e2_offload_overlap_smallbuckets": Run(
        2,
        clip=CLIP,
        options={
            "offload": True,
            "overlap_param_gather": True,
            "with_module": True,
            "bucket_numel": 100,
            "align": 8,
        },
    ),
    "e4_nohooks_accum": Run(4, accum=2, options={"overlap_grad_reduce": False}),
    "e2_ep_unaware": Run(2, clip=CLIP, options={"ep_aware": False}),
    "e2_native_collectives_clip": Run(2, clip=CLIP, options={"collectives": "native"}),
    "e2_native_zero2_accum": Run(2, accum=2, options={"collectives": "native", "zero_stage": 2}),
    "e2_wrong_layout": Run(2, wrong_layout=True),
}


def _train_worker(rank: int, world: int, ckpt_dir: str) -> dict:
    out: dict = {}
    for key, run in RUNS.items():
        t = Trainer(run)
        for _ in range(STEPS):
            t.train_step()
        exp = _expected_state(t)
        out[key] = {
            "params": t.params(),
            "ep_rank": t.topo.rank("ep"),
            "owned": t.opt.owned_numel(),
            "state_bytes": t.opt.state_bytes(),
            "padding_bytes": t.opt.padding_bytes(),
            "bound": t.opt.padding_bound_bytes(),
            "metrics": t.opt.metrics(),
            **exp,
        }
        t.opt.close()
    out["ckpt"] = _checkpoint_save_and_reload(rank, ckpt_dir)
    return out


def _checkpoint_save_and_reload(rank: int, ckpt_dir: str, trainer: type[Trainer] = Trainer) -> dict:
    """Save at (4, 2) after STEPS - 1 steps; one more step there; reload at (4, 4) and (4, 1) and step."""
    t = trainer(Run(2, clip=CLIP))
    for _ in range(STEPS - 1):
        t.train_step()
    dcp.save(t.opt.sharded_state_dict(), checkpoint_id=ckpt_dir)
    if rank == 0:
        torch.save(t.sched.state_dict(), Path(ckpt_dir) / "sched.pt")
    saved = t.params()
    t.train_step()
    result = {"continued": t.params(), "saved_ep_rank": t.topo.rank("ep")}
    for ep in (4, 1):
        result[ep] = _resume(ckpt_dir, ep, trainer)
        result[ep]["saved"] = saved
    return result


def _resume(ckpt_dir: str, ep_size: int, trainer: type[Trainer] = Trainer) -> dict:
    """Fresh model (zeros) and optimizer at another layout, load the checkpoint, take one step."""
    t = trainer(Run(ep_size, clip=CLIP))
    with torch.no_grad():
        for _, p in t.named:
            p.zero_()
    sd = t.opt.sharded_state_dict()
    dcp.load(sd, checkpoint_id=ckpt_dir)
    t.opt.load_sharded_state_dict(sd)
    t.sched.load_state_dict(torch.load(Path(ckpt_dir) / "sched.pt", weights_only=True))
    t.steps = t.opt.steps_done
    loaded = t.params()
    t.train_step()
    return {"loaded": loaded, "next": t.params(), "ep_rank": t.topo.rank("ep"), "ep_size": ep_size}


def _resume_worker(rank: int, world: int, ckpt_dir: str, trainer: type[Trainer] = Trainer) -> dict:
    return {ep: _resume(ckpt_dir, ep, trainer) for ep in (1, 2)}


@pytest.fixture(scope="module")
def results() -> dict:
    refs = {None: _reference(STEPS, None), CLIP: _reference(STEPS, CLIP), "warm": _reference(STEPS, CLIP, 2)}
    with tempfile.TemporaryDirectory() as d:
        four = run_distributed(_train_worker, 4, d)
        two = run_distributed(_resume_worker, 2, d)
    return {"refs": refs, "four": four, "two": two}


def _ref_for(key: str, refs: dict) -> dict[str, torch.Tensor]:
    run = RUNS[key]
    if run.options.get("clip_after_step"):
        return refs["warm"][-1]
    return refs[run.clip][-1]


def _topo(ep_rank: int, ep_size: int) -> LayoutMesh:
    """The mesh of EP rank `ep_rank` of one `ep_size`-rank EP group (what `_max_rel_error` slices by)."""
    return LayoutMesh(ParallelLayout(world_size=ep_size, ep=ep_size), ep_rank)


@pytest.mark.parametrize("key", [k for k in RUNS if k != "e2_wrong_layout"])
def test_matches_single_process_adamw(results: dict, key: str) -> None:
    ref = _ref_for(key, results["refs"])
    for rank, rank_out in enumerate(results["four"]):
        r = rank_out[key]
        _assert_same_weights(r["params"], ref, r["ep_rank"], RUNS[key].ep_size, what=f"{key} rank {rank}")


def test_reducing_experts_over_the_world_is_caught(results: dict) -> None:
    ref = results["refs"][None][-1]
    errs = [
        _max_rel_error(o["e2_wrong_layout"]["params"], ref, _topo(o["e2_wrong_layout"]["ep_rank"], 2))
        for o in results["four"]
    ]
    assert max(errs) > 1e-3


@pytest.mark.parametrize("key", ["e1", "e2", "e4", "e2_ep_unaware"])
def test_state_bytes_is_12_P_over_W_plus_padding(results: dict, key: str) -> None:
    outs = [o[key] for o in results["four"]]
    first = outs[0]
    world, ep = 4, RUNS[key].ep_size
    # every parameter element is owned by exactly one rank (EP-unaware: dense ones by E ranks)
    dense_copies = 1 if RUNS[key].options.get("ep_aware", True) else ep
    assert sum(o["owned"] for o in outs) == first["dense"] * dense_copies + first["expert_total"]
    for o in outs:
        assert o["state_bytes"] == 12 * o["owned"] + o["padding_bytes"]
        assert 0 <= o["padding_bytes"] <= o["bound"]
        assert o["metrics"]["optim/state_bytes"] == o["state_bytes"]
        assert o["metrics"]["optim/step_ms"] > 0
        if dense_copies == 1:
            p_total = first["dense"] + first["expert_total"]
            assert abs(o["state_bytes"] - 12 * p_total / world) <= o["bound"]
        else:  # the EP-unaware formula 12 * (P_dense / EDP + P_expert / W)
            expect = 12 * (first["dense"] / (world // ep) + first["expert_total"] / world)
            assert abs(o["state_bytes"] - expect) <= o["bound"]


def test_checkpoint_reshards_across_layouts(results: dict) -> None:
    assert_checkpoint_reshards(results["four"], results["two"], results["refs"][CLIP])


def assert_checkpoint_reshards(four: list[dict], two: list[dict], ref: list[dict[str, torch.Tensor]]) -> None:
    """What `_checkpoint_save_and_reload` (every rank's "ckpt" in `four`) and `_resume_worker` (`two`)
    give equals the reference's steps: the run saved at (4, 2) continues there, and reloaded at (4, 4),
    (4, 1), (2, 1) and (2, 2) its master weights alone restore the model and its next step is the
    reference's."""
    for rank, o in enumerate(four):
        ck = o["ckpt"]
        _assert_same_weights(
            ck["continued"], ref[STEPS - 1], ck["saved_ep_rank"], 2, what=f"(4, 2) rank {rank}"
        )
        for ep in (4, 1):
            res = ck[ep]
            what = f"(4, 2) -> (4, {ep}) rank {rank}"
            # the master weights alone restore the model, at the new layout's slices
            _assert_same_weights(res["loaded"], ref[STEPS - 2], res["ep_rank"], ep, what=f"{what} loaded")
            _assert_same_weights(res["next"], ref[STEPS - 1], res["ep_rank"], ep, what=f"{what} next")
    for rank, o in enumerate(two):
        for ep, res in o.items():
            what = f"(4, 2) -> (2, {ep}) rank {rank}"
            _assert_same_weights(res["loaded"], ref[STEPS - 2], res["ep_rank"], ep, what=f"{what} loaded")
            _assert_same_weights(res["next"], ref[STEPS - 1], res["ep_rank"], ep, what=f"{what} next")


def test_bucket_plan_alignment_and_padding() -> None:
    entries = [
        ParamEntry(i, f"p{i}", (n,), n, "float32", 0, "dense", 0, n, (n,))
        for i, n in enumerate([5, 37, 3, 64])
    ]
    buckets = plan_buckets(entries, {"dense": 4, "expert": 2}, bucket_numel=80, align=8)
    seen = {}
    for b in buckets:
        assert b.numel % (4 * 8) == 0
        for s in b.slots:
            assert s.start % 8 == 0
        for rank in range(4):
            for seg in b.segments(rank):
                seen.setdefault(seg.slot.entry.name, 0)
                seen[seg.slot.entry.name] += seg.length
    assert seen == {e.name: e.numel for e in entries}
    with pytest.raises(ValueError, match="positive"):
        plan_buckets(entries, {"dense": 4, "expert": 2}, bucket_numel=0, align=8)


def test_bad_inputs_raise_one_sentence() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="Unknown EPShardedAdamW option"):
        EPShardedAdamW(model.parameters(), model.named_parameters(), zero_stage_typo=2)
    with pytest.raises(ValueError, match="zero_stage"):
        EPShardedAdamW(model.parameters(), model.named_parameters(), zero_stage=3)
    with pytest.raises(ValueError, match="needs a name"):
        EPShardedAdamW(model.parameters(), [])
    with pytest.raises(ValueError, match="amsgrad"):
        EPShardedAdamW.from_adamw(
            torch.optim.AdamW(model.parameters(), amsgrad=True), model.named_parameters(), None
        )
    with pytest.raises(ValueError, match="torch.optim.AdamW"):
        EPShardedAdamW.from_adamw(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), None)


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
def test_from_adamw_keeps_groups_for_schedulers() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    adamw = torch.optim.AdamW(_groups(list(model.named_parameters())), lr=0.5)
    sched = torch.optim.lr_scheduler.LambdaLR(adamw, lambda s: 0.1 * (s + 1))
    opt = EPShardedAdamW.from_adamw(adamw, model.named_parameters(), None)
    assert opt.param_groups[0] is adamw.param_groups[0] and opt.param_groups[0]["initial_lr"] == 0.5
    sched.optimizer = opt
    sched.step()
    assert math.isclose(opt.param_groups[1]["lr"], 0.5 * 0.2)


# ---------------------------------------------------------------------------------------------
# The tiny Mula MoE with the strategy's real expert parallelism (all-to-all dispatcher).

MULA_STEPS, MULA_MICRO, MULA_SEQ = 3, 2, 16


def _mula_config():
    from mula import MulaConfig

    return MulaConfig.from_name(
        "mula-tiny-moe", vocab_size=256, hidden_size=32, num_layers=2, num_heads=2, num_experts=8, top_k=2,
        expert_intermediate_size=32, max_position_embeddings=64,
    )  # fmt: skip


def _mula_batches(world: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seeded(7))
    vocab = _mula_config().vocab_size
    return [
        torch.randint(0, vocab, (world * MULA_MICRO, MULA_SEQ + 1), generator=g) for _ in range(MULA_STEPS)
    ]


def _mula_loss(model: nn.Module, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's loss and its [MoE layers, E] tokens per expert."""
    cfg = _mula_config()
    out = model(batch[:, :-1])
    ce = F.cross_entropy(out.logits.flatten(0, 1), batch[:, 1:].flatten())
    loss = ce + cfg.router_aux_loss_coef * out.aux_loss + cfg.router_z_loss_coef * out.z_loss
    return loss, out.tokens_per_expert.detach()


def _mula_model() -> nn.Module:
    from mula import Mula

    torch.manual_seed(seeded(0))
    return Mula(_mula_config())


def _mula_groups(model: nn.Module) -> list[dict]:
    return _groups(list(model.named_parameters()))


def _mula_reference(world: int) -> dict:
    """One process: per step the loss, the gradient norm, the global expert counts and the near ties
    (what `equality.assert_same_training` reads), and the parameters after the last step."""
    cfg = _mula_config()
    model = _mula_model()
    opt = torch.optim.AdamW(_mula_groups(model), lr=LR, eps=ADAMW_EPS)
    record = LoopRecord(near_ties_of=(model, cfg))
    for batch in _mula_batches(world):
        opt.zero_grad()
        for micro in batch.split(MULA_MICRO):
            loss, tokens = _mula_loss(model, micro)
            (loss / world).backward()
            record.add(loss.item() / world, tokens)
        record.end_step(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5))
        opt.step()
    return {**record.as_dict(), "params": {n: p.detach().clone() for n, p in model.state_dict().items()}}


def _mula_worker(rank: int, world: int) -> dict:
    from strategies.experts.expert_parallel import apply_expert_parallel

    out = {}
    for ep in (1, 4):
        topo = build_topology(ep)
        model = _mula_model()
        apply_expert_parallel(model, topo)
        opt = EPShardedAdamW.from_adamw(
            torch.optim.AdamW(_mula_groups(model), lr=LR, eps=ADAMW_EPS),
            list(model.named_parameters()),
            topo,
            bucket_numel=4096,
        )
        record = LoopRecord()
        for batch in _mula_batches(world):
            opt.zero_grad()
            loss, tokens = _mula_loss(model, batch.split(MULA_MICRO)[rank])
            loss.backward()
            record.add(loss.item() / world, tokens)
            record.end_step(opt.clip_grad_norm_(0.5))  # the global loss and counts
            opt.step()
        out[ep] = {
            **record.as_dict(),
            "params": {n: p.detach().clone() for n, p in model.state_dict().items()},
            "ep_rank": topo.rank("ep"),
        }
        opt.close()
    return out


def test_tiny_mula_moe_with_expert_parallelism_matches_adamw() -> None:
    """The suite's equality rule (tests/equality.py): per-step losses and gradient norms, then the
    parameters after the last step, a rank's experts against the same experts of the reference."""
    pytest.importorskip("mula.model.transformer")
    ref = _mula_reference(4)
    for rank, rank_out in enumerate(run_distributed(_mula_worker, 4)):
        for ep, res in rank_out.items():
            what = f"E={ep} rank {rank}"
            assert_same_training(res, ref, what=what)
            want = {n: _slice(n, ref["params"][n], res["ep_rank"], ep) for n in res["params"]}
            assert_same_weights(res["params"], want, what=what)


def test_bf16_params_keep_fp32_master_weights() -> None:
    """Mixed precision (one process): bf16 model parameters, fp32 master weights and moments.

    The master weights follow fp32 AdamW fed the same (bf16) gradients; the model parameters are
    their bf16 rounding after every step."""
    torch.manual_seed(seeded(0))
    ref = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4)).to(torch.bfloat16)
    with torch.no_grad():
        for p, q in zip(model.parameters(), ref.parameters()):
            q.copy_(p.float())  # same starting point, exactly representable in bf16
    opt = EPShardedAdamW(
        _groups(list(model.named_parameters())), model.named_parameters(), lr=LR, eps=ADAMW_EPS
    )
    ref_opt = torch.optim.AdamW(_groups(list(ref.named_parameters())), lr=LR, eps=ADAMW_EPS)
    for step in range(3):
        grads = [torch.randn(p.shape, generator=torch.Generator().manual_seed(seeded(step))).to(torch.bfloat16)
                 for p in model.parameters()]  # fmt: skip
        opt.zero_grad()
        ref_opt.zero_grad()
        torch.autograd.backward(list(model.parameters()), grads)
        for q, g in zip(ref.parameters(), grads):
            q.grad = g.float()
        opt.step()
        ref_opt.step()
    master = torch.cat([q.detach().reshape(-1) for q in ref.parameters()])
    ours = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert ours.dtype == torch.bfloat16
    torch.testing.assert_close(ours, master.to(torch.bfloat16), rtol=0, atol=0)
    assert opt.state_bytes() >= 12 * master.numel()


def test_state_is_shared_with_lightning_optimizer_wrapper() -> None:
    """Lightning calls our methods on a LightningOptimizer wrapper (``self`` = the wrapper, reads
    forwarded to us): a clip through the wrapper must count for the step on the real optimizer."""
    from lightning.pytorch.core.optimizer import LightningOptimizer

    torch.manual_seed(seeded(0))
    model, ref = nn.Linear(4, 3), nn.Linear(4, 3)
    ref.load_state_dict(model.state_dict())
    opt = EPShardedAdamW(
        model.parameters(), model.named_parameters(), lr=LR, eps=ADAMW_EPS, max_grad_norm=1e-4
    )
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=ADAMW_EPS)
    wrapper = LightningOptimizer(opt)
    x = torch.randn(8, 4)
    for _ in range(2):
        wrapper.zero_grad()
        ref_opt.zero_grad()
        model(x).square().mean().backward()
        ref(x).square().mean().backward()
        wrapper.clip_grad_norm_(1e9)  # no-op clip: step() must not clip again to max_grad_norm
        opt.step()
        ref_opt.step()
    torch.testing.assert_close(model.weight, ref.weight, rtol=1e-6, atol=1e-7)
    assert opt.steps_done == 2 and wrapper.steps_done == 2
