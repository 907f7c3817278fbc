"""`model.optimizer: muon` (mula/training/muon.py): Moonlight's rule on one process equals torch's own
optimizers (`torch.optim.Muon` on every block matrix, each expert's gate, up and down its own matrix, plus
`torch.optim.AdamW` for the rest, same grouping and lr schedule): losses and every weight within 1e-6 over
10 fp32 steps of a tiny MoE. Also: the grouping rule against explicit lists (tiny MoE, tiny DeepSeek-V3 with
MLA), a wrong reference (no Nesterov, Keller Jordan's scale) is told apart, an expert stack's update is its
matrices' (not one Newton-Schulz of the stack or of a fused gate_up), the momentum buffer is torch's and
(1 - momentum) times Moonlight's, the refusals, the state bytes and `mula plan`'s count of them.

Why the runs agree by construction, on any host: both models start from one copy and see the same batches,
so their gradients are the same bits as long as their weights are; Muon's matrix update is the same
sequence of torch operations on the same matrix (torch's bf16 Newton-Schulz included) and AdamW's is
torch's functional AdamW, the kernel torch.optim.AdamW calls.
"""

from __future__ import annotations

import copy

import pytest
import torch

from callbacks.moe_metrics import _state_bytes
from mula.layout.rules import check_optimizer
from mula.model.config import MulaConfig
from mula.model.param_names import is_muon_param, muon_matrix_shape
from mula.plan import Layout, plan_memory
from mula.plan.layout import check_runnable
from mula.training.module import MulaLightningModule, warmup_cosine
from mula.training.muon import (
    MulaMuon,
    adjusted_lr,
    is_muon_group,
    muon_matrix_update,
    muon_update,
    newton_schulz,
)

TINY = {"num_layers": 2, "hidden_size": 32, "num_heads": 2, "vocab_size": 64, "num_experts": 4, "top_k": 2,
        "expert_intermediate_size": 32, "max_position_embeddings": 64}  # fmt: skip
SCHEDULE = {"lr": 2e-2, "min_lr": 2e-3, "warmup_steps": 3, "decay_steps": 10}
ADAMW = {"betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
STEPS, B, T = 10, 4, 16


def _module(**kwargs) -> MulaLightningModule:
    torch.manual_seed(0)
    module = MulaLightningModule(
        "mula-tiny-moe", overrides=TINY, **SCHEDULE, **ADAMW, optimizer="muon", **kwargs
    )
    module.configure_model()
    module.trainer = None  # decay_steps is explicit: no Trainer needed
    return module


def _batch(step: int) -> torch.Tensor:
    # two batches in turn: the loss falls within the few steps
    return torch.randint(0, TINY["vocab_size"], (B, T + 1), generator=torch.Generator().manual_seed(step % 2))


class TorchReference:
    """The reference: torch.optim.Muon on every Muon matrix as its own 2-D tensor (an expert stack's slices,
    gate_up's gate and up rows apart), torch.optim.AdamW on the rest, copied back into the model's weights
    after each step."""

    def __init__(self, model: torch.nn.Module, nesterov: bool = True, adjust_lr_fn: str = "match_rms_adamw"):
        self.model = model
        self.matrices: list[tuple[torch.Tensor, list[torch.nn.Parameter]]] = []
        muon_groups: list[list[torch.nn.Parameter]] = [[], []]
        adamw_groups: list[list[torch.nn.Parameter]] = [[], []]
        for name, p in model.named_parameters():
            no_decay = name == "embed.weight"
            if not is_muon_param(name, p.shape):
                adamw_groups[no_decay].append(p)
                continue
            rows, cols = muon_matrix_shape(name, p.shape)
            mats = [torch.nn.Parameter(m.detach().clone()) for m in p.detach().view(-1, rows, cols)]
            self.matrices.append((p, mats))
            muon_groups[no_decay] += mats
        lr, wd = SCHEDULE["lr"], ADAMW["weight_decay"]
        self.muon = torch.optim.Muon(
            [{"params": muon_groups[0]}, {"params": muon_groups[1], "weight_decay": 0.0}],
            lr=lr, weight_decay=wd, momentum=0.95, nesterov=nesterov, ns_steps=5, adjust_lr_fn=adjust_lr_fn,
        )  # fmt: skip
        self.adamw = torch.optim.AdamW(
            [{"params": adamw_groups[0]}, {"params": adamw_groups[1], "weight_decay": 0.0}],
            lr=lr, betas=ADAMW["betas"], eps=ADAMW["eps"], weight_decay=wd,
        )  # fmt: skip

    def step(self, lr: float) -> None:
        for p, mats in self.matrices:
            for m, g in zip(mats, p.grad.view(-1, *mats[0].shape)):
                m.grad = g.clone()
        for opt in (self.muon, self.adamw):
            for group in opt.param_groups:
                group["lr"] = lr
            opt.step()
        with torch.no_grad():
            for p, mats in self.matrices:
                p.view(-1, *mats[0].shape).copy_(torch.stack(list(mats)))

    def zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)


