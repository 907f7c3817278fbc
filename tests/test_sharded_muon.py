"""EP-aware sharded Muon (strategies/optim/sharded_muon.py) against one process running Muon.

One process, bit for bit: `EPShardedMuon` over the tiny MoE's param groups (small buckets, so Muon and
AdamW buckets interleave) equals `MulaMuon` on its Muon groups stepped beside `EPShardedAdamW` on its
AdamW groups (the sharded optimizer's own AdamW kernel, so the two AdamW halves are the same bits by
construction): the Muon half is then exactly `torch.optim.Muon`'s update (tests/test_muon.py).

On 4 (and 2) gloo ranks, tests/test_sharded_optimizer.py's stand-in with the real model's expert stacks
(softly gated SwiGLU experts, no top-k choice: a fused gate_up [E, 2I, H] of 2E matrices [I, H], each
expert's gate then its up, and a down [E, H, I] of E) trained with Muon for its blocks' matrices and
AdamW for the rest equals one process running `MulaMuon`, every weight bit for bit (`torch.equal`), at
E = 1 and 2 with clipping, E = 2 with fp32 Newton-Schulz, and E = 4 with ZeRO-2, accumulation, native
collectives and small buckets; state bytes per rank are exactly 8 per owned Muon element + 12 per owned
AdamW element + the stated padding; every matrix (gate and up apart) has one owner in its domain
(experts' in their EDP group), balanced by Newton-Schulz FLOPs; the checkpoint saved at (W=4, E=2)
reloads at (4, 4), (4, 1), (2, 1), (2, 2) and takes the reference's next step, bit for bit. Planted bugs
fail that proof: an expert stack orthogonalised as one matrix, gate_up as one matrix, gate_up's step
scaled by its fused shape, one owner's matrices skipped, one owner's orthogonalised slices not returned
(zeros sent back), the returned slices unpacked as another owner's.

Why the distributed runs agree bit for bit: every gradient a rank contributes is put on a 2^-20 grid
per unit of the reference's sum (one of its WORLD micro-batches; a rank of a 2-rank world grids each of
its two on its own), so every layout's reduced gradient is the reference's to the bit, whatever the
summation order; the Nesterov update is then the same elementwise arithmetic on each rank's slice, a
matrix's owner receives it whole (the all-to-all of strategies/optim/muon_exchange.py) and runs
Newton-Schulz on the same matrix as one process, whose result goes back unchanged. The one quantity a layout sums in its own order is the global gradient norm
(each rank's share of the squares, then the all-reduce, in fp32): a clipped run records the norm of
each step, the reference checks it against its own gradient's (to fp32's rounding, 1e-6) and clips by
that norm with the sharded optimizer's arithmetic, so the clipping's effect is compared bit for bit.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import tempfile
from collections.abc import Iterator
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from dist_helpers import run_distributed
from equality import ADAMW_EPS, seeded
from test_muon import _batch as _lm_batch
from test_muon import _module
from test_sharded_optimizer import (
    CLIP,
    E_TOTAL,
    HIDDEN,
    INTER,
    LAYERS,
    LR,
    STEPS,
    Run,
    StandIn,
    Trainer,
    _batch,
    _checkpoint_save_and_reload,
    _local_params,
    _loss,
    _resume_worker,
    _schedule,
    _slice,
)
from torch import nn

import strategies.optim.sharded_muon as sharded_muon
from mula.layout.flat_buffers import Bucket, MatrixTask, ParamEntry, matrix_owners, plan_buckets
from mula.model.moe import is_expert_param
from mula.model.param_names import is_muon_param
from mula.training.muon import MUON_KEY, MulaMuon, adjusted_lr, optimizer_param_groups
from strategies.optim.muon_exchange import BucketExchange
from strategies.optim.sharded_muon import EPShardedMuon
from strategies.optim.sharded_optimizer import EPShardedAdamW
from strategies.topology import LayoutMesh, build_topology

MUON = {"momentum": 0.95, "ns_steps": 5, "adjust_lr": "match_rms_adamw"}


class FusedExperts(nn.Module):
    """SwiGLU experts stacked as the real model's (mula/model/moe/experts.py): gate_up [E, 2I, H], each
    expert's gate rows then its up rows, and down [E, H, I]."""

    def __init__(self, num: int) -> None:
        super().__init__()
        self.gate_up = nn.Parameter(torch.randn(num, 2 * INTER, HIDDEN) * 0.3)
        self.down = nn.Parameter(torch.randn(num, HIDDEN, INTER) * 0.3)

    def forward(self, x: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        gate, up = torch.einsum("nh,eih->nei", x, self.gate_up).chunk(2, dim=-1)
        return (gates.unsqueeze(-1) * torch.einsum("nei,ehi->neh", F.silu(gate) * up, self.down)).sum(1)


class FusedStandIn(StandIn):
    """tests/test_sharded_optimizer.py's stand-in with `FusedExperts` in every MoE layer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(seeded(1))
        for layer in self.layers:
            layer.mlp.experts = FusedExperts(E_TOTAL)


# The stand-in's Muon matrices, written out (rows, cols) by parameter: gate_up's are its gate and up [I, H]
MATRICES = {
    f"layers.{i}.{name}": shape
    for i in range(LAYERS)
    for name, shape in {
        "proj.weight": (HIDDEN, HIDDEN),
        "mlp.router.weight": (E_TOTAL, HIDDEN),
        "mlp.experts.gate_up": (INTER, HIDDEN),
        "mlp.experts.down": (HIDDEN, INTER),
    }.items()
}


def _muon_groups(named: list[tuple[str, nn.Parameter]]) -> list[dict]:
    """Moonlight's rule on the stand-in (the module's grouping): the blocks' matrices (projection, router,
    each expert's gate, up and down) to Muon, the rest (input/output projections, norms, biases) to
    AdamW; biases and norms undecayed."""
    return optimizer_param_groups(named, 0.1, ("*.bias", "*norm*"), "muon")


# Gradients on a grid of 2^-20 (each rank's, before any sum): sums of a few of them are exact in fp32 in any
# order, so every layout's reduced gradient is the reference's to the bit (module docstring).
GRID = 2.0**-20
WORLD = 4


def on_grid(grad: torch.Tensor) -> torch.Tensor:
    """`grad` rounded to the nearest multiple of `GRID` (|grad| << 2^3, so 8 of them add up exactly)."""
    return torch.round(grad / GRID) * GRID


# --------------------------------------------------------------------------------------------
# planted bugs: each must fail the proof (`assert_same_bits`)


_matrix_shape = EPShardedMuon._matrix_shape  # the sound one, which the planted ones call


def _whole_stack(self: EPShardedMuon, group: dict, position: int) -> tuple[int, int] | None:
    shape = _matrix_shape(self, group, position)
    p = group["params"][position]
    return shape if shape is None or p.dim() < 3 else (p.numel() // p.shape[-1], p.shape[-1])


def _fused_matrix(self: EPShardedMuon, group: dict, position: int) -> tuple[int, int] | None:
    shape = _matrix_shape(self, group, position)
    return shape if shape is None else tuple(group["params"][position].shape[-2:])


def _fused_scale(lr: float, how: str, rows: int, cols: int) -> float:
    # gate_up's matrices [I, H] (the stand-in's only matrices of that shape) stepped as its fused [2I, H]
    return adjusted_lr(lr, how, 2 * rows if (rows, cols) == (INTER, HIDDEN) else rows, cols)


def wrong_owner_unpack(self: BucketExchange, packed: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    runs = [list(r) for r in self.plan.send]
    at = 0
    for lo, hi in (run for r in runs[1:] + runs[:1] for run in r):  # the owners' pieces rotated by one
        out[lo:hi].copy_(packed[at : at + hi - lo])
        at += hi - lo
    return out


def zeros_returned(exchange: BucketExchange) -> None:
    """Make `exchange` return zeros in place of this rank's orthogonalised matrices."""
    give_back = exchange.give_back
    exchange.give_back = lambda received, packed: give_back(received.zero_(), packed)  # type: ignore[method-assign]


