"""Multi-token prediction (mula.model.mtp) against a plain-PyTorch transcription of DeepSeek-V3's
equations 21-25 (section 2.2), written here: each depth k truncates the sequence to T - k positions,
normalises the previous depth's hidden state and the embeddings of the tokens k ahead, concatenates them,
projects 2h -> h, runs the module's block and the shared head, and averages the cross-entropies against
the tokens k + 1 ahead. Mula instead pads every depth to T positions and masks the padded targets; the
loss and every gradient agree in fp32 to 1e-6.

The blocks are the model's own (the block is not what is under test); the router losses are weighted 0 so
that the padded positions' routing has no part in the loss.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mula import MulaConfig
from mula.model.layers import rope_cos_sin
from mula.model.mtp import MTPModule
from mula.training.module import MulaLightningModule

DEPTH, LAMBDA, B, T = 2, 0.3, 2, 12


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _run_blocks(blocks, x: torch.Tensor, config: MulaConfig) -> torch.Tensor:
    cos, sin = rope_cos_sin(config, x.shape[1], x.device)
    for block in blocks:
        x, _ = block(x, cos, sin)
    return x


def reference_losses(model, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(main cross-entropy + LAMBDA * L_MTP, L_MTP) by the paper's equations, sequences truncated per depth."""
    c, n = model.config, model.config.num_layers
    tokens = batch.shape[1] - 1
    h = _run_blocks(model.layers[:n], model.embed(batch[:, :tokens]), c)
    h = _rms(h, model.norm.weight, c.norm_eps)  # h^0: what the (linear) output head maps to logits
    main = F.cross_entropy((h @ model.lm_head.weight.T).flatten(0, 1), batch[:, 1:].flatten())
    terms = []
    for k in range(1, c.mtp_depth + 1):
        m, length = model.mtp[k - 1], tokens - k
        emb = model.embed(batch[:, k : k + length])  # Emb(t_{i+k}), i = 1..T-k
        h = torch.cat(
            (_rms(emb, m.enorm.weight, c.norm_eps), _rms(h[:, :length], m.hnorm.weight, c.norm_eps)), -1
        )
        h = _rms(_run_blocks([model.layers[n + k - 1]], h @ m.eh_proj.weight.T, c), m.norm.weight, c.norm_eps)
        logits = h @ model.lm_head.weight.T  # h^k, the next depth's input
        terms.append(F.cross_entropy(logits.flatten(0, 1), batch[:, k + 1 : k + 1 + length].flatten()))
    mtp = torch.stack(terms).mean()
    return main + LAMBDA * mtp, mtp


@pytest.fixture(scope="module")
def module() -> MulaLightningModule:
    torch.manual_seed(0)
    config = MulaConfig.from_name(
        "deepseek-v3-tiny", vocab_size=256, mtp_depth=DEPTH, mtp_loss_weight=LAMBDA,
        router_aux_loss_coef=0.0, router_z_loss_coef=0.0,
    )  # fmt: skip
    m = MulaLightningModule(config)
    m.configure_model()
    return m


def _grads(module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    module.model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in module.model.named_parameters() if p.grad is not None}


def test_loss_and_gradients_equal_the_papers_equations(module):
    batch = torch.randint(0, 256, (B, T + 1), generator=torch.Generator().manual_seed(1))
    loss, _, out = module._losses(batch, mtp=True)
    ours = _grads(module, loss)
    ref_loss, ref_mtp = reference_losses(module.model, batch)
    theirs = _grads(module, ref_loss)
    torch.testing.assert_close(out.mtp_loss, ref_mtp, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    assert ours.keys() == theirs.keys() and any(n.startswith("mtp.") for n in ours)
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-6, atol=1e-6, msg=name)
    # the MTP modules' gradients are not zero: the comparison covers them
    assert all(
        ours[n].abs().sum() > 0
        for n in ours
        if n.startswith(("mtp.", f"layers.{module.config.num_layers}.attn"))
    )


def test_a_planted_bug_is_caught(module, monkeypatch):
    """The paper writes [hidden; embedding]: putting the hidden state first (a plausible slip) changes the
    loss, so the equality above would catch it."""
    batch = torch.randint(0, 256, (B, T + 1), generator=torch.Generator().manual_seed(2))
    monkeypatch.setattr(
        MTPModule, "forward", lambda self, h, e: self.eh_proj(torch.cat((self.hnorm(h), self.enorm(e)), -1))
    )
    with torch.no_grad():
        planted = module._losses(batch, mtp=True)[2].mtp_loss
        assert not torch.allclose(planted, reference_losses(module.model, batch)[1], rtol=1e-4, atol=1e-4)


def test_validation_runs_no_mtp_and_logs_it_in_training(module):
    batch = torch.randint(0, 256, (B, T + 1))
    with torch.no_grad():
        _, ce, out = module._losses(batch)
    assert out.mtp_logits == () and out.mtp_loss is None
    assert out.tokens_per_expert.shape[0] == module.config.num_moe_layers - DEPTH


def test_config_refuses_bad_values_and_counts_the_module():
    with pytest.raises(ValueError, match="mtp_depth must be >= 0"):
        MulaConfig.from_name("deepseek-v3-tiny", mtp_depth=-1)
    with pytest.raises(ValueError, match="mtp_loss_weight must be >= 0"):
        MulaConfig.from_name("deepseek-v3-tiny", mtp_depth=1, mtp_loss_weight=float("nan"))
    off, on = MulaConfig.from_name("deepseek-v3-tiny"), MulaConfig.from_name("deepseek-v3-tiny", mtp_depth=1)
    assert on.num_params() - off.num_params() == on.num_mtp_params() > 0 and off.num_mtp_params() == 0
    assert on.flops_per_token(64) > off.flops_per_token(64)
    assert "mtp_depth" in on.architecture_differences(off)[0]


