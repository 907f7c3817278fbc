"""Activation checkpointing leaves gradients and MoE statistics unchanged, alone and under expert parallelism.

Each setting (`none`, `full`, `[moe]`, `[attention]`, `[norms]`, `[moe, attention]`) is compared with
the model without checkpointing: in one process (bitwise / 1e-6) and on 4 gloo CPU ranks with expert
parallel sizes 2 and 4 against one process running the same 4 micro-batches (the comparison of
tests/test_expert_parallel.py), every rank's expert gradients included.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dist_helpers import run_distributed

from mula import Mula, MulaConfig
from mula.model.moe import is_expert_param
from mula.model.transformer import parse_activation_checkpointing
from mula.training.module import MulaLightningModule
from strategies.experts.expert_parallel import apply_expert_parallel
from strategies.optim.grad_sync import GradientSynchronizer
from strategies.topology import build_topology

WORLD, MICRO, SEQ = 4, 2, 16
SETTINGS = ["none", "full", ["moe"], ["attention"], ["norms"], ["moe", "attention"]]
CONFIG = MulaConfig.from_name(
    "mula-tiny-moe", vocab_size=256, hidden_size=32, num_layers=2, num_heads=2, num_experts=8, top_k=2,
    expert_intermediate_size=32, max_position_embeddings=64,
)  # fmt: skip


def _batch() -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, CONFIG.vocab_size, (WORLD * MICRO, SEQ + 1), generator=g)


def _model(setting) -> Mula:
    torch.manual_seed(0)
    model = Mula(CONFIG)
    model.set_activation_checkpointing(setting)
    return model


def _loss(model: Mula, batch: torch.Tensor):
    out = model(batch[:, :-1])
    ce = F.cross_entropy(out.logits.flatten(0, 1), batch[:, 1:].flatten())
    return ce + CONFIG.router_aux_loss_coef * out.aux_loss + CONFIG.router_z_loss_coef * out.z_loss, out


def _grads_and_stats(setting) -> tuple[dict, list]:
    model = _model(setting)
    stats = []
    for micro in _batch().split(MICRO):
        loss, out = _loss(model, micro)
        (loss / WORLD).backward()
        stats.append((out.aux_loss.detach(), out.z_loss.detach(), out.tokens_per_expert))
    return {n: p.grad.clone() for n, p in model.named_parameters()}, stats


@pytest.mark.parametrize("setting", SETTINGS, ids=str)
def test_gradients_and_stats_unchanged_in_one_process(setting) -> None:
    ref_grads, ref_stats = _grads_and_stats("none")
    grads, stats = _grads_and_stats(setting)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-6, atol=0, msg=name)
    for (aux, z, counts), (ref_aux, ref_z, ref_counts) in zip(stats, ref_stats):
        assert torch.equal(aux, ref_aux) and torch.equal(z, ref_z) and torch.equal(counts, ref_counts)


def test_checkpointed_forward_runs_each_moe_layer_once_per_recompute() -> None:
    """The MoE layer's forward runs again in backward (recompute), never a third time."""
    model = _model(["moe"])
    calls = []
    for block in model.layers:
        block.mlp.register_forward_hook(lambda *_: calls.append(torch.is_grad_enabled()))
    loss, _ = _loss(model, _batch()[:MICRO])
    assert len(calls) == CONFIG.num_layers
    loss.backward()
    assert len(calls) == 2 * CONFIG.num_layers


@pytest.mark.parametrize("value", ["some", ["moe", "mlp"], [], "attention,moe"])
def test_unknown_setting_is_refused_with_one_sentence(value) -> None:
    with pytest.raises(ValueError, match="activation_checkpointing must be 'none', 'full' or a list of"):
        parse_activation_checkpointing(value)
    with pytest.raises(ValueError, match="activation_checkpointing"):
        MulaLightningModule(CONFIG, activation_checkpointing=value)


def test_module_passes_the_setting_to_every_block() -> None:
    module = MulaLightningModule(CONFIG, activation_checkpointing=["moe", "attention"])
    module.configure_model()
    assert all(block.checkpointing == {"moe", "attention"} for block in module.model.layers)
    assert MulaLightningModule(CONFIG).hparams.activation_checkpointing == "none"


def _ep_grads(rank: int, ep_size: int, setting) -> dict:
    topo = build_topology(ep_size)
    model = _model(setting)
    apply_expert_parallel(model, topo)
    named = list(model.named_parameters())
    sync = GradientSynchronizer(named, topo, bucket_size_mb=0.01, overlap=True)
    loss, _ = _loss(model, _batch().split(MICRO)[rank])
    loss.backward()
    sync.finish()
    local = list(topo.local_expert_range(CONFIG.num_experts))
    sent = sum(block.mlp.dispatcher.bytes_sent for block in model.layers)
    return {"grads": {n: p.grad.clone() for n, p in named}, "local": local, "bytes_sent": sent}


def _ep_worker(rank: int, world: int) -> dict:
    return {(ep, str(s)): _ep_grads(rank, ep, s) for ep in (2, 4) for s in SETTINGS}


def test_expert_parallel_gradients_unchanged() -> None:
    ref_grads, _ = _grads_and_stats("none")
    results = run_distributed(_ep_worker, WORLD)
    for runs in results:
        for (ep, setting), run in runs.items():
            for name, grad in run["grads"].items():
                full = ref_grads[name]
                expected = full[run["local"][0] : run["local"][-1] + 1] if is_expert_param(name) else full
                torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-7, msg=f"{ep} {setting} {name}")
            # a recomputed MoE layer really sends its forward rows again: counted, as traffic
            plain = runs[(ep, "none")]["bytes_sent"]
            if setting in ("full", str(["moe"]), str(["moe", "attention"])):
                assert plain < run["bytes_sent"] < 2 * plain
            else:
                assert run["bytes_sent"] == plain


def test_step_expert_counts_do_not_count_a_recompute_twice() -> None:
    """The counts the module sums per step (and the metrics callbacks read) are those of one forward."""
    counts = {}
    for setting in ("none", "full", ["moe"]):
        module = MulaLightningModule(CONFIG, activation_checkpointing=setting)
        torch.manual_seed(0)
        module.configure_model()
        loss, out = _loss(module.model, _batch())
        loss.backward()
        module._step_counts = out.tokens_per_expert.detach()  # as training_step accumulates it
        module.on_before_optimizer_step(None)
        counts[str(setting)] = module.step_expert_counts
    assert counts["none"].sum() == CONFIG.num_layers * WORLD * MICRO * SEQ * CONFIG.top_k
    assert torch.equal(counts["full"], counts["none"]) and torch.equal(counts["['moe']"], counts["none"])


def test_cli_reads_a_list_and_refuses_an_unknown_part(capsys, tmp_path, monkeypatch) -> None:
    from pathlib import Path

    from mula.cli import main

    monkeypatch.chdir(tmp_path)
    recipe = str(Path(__file__).resolve().parents[1] / "recipes" / "mula-tiny-moe.yaml")
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "-c", recipe, "--model.activation_checkpointing=[moe, attention]", "--print_config"])
    assert exit_info.value.code == 0
    assert "activation_checkpointing:\n  - moe\n  - attention" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "-c", recipe, "--model.activation_checkpointing=[moe, mlp]"])
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("mula: error:")]
    assert errors == [
        "mula: error: activation_checkpointing must be 'none', 'full' or a list of "
        "['moe', 'attention', 'norms'], got ['moe', 'mlp']."
    ]
