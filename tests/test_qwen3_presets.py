"""Qwen3-MoE presets: parameter counts against the published figures, the meta-device modules (Mula's
and transformers' `Qwen3MoeForCausalLM`), the torch-free parameter list, and the exact FLOP formula."""

from __future__ import annotations

import pytest
import torch
from test_config import meta_counts

from mula import Mula, MulaConfig

# Model cards (huggingface.co/Qwen/Qwen3-30B-A3B, huggingface.co/Qwen/Qwen3-235B-A22B): total and
# activated parameters, in billions, as printed there
PUBLISHED = {"qwen3-30b-a3b": (30.5, 3.3), "qwen3-235b-a22b": (235.0, 22.0)}
EXACT = {  # hand-computed below (test_exact_counts_by_hand)
    "qwen3-30b-a3b": (30_532_122_624, 3_353_032_704),
    "qwen3-235b-a22b": (235_093_634_560, 22_190_763_520),
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_counts_match_the_published_figures_and_the_modules(name):
    cfg = MulaConfig.from_name(name)
    total, active = cfg.num_params(), cfg.num_active_params()
    assert (total, active) == meta_counts(cfg) == EXACT[name]
    published_total, published_active = PUBLISHED[name]
    assert abs(total / 1e9 - published_total) <= 0.005 * published_total
    # The activated figures are printed to two digits, truncated (3.353B -> "3.3B", 22.19B -> "22B"),
    # so they bound the count from below to within one unit of their last digit, not to 0.5 %.
    unit = 0.1 if published_active < 10 else 1.0
    assert published_active <= active / 1e9 < published_active + unit


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_counts_equal_transformers_qwen3_moe_on_meta(name):
    transformers = pytest.importorskip("transformers")
    from mula.hf import config_to_hf

    d = config_to_hf(MulaConfig.from_name(name))
    d.pop("torch_dtype")
    with torch.device("meta"):
        hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig.from_dict(d))
    assert sum(p.numel() for p in hf.parameters()) == MulaConfig.from_name(name).num_params()


def test_exact_counts_by_hand():
    for name, (h, layers, heads, i) in {"qwen3-30b-a3b": (2048, 48, 32, 768),
                                        "qwen3-235b-a22b": (4096, 94, 64, 1536)}.items():  # fmt: skip
        v, e, k, kv, d = 151936, 128, 8, 4, 128
        attn = 2 * h * heads * d + 2 * h * kv * d + 2 * d  # q, o, k, v + per-head q_norm, k_norm
        layer = attn + 2 * h + e * h  # + two block norms + router
        outer = 2 * v * h + h  # untied embedding and head, final norm
        assert (layers * (layer + e * 3 * h * i) + outer, layers * (layer + k * 3 * h * i) + outer) == EXACT[
            name
        ]