def _train(module: MulaLightningModule) -> tuple[list[float], list[float]]:
    """STEPS steps of the module's own optimizer and LR scheduler: (losses, the lr of each step)."""
    conf = module.configure_optimizers()
    opt, sched = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
    losses, lrs = [], []
    for step in range(STEPS):
        lrs.append(opt.param_groups[0]["lr"])
        assert lrs[-1] == pytest.approx(warmup_cosine(step, **SCHEDULE))
        assert all(g["lr"] == lrs[-1] for g in opt.param_groups)  # one lr for both kinds
        opt.zero_grad()
        loss = module._losses(_batch(step))[0]
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses, lrs


def _train_reference(reference: TorchReference, lrs: list[float]) -> list[float]:
    """The reference's steps at the module run's learning rates, its loss computed by the module's code."""
    losses_of = _module()
    losses_of.model = reference.model
    losses = []
    for lr in lrs:
        reference.zero_grad()
        loss = losses_of._losses(_batch(len(losses)))[0]
        loss.backward()
        reference.step(lr)
        losses.append(loss.item())
    return losses


def _max_weight_difference(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters(), strict=True))


@pytest.fixture(scope="module")
def trained() -> dict:
    module = _module()
    reference = TorchReference(copy.deepcopy(module.model))
    start = copy.deepcopy(module.model)
    losses, lrs = _train(module)
    ref_losses = _train_reference(reference, lrs)
    return {
        "module": module,
        "reference": reference,
        "start": start,
        "losses": losses,
        "ref_losses": ref_losses,
        "lrs": lrs,
    }


def test_ten_steps_equal_torch_muon_plus_adamw(trained: dict) -> None:
    losses, ref_losses = trained["losses"], trained["ref_losses"]
    assert max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)) <= 1e-6, (losses, ref_losses)
    assert _max_weight_difference(trained["module"].model, trained["reference"].model) <= 1e-6
    # the run really trained: every weight group moved far beyond the agreement asked for
    assert _max_weight_difference(trained["module"].model, trained["start"]) > 1e-3
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("wrong", [{"nesterov": False}, {"adjust_lr_fn": "original"}])
def test_a_wrong_reference_is_told_apart(trained: dict, wrong: dict) -> None:
    """The comparison sees the rule's parts: plain momentum or Keller Jordan's scale moves the weights by far
    more than the 1e-6 the equal runs agree to."""
    reference = TorchReference(copy.deepcopy(trained["start"]), **wrong)
    _train_reference(reference, trained["lrs"])
    assert _max_weight_difference(trained["module"].model, reference.model) > 1e-4


GROUP = {"lr": 2e-2, "weight_decay": 0.1, "momentum": 0.95, "ns_steps": 5, "adjust_lr": "match_rms_adamw"}


