"""Presets, parameter counts (vs the real module on the meta device) and the FLOP formula."""

import dataclasses

import pytest
import torch

from mula import Mula, MulaConfig
from mula.model.config import PRESETS

# name -> (total, active) from the issue, in billions, to the printed precision
EXPECTED = {
    "mula-1b": (1.28, 1.28),
    "mula-7b-a1b": (6.92, 1.28),
    "mula-20b-a2b": (20.08, 2.36),
    "mula-100b-a7b": (99.99, 7.58),
    "mula-220b-a10b": (220.2, 10.02),
}
EXACT = {  # hand-computed, see the arithmetic in test_exact_counts_by_hand
    "mula-7b-a1b": (6_919_161_856, 1_282_017_280),
    "mula-1b": (1_279_787_008, 1_279_787_008),
}


def meta_counts(cfg: MulaConfig) -> tuple[int, int]:
    """(total, active) counted on the real module: active drops the (E - k)/E unrouted expert share."""
    with torch.device("meta"):
        model = Mula(cfg)
    total = active = 0
    for name, p in model.named_parameters():
        total += p.numel()
        active += p.numel() * cfg.top_k // cfg.num_experts if ".experts." in name else p.numel()
    return total, active


@pytest.mark.parametrize("name", list(PRESETS))
def test_counts_match_meta_module(name):
    cfg = MulaConfig.from_name(name)
    total, active = meta_counts(cfg)
    assert cfg.num_params() == total
    assert cfg.num_active_params() == active
    if name in EXPECTED:
        t, a = EXPECTED[name]
        digits = 1 if t > 200 else 2
        assert round(total / 1e9, digits) == t and round(active / 1e9, 2) == a
    if name.startswith("mula-tiny"):
        assert 1e6 < total < 1e7 and cfg.vocab_size >= 4096


def test_exact_counts_by_hand():
    h, v, i, e, k, layers = 2048, 50304, 1024, 64, 8, 16
    attn = 4 * h * h + 2 * h  # q,k,v,o + q_norm + k_norm
    layer = attn + 2 * h + e * h  # + two block norms + router
    outer = 2 * v * h + h
    assert layers * (layer + e * 3 * h * i) + outer == EXACT["mula-7b-a1b"][0]
    assert layers * (layer + k * 3 * h * i) + outer == EXACT["mula-7b-a1b"][1]
    for name, (total, active) in EXACT.items():
        cfg = MulaConfig.from_name(name)
        assert (cfg.num_params(), cfg.num_active_params()) == (total, active)


@pytest.mark.parametrize(
    "kw",
    [
        {"num_kv_heads": 4},
        {"head_dim": 64},
        {"tie_embeddings": True},
        {"norm": "layernorm", "num_experts": 0, "qk_norm": True},
        {"num_dense_layers": 1, "intermediate_size": 4096},
        {"mtp_depth": 2},  # multi-token prediction modules (mula.model.mtp)
    ],
)
def test_counts_for_variants(kw):
    cfg = MulaConfig.from_name("mula-7b-a1b", num_layers=2, **kw)
    assert (cfg.num_params(), cfg.num_active_params()) == meta_counts(cfg)


@pytest.mark.parametrize(
    "name, kw",
    [(name, {}) for name in PRESETS]
    + [
        (
            "mula-7b-a1b",
            {"num_layers": 2, "num_kv_heads": 4, "head_dim": 64, "expert_intermediate_size": 768},
        ),
        ("mula-7b-a1b", {"num_layers": 2, "tie_embeddings": True}),
        ("mula-1b", {"num_layers": 2, "norm": "rmsnorm", "qk_norm": True, "num_kv_heads": 8}),
        ("mula-tiny-dense", {"norm": "layernorm", "qk_norm": True, "intermediate_size": 320}),
        ("mula-tiny-moe", {"num_dense_layers": 1, "intermediate_size": 320}),
        ("mula-7b-a1b", {"num_layers": 3, "num_dense_layers": 2, "tie_embeddings": True}),
        ("deepseek-v3-tiny", {"mtp_depth": 2}),
        ("mula-tiny-dense", {"mtp_depth": 1}),
    ],
)
def test_parameter_shapes_are_the_modules(name, kw):
    """The planner's torch-free parameter list equals the module's named_parameters, order included."""
    cfg = MulaConfig.from_name(name, **kw)
    with torch.device("meta"):
        model = Mula(cfg)
    assert cfg.parameter_shapes() == [(n, tuple(p.shape)) for n, p in model.named_parameters()]


