"""`mula upcycle`: the upcycled MoE computes the dense model's function at step 0 (plain and granular), in
Mula and, exported, in transformers; the pairs that cannot are refused in one sentence."""

import dataclasses

import pytest
import torch

from mula import Mula, MulaConfig
from mula.checkpoint import load_weights, save_weights
from mula.commands.entry import main
from mula.model import upcycle as upcycle_module
from mula.model.upcycle import granularity, upcycle_refusal, upcycle_state_dict

# rmsnorm + whole-projection QK-norm: the upcycled MoE is an OLMoE transformers loads
DENSE = MulaConfig(
    name="tiny-dense", vocab_size=128, hidden_size=32, num_layers=2, num_heads=4, max_position_embeddings=64,
    num_experts=0, intermediate_size=64,
)  # fmt: skip
MOE = dataclasses.replace(
    DENSE, name="tiny-moe", num_experts=8, top_k=4, expert_intermediate_size=16, norm_topk_prob=True
)
# name -> (MoE fields, router_init); granularity = 64 / expert_intermediate_size
PAIRS = {
    "plain": ({"expert_intermediate_size": 64, "num_experts": 4, "top_k": 2}, "random"),
    "granular-4-one-copy-per-token": ({}, "random"),
    "granular-2-two-copies-per-token": ({"expert_intermediate_size": 32}, "random"),
    "plain-zeros-no-norm": ({"expert_intermediate_size": 64, "norm_topk_prob": False}, "zeros"),
    "granular-sigmoid-groups-scaled": (
        {"router_scoring": "sigmoid", "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5},
        "random",
    ),
    "granular-dense-first-block": ({"num_dense_layers": 1, "intermediate_size": 64}, "random"),
}


def dense_model(seed: int = 0) -> Mula:
    """The dense model, every weight random and large enough for a wrong MLP to show in the logits."""
    torch.manual_seed(seed)
    model = Mula(DENSE).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    return model


def tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(seed))


def upcycled(dense: Mula, moe: MulaConfig, router_init: str = "random") -> Mula:
    state = upcycle_state_dict(DENSE, dense.state_dict(), moe, router_init, seed=1)
    model = Mula(moe).eval()
    model.load_state_dict(state, strict=True)
    return model


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.fixture(scope="module")
def dense() -> Mula:
    return dense_model()


@pytest.fixture(scope="module")
def reference(dense: Mula) -> torch.Tensor:
    with torch.no_grad():
        logits = dense(tokens()).logits
    assert logits.abs().max() > 1  # large enough for a mismatch to show
    return logits


@pytest.mark.parametrize("name", list(PAIRS))
@torch.no_grad()
def test_the_upcycled_moe_computes_the_dense_function(name, dense, reference) -> None:
    fields, router_init = PAIRS[name]
    moe = dataclasses.replace(MOE, **fields)
    assert upcycle_refusal(DENSE, moe, router_init) is None
    out = upcycled(dense, moe, router_init)(tokens())
    assert max_diff(out.logits, reference) < 1e-5
    if router_init == "random":  # the tokens really spread over several copies of the dense MLP
        copies = out.tokens_per_expert.view(out.tokens_per_expert.shape[0], -1, granularity(DENSE, moe))
        assert (copies.sum(-1) > 0).sum(-1).min() >= 2


@pytest.mark.parametrize(
    "plant",
    ["no folded scale", "independent router rows", "slices by interleaved features"],
)
@torch.no_grad()
def test_a_planted_upcycling_bug_changes_the_function(plant, dense, reference, monkeypatch) -> None:
    moe = dataclasses.replace(MOE, expert_intermediate_size=32)  # granularity 2, two copies per token
    if plant == "no folded scale":
        monkeypatch.setattr(upcycle_module, "down_scale", lambda *a: 1.0)
    elif plant == "independent router rows":
        rows = upcycle_module._router_rows
        monkeypatch.setattr(upcycle_module, "_router_rows", lambda m, c, g, *a: rows(m, c * g, 1, *a))
    else:
        state = upcycle_state_dict(DENSE, dense.state_dict(), moe, seed=1)
        gate_up = state["layers.0.mlp.experts.gate_up"]  # swap one slice's gate rows with the other's
        state["layers.0.mlp.experts.gate_up"] = torch.cat((gate_up[:, :16].roll(1, 0), gate_up[:, 16:]), 1)
        model = Mula(moe).eval()
        model.load_state_dict(state)
        assert max_diff(model(tokens()).logits, reference) > 1e-2
        return
    assert max_diff(upcycled(dense, moe)(tokens()).logits, reference) > 1e-2


