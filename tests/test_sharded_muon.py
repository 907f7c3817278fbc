"""EP-aware sharded Muon (strategies/optim/sharded_muon.py) against one process running Muon.

One process, bit for bit: `EPShardedMuon` over the tiny MoE's param groups (small buckets, so Muon and
AdamW buckets interleave) equals `MulaMuon` on its Muon groups stepped beside `EPShardedAdamW` on its
AdamW groups (the sharded optimizer's own AdamW kernel, so the two AdamW halves are the same bits by
construction): the Muon half is then exactly `torch.optim.Muon`'s update (tests/test_muon.py).

On 4 (and 2) gloo ranks, tests/test_sharded_optimizer.py's stand-in (softly gated experts: no top-k
choice) trained with Muon for its blocks' matrices (each expert's its own) and AdamW for the rest equals
one process running `MulaMuon` by the suite's equality rule's weights (tests/equality.py) at E = 1, 2
(with clipping) and 4 (ZeRO-2, accumulation, native collectives, small buckets); state bytes per rank are
exactly 8 per owned Muon element + 12 per owned AdamW element + the stated padding, every matrix has one
owner in its domain (experts' in their EDP group), balanced by Newton-Schulz FLOPs; the checkpoint saved
at (W=4, E=2) reloads at (4, 4), (4, 1), (2, 1), (2, 2) and takes the reference's next step. A negative
control (every rank orthogonalises every matrix, so the reduce-scatter sums W copies) fails the rule.

Why the distributed runs agree by construction: every gradient a rank contributes is put on a 2^-20 grid
per unit of the reference's sum (one of its WORLD micro-batches; a rank of a 2-rank world grids each of
its two on its own), so every layout's reduced gradient is the reference's to the bit, whatever the
summation order or the host's rounding; the Nesterov update is then the same elementwise arithmetic on
each rank's slice, and a matrix's owner runs Newton-Schulz on the same bf16 matrix as one process.
"""

from __future__ import annotations

import copy
import dataclasses
import tempfile

import pytest
import torch
from dist_helpers import run_distributed
from equality import ADAMW_EPS
from test_muon import _batch as _lm_batch
from test_muon import _module
from test_sharded_optimizer import (
    LR,
    STEPS,
    Run,
    StandIn,
    Trainer,
    _assert_same_weights,
    _batch,
    _checkpoint_save_and_reload,
    _loss,
    _max_rel_error,
    _resume_worker,
    _schedule,
    _topo,
    assert_checkpoint_reshards,
)
from torch import nn

from mula.layout.flat_buffers import ParamEntry, matrix_owners, plan_buckets
from mula.model.moe import is_expert_param
from mula.model.param_names import is_muon_param
from mula.training.muon import MUON_KEY, MulaMuon, optimizer_param_groups
from strategies.optim.sharded_muon import EPShardedMuon
from strategies.optim.sharded_optimizer import EPShardedAdamW
from strategies.topology import LayoutMesh

MUON = {"momentum": 0.95, "ns_steps": 5, "adjust_lr": "match_rms_adamw"}


def _muon_groups(named: list[tuple[str, nn.Parameter]]) -> list[dict]:
    """Moonlight's rule on the stand-in (the module's grouping): the blocks' matrices (router, projection,
    each expert's w_in and w_out) to Muon, the rest (input/output projections, norms, biases) to AdamW;
    biases and norms undecayed."""
    return optimizer_param_groups(named, 0.1, ("*.bias", "*norm*"), "muon")


# Gradients on a grid of 2^-20 (each rank's, before any sum): sums of a few of them are exact in fp32 in any
# order, so every layout's reduced gradient is the reference's to the bit (module docstring).
GRID = 2.0**-20


def on_grid(grad: torch.Tensor) -> torch.Tensor:
    """`grad` rounded to the nearest multiple of `GRID` (|grad| << 2^3, so 8 of them add up exactly)."""
    return torch.round(grad / GRID) * GRID


class MuonTrainer(Trainer):
    """tests/test_sharded_optimizer.py's driver with `EPShardedMuon`, unclipped (the clipping is the sharded
    optimizer's, tested there; its norm's summation order is the layout's), each rank's gradient on the
    grid; `every_rank_owns_all` plants the negative control."""

    every_rank_owns_all = False

    def __init__(self, run: Run) -> None:
        super().__init__(dataclasses.replace(run, clip=None))

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
        if self.every_rank_owns_all:
            opt._mine = dict(opt._tasks)
        return opt


class WrongOwners(MuonTrainer):
    every_rank_owns_all = True


RUNS = {
    "e1": Run(1),
    "e2": Run(2),
    "e4_zero2_accum_native_smallbuckets": Run(
        4, accum=2, options={"zero_stage": 2, "collectives": "native", "bucket_numel": 200, "align": 8}
    ),
    "e2_ns_float32": Run(2, options={"ns_dtype": "float32"}),  # the update's collectives in fp32
}
WORLD = 4