def test_an_expert_stack_is_its_matrices() -> None:
    """`muon_update` of a stack [3, 16, 24] whose matrices are [8, 24] (a fused gate_up of 3 experts: each
    one's gate, then its up) is the 6 matrices' updates, each computed alone by `muon_matrix_update`, bit
    for bit, momentum included, and each of them orthogonal; one Newton-Schulz of the flattened stack
    [48, 24], or of each expert's fused [16, 24], at the same scale, is another update."""
    gen = torch.Generator().manual_seed(0)
    weight, grad, buffer = (torch.randn(3, 16, 24, generator=gen) for _ in range(3))
    stack, stack_buffer = weight.clone(), buffer.clone()
    muon_update(stack, grad, stack_buffer, GROUP, (8, 24))
    alone = []
    for w, g, b in zip(*(t.view(6, 8, 24) for t in (weight, grad, buffer))):
        w, b = w.clone(), b.clone()
        muon_matrix_update(w, g.clone(), b, **GROUP)
        alone.append((w, b))
    assert torch.equal(stack, torch.stack([w for w, _ in alone]).view(3, 16, 24))
    assert torch.equal(stack_buffer, torch.stack([b for _, b in alone]).view(3, 16, 24))
    lr, scale = GROUP["lr"], adjusted_lr(GROUP["lr"], GROUP["adjust_lr"], 8, 24)
    decayed = weight * (1 - lr * GROUP["weight_decay"])
    for matrix in (stack - decayed).view(6, 8, 24) / -scale:  # the orthogonalised update, to rounding
        s = torch.linalg.svdvals(matrix)
        assert 0.5 < s.min() and s.max() < 1.3
    nesterov = grad.lerp(buffer.lerp(grad, 1 - GROUP["momentum"]), GROUP["momentum"])
    for rows in (48, 16):  # the whole stack as one matrix; gate and up of each expert as one
        orthogonal = torch.cat([newton_schulz(m, 5) for m in nesterov.view(-1, rows, 24)]).view(3, 16, 24)
        wrong = weight.clone().mul_(1 - lr * GROUP["weight_decay"]).add_(orthogonal, alpha=-scale)
        assert (wrong - stack).abs().max() > 1e-3


def _moonlight_step(weight: torch.Tensor, grad: torch.Tensor, momentum: torch.Tensor) -> None:
    """One step of Moonlight's published Muon (arXiv 2502.16982's code) on one matrix, in place: its
    momentum M <- mu M + G, the Nesterov input G + mu M; Newton-Schulz in fp32 and the rest as Mula's."""
    momentum.mul_(GROUP["momentum"]).add_(grad)
    orthogonal = newton_schulz(grad.add(momentum, alpha=GROUP["momentum"]), 5, torch.float32)
    weight.mul_(1 - GROUP["lr"] * GROUP["weight_decay"])
    weight.add_(orthogonal, alpha=-adjusted_lr(GROUP["lr"], GROUP["adjust_lr"], *weight.shape))