@pytest.mark.parametrize("name", ["plain", "granular-2-two-copies-per-token"])
@torch.no_grad()
def test_the_export_loads_in_transformers_with_the_dense_logits(name, dense, reference, tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    from mula.hf import export_hf

    save_weights(dense, tmp_path / "dense.pt")
    main(["upcycle", "--weights", str(tmp_path / "dense.pt"), "--model", _yaml(name),
          "--output", str(tmp_path / "moe.pt")])  # fmt: skip
    export_hf(tmp_path / "moe.pt", tmp_path / "hf")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(loaded).__name__ == "OlmoeForCausalLM"
    assert max_diff(loaded(tokens()).logits, reference) < 1e-5  # the bound, as for Mula
    assert max_diff(load_weights(tmp_path / "moe.pt")(tokens()).logits, reference) < 1e-5


def _yaml(name: str) -> str:
    """The MoE config of PAIRS[name] as the flow mapping `--model` takes."""
    fields = {**dataclasses.asdict(MOE), **PAIRS[name][0]}
    return "{" + ", ".join(f"{k}: {'null' if v is None else v}" for k, v in fields.items()) + "}"


def test_mula_fit_starts_from_the_upcycled_weights(dense, tmp_path) -> None:
    from mula.training.module import MulaLightningModule

    save_weights(dense, tmp_path / "dense.pt")
    main(["upcycle", "--weights", str(tmp_path / "dense.pt"), "--model", _yaml("plain"),
          "--output", str(tmp_path / "moe.pt"), "--router_init", "zeros"])  # fmt: skip
    module = MulaLightningModule(
        config=dataclasses.replace(MOE, **PAIRS["plain"][0]), init_weights=str(tmp_path / "moe.pt")
    )
    module.configure_model()
    router = module.model.layers[0].mlp.router.weight
    assert torch.count_nonzero(router) == 0
    with torch.no_grad():
        assert max_diff(module.model.eval()(tokens()).logits, dense(tokens()).logits) < 1e-5


def test_the_mula_family_pair_dry_runs_on_the_meta_device(capsys) -> None:
    overrides = "{norm: layernorm, qk_norm: false, norm_topk_prob: true}"
    main(["upcycle", "--weights", "mula-1b", "--model", "mula-7b-a1b", "--overrides", overrides,
          "--output", "never-written.pt", "--dry_run", "true"])  # fmt: skip
    out = capsys.readouterr().out
    assert "8 copies of the dense MLP in 8 slices each" in out and "wrote nothing" in out


REFUSALS = {
    "different attention": ({"qk_norm": False}, "differ outside the MLP (qk_norm: True vs False)"),
    "different vocabulary": ({"vocab_size": 256}, "vocab_size: 128 vs 256"),
    "experts not a slice": (
        {"expert_intermediate_size": 24},
        "does not divide the dense intermediate_size 64",
    ),
    "top_k not a multiple of G": ({"top_k": 2}, "must be multiples of 4"),
    "softmax without norm": ({"norm_topk_prob": False}, "set norm_topk_prob true"),
    "zero router granular": ({}, "use router_init random"),
    "groups split copies": ({"n_group": 4, "topk_group": 2}, "would split the copies of 4 experts"),
    "shared experts": ({"num_shared_experts": 1}, "Shared experts"),
    "dense first block narrower": ({"num_dense_layers": 1, "intermediate_size": 32}, "must be 64"),
    "uniform routing": ({"routing_mode": "uniform"}, "routing_mode 'learned'"),
}


@pytest.mark.parametrize("name", list(REFUSALS))
def test_a_pair_that_cannot_preserve_the_function_is_refused(name, dense, tmp_path, capsys) -> None:
    fields, sentence = REFUSALS[name]
    router_init = "zeros" if name == "zero router granular" else "random"
    moe = dataclasses.replace(MOE, **fields)
    refusal = upcycle_refusal(DENSE, moe, router_init)
    assert refusal is not None and sentence in refusal, refusal
    assert refusal.count(". ") == 0  # one sentence
    if name == "different attention":  # and on the command line: one line, exit status 2, nothing written
        save_weights(dense, tmp_path / "dense.pt")
        with pytest.raises(SystemExit) as stopped:
            main(["upcycle", "--weights", str(tmp_path / "dense.pt"), "--model", _yaml("plain"),
                  "--overrides", "{qk_norm: false}", "--output", str(tmp_path / "moe.pt")])  # fmt: skip
        assert stopped.value.code == 2 and not (tmp_path / "moe.pt").exists()
        assert capsys.readouterr().err.strip() == f"mula: error: {refusal}"


@pytest.mark.parametrize(
    "args, sentence",
    [
        (["--weights", "mula-1b", "--model", "mula-7b-a1b"], "names a preset, not a weights file"),
        (
            ["--weights", "w.pt", "--model", "mula-7b-a1b", "--router_init", "normal"],
            "router_init must be one of",
        ),
        (["--weights", "w.pt", "--model", "mula-tiny-dense"], "is dense (num_experts 0)"),
    ],
)
def test_bad_command_lines_stop_in_one_sentence(args, sentence, dense, tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    save_weights(dense, "w.pt")
    with pytest.raises(SystemExit) as stopped:
        main(["upcycle", *args, "--output", "out.pt"])
    err = capsys.readouterr().err.strip()
    assert stopped.value.code == 2 and err.startswith("mula: error: ") and sentence in err, err
    assert len(err.splitlines()) == 1 and not (tmp_path / "out.pt").exists()


def test_the_overview_lists_upcycle(capsys) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(["--help"])
    assert stopped.value.code == 0 and "    upcycle" in capsys.readouterr().out
