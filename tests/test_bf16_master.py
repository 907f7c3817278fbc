"""bf16 weights with fp32 master weights: the tiny Mula MoE on 4 gloo CPU ranks (E = 2), sharded AdamW.

Reference: one process runs the same bf16 model on the whole global batch (each rank's micro-batch
in turn, gradients accumulated in fp32 and averaged), torch AdamW on fp32 copies of the weights, and
the bf16 weights set to the rounding of those copies after every step. The distributed run computes
the same bf16 gradients up to the order of bf16 roundings (expert gradients are one matmul over the
tokens of both EP ranks there), so the two follow each other within bf16 rounding, not bit for bit.
Every run takes the suite's AdamW eps and seeds (tests/equality.py: `ADAMW_EPS`, `seeded`); the
tolerances are bf16's own, stated below, not the fp32 equality rule's.

Also checked from the optimizer's own numbers: weights 2 bytes per local element on the device,
gradient buffers in the reduce dtype (full buckets under ZeRO-1, shards only under ZeRO-2), 12 bytes
per owned element of fp32 state (12 P / W per rank); and a checkpoint (bf16 model state, fp32
optimizer masters) saved at (W=4, E=2) restores the bf16 weights exactly at (4, 2), (4, 4) and (2, 1)
from the masters alone, continues bit for bit at (4, 2), and within bf16 rounding at the others.
At LR = 1e-4 most updates are below a bf16 ulp of the weight, so the check also fails without masters
(``test_the_tolerance_catches_missing_master_weights``).
"""

from __future__ import annotations

import tempfile

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from dist_helpers import run_distributed
from equality import ADAMW_EPS, seeded
from torch import nn

from mula.model.moe import is_expert_param
from strategies.optim.sharded_optimizer import EPShardedAdamW
from strategies.topology import build_topology

STEPS, MICRO, SEQ, LR, WORLD, EP, ALIGN = 20, 2, 16, 1e-4, 4, 2, 16
BF16_EPS = 2.0**-8  # relative spacing of bf16 numbers
REL_TOL = 1e-2  # per-tensor relative distance from the reference (measured: <= 3e-3; no masters: 2e-2)


def _config():
    from mula import MulaConfig

    return MulaConfig.from_name(
        "mula-tiny-moe", vocab_size=128, hidden_size=32, num_layers=2, num_heads=2, num_experts=4, top_k=2,
        expert_intermediate_size=32, max_position_embeddings=64,
    )  # fmt: skip


def _model() -> nn.Module:
    from mula import Mula

    torch.manual_seed(seeded(0))
    return Mula(_config()).to(torch.bfloat16)  # what bf16-true's convert_module does


def _batches(steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seeded(11))
    return [
        torch.randint(0, _config().vocab_size, (WORLD * MICRO, SEQ + 1), generator=g) for _ in range(steps)
    ]


def _loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    cfg = _config()
    out = model(batch[:, :-1])
    ce = F.cross_entropy(out.logits.flatten(0, 1).float(), batch[:, 1:].flatten())
    return ce + cfg.router_aux_loss_coef * out.aux_loss + cfg.router_z_loss_coef * out.z_loss