def test_the_momentum_is_torch_muons_and_1_minus_mu_times_moonlights() -> None:
    """`MulaMuon`'s "momentum_buffer" is torch.optim.Muon's bit for bit (B <- mu B + (1 - mu) G) and
    (1 - mu) times Moonlight's (M <- mu M + G), whose Nesterov input is larger by the same 1 / (1 - mu),
    which Newton-Schulz's normalisation divides out: in fp32, 3 steps of each from one matrix agree to
    rounding. Moonlight's buffer given to Mula's update times (1 - mu) takes Moonlight's next step; as
    it is, another (docs/muon.md)."""
    mu = GROUP["momentum"]
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(16, 24, generator=gen)
    grads = [torch.randn(16, 24, generator=gen) for _ in range(4)]
    mula_weight, torch_weight = (torch.nn.Parameter(start.clone()) for _ in range(2))
    options = {"lr": GROUP["lr"], "weight_decay": GROUP["weight_decay"], "momentum": mu}
    mula = MulaMuon([{"params": [mula_weight], "muon": True}], **options, ns_dtype="float32")
    reference = torch.optim.Muon([torch_weight], **options, adjust_lr_fn=GROUP["adjust_lr"])
    moonlight_weight, moonlight_momentum = start.clone(), torch.zeros_like(start)
    for grad in grads[:3]:
        for weight, opt in ((mula_weight, mula), (torch_weight, reference)):
            weight.grad = grad.clone()
            opt.step()
        _moonlight_step(moonlight_weight, grad, moonlight_momentum)
    buffer = mula.state[mula_weight]["momentum_buffer"]
    assert torch.equal(buffer, reference.state[torch_weight]["momentum_buffer"])
    torch.testing.assert_close(buffer, (1 - mu) * moonlight_momentum, rtol=1e-6, atol=1e-7)
    assert (buffer - moonlight_momentum).abs().max() > 0.1  # the factor is not rounding
    torch.testing.assert_close(mula_weight.detach(), moonlight_weight, rtol=0, atol=1e-6)
    before = moonlight_weight.clone(), moonlight_momentum.clone()
    _moonlight_step(moonlight_weight, grads[3], moonlight_momentum)
    for imported, converted in (((1 - mu) * before[1], True), (before[1].clone(), False)):
        weight = before[0].clone()
        muon_matrix_update(weight, grads[3], imported, **GROUP, ns_dtype="float32")
        off = (weight - moonlight_weight).abs().max().item()
        assert off < 1e-6 if converted else off > 1e-4, (converted, off)


def _grouping(name: str, **overrides) -> dict[str, list[str]]:
    torch.manual_seed(0)
    module = MulaLightningModule(name, overrides={"num_layers": 2, **overrides}, optimizer="muon")
    module.configure_model()
    names = {id(p): n for n, p in module.model.named_parameters()}
    out: dict[str, list[str]] = {"muon": [], "adamw": []}
    for group in module.param_groups():
        kind = "muon" if is_muon_group(group) else "adamw"
        out[kind] += [names[id(p)] for p in group["params"]]
    return out


def test_grouping_of_the_tiny_moe() -> None:
    groups = _grouping("mula-tiny-moe")
    block = ["attn.q_proj.weight", "attn.k_proj.weight", "attn.v_proj.weight", "attn.o_proj.weight",
             "mlp.router.weight", "mlp.experts.gate_up", "mlp.experts.down"]  # fmt: skip
    assert groups["muon"] == [f"layers.{i}.{n}" for i in range(2) for n in block]
    norms = ["attn_norm.weight", "attn.q_norm.weight", "attn.k_norm.weight", "mlp_norm.weight"]
    assert groups["adamw"] == [f"layers.{i}.{n}" for i in range(2) for n in norms] + [
        "norm.weight", "lm_head.weight", "embed.weight"  # the last: the no_decay group
    ]  # fmt: skip