BUGS = {
    # an expert stack [E_local, m, n] orthogonalised (and scaled) as one matrix [E_local m, n]
    "stack_as_one_matrix": (EPShardedMuon, "_matrix_shape", _whole_stack),
    # gate_up [E, 2I, H] split by its last two dimensions: each expert's gate and up one matrix [2I, H]
    "gate_up_as_one_matrix": (EPShardedMuon, "_matrix_shape", _fused_matrix),
    # gate and up orthogonalised apart, but stepped by the scale of the fused [2I, H]
    "scale_from_fused_shape": (sharded_muon, "adjusted_lr", _fused_scale),
    # world rank 1 skips the matrices it owns (their update stays zero: weight decay only)
    "one_owner_skipped": None,
    # world rank 1 orthogonalises its matrices but returns zeros for their slices
    "one_owners_slices_not_returned": None,
    # the returned slices unpacked as if each had come from the next owner
    "returned_slices_from_the_wrong_owner": (BucketExchange, "unpack", wrong_owner_unpack),
}


@contextlib.contextmanager
def planted(bug: str | None) -> Iterator[None]:
    """`bug` (a key of `BUGS`, or None) planted in this process's sharded Muon while the block runs
    (the owners' bugs are planted on the optimizer, `MuonTrainer.optimizer`)."""
    patch = BUGS[bug] if bug is not None else None
    with mock.patch.object(*patch) if patch is not None else contextlib.nullcontext():
        yield