@pytest.mark.parametrize("precision", ["32-true", "bf16-true"])
def test_the_planner_counts_the_modules(precision):
    """`mula plan`: the MTP modules' parameters on the (one) stage, and their activations against the
    saved-tensor bytes of a training forward (as tests/test_plan_measured_mla.py; with the MoE layers
    recomputed, the routing's imbalance out of the count, they agree to a few bytes), FLOPs in the count."""
    from mula.plan import Layout, plan_memory
    from mula.plan.activations import activation_bytes
    from mula.training.memory_meter import SavedTensorMeter

    b, t = 4, 128
    config = MulaConfig.from_name("deepseek-v3-tiny", vocab_size=512, num_layers=3, mtp_depth=2)
    torch.manual_seed(0)
    module = MulaLightningModule(config, decay_steps=10, activation_checkpointing=["moe"])
    module.configure_model()
    if precision == "bf16-true":
        module.to(torch.bfloat16)
    batch = torch.randint(0, config.vocab_size, (b, t + 1), generator=torch.Generator().manual_seed(0))
    with SavedTensorMeter(exclude=module.parameters()) as meter:
        module._losses(batch, mtp=True)
    layout = Layout(micro_batch=b, seq_len=t, precision=precision, checkpointing=["moe"])
    planned = activation_bytes(config, layout, range(config.num_blocks), first=True, last=True)
    assert abs(planned - meter.bytes) <= 16
    off = MulaConfig.from_name("deepseek-v3-tiny", vocab_size=512, num_layers=3)
    with_mtp, without = plan_memory(config, layout), plan_memory(off, layout)
    assert with_mtp.params - without.params == config.num_mtp_params() * layout.param_bytes


def test_train_mtp_loss_is_logged_beside_the_other_losses(tmp_path):
    import lightning as L
    from torch.utils.data import DataLoader

    config = MulaConfig.from_name("deepseek-v3-tiny", vocab_size=256, num_layers=2, mtp_depth=1)
    module = MulaLightningModule(config, lr=1e-3, warmup_steps=1, decay_steps=2)
    data = [torch.randint(0, 256, (T + 1,), generator=torch.Generator().manual_seed(i)) for i in range(4)]
    trainer = L.Trainer(
        max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path, log_every_n_steps=1,
    )  # fmt: skip
    trainer.fit(module, train_dataloaders=DataLoader(data, batch_size=2, collate_fn=torch.stack))
    logged = trainer.callback_metrics
    assert {
        "train/loss",
        "train/ce_loss",
        "train/aux_loss",
        "train/z_loss",
        "train/mtp_loss",
    } <= logged.keys()
    # the logged total is the CE, the router terms and the weighted MTP loss of the step
    aux = (
        config.router_aux_loss_coef * logged["train/aux_loss"]
        + config.router_z_loss_coef * logged["train/z_loss"]
    )
    total = logged["train/ce_loss"] + aux + config.mtp_loss_weight * logged["train/mtp_loss"]
    torch.testing.assert_close(logged["train/loss"], total)
    assert logged["train/mtp_loss"] > 0


def test_the_planner_puts_the_modules_and_an_embedding_copy_on_the_last_stage():
    """With pipeline stages the MTP block is the last stage's (after its main blocks), and `mula plan`
    counts on each stage the parameters its split model holds: the last stage's MTP module, its block and
    its copy of the embedding (strategies/pipeline/split.py) included."""
    from mula import Mula
    from mula.layout.parallel_layout import ParallelLayout
    from mula.plan import Layout
    from mula.plan.memory import plan_stage
    from strategies.pipeline.split import split_model

    config = MulaConfig.from_name("deepseek-v3-tiny", vocab_size=512, num_layers=4, mtp_depth=1)
    layout = Layout(world_size=2, pp_size=2, micro_batches=2, seq_len=64)
    par = ParallelLayout(world_size=2, pp=2)
    held = [par.rank_holdings(s, config.num_layers, config.num_experts, config.mtp_depth) for s in (0, 1)]
    assert [h.blocks for h in held] == [[0, 1], [2, 3, 4]] and list(held[1].mtp_blocks) == [4]
    assert [h.main_blocks(0) for h in held] == [[0, 1], [2, 3]]
    for stage in (0, 1):
        model = Mula(config)
        split_model(model, held[stage])
        names = [n for n, _ in model.named_parameters()]
        assert "embed.weight" in names and any(n.startswith("mtp.0.") for n in names) == (stage == 1)
        count = sum(p.numel() for p in model.parameters())
        assert plan_stage(config, layout, stage).params == count * layout.param_bytes, stage


def test_sequences_too_short_for_the_modules_are_one_sentence():
    """One sentence, from one check (`check_mtp_sequence`) that the module's loss and a pipeline's step
    (strategies/pipeline/schedule.py, on every rank before any stage runs) both call."""
    from mula.model.mtp import check_mtp_sequence

    config = MulaConfig.from_name("deepseek-v3-tiny", vocab_size=256, num_layers=2, mtp_depth=2)
    module = MulaLightningModule(config)
    module.configure_model()
    sentence = "mtp_depth=2 needs sequences longer than 2 tokens, got 2."
    with pytest.raises(ValueError, match=sentence):
        module._losses(torch.zeros(1, 3, dtype=torch.long), mtp=True)
    with pytest.raises(ValueError, match=sentence):
        check_mtp_sequence(2, 2)
    check_mtp_sequence(0, 1)
    check_mtp_sequence(2, 3)