def test_grouping_of_a_tiny_deepseek_v3_with_mla() -> None:
    groups = _grouping("deepseek-v3-tiny")
    attn = ["attn.q_a_proj.weight", "attn.q_b_proj.weight", "attn.kv_a_proj_with_mqa.weight",
            "attn.kv_b_proj.weight", "attn.o_proj.weight"]  # fmt: skip
    dense = ["mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]
    moe = ["mlp.router.weight", "mlp.experts.gate_up", "mlp.experts.down", "mlp.shared_experts.gate_proj.weight",
           "mlp.shared_experts.up_proj.weight", "mlp.shared_experts.down_proj.weight"]  # fmt: skip
    assert sorted(groups["muon"]) == sorted(
        [f"layers.0.{n}" for n in attn + dense] + [f"layers.1.{n}" for n in attn + moe]
    )
    assert all(n.endswith("norm.weight") or n in ("lm_head.weight", "embed.weight") for n in groups["adamw"])
    # gate_up [E, 2I, H] holds a gate and an up matrix [I, H] per expert; the other stacks one per expert
    assert muon_matrix_shape("layers.1.mlp.experts.gate_up", (16, 128, 128)) == (64, 128)
    assert muon_matrix_shape("layers.1.mlp.experts.down", (16, 128, 64)) == (128, 64)
    assert muon_matrix_shape("layers.1.mlp.shared_experts.gate_proj.weight", (128, 128)) == (128, 128)


def test_state_is_one_fp32_momentum_per_matrix_element_and_the_plan_counts_it(trained: dict) -> None:
    module = trained["module"]
    opt = module.configure_optimizers()["optimizer"]  # a fresh one over the trained weights: one step

    module._losses(_batch(0))[0].backward()
    opt.step()
    muon_numel = adamw_numel = 0
    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state[p]
            if is_muon_group(group):
                assert list(state) == ["momentum_buffer"] and state["momentum_buffer"].dtype == torch.float32
                muon_numel += p.numel()
            else:
                assert set(state) == {"step", "exp_avg", "exp_avg_sq"}
                adamw_numel += p.numel()
    state = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if v.dim() > 0)
    assert state == 4 * muon_numel + 8 * adamw_numel
    assert muon_numel > 0 and adamw_numel > 0
    plan = plan_memory(module.config, Layout(micro_batch=B, seq_len=T, optimizer="muon"))
    assert plan.optimizer == state
    assert plan.params + plan.optimizer == _state_bytes(opt)  # the `optim/state_bytes` metric
    adamw_plan = plan_memory(module.config, Layout(micro_batch=B, seq_len=T))
    assert adamw_plan.optimizer - plan.optimizer == 4 * muon_numel


def test_refusals_are_one_sentence() -> None:
    with pytest.raises(ValueError, match=r"^optimizer must be one of adamw, muon, got 'sgd'\.$"):
        MulaLightningModule("mula-tiny-moe", optimizer="sgd")
    with pytest.raises(
        ValueError, match=r"^muon_adjust_lr must be one of match_rms_adamw, original, got 'x'\.$"
    ):
        MulaLightningModule("mula-tiny-moe", optimizer="muon", muon_adjust_lr="x")
    with pytest.raises(
        ValueError, match=r"^model\.optimizer=muon is not available with tensor_parallel_size=2 "
    ):
        check_optimizer("muon", 2, False)
    with pytest.raises(ValueError, match=r"^model\.optimizer=muon does not offload its state to the host "):
        check_optimizer("muon", 1, True)
    check_optimizer("adamw", 2, True)  # AdamW runs everywhere
    check_optimizer("muon", 1, False)  # sharded or not
    with pytest.raises(ValueError, match="does not offload its state"):  # `mula plan` refuses it too
        check_runnable(
            MulaConfig.from_name("mula-tiny-moe"),
            Layout(optimizer="muon", shard_optimizer=True, offload=True),
            8,
        )
    with pytest.raises(ValueError, match="Muon trains only the blocks' matrices"):
        MulaMuon([{"params": [torch.nn.Parameter(torch.zeros(3))], "muon": True}])
    with pytest.raises(
        ValueError, match=r"^muon_ns_dtype must be one of bfloat16, float32, got 'float16'\.$"
    ):
        MulaLightningModule("mula-tiny-moe", optimizer="muon", muon_ns_dtype="float16")
    with pytest.raises(ValueError, match=r"^muon_ns_dtype must be one of bfloat16, float32, got 'fp32'\.$"):
        Layout(optimizer="muon", muon_ns_dtype="fp32")  # `mula plan` reads model.muon_ns_dtype