def _reference(steps: int, accum: int = 1, ns_dtype: str = "bfloat16") -> list[dict[str, torch.Tensor]]:
    """One process on the whole global batch: each of the WORLD ranks' micro-batch gradients on the grid,
    summed and divided by WORLD (exact), `MulaMuon` on the Muon groups beside `EPShardedAdamW` (the same
    AdamW kernel as the sharded runs') on the others; parameters after each step."""
    model = StandIn()
    named = list(model.named_parameters())
    groups = _muon_groups(named)
    muon = MulaMuon([g for g in groups if g.get(MUON_KEY)], lr=LR, eps=ADAMW_EPS, **MUON, ns_dtype=ns_dtype)
    adamw = EPShardedAdamW(
        [g for g in groups if not g.get(MUON_KEY)], named, lr=LR, eps=ADAMW_EPS, overlap_grad_reduce=False
    )
    scheds = [torch.optim.lr_scheduler.LambdaLR(opt, _schedule) for opt in (muon, adamw)]
    out = []
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
        for opt in (muon, adamw):
            opt.step()
        for sched in scheds:
            sched.step()
        out.append({n: p.detach().clone() for n, p in named})
    return out


def _ref_key(run: Run) -> tuple[int, str]:
    """The reference a run is compared with: its accumulation and Newton-Schulz dtype."""
    return run.accum, run.options.get("ns_dtype", "bfloat16")


def _ref_keys() -> set[tuple[int, str]]:
    return {_ref_key(run) for run in RUNS.values()} | {(1, "bfloat16")}


def _owned(opt: EPShardedMuon) -> dict[str, int]:
    """Parameter elements whose state this rank owns, by kind (padding excluded)."""
    out = {"muon": 0, "adamw": 0}
    for b, st in zip(opt.buckets, opt.reducer.states):
        out["muon" if b.muon else "adamw"] += sum(s.length for s in b.segments(st.domain.rank))
    return out


def _train_worker(rank: int, world: int, ckpt_dir: str) -> dict:
    out: dict = {}
    for key, run in {**RUNS, "wrong_owners": Run(2)}.items():
        t = (WrongOwners if key == "wrong_owners" else MuonTrainer)(run)
        for _ in range(STEPS):
            t.train_step()
        out[key] = {
            "params": t.params(),
            "ep_rank": t.topo.rank("ep"),
            "owned": _owned(t.opt),
            "state_bytes": t.opt.state_bytes(),
            "padding_bytes": t.opt.padding_bytes(),
            "bound": t.opt.padding_bound_bytes(),
            "metric": t.opt.metrics()["optim/state_bytes"],
            "matrices": [
                (t.opt.reducer.states[i].domain.name, t.opt.buckets[i].slots[0].entry.name, task)
                for i, tasks in t.opt._mine.items()
                for task in tasks
            ],
        }
        t.opt.close()
    out["ckpt"] = _checkpoint_save_and_reload(rank, ckpt_dir, MuonTrainer)
    return out


@pytest.fixture(scope="module")
def results() -> dict:
    refs = {key: _reference(STEPS, *key) for key in _ref_keys()}
    with tempfile.TemporaryDirectory() as d:
        four = run_distributed(_train_worker, 4, d)
        two = run_distributed(_resume_worker, 2, d, MuonTrainer)
    return {"refs": refs, "four": four, "two": two}


@pytest.mark.parametrize("key", list(RUNS))
def test_matches_one_process_muon(results: dict, key: str) -> None:
    ref = results["refs"][_ref_key(RUNS[key])][-1]
    for rank, rank_out in enumerate(results["four"]):
        r = rank_out[key]
        _assert_same_weights(r["params"], ref, r["ep_rank"], RUNS[key].ep_size, what=f"{key} rank {rank}")


def test_every_rank_orthogonalising_every_matrix_is_caught(results: dict) -> None:
    ref = results["refs"][1, "bfloat16"][-1]
    errs = [
        _max_rel_error(o["wrong_owners"]["params"], ref, _topo(o["wrong_owners"]["ep_rank"], 2))
        for o in results["four"]
    ]
    assert max(errs) > 1e-3


@pytest.mark.parametrize("key", list(RUNS))
def test_state_bytes_are_8_per_muon_and_12_per_adamw_element(results: dict, key: str) -> None:
    outs = [o[key] for o in results["four"]]
    model = StandIn()
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


@pytest.mark.parametrize("key", list(RUNS))
def test_each_matrix_has_one_owner_in_its_domain(results: dict, key: str) -> None:
    """Dense matrices over all 4 ranks, each expert block's over its EDP group (the ranks holding it):
    every matrix orthogonalised exactly once; the dense Newton-Schulz FLOPs spread over the ranks."""
    ep = RUNS[key].ep_size
    outs = [o[key] for o in results["four"]]
    dense = [(name, t.start) for o in outs for dom, name, t in o["matrices"] if dom == "dense"]
    assert len(dense) == len(set(dense))
    experts: dict[int, list] = {}
    for o in outs:
        experts.setdefault(o["ep_rank"], []).extend(
            (name, t.start) for dom, name, t in o["matrices"] if dom == "expert"
        )
    for found in experts.values():
        assert len(found) == len(set(found))
        assert len(found) == len(experts[0])
    model = StandIn()
    n_dense = sum(
        p.numel() // (p.shape[-2] * p.shape[-1])
        for n, p in model.named_parameters()
        if is_muon_param(n, p.shape) and not is_expert_param(n)
    )
    assert len(dense) == n_dense
    loads = [sum(t.cost for dom, _, t in o["matrices"] if dom == "dense") for o in outs]
    largest = max(t.cost for o in outs for dom, _, t in o["matrices"] if dom == "dense")
    assert max(loads) - min(loads) <= largest  # the greedy split's bound
    assert ep in (1, 2, 4)


def test_checkpoint_reshards_across_layouts(results: dict) -> None:
    assert_checkpoint_reshards(results["four"], results["two"], results["refs"][1, "bfloat16"])


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