# --------------------------------------------------------------------------------------------
# the runs


class MuonTrainer(Trainer):
    """tests/test_sharded_optimizer.py's driver on `FusedStandIn` with `EPShardedMuon`, each rank's
    gradient on the grid; a clipped run records the global gradient norm of each step (`norms`); `bug`
    plants one of `BUGS` (the caller holds `planted(bug)` around the run)."""

    def __init__(self, run: Run, bug: str | None = None) -> None:
        self.run, self.bug, self.steps, self.norms = run, bug, 0, []
        self.topo = build_topology(run.ep_size)
        self.replica = FusedStandIn()
        self.local = _local_params(self.replica, self.topo.rank("ep"), self.topo.size("ep"))
        self.named = list(self.local.named_parameters())
        self.opt = self.optimizer(self.topo, dict(run.options))
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, _schedule)

    def replica_grads(self, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
        # The reference grids each of the WORLD ranks' micro-batch gradients; a rank of a smaller world
        # holds several of them and grids each on its own (gridding their sum would round it elsewhere:
        # (4, 2) -> (2, 1) then missed the reference's next step on an AMX Xeon, a bf16 rounding away)
        parts = WORLD // self.topo.size("replica")
        total: list[torch.Tensor] = []
        for xp, yp in zip(x.chunk(parts), y.chunk(parts), strict=True):
            grads = [on_grid(g) / parts for g in super().replica_grads(xp, yp)]  # / 2^k: exact
            total = [a + b for a, b in zip(total, grads, strict=True)] if total else grads
        return total

    def optimizer(self, topology: LayoutMesh, options: dict) -> EPShardedMuon:
        opt = EPShardedMuon(
            _muon_groups(self.named), self.named, topology, lr=LR, eps=ADAMW_EPS, **MUON, **options
        )
        if self.bug == "one_owners_slices_not_returned" and topology.rank("world") == 1:
            for exchange in opt._exchange.values():
                zeros_returned(exchange)
        if self.bug == "one_owner_skipped" and topology.rank("world") == 1:
            opt._mine = {i: [] for i in opt._mine}
        return opt

    def train_step(self) -> None:
        super().train_step()
        if self.run.clip is not None:
            self.norms.append(self.opt.metrics()["optim/grad_norm"])


class UnclippedMuonTrainer(MuonTrainer):
    """The checkpoint runs' trainer (tests/test_sharded_optimizer.py's checkpoint helpers ask for clipping):
    unclipped, so that the run resumed at another layout, which sums the norm in its own order, needs no
    norm of its own in the reference."""

    def __init__(self, run: Run, bug: str | None = None) -> None:
        super().__init__(dataclasses.replace(run, clip=None), bug)


RUNS = {
    "e1_clip": Run(1, clip=CLIP),
    "e2_clip": Run(2, clip=CLIP),
    "e4_zero2_accum_native_smallbuckets": Run(
        4, accum=2, options={"zero_stage": 2, "collectives": "native", "bucket_numel": 200, "align": 8}
    ),
    "e2_ns_float32": Run(2, options={"ns_dtype": "float32"}),  # the update's collectives in fp32
}
BUG_RUN, BUG_STEPS = Run(2), 2  # each planted bug's run (its reference: the unclipped one), kept short


def _reference(
    steps: int, accum: int = 1, ns_dtype: str = "bfloat16", norms: list[float] | None = None
) -> tuple[list[dict[str, torch.Tensor]], list[float]]:
    """One process on the whole global batch: each of the WORLD ranks' micro-batch gradients on the grid,
    summed and divided by WORLD (exact), `MulaMuon` on the Muon groups beside `EPShardedAdamW` (the same
    AdamW kernel as the sharded runs') on the others: (parameters after each step, each step's global
    gradient norm in fp64). With `norms` (a clipped run's global gradient norm of each step), each
    step's gradient is clipped to `CLIP` by that norm with the sharded optimizer's arithmetic (the test
    checks it against this gradient's: module docstring)."""
    model = FusedStandIn()
    named = list(model.named_parameters())
    groups = _muon_groups(named)
    muon = MulaMuon([g for g in groups if g.get(MUON_KEY)], lr=LR, eps=ADAMW_EPS, **MUON, ns_dtype=ns_dtype)
    adamw = EPShardedAdamW(
        [g for g in groups if not g.get(MUON_KEY)], named, lr=LR, eps=ADAMW_EPS, overlap_grad_reduce=False
    )
    scheds = [torch.optim.lr_scheduler.LambdaLR(opt, _schedule) for opt in (muon, adamw)]
    out, exact = [], []
    for step in range(steps):
        x, y = _batch(step)
        total = [torch.zeros_like(p) for _, p in named]
        for xr, yr in zip(x.chunk(WORLD), y.chunk(WORLD)):
            for xm, ym in zip(xr.chunk(accum), yr.chunk(accum)):
                model.zero_grad()
                (_loss(model, xm, ym) / accum).backward()
                for t, (_, p) in zip(total, named):
                    t.add_(on_grid(p.grad))
        for opt in (muon, adamw):
            opt.zero_grad()
        for t, (_, p) in zip(total, named):
            p.grad = t / WORLD
        exact.append(torch.cat([p.grad.flatten() for _, p in named]).double().norm().item())
        if norms is not None:
            # ShardClipping.clip_grad_norm_'s arithmetic, on the run's fp32 norm
            coef = (CLIP / (torch.tensor(norms[step], dtype=torch.float32) + 1e-6)).clamp(max=1.0)
            assert coef < 0.5  # the clipping acts on every step
            for _, p in named:
                p.grad.mul_(coef)
        for opt in (muon, adamw):
            opt.step()
        for sched in scheds:
            sched.step()
        out.append({n: p.detach().clone() for n, p in named})
    return out, exact


def _owned(opt: EPShardedMuon) -> dict[str, int]:
    """Parameter elements whose state this rank owns, by kind (padding excluded)."""
    out = {"muon": 0, "adamw": 0}
    for b, st in zip(opt.buckets, opt.reducer.states):
        out["muon" if b.muon else "adamw"] += sum(s.length for s in b.segments(st.domain.rank))
    return out


def _param_of(bucket: Bucket, task: MatrixTask) -> str:
    """The name of the parameter whose matrix `task` is."""
    (name,) = (s.entry.name for s in bucket.slots if s.start <= task.start < s.start + s.entry.numel)
    return name


def _train_worker(rank: int, world: int, ckpt_dir: str) -> dict:
    out: dict = {}
    runs = {**{key: (run, None) for key, run in RUNS.items()}, **{bug: (BUG_RUN, bug) for bug in BUGS}}
    for key, (run, bug) in runs.items():
        with planted(bug):
            t = MuonTrainer(run, bug)
            for _ in range(STEPS if bug is None else BUG_STEPS):
                t.train_step()
            out[key] = {
                "params": t.params(),
                "norms": t.norms,
                "ep_rank": t.topo.rank("ep"),
                "owned": _owned(t.opt),
                "state_bytes": t.opt.state_bytes(),
                "padding_bytes": t.opt.padding_bytes(),
                "bound": t.opt.padding_bound_bytes(),
                "metric": t.opt.metrics()["optim/state_bytes"],
                "matrices": [
                    (t.opt.reducer.states[i].domain.name, _param_of(t.opt.buckets[i], task), task)
                    for i, tasks in t.opt._mine.items()
                    for task in tasks
                ],
            }
            t.opt.close()
    out["ckpt"] = _checkpoint_save_and_reload(rank, ckpt_dir, UnclippedMuonTrainer)
    return out


@pytest.fixture(scope="module")
def results() -> dict:
    with tempfile.TemporaryDirectory() as d:
        four = run_distributed(_train_worker, 4, d)
        two = run_distributed(_resume_worker, 2, d, UnclippedMuonTrainer)
    refs, ref_norms = {}, {}
    refs["unclipped"], _ = _reference(STEPS)
    for key, run in RUNS.items():
        ns_dtype = run.options.get("ns_dtype", "bfloat16")
        norms = four[0][key]["norms"] if run.clip is not None else None
        refs[key], ref_norms[key] = _reference(STEPS, run.accum, ns_dtype, norms)
    return {"refs": refs, "ref_norms": ref_norms, "four": four, "two": two}


def assert_same_bits(
    params: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], ep_rank: int, ep_size: int, what: str
) -> None:
    """The proof: this rank's parameters are the reference's bit for bit, experts sliced to the rank's
    block."""
    for name, value in params.items():
        want = _slice(name, ref[name], ep_rank, ep_size)
        assert torch.equal(value, want), f"{what} {name}: {(value - want).abs().max().item():.3g} off"