@pytest.mark.parametrize("name", ["mula-tiny-moe", "deepseek-v3-tiny"])
def test_the_planner_reads_the_optimizer_and_lists_the_modules_groups(name: str) -> None:
    """`mula plan` takes `model.optimizer` from a recipe, and its torch-free parameter list (names, shapes,
    groups, Muon or not, in order) is what the module hands the optimizer."""
    from mula.plan.parameters import model_parameters
    from mula.plan.settings import plan_inputs

    inputs = plan_inputs({"accelerator": "cpu"}, {"config": name, "optimizer": "muon"}, {"seq_len": 64})
    assert inputs.layout.optimizer == "muon"
    with torch.device("meta"):
        module = MulaLightningModule(name, optimizer="muon")
        module.configure_model()
    names = {id(p): n for n, p in module.named_parameters()}
    real = [
        (names[id(p)], tuple(p.shape), gi, is_muon_group(g))
        for gi, g in enumerate(module.param_groups())
        for p in g["params"]
    ]
    planned = [
        (p.name, p.shape, p.group, p.muon) for p in model_parameters(inputs.config, ("embed.weight",), "muon")
    ]
    assert planned == real


def test_moonlight_recipe_trains_muon_and_its_header_states_the_plan(capsys, monkeypatch) -> None:
    """recipes/moonlight-16b-a3b-muon.yaml instantiates with Moonlight's optimizer settings, and `mula plan`
    gives the memory and step time its header states (the dry run at that layout: tests/test_dry_run.py)."""
    import json
    import re
    from pathlib import Path

    from test_recipes import probe

    from mula.commands.entry import main as mula_command
    from mula.plan.recipe_reader import header_command

    root = Path(__file__).resolve().parents[1]
    recipe = root / "recipes" / "moonlight-16b-a3b-muon.yaml"
    monkeypatch.setattr("sys.argv", ["mula"])
    monkeypatch.chdir(root)
    text = recipe.read_text()
    mula_command(["plan", *header_command(text, "mula plan"), "--format=json"])
    plan = json.loads(capsys.readouterr().out)
    said = re.search(
        r"Planned on 1 H100 node \(8 GPUs\): ([\d.]+) GB per rank .*?, ([\d.]+) s per step", text, re.S
    )
    assert said and plan["fits"]
    assert float(said.group(1)) == round(plan["per_rank_bytes"]["total"] / 1e9, 1)
    assert float(said.group(2)) == round(plan["step_time_s"], 2)
    cli = probe(recipe, extra=("--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.num_nodes=1"))
    module = cli.model
    assert module.optimizer == "muon" and module.config.name == "deepseek-v3-16b"
    assert module.muon_options == {
        "momentum": 0.95, "ns_steps": 5, "adjust_lr": "match_rms_adamw", "ns_dtype": "bfloat16",
    }  # fmt: skip
    assert (module.lr, module.weight_decay) == (4e-4, 0.1)  # AdamW's, carried over by the RMS match


def test_moonlight_recipe_header_command_reads_alike(monkeypatch) -> None:
    """`mula plan`'s light reader reads the recipe (`model.optimizer` included) as `mula fit`'s parser does."""
    from pathlib import Path

    from test_plan_reader import assert_read_alike

    from mula.plan.recipe_reader import header_command

    root = Path(__file__).resolve().parents[1]
    monkeypatch.setattr("sys.argv", ["mula"])
    monkeypatch.chdir(root)
    argv = header_command((root / "recipes" / "moonlight-16b-a3b-muon.yaml").read_text(), "mula plan")
    assert_read_alike(argv, monkeypatch)
    assert_read_alike([*argv, "--model.optimizer=adamw"], monkeypatch)