def _groups(named: list[tuple[str, nn.Parameter]]) -> list[dict]:
    return [
        {"params": [p for _, p in named if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0},
    ]


def _reference(steps: int) -> dict[str, torch.Tensor]:
    """bf16 forward/backward, fp32-master AdamW, bf16 weights rounded from the masters each step."""
    model = _model()
    params = list(model.parameters())
    masters = [nn.Parameter(p.detach().float()) for p in params]
    by_id = {id(p): m for p, m in zip(params, masters)}
    groups = _groups(list(model.named_parameters()))
    opt = torch.optim.AdamW(
        [{**g, "params": [by_id[id(p)] for p in g["params"]]} for g in groups], lr=LR, eps=ADAMW_EPS
    )
    for batch in _batches(steps):
        total = [torch.zeros_like(m) for m in masters]
        for micro in batch.split(MICRO):
            grads = torch.autograd.grad(_loss(model, micro), params, allow_unused=True)
            for t, g in zip(total, grads):
                if g is not None:
                    t.add_(g.float(), alpha=1 / WORLD)
        for m, t in zip(masters, total):
            m.grad = t
        opt.step()
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _build(ep: int, **options) -> tuple[nn.Module, EPShardedAdamW, object]:
    from strategies.experts.expert_parallel import apply_expert_parallel

    topo = build_topology(ep)
    model = _model()
    apply_expert_parallel(model, topo)
    named = list(model.named_parameters())
    adamw = torch.optim.AdamW(_groups(named), lr=LR, eps=ADAMW_EPS)
    opt = EPShardedAdamW.from_adamw(adamw, named, topo, bucket_numel=4096, align=ALIGN, **options)
    return model, opt, topo


def _train(model: nn.Module, opt: EPShardedAdamW, rank: int, batches: list[torch.Tensor]) -> None:
    for batch in batches:
        opt.zero_grad()
        _loss(model, batch.split(MICRO)[rank]).backward()
        opt.step()


def _sizes(model: nn.Module, opt: EPShardedAdamW, topo) -> dict:
    local = sum(p.numel() for p in model.parameters())
    expert = sum(p.numel() for n, p in model.named_parameters() if is_expert_param(n))
    return {
        "local": local,
        "global": local - expert + expert * topo.size("ep"),
        "metrics": opt.metrics(),
        "state_bytes": opt.state_bytes(),
        "param_bytes": opt.param_bytes(),
        "grad_buffer_bytes": opt.grad_buffer_bytes(),
        "owned": opt.owned_numel(),
        "bound": opt.padding_bound_bytes(),
        "full_numel": sum(b.numel for b in opt.buckets),
        "shard_numel": opt.shard_grad.numel(),
        "slack": sum(len(b.slots) * ALIGN + b.group_size * ALIGN for b in opt.buckets),
        "param_dtype": next(model.parameters()).dtype,
    }


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _train_worker(rank: int, world: int, ckpt_dir: str) -> dict:
    out: dict = {"ep_rank": build_topology(EP).rank("ep")}
    for key, options in {
        "fp32_reduce": {},
        "bf16_reduce_zero2": {"reduce_dtype": torch.bfloat16, "zero_stage": 2},
    }.items():
        model, opt, topo = _build(EP, **options)
        _train(model, opt, rank, _batches(STEPS))
        out[key] = {"params": _params(model), **_sizes(model, opt, topo)}
        opt.close()
    # Checkpoint after 2 steps: bf16 model state, fp32 masters in the optimizer state.
    model, opt, topo = _build(EP)
    batches = _batches(3)
    _train(model, opt, rank, batches[:2])
    model_sd = {n: p.detach().clone() for n, p in model.state_dict().items()}
    saved = _params(model)
    dcp.save(opt.sharded_state_dict(), checkpoint_id=ckpt_dir)
    master = opt.master.clone()
    _train(model, opt, rank, batches[2:])
    out["ckpt"] = {
        "model_dtypes": {v.dtype for v in model_sd.values() if v.is_floating_point()},
        "master_dtype": master.dtype,
        "master_is_not_bf16": bool((master != master.bfloat16().float()).any()),
        "saved": saved,
        "continued": _params(model),
    }
    opt.close()
    out["resumed"] = [_resume(rank, ckpt_dir, ep) for ep in (EP, 4)]
    return out


def _resume(rank: int, ckpt_dir: str, ep: int) -> dict:
    """Fresh model (zeros) at another layout: load the optimizer checkpoint, take the third step."""
    model, opt, _ = _build(ep)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    sd = opt.sharded_state_dict()
    dcp.load(sd, checkpoint_id=ckpt_dir)
    opt.load_sharded_state_dict(sd)
    loaded = _params(model)
    _train(model, opt, rank, _batches(3)[2:])
    result = {"loaded": loaded, "next": _params(model), "ep_rank": build_topology(ep).rank("ep"), "ep": ep}
    opt.close()
    return result


def _resume_worker(rank: int, world: int, ckpt_dir: str) -> dict:
    return [_resume(rank, ckpt_dir, 1)]


@pytest.fixture(scope="module")
def results() -> dict:
    pytest.importorskip("mula.model.transformer")
    with tempfile.TemporaryDirectory() as d:
        four = run_distributed(_train_worker, WORLD, d)
        two = run_distributed(_resume_worker, 2, d)
    return {"ref": _reference(STEPS), "four": four, "two": two}


def _slice(name: str, full: torch.Tensor, ep_rank: int, ep: int) -> torch.Tensor:
    if not is_expert_param(name):
        return full
    per = full.shape[0] // ep
    return full[ep_rank * per : (ep_rank + 1) * per]


@pytest.mark.parametrize("key", ["fp32_reduce", "bf16_reduce_zero2"])
def test_bf16_weights_follow_fp32_master_reference(results: dict, key: str) -> None:
    ref = results["ref"]
    for o in results["four"]:
        for name, value in o[key]["params"].items():
            assert value.dtype == torch.bfloat16
            expected = _slice(name, ref[name], o["ep_rank"], EP).float()
            # Within bf16 rounding: a few bf16 ulps of the weight, plus a few lr: Adam's normalised update
            # of an element whose gradient is small against its bf16 rounding swings by up to 2 lr a step,
            # and a top-k choice flipped by bf16 rounding (a token sent to another expert; one happens
            # within 3-9 steps at seeds 0-3) moves its experts' weights by about a step. Measured with
            # ADAMW_EPS at seeds 0-3: up to 0.9 lr for dense weights, 2.9 lr for experts.
            diff = (value.float() - expected).abs()
            tol = 4 * BF16_EPS * expected.abs() + 8 * LR
            assert (diff <= tol).all(), f"{key} {name}: max diff {diff.max():.3g}"
            rel = ((value.float() - expected).norm() / expected.norm()).item()
            assert rel <= REL_TOL, f"{key} {name}: relative error {rel:.3g}"


def _no_master_run(steps: int) -> dict[str, torch.Tensor]:
    """Control: torch AdamW straight on the bf16 weights (bf16 state, no fp32 masters)."""
    model = _model()
    opt = torch.optim.AdamW(_groups(list(model.named_parameters())), lr=LR, eps=ADAMW_EPS)
    for batch in _batches(steps):
        opt.zero_grad()
        for micro in batch.split(MICRO):
            (_loss(model, micro) / WORLD).backward()
        opt.step()
    return _params(model)


def test_the_tolerance_catches_missing_master_weights(results: dict) -> None:
    """At this lr most updates are below a bf16 ulp of the weight: without fp32 masters they round
    away, and the run leaves the reference by more than the tolerance the sharded run meets."""
    ref, control = results["ref"], _no_master_run(STEPS)
    worst = max(((control[n].float() - r.float()).norm() / r.float().norm()).item() for n, r in ref.items())
    assert worst > REL_TOL


@pytest.mark.parametrize("key", ["fp32_reduce", "bf16_reduce_zero2"])
def test_device_and_state_bytes(results: dict, key: str) -> None:
    outs = [o[key] for o in results["four"]]
    p_global = outs[0]["global"]
    assert sum(o["owned"] for o in outs) == p_global  # every element's state owned exactly once
    for o in outs:
        m = o["metrics"]
        assert o["param_dtype"] == torch.bfloat16
        # fp32 master + 2 moments: 12 bytes per owned element, 12 P / W per rank up to padding
        assert m["optim/state_bytes"] == o["state_bytes"] == 12 * o["owned"] + m["optim/padding_bytes"]
        assert abs(o["state_bytes"] - 12 * p_global / WORLD) <= o["bound"]
        # weights: 2 bytes per local element (plus alignment padding)
        assert m["optim/param_bytes"] == o["param_bytes"] == 2 * o["full_numel"]
        assert 2 * o["local"] <= o["param_bytes"] <= 2 * (o["local"] + o["slack"])
        assert m["optim/grad_buffer_bytes"] == o["grad_buffer_bytes"]
        if key == "fp32_reduce":  # ZeRO-1: full fp32 buckets + the fp32 shard
            assert o["grad_buffer_bytes"] == 4 * (o["full_numel"] + o["shard_numel"])
        else:  # ZeRO-2 in bf16: only the bf16 shard persists (buckets live while in flight)
            assert o["grad_buffer_bytes"] == 2 * o["shard_numel"]
            assert o["shard_numel"] * WORLD <= 2 * (p_global + o["slack"] * WORLD)


def test_checkpoint_holds_bf16_weights_and_fp32_masters_and_reshards(results: dict) -> None:
    for o in results["four"]:
        ck = o["ckpt"]
        assert ck["model_dtypes"] == {torch.bfloat16}
        assert ck["master_dtype"] == torch.float32 and ck["master_is_not_bf16"]

    def whole(key: str) -> dict[str, torch.Tensor]:  # the (4, 2) run's parameters, experts reassembled
        by_rank = {o["ep_rank"]: o["ckpt"][key] for o in results["four"]}
        return {
            n: torch.cat([by_rank[r][n] for r in range(EP)]) if is_expert_param(n) else by_rank[0][n]
            for n in by_rank[0]
        }

    saved, continued = whole("saved"), whole("continued")
    same = [o["resumed"][0] for o in results["four"]]  # (4, 2): the saving layout
    other = [o["resumed"][1] for o in results["four"]] + [r[0] for r in results["two"]]  # (4, 4), (2, 1)
    for exact, res in [(True, r) for r in same] + [(False, r) for r in other]:
        for name, value in res["loaded"].items():  # the fp32 masters alone restore the bf16 weights
            expected = _slice(name, saved[name], res["ep_rank"], res["ep"])
            torch.testing.assert_close(value, expected, rtol=0, atol=0)
        for name, value in res["next"].items():
            expected = _slice(name, continued[name], res["ep_rank"], res["ep"])
            if exact:  # resuming where it was saved continues bit for bit
                torch.testing.assert_close(value, expected, rtol=0, atol=0)
            else:  # another layout reorders the gradients' bf16 roundings: within bf16 rounding
                diff = (value.float() - expected.float()).abs()
                assert (diff <= 4 * BF16_EPS * expected.float().abs() + 2 * LR).all(), name


@pytest.mark.parametrize(
    ("name", "dtype"), [("fp32", torch.float32), ("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16)]
)
def test_recipe_reduce_dtype_names(name: str, dtype: torch.dtype) -> None:
    from strategies import XPUMoEStrategy

    assert XPUMoEStrategy(optimizer_options={"reduce_dtype": name}).optimizer_options["reduce_dtype"] == dtype