def assert_run_is_the_reference(
    outs: list[dict], ref: dict[str, torch.Tensor], ep_size: int, what: str
) -> None:
    """`assert_same_bits` on every rank of a run."""
    for rank, o in enumerate(outs):
        assert_same_bits(o["params"], ref, o["ep_rank"], ep_size, f"{what} rank {rank}")


@pytest.mark.parametrize("key", list(RUNS))
def test_matches_one_process_muon_bit_for_bit(results: dict, key: str) -> None:
    """Every weight of every rank is the reference's; a clipped run's norms (every rank's the same, which
    the reference clipped by) are the reference's gradient norms to fp32's rounding."""
    outs = [o[key] for o in results["four"]]
    if RUNS[key].clip is not None:
        assert all(o["norms"] == outs[0]["norms"] for o in outs)
        for step, (norm, exact) in enumerate(zip(outs[0]["norms"], results["ref_norms"][key], strict=True)):
            assert abs(norm - exact) <= 1e-6 * exact, (step, norm, exact)
    assert_run_is_the_reference(outs, results["refs"][key][-1], RUNS[key].ep_size, key)


@pytest.mark.parametrize("bug", list(BUGS))
def test_a_planted_bug_fails_the_proof(results: dict, bug: str) -> None:
    """Each bug of `BUGS`, planted in every rank's sharded Muon, makes the proof fail, and not by a
    rounding: some weight is off by more than the equality rule's 1e-4."""
    outs = [o[bug] for o in results["four"]]
    ref = results["refs"]["unclipped"][BUG_STEPS - 1]
    with pytest.raises(AssertionError):
        assert_run_is_the_reference(outs, ref, BUG_RUN.ep_size, bug)
    worst = max(
        (value - _slice(name, ref[name], o["ep_rank"], BUG_RUN.ep_size)).abs().max().item()
        for o in outs
        for name, value in o["params"].items()
    )
    assert worst > 1e-4, worst
    # the `_matrix_shape` bugs did change the matrices (stand-in: no other shape than `MATRICES`')
    shapes = {(t.rows, t.cols) for o in outs for _, _, t in o["matrices"]}
    assert (shapes <= set(MATRICES.values())) == (BUGS[bug] is None or BUGS[bug][1] != "_matrix_shape")
    if bug == "one_owner_skipped":  # rank 1 owns matrices at this layout (e2_clip's: E = 2, defaults)
        assert results["four"][1]["e2_clip"]["matrices"]