def test_deepseek_v3_presets_match_the_published_counts():
    """DeepSeek-V3: 671B total as published (the 14B multi-token prediction module excluded, as in the
    published 671B) and 37B active, a number published to two digits; DeepSeek counts the active
    parameters without the embedding lookup (as DeepSeek-V2-Lite's 2.4B and V2's 21B), which gives 36.63B:
    within 1 % of 37B (the 0.5 % of issue 27 is finer than the published rounding; with the embedding it
    is 37.55B). Moonlight-16B-A3B's published 15.29B / 2.24B leave out the embedding and the LM head.
    Optimus' 1.1T variant: 1.1T and 58B as Optimus counts (every parameter)."""
    dsv3 = MulaConfig.from_name("deepseek-v3-671b", mtp_depth=0)
    emb = dsv3.vocab_size * dsv3.hidden_size
    assert abs(dsv3.num_params() / 671e9 - 1) < 0.0005  # 671.03B
    assert abs((dsv3.num_active_params() - emb) / 37e9 - 1) < 0.011  # 36.63B
    # the preset's MTP module: the checkpoint's 685B (deepseek-ai/DeepSeek-V3's card) hold it with its own
    # copies of the embedding and the head (684.49B; the card also counts the fp8 scales, about 0.04B)
    with_mtp = MulaConfig.from_name("deepseek-v3-671b")
    assert with_mtp.num_params() - dsv3.num_params() == with_mtp.num_mtp_params() > 0
    assert abs((with_mtp.num_params() + 2 * emb) / 685e9 - 1) < 0.001
    moon = MulaConfig.from_name("deepseek-v3-16b")
    emb = moon.vocab_size * moon.hidden_size
    assert round((moon.num_params() - 2 * emb) / 1e9, 2) == 15.29
    assert round((moon.num_active_params() - 2 * emb) / 1e9, 2) == 2.24
    big = MulaConfig.from_name("deepseek-v3-1.1t")
    assert round(big.num_params() / 1e12, 1) == 1.1 and round(big.num_active_params() / 1e9) == 58


@pytest.mark.parametrize(
    "kw",
    [
        {"q_lora_rank": None},
        {"v_head_dim": 48, "num_shared_experts": 2, "shared_expert_intermediate_size": 40},
        {"num_dense_layers": 0, "tie_embeddings": True},
    ],
)
def test_deepseek_v3_variants_count_as_the_module(kw):
    cfg = MulaConfig.from_name("deepseek-v3-tiny", **kw)
    assert (cfg.num_params(), cfg.num_active_params()) == meta_counts(cfg)
    with torch.device("meta"):
        model = Mula(cfg)
    assert cfg.parameter_shapes() == [(n, tuple(p.shape)) for n, p in model.named_parameters()]


@pytest.mark.parametrize(
    "name, kw",
    [
        ("mula-7b-a1b", {}), ("mula-1b", {}), ("mula-tiny-moe", {}), ("mula-tiny-moe", {"num_dense_layers": 2}),
        ("deepseek-v3-tiny", {}), ("deepseek-v3-tiny", {"q_lora_rank": None, "v_head_dim": 48}),
    ],
)  # fmt: skip
def test_flops_formula(name, kw):
    cfg = MulaConfig.from_name(name, **kw)
    with torch.device("meta"):
        model = Mula(cfg)
    # matmul params a token touches: every 2-D+ weight except the embedding, experts scaled to top_k
    matmul = 0
    for pname, p in model.named_parameters():
        if p.dim() < 2 or pname == "embed.weight":
            continue
        matmul += p.numel() * cfg.top_k // cfg.num_experts if ".experts." in pname else p.numel()
    seq = 4096
    # QK^T over the query/key width, AV over the value width, per head (both hidden_size / heads without MLA)
    widths = (
        cfg.num_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
        if cfg.is_mla
        else 2 * cfg.hidden_size
    )
    assert cfg.flops_per_token(seq) == 6 * matmul + 6 * cfg.num_layers * widths * seq
    if name == "mula-7b-a1b":
        # = 6 * (active - embedding - norms) + attention term
        norms = 16 * 4 * 2048 + 2048
        assert cfg.flops_per_token(seq) == 6 * (1_282_017_280 - 50304 * 2048 - norms) + 12 * 16 * 2048 * seq