def test_the_planner_prices_newton_schulz_as_torch_counts_it() -> None:
    """`newton_schulz_flops`: replicated, every Muon matrix a rank holds, as torch's FLOP counter counts
    `newton_schulz` on it; sharded at W=4, the busiest owner's share, between a quarter of that and a
    quarter plus the largest matrix's per domain, dense and expert (the greedy split's bound); nothing
    for AdamW."""
    from torch.utils.flop_counter import FlopCounterMode

    from mula.plan.step_overheads import newton_schulz_flops

    config = MulaConfig.from_name("mula-tiny-moe")
    with torch.device("meta"):
        module = MulaLightningModule("mula-tiny-moe", optimizer="muon")
        module.configure_model()
    per_matrix = []
    for group in module.param_groups():
        for p, (rows, cols) in zip(group["params"], group.get("matrix_shapes", [])):
            with FlopCounterMode(display=False) as counter:
                newton_schulz(torch.zeros(rows, cols), 5)
            per_matrix += [counter.get_total_flops()] * (p.numel() // (rows * cols))
    replicated = newton_schulz_flops(config, Layout(world_size=4, optimizer="muon"))
    assert replicated == sum(per_matrix) > 0
    sharded = newton_schulz_flops(config, Layout(world_size=4, optimizer="muon", shard_optimizer=True))
    assert replicated / 4 <= sharded <= replicated / 4 + 2 * max(per_matrix)
    assert newton_schulz_flops(config, Layout(world_size=4)) == 0


def _newton_schulz_float64(update: torch.Tensor, steps: int) -> torch.Tensor:
    """Keller Jordan's quintic iteration written out in float64 (the fp32 option's reference)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = update.double()
    tall = x.size(0) > x.size(1)
    x = x.T if tall else x
    x = x / x.norm()
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


@pytest.mark.parametrize("shape", [(16, 48), (48, 16), (32, 32)])
def test_fp32_newton_schulz_is_the_iteration_in_fp32(shape: tuple[int, int]) -> None:
    """`muon_ns_dtype: float32`: the same iteration without bf16's rounding. A Gaussian matrix is well
    conditioned (its smallest singular value is far from 0), so fp32's rounding stays near 1e-6 through
    the 5 steps, where bf16's is ~1e-2 of an element: the two dtypes are told apart by orders of magnitude."""
    update = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    exact = _newton_schulz_float64(update, 5)
    fp32, bf16 = newton_schulz(update, 5, torch.float32), newton_schulz(update, 5)
    assert fp32.dtype == torch.float32 and bf16.dtype == torch.bfloat16
    assert (fp32.double() - exact).abs().max() < 1e-4 < (bf16.double() - exact).abs().max()


def test_muon_ns_dtype_reaches_the_optimizer_and_the_planner() -> None:
    """The module's `muon_ns_dtype` is the optimizer's (its step runs Newton-Schulz in it: the float32 and
    bfloat16 modules' first steps differ), and the planner prices it: sharded Muon's all-to-alls of the
    update and of the result carry 4 bytes per element instead of 2."""
    from mula.layout.muon_exchange import exchange_volume
    from mula.plan.grad_reduction import optimizer_volumes, sharded_buckets
    from mula.plan.memory import stage_params
    from mula.plan.parameters import model_parameters

    weights = {}
    for dtype in ("float32", "bfloat16"):
        module = _module(muon_ns_dtype=dtype)
        opt = module.configure_optimizers()["optimizer"]
        assert opt.ns_dtype == dtype
        module._losses(_batch(0))[0].backward()
        opt.step()
        weights[dtype] = module.model.layers[0].attn.o_proj.weight.detach().clone()
    assert not torch.equal(weights["float32"], weights["bfloat16"])

    config = MulaConfig.from_name("mula-tiny-moe")
    layouts = {
        dtype: Layout(world_size=4, ep_size=2, optimizer="muon", shard_optimizer=True, muon_ns_dtype=dtype)
        for dtype in ("bfloat16", "float32")
    }
    params = stage_params(
        model_parameters(config, ("embed.weight",), "muon"), range(config.num_layers), True, True
    )
    gathers = {dtype: optimizer_volumes(params, layout)[1] for dtype, layout in layouts.items()}
    # the elements sharded Muon's all-to-alls send to the matrices' owners and back, 2 more bytes each
    extra = exchange_volume(sharded_buckets(params, layouts["float32"]), 2).sent
    assert extra > 0 and gathers["float32"] - gathers["bfloat16"] == pytest.approx(extra)