@pytest.mark.parametrize("key", list(RUNS))
def test_state_bytes_are_8_per_muon_and_12_per_adamw_element(results: dict, key: str) -> None:
    outs = [o[key] for o in results["four"]]
    model = FusedStandIn()
    ep = RUNS[key].ep_size
    total = {"muon": 0, "adamw": 0}
    for name, p in model.named_parameters():
        total["muon" if is_muon_param(name, p.shape) else "adamw"] += p.numel()
    # every element is owned once: dense ones over the 4 ranks, each expert block over its EDP group
    assert {k: sum(o["owned"][k] for o in outs) for k in total} == total
    for o in outs:
        assert o["state_bytes"] == 8 * o["owned"]["muon"] + 12 * o["owned"]["adamw"] + o["padding_bytes"]
        assert 0 <= o["padding_bytes"] <= o["bound"]
        assert o["metric"] == o["state_bytes"]
        assert abs(o["state_bytes"] - (8 * total["muon"] + 12 * total["adamw"]) / 4) <= o["bound"]
    assert ep in (1, 2, 4)


def test_the_stand_in_holds_the_real_models_matrices() -> None:
    """The grouping gives Muon exactly `MATRICES`, each parameter split into matrices of the written-out
    shape (gate_up's gate and up apart): a grouping that took gate_up, or a stack, for one matrix fails
    here, where the runs above could not tell it (both sides read the same groups)."""
    named = list(FusedStandIn().named_parameters())
    names = {id(p): n for n, p in named}
    found = {
        names[id(p)]: tuple(shape)
        for g in _muon_groups(named)
        if g.get(MUON_KEY)
        for p, shape in zip(g["params"], g["matrix_shapes"], strict=True)
    }
    assert found == MATRICES