@pytest.mark.parametrize(
    "name, kw",
    [("qwen3-moe-tiny", {}), ("qwen3-moe-tiny", {"num_dense_layers": 1, "tie_embeddings": True}),
     ("qwen3-30b-a3b", {"num_layers": 2}), ("mula-tiny-dense", {"qk_norm": True, "qk_norm_per_head": True}),
     ("mula-tiny-dense", {"norm": "layernorm", "qk_norm": True, "qk_norm_per_head": True})],
)  # fmt: skip
def test_parameter_shapes_and_flops_are_the_modules(name, kw):
    """The planner's parameter list is the module's; `flops_per_token` is 6 x the matmul parameters a
    token goes through (per-head norms are not matmuls) + the attention term over num_heads * head_dim."""
    cfg = MulaConfig.from_name(name, **kw)
    with torch.device("meta"):
        model = Mula(cfg)
    assert cfg.parameter_shapes() == [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    total, active = meta_counts(cfg) if cfg.is_moe else (sum(p.numel() for p in model.parameters()),) * 2
    assert (cfg.num_params(), cfg.num_active_params()) == (total, active)
    matmul = 0
    for pname, p in model.named_parameters():
        if p.dim() < 2 or pname == "embed.weight":
            continue
        matmul += p.numel() * cfg.top_k // cfg.num_experts if ".experts." in pname else p.numel()
    if cfg.tie_embeddings:
        matmul += cfg.vocab_size * cfg.hidden_size  # the tied head is a matmul too
    seq = 1024
    q = cfg.num_heads * cfg.head_size
    assert cfg.flops_per_token(seq) == 6 * matmul + 12 * cfg.num_layers * q * seq
    if name.startswith("qwen3"):
        assert q != cfg.hidden_size  # the attention term is not the hidden size's


@pytest.mark.parametrize(
    "overrides",
    [{}, {"router_scoring": "sigmoid", "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5}],
)
def test_planner_activation_bytes_against_the_saved_tensors(overrides):
    """The planner's activation bytes of the tiny Qwen3-MoE preset (per-head norm statistics, the
    renormalised top-k, sigmoid scoring) against `SavedTensorMeter` on one process: exact to the same
    few bytes as OLMoE's when the MoE layer is recomputed (nothing there depends on the routing), within
    the 10 % of tests/test_plan_measured.py otherwise (the planner assumes balanced routing)."""
    from mula.plan import Layout, plan_memory
    from mula.training.memory_meter import SavedTensorMeter
    from mula.training.module import MulaLightningModule

    b, t = 4, 128
    config = MulaConfig.from_name("qwen3-moe-tiny", vocab_size=512, num_layers=2, **overrides)
    batch = torch.randint(0, config.vocab_size, (b, t + 1), generator=torch.Generator().manual_seed(0))
    for checkpointing, tolerance in (("none", 0.10), (["moe"], 0.0)):
        torch.manual_seed(0)
        module = MulaLightningModule(config, decay_steps=10, activation_checkpointing=checkpointing)
        module.configure_model()
        with SavedTensorMeter(exclude=module.parameters()) as meter:
            module._losses(batch)
        layout = Layout(
            world_size=1, micro_batch=b, seq_len=t, precision="32-true", checkpointing=checkpointing
        )
        planned = plan_memory(config, layout).activations
        assert abs(planned - meter.bytes) <= tolerance * meter.bytes + 8, (
            checkpointing,
            planned,
            meter.bytes,
        )


def test_tensor_parallelism_takes_per_head_qk_norm():
    """Per-head QK-norm runs under TP (tests/test_qwen3_tensor_parallel.py); T must still divide the heads."""
    from mula.layout.parallel_layout import ParallelLayout
    from mula.model.config import resolve_config

    config = resolve_config("mula-tiny-dense", {"qk_norm": True, "qk_norm_per_head": True})
    ParallelLayout(world_size=4, tp=2).validate(config)
    with pytest.raises(ValueError, match="attention heads are not divisible by tensor_parallel_size=8"):
        ParallelLayout(world_size=8, tp=8).validate(config)


def test_single_node_recipe_instantiates_and_fits_one_h100_node(capsys, tmp_path, monkeypatch):
    """recipes/qwen3-moe-15b-a2b.yaml: composed on base/paper.yaml, parsed and instantiated by the CLI
    without building the model, and `mula plan` on recipes/machines/h100.yaml's one node says it fits."""
    import json
    from pathlib import Path

    from mula.cli import main
    from mula.commands.lightning_cli import MulaCLI

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "qwen3-moe-15b-a2b.yaml"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["mula"])
    monkeypatch.setenv("WANDB_MODE", "offline")

    class Probe(MulaCLI):
        def _run_subcommand(self, subcommand: str) -> None:
            pass

    cli = Probe(args=["fit", "-c", str(recipe)])
    config = cli.model.config
    assert cli.model.model is None and config.name == "qwen3-moe-15b-a2b" and config.qk_norm_per_head
    assert (config.aux_loss_scope, config.router_aux_loss_coef, config.router_z_loss_coef) == (
        "global",
        1e-3,
        0,
    )
    assert cli.datamodule.seq_len <= config.max_position_embeddings
    assert round(config.num_params() / 1e9, 1) == 15.6 and round(config.num_active_params() / 1e9, 1) == 2.0
    main(["plan", "-c", str(recipe), "--machine=h100", "--nodes=1", "--format=json"])
    out = json.loads(capsys.readouterr().out)
    assert out["layout"]["world_size"] == 8 and out["layout"]["ep_size"] == 8
    assert out["fits"] and out["per_rank_bytes"]["total"] <= 80e9