def test_from_name_and_validation():
    assert MulaConfig.from_name("mula-7b-a1b") == MulaConfig(name="mula-7b-a1b")  # defaults = OLMoE
    cfg = MulaConfig.from_name("mula-tiny-moe", num_layers=2)
    assert cfg.num_layers == 2 and cfg.name == "mula-tiny-moe"
    assert MulaConfig.from_dict(dataclasses.asdict(cfg)) == cfg
    with pytest.raises(ValueError, match="Unknown Mula preset 'mula-3b'; valid names: mula-tiny-moe"):
        MulaConfig.from_name("mula-3b")
    with pytest.raises(ValueError, match="Unknown MulaConfig field"):
        MulaConfig.from_name("mula-1b", hidden=3)
    with pytest.raises(ValueError, match="num_kv_heads"):
        MulaConfig(num_kv_heads=3)
    with pytest.raises(ValueError, match="top_k"):
        MulaConfig(num_experts=4, top_k=5)
    with pytest.raises(ValueError, match="norm"):
        MulaConfig(norm="batchnorm")
    with pytest.raises(ValueError, match="divisible"):
        MulaConfig(hidden_size=100, num_heads=16)
    assert MulaConfig(num_kv_heads=4).kv_heads == 4 and MulaConfig().head_size == 128
    assert MulaConfig.from_name("mula-1b").is_moe is False
    with pytest.raises(
        ValueError, match=r"num_dense_layers must be in \[0, num_layers=4\) so that at least one"
    ):
        MulaConfig.from_name("mula-tiny-moe", num_dense_layers=4)
    with pytest.raises(ValueError, match="num_dense_layers must be in"):
        MulaConfig.from_name("mula-tiny-moe", num_dense_layers=-1)
    with pytest.raises(ValueError, match="num_dense_layers=1 needs an MoE model"):
        MulaConfig.from_name("mula-tiny-dense", num_dense_layers=1)
    with pytest.raises(ValueError, match="intermediate_size must be positive for the dense blocks"):
        MulaConfig.from_name("mula-tiny-moe", num_dense_layers=1, intermediate_size=0)
    mixed = MulaConfig.from_name("mula-tiny-moe", num_dense_layers=1)
    assert (mixed.num_moe_layers, mixed.is_moe_layer(0), mixed.is_moe_layer(1), mixed.moe_layer_row(3)) == (
        3, False, True, 2,
    )  # fmt: skip
    with pytest.raises(ValueError, match="Block 0 is not an MoE block"):
        mixed.moe_layer_row(0)


def test_architecture_fields_name_real_fields_and_resolve_defaults():
    names = {f.name for f in dataclasses.fields(MulaConfig)}
    every = (
        MulaConfig.ARCHITECTURE_FIELDS
        + MulaConfig.MOE_ARCHITECTURE_FIELDS
        + MulaConfig.DENSE_ARCHITECTURE_FIELDS
    )
    assert set(every) <= names
    assert not {"router_z_loss_coef", "router_aux_loss_coef", "init_std", "expert_backend", "name"} & set(
        every
    )
    config = MulaConfig.from_name("mula-tiny-moe")
    explicit = dataclasses.replace(config, num_kv_heads=config.num_heads, head_dim=config.head_size, name="x")
    assert config.architecture() == explicit.architecture()
    assert config.architecture_differences(dataclasses.replace(config, router_z_loss_coef=1.0)) == []
    assert config.architecture_differences(dataclasses.replace(config, top_k=2)) == ["top_k: 2 vs 4"]
    # the dense first blocks are architecture, and so is their MLP width (only when there are some)
    assert config.architecture_differences(dataclasses.replace(config, intermediate_size=64)) == []
    mixed = dataclasses.replace(config, num_dense_layers=1, intermediate_size=64)
    assert config.architecture_differences(mixed) == [
        "intermediate_size: 64 vs None", "num_dense_layers: 1 vs 0",
    ]  # fmt: skip


def test_shared_experts_are_dense_parameters_and_mla_takes_tensor_parallelism():
    """Shared experts sit under `shared_experts`, not `experts`: replicated over the expert-parallel group
    and sharded by the optimizer as dense weights (the planner's ParamSpec agrees). MLA takes TP when T
    divides its heads (tests/test_deepseek_v3_tensor_parallel.py)."""
    from mula.layout.rules import check_tensor_parallel
    from mula.model.param_names import is_expert_param
    from mula.plan.parameters import model_parameters

    cfg = MulaConfig.from_name("deepseek-v3-tiny")
    specs = {p.name: p for p in model_parameters(cfg)}
    shared = [n for n in specs if ".shared_experts." in n]
    assert len(shared) == 3 * cfg.num_moe_layers and not any(specs[n].is_expert for n in shared)
    assert not is_expert_param("layers.1.mlp.shared_experts.gate_proj.weight")
    assert is_expert_param("layers.1.mlp.experts.gate_up")
    dense_mla = MulaConfig.from_name(
        "deepseek-v3-tiny", num_experts=0, num_dense_layers=0, num_shared_experts=0
    )
    check_tensor_parallel(dense_mla, 2)
    with pytest.raises(ValueError, match="4 attention heads are not divisible by tensor_parallel_size=8"):
        check_tensor_parallel(dense_mla, 8)
    with pytest.raises(ValueError, match="set kv_lora_rank"):
        MulaConfig.from_name("mula-tiny-moe", qk_rope_head_dim=16)
    with pytest.raises(ValueError, match="num_shared_experts needs an MoE model"):
        MulaConfig.from_name("mula-tiny-dense", num_shared_experts=1)