@pytest.mark.parametrize("key", list(RUNS))
def test_each_matrix_has_one_owner_in_its_domain(results: dict, key: str) -> None:
    """Dense matrices over all 4 ranks, each expert block's over its EDP group (the ranks holding it):
    every matrix, gate and up apart, orthogonalised exactly once; the dense Newton-Schulz FLOPs spread
    over the ranks."""
    ep = RUNS[key].ep_size
    outs = [o[key] for o in results["four"]]
    assert {(name, (t.rows, t.cols)) for o in outs for _, name, t in o["matrices"]} <= set(MATRICES.items())
    dense = [(name, t.start) for o in outs for dom, name, t in o["matrices"] if dom == "dense"]
    assert len(dense) == len(set(dense))
    experts: dict[int, list] = {}
    for o in outs:
        experts.setdefault(o["ep_rank"], []).extend(
            (name, t.start) for dom, name, t in o["matrices"] if dom == "expert"
        )
    assert len(experts) == ep
    for found in experts.values():
        assert len(found) == len(set(found))
        assert len(found) == LAYERS * 3 * E_TOTAL // ep  # each local expert's gate, up and down
    assert len(dense) == sum(1 for name in MATRICES if not is_expert_param(name))
    loads = [sum(t.cost for dom, _, t in o["matrices"] if dom == "dense") for o in outs]
    largest = max(t.cost for o in outs for dom, _, t in o["matrices"] if dom == "dense")
    assert max(loads) - min(loads) <= largest  # the greedy split's bound


def test_checkpoint_reshards_across_layouts_bit_for_bit(results: dict) -> None:
    """tests/test_sharded_optimizer.py's `assert_checkpoint_reshards`, bit for bit: the run saved at (4, 2)
    continues there, and reloaded at (4, 4), (4, 1), (2, 1) and (2, 2) its master weights alone restore
    the model and its next step is the reference's."""
    ref = results["refs"]["unclipped"]
    for rank, o in enumerate(results["four"]):
        ck = o["ckpt"]
        assert_same_bits(ck["continued"], ref[STEPS - 1], ck["saved_ep_rank"], 2, f"(4, 2) rank {rank}")
        for ep in (4, 1):
            res = ck[ep]
            what = f"(4, 2) -> (4, {ep}) rank {rank}"
            assert_same_bits(res["loaded"], ref[STEPS - 2], res["ep_rank"], ep, f"{what} loaded")
            assert_same_bits(res["next"], ref[STEPS - 1], res["ep_rank"], ep, f"{what} next")
    for rank, o in enumerate(results["two"]):
        for ep, res in o.items():
            what = f"(4, 2) -> (2, {ep}) rank {rank}"
            assert_same_bits(res["loaded"], ref[STEPS - 2], res["ep_rank"], ep, f"{what} loaded")
            assert_same_bits(res["next"], ref[STEPS - 1], res["ep_rank"], ep, f"{what} next")


# --------------------------------------------------------------------------------------------
# one process, bit for bit


def test_one_process_equals_mula_muon_beside_sharded_adamw_bit_for_bit() -> None:
    module = _module()
    kwargs = {"lr": 2e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    sharded_model = module.model
    reference_model = copy.deepcopy(sharded_model)
    sharded = EPShardedMuon(
        module.param_groups(), sharded_model.named_parameters(), **kwargs, **MUON, bucket_numel=3000
    )
    dense = [b.muon for b in sharded.buckets if b.domain == "dense"]
    assert dense.count(True) > 1 and dense.count(False) > 1
    module.model = reference_model
    groups = module.param_groups()
    muon = MulaMuon([g for g in groups if g.get(MUON_KEY)], **kwargs, **MUON)
    adamw = EPShardedAdamW(
        [g for g in groups if not g.get(MUON_KEY)],
        reference_model.named_parameters(),
        **kwargs,
        bucket_numel=3000,
    )
    for step in range(5):
        losses = []
        for model, opts in ((sharded_model, (sharded,)), (reference_model, (muon, adamw))):
            module.model = model
            for opt in opts:
                opt.zero_grad()
            loss = module._losses(_lm_batch(step))[0]
            loss.backward()
            for opt in opts:
                opt.step()
            losses.append(loss.item())
        assert losses[0] == losses[1], (step, losses)
    for (name, p), q in zip(sharded_model.named_parameters(), reference_model.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert any(
        not torch.equal(p, q) for p, q in zip(sharded_model.parameters(), _module().model.parameters())
    )


# --------------------------------------------------------------------------------------------
# the layout, pure


def _entry(index: int, shape: tuple[int, ...], domain: str = "dense", matrix: bool = True) -> ParamEntry:
    n = 1
    for d in shape:
        n *= d
    mat = (shape[-2], shape[-1]) if matrix else None
    return ParamEntry(index, f"p{index}", shape, n, "float32", 0, domain, 0, n, shape, mat)


def test_buckets_hold_one_kind_and_come_in_backward_order() -> None:
    """Muon's matrices and AdamW's parameters never share a bucket; the buckets launch in the order
    backward completes them (the earliest-registered parameter's gradient comes last)."""
    entries = [
        _entry(0, (64,), matrix=False), _entry(1, (8, 8)), _entry(2, (8,), matrix=False), _entry(3, (8, 16)),
        _entry(4, (8,), matrix=False), _entry(5, (16, 8)), _entry(6, (2, 8, 4), "expert"), _entry(7, (64, 8), matrix=False),
    ]  # fmt: skip
    buckets = plan_buckets(entries, {"dense": 4, "expert": 2}, bucket_numel=200, align=4)
    for b in buckets:
        assert len({s.entry.matrix is not None for s in b.slots}) == 1
        assert b.muon == (b.slots[0].entry.matrix is not None)
        assert b.numel % (b.group_size * 4) == 0 and all(s.start % 4 == 0 for s in b.slots)
        assert [s.bucket for s in b.slots] == [b.index] * len(b.slots)
    dense = [b for b in buckets if b.domain == "dense"]
    completion = [min(s.entry.index for s in b.slots) for b in dense]
    assert completion == sorted(completion, reverse=True)
    assert [b.domain for b in buckets] == ["dense"] * len(dense) + ["expert"]
    assert sorted(s.entry.index for b in buckets for s in b.slots) == list(range(8))
    # without Muon, the buckets are AdamW's: filled in reverse registration order, dense then expert
    plain = [dataclass_replace(e, matrix=None) for e in entries]
    order = [s.entry.index for b in plan_buckets(plain, {"dense": 4, "expert": 2}, 200, 4) for s in b.slots]
    assert order == [7, 5, 4, 3, 2, 1, 0, 6]


def dataclass_replace(entry: ParamEntry, **changes) -> ParamEntry:
    import dataclasses

    return dataclasses.replace(entry, **changes)


def test_matrix_owners_balance_newton_schulz_flops_not_bytes() -> None:
    """One 64 x 64 matrix costs as much Newton-Schulz as 8 of 64 x 8 (262,144 FLOP units each side):
    by bytes the split would be 8:1, by FLOPs it is even; every matrix has exactly one owner."""
    entries = [_entry(0, (64, 64)), _entry(1, (8, 64, 8))]
    buckets = plan_buckets(entries, {"dense": 2, "expert": 2}, bucket_numel=1 << 20, align=1)
    tasks = matrix_owners(buckets)[0]
    assert len(tasks) == 9 and len({t.start for t in tasks}) == 9
    loads = [sum(t.cost for t in tasks if t.owner == r) for r in (0, 1)]
    assert loads == [64 * 64 * 64, 8 * 64 * 8 * 8]
    assert matrix_owners(buckets) == matrix_owners(
        plan_buckets(entries, {"dense": 2, "expert": 2}, 1 << 20, 1)
    )
