"""The named model presets `MulaConfig.from_name` knows: plain field values, each family's numbers with
their published source (tests/test_config.py builds every preset on the meta device and checks its
parameter counts)."""

from __future__ import annotations

from typing import Any

_OLMOE: dict[str, Any] = {
    "vocab_size": 50304, "hidden_size": 2048, "num_layers": 16, "num_heads": 16,
    "max_position_embeddings": 4096, "rope_theta": 10000.0, "norm": "rmsnorm", "norm_eps": 1e-5,
    "qk_norm": True, "num_experts": 64, "top_k": 8, "expert_intermediate_size": 1024,
    "norm_topk_prob": False, "router_aux_loss_coef": 0.01, "router_z_loss_coef": 0.001, "init_std": 0.02,
    "tie_embeddings": False,
}  # fmt: skip

# DeepSeek-V3 (arXiv 2412.19437 and deepseek-ai/DeepSeek-V3's config.json): MLA, 3 dense blocks, 1 shared +
# 256 routed experts top-8 by sigmoid scores in 8 groups of which 4, scaled by 2.5. Pretrained at 4K context
# (YaRN extends it afterwards; Mula has no YaRN), init std 0.006 (the report's; config.json says 0.02).
# Balancing as the report: the bias (update speed 0.001) and a balance loss of weight 1e-4 -- Mula's loss is
# top_k times DeepSeek's, so 1e-4 / 8; over the micro-batch here (`aux_loss_scope: sequence` is DeepSeek's
# per-sequence form, docs/moe-routing.md). No z-loss.
_DEEPSEEK_V3: dict[str, Any] = {
    "vocab_size": 129280, "hidden_size": 7168, "num_layers": 61, "num_heads": 128,
    "max_position_embeddings": 4096, "rope_theta": 10000.0, "norm": "rmsnorm", "norm_eps": 1e-6,
    "qk_norm": False, "intermediate_size": 18432, "num_experts": 256, "top_k": 8,
    "expert_intermediate_size": 2048, "norm_topk_prob": True, "router_scoring": "sigmoid", "n_group": 8,
    "topk_group": 4, "routed_scaling_factor": 2.5, "router_bias": True, "router_bias_update_rate": 0.001,
    "router_aux_loss_coef": 1.25e-5, "router_z_loss_coef": 0.0, "num_dense_layers": 3,
    "num_shared_experts": 1, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "init_std": 0.006, "tie_embeddings": False,
}  # fmt: skip

# Qwen3-MoE (transformers' Qwen3MoeForCausalLM): per-head QK RMSNorm, head_dim 128 decoupled from
# hidden/heads, GQA with 4 KV heads, 128 experts top-8 renormalised, no shared experts, every block MoE,
# RoPE theta 1e6, RMSNorm eps 1e-6, untied head, vocabulary 151,936. Shapes from the published
# config.json files, huggingface.co/Qwen/Qwen3-30B-A3B and huggingface.co/Qwen/Qwen3-235B-A22B
# (intermediate_size is their dense MLP width, unused while every block is MoE). Router aux loss weight
# 0.001 as there; no z-loss (transformers' Qwen3-MoE has none).
_QWEN3_MOE: dict[str, Any] = {
    "vocab_size": 151936, "num_kv_heads": 4, "head_dim": 128, "max_position_embeddings": 40960,
    "rope_theta": 1000000.0, "norm": "rmsnorm", "norm_eps": 1e-6, "qk_norm": True, "qk_norm_per_head": True,
    "num_experts": 128, "top_k": 8, "norm_topk_prob": True, "router_aux_loss_coef": 0.001,
    "router_z_loss_coef": 0.0, "init_std": 0.02, "tie_embeddings": False,
}  # fmt: skip

PRESETS: dict[str, dict[str, Any]] = {
    # a few million parameters; vocab 4096 = the demo tokenizer's size; trains on 2 CPU cores
    "mula-tiny-moe": {
        **_OLMOE, "name": "mula-tiny-moe", "vocab_size": 4096, "hidden_size": 128, "num_layers": 4,
        "num_heads": 4, "max_position_embeddings": 1024, "num_experts": 16, "top_k": 4,
        "expert_intermediate_size": 128,
    },
    "mula-tiny-dense": {
        **_OLMOE, "name": "mula-tiny-dense", "vocab_size": 4096, "hidden_size": 128, "num_layers": 4,
        "num_heads": 4, "max_position_embeddings": 1024, "norm": "layernorm", "qk_norm": False,
        "num_experts": 0, "intermediate_size": 512,
    },
    # Qwen3-MoE's structure at test size (head_dim 64 != hidden/heads = 32, 2 KV heads)
    "qwen3-moe-tiny": {
        **_QWEN3_MOE, "name": "qwen3-moe-tiny", "vocab_size": 4096, "hidden_size": 128, "num_layers": 4,
        "num_heads": 4, "num_kv_heads": 2, "head_dim": 64, "max_position_embeddings": 1024,
        "intermediate_size": 256, "num_experts": 16, "top_k": 4, "expert_intermediate_size": 64,
    },
    # 30.5B total, 3.3B active (model card)
    "qwen3-30b-a3b": {
        **_QWEN3_MOE, "name": "qwen3-30b-a3b", "hidden_size": 2048, "num_layers": 48, "num_heads": 32,
        "intermediate_size": 6144, "expert_intermediate_size": 768,
    },
    # A single-node size of the family: transformers' Qwen3MoeConfig defaults ("Qwen3-15B-A2B" style),
    # i.e. 24 of Qwen3-30B-A3B's blocks: 15.6B total, 2.0B active (recipes/qwen3-moe-15b-a2b.yaml)
    "qwen3-moe-15b-a2b": {
        **_QWEN3_MOE, "name": "qwen3-moe-15b-a2b", "hidden_size": 2048, "num_layers": 24, "num_heads": 32,
        "intermediate_size": 6144, "expert_intermediate_size": 768,
    },
    # 235B total, 22B active (model card)
    "qwen3-235b-a22b": {
        **_QWEN3_MOE, "name": "qwen3-235b-a22b", "hidden_size": 4096, "num_layers": 94, "num_heads": 64,
        "intermediate_size": 12288, "expert_intermediate_size": 1536,
    },
    # = OLMo-1B-hf (untied, non-parametric LayerNorm, no QK-norm)
    "mula-1b": {
        **_OLMOE, "name": "mula-1b", "norm": "layernorm", "qk_norm": False, "num_experts": 0,
        "intermediate_size": 8192,
    },
    # = OLMoE-1B-7B-0924
    "mula-7b-a1b": {**_OLMOE, "name": "mula-7b-a1b"},
    "mula-20b-a2b": {**_OLMOE, "name": "mula-20b-a2b", "num_experts": 96, "num_layers": 32},
    "mula-100b-a7b": {
        **_OLMOE, "name": "mula-100b-a7b", "hidden_size": 3072, "num_heads": 24, "num_experts": 144,
        "expert_intermediate_size": 1536, "num_layers": 48,
    },
    "mula-220b-a10b": {
        **_OLMOE, "name": "mula-220b-a10b", "hidden_size": 3072, "num_heads": 24, "num_experts": 240,
        "expert_intermediate_size": 1536, "num_layers": 64,
    },
    # The dense GPT shapes Frontier trained with tensor, pipeline and data parallelism (arXiv 2312.12705,
    # "Optimizing Distributed Training on Frontier for Large Language Models", Dash et al.): 175B = GPT-3's
    # 96 layers, hidden 12,288, 96 heads; 1T = 128 layers, hidden 25,600, 160 heads (the shapes issue 24
    # quotes from the paper). 22B: the paper's own table could not be read from this workspace (only its
    # abstract is reachable), so it is Megatron-LM's 22B GPT (48 layers, hidden 6,144, 64 heads; Korthikanti
    # et al., arXiv 2205.05198, its table of evaluated models; as calculon's models/megatron-22B.json) -- the same family the 1T
    # shape is (that table's 1T is 128 x 25,600 x 160): check it against the paper's table when reachable.
    # Mula's blocks are SwiGLU: intermediate_size = 8h/3 keeps GPT's 8h^2 MLP weights per layer (rounded
    # down to a multiple of 8 for the 1T, so that T = 8 splits it). Non-parametric LayerNorm, no QK-norm,
    # untied head, as mula-1b. Vocabulary and context: GPT-3's 2,048 tokens and Megatron's GPT-2 BPE
    # vocabulary padded to 51,200 (Megatron-LM's GPT models, arXiv 2104.04473 and 2205.05198) -- the
    # Frontier paper's own values not checked here, for the same reason.
    **{
        name: {
            **_OLMOE, "name": name, "vocab_size": 51200, "max_position_embeddings": 2048, "norm": "layernorm",
            "qk_norm": False, "num_experts": 0, "num_layers": layers, "hidden_size": hidden,
            "num_heads": heads, "intermediate_size": 8 * hidden // 3 // 8 * 8,
        }
        for name, layers, hidden, heads in (
            ("mula-gpt-22b", 48, 6144, 64),
            ("mula-gpt-175b", 96, 12288, 96),
            ("mula-gpt-1t", 128, 25600, 160),
        )
    },
    # The DeepSeek-V3 family (docs/models.md). A tiny test shape: every feature on (MLA with a q latent,
    # a dense first block, one shared expert, sigmoid routing over 4 groups of which 2, scaling, bias).
    "deepseek-v3-tiny": {
        **_DEEPSEEK_V3, "name": "deepseek-v3-tiny", "vocab_size": 4096, "hidden_size": 128, "num_layers": 4,
        "num_heads": 4, "max_position_embeddings": 1024, "intermediate_size": 384, "num_experts": 16,
        "top_k": 4, "expert_intermediate_size": 64, "n_group": 4, "topk_group": 2, "num_dense_layers": 1,
        "q_lora_rank": 64, "kv_lora_rank": 32, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16,
        "v_head_dim": 32,
    },
    # = DeepSeek-V3 (-Base), deepseek-ai/DeepSeek-V3 config.json: 671B parameters, 37B active, plus the one
    # multi-token prediction module (num_nextn_predict_layers: 1; its 14B published parameters, 11.6B without
    # the copies of the embedding and head it shares, are not in the 671B: `num_mtp_params`). Its loss
    # weight is the report's 0.3 of the first 10T tokens; the report lowers it to 0.1 for the last 4.8T:
    # a run continuing from there sets `mtp_loss_weight: 0.1` in its overrides (a training setting).
    "deepseek-v3-671b": {**_DEEPSEEK_V3, "name": "deepseek-v3-671b", "mtp_depth": 1, "mtp_loss_weight": 0.3},
    # = Moonlight-16B-A3B (moonshotai/Moonlight-16B-A3B config.json, a DeepseekV3ForCausalLM; arXiv 2502.16982):
    # DeepSeek-V2-Lite's scale (27 layers, 64 experts top-6, 2 shared, no q latent) with V3's sigmoid router
    "deepseek-v3-16b": {
        **_DEEPSEEK_V3, "name": "deepseek-v3-16b", "vocab_size": 163840, "hidden_size": 2048, "num_layers": 27,
        "num_heads": 16, "max_position_embeddings": 8192, "rope_theta": 50000.0, "norm_eps": 1e-5,
        "intermediate_size": 11264, "num_experts": 64, "top_k": 6, "expert_intermediate_size": 1408,
        "num_shared_experts": 2, "num_dense_layers": 1, "n_group": 1, "topk_group": 1,
        "routed_scaling_factor": 2.446, "q_lora_rank": None,
    },
    # Optimus' 1.1T DeepSeek-V3 variant (IntelLabs/Optimus-LM submit_dsv3-1trillion_job.pbs:
    # MODEL_CHOICE=deepseek-ai/DeepSeek-V3--N264-L96, i.e. DeepSeek-V3 with 96 layers and 264 routed
    # experts, everything else as published; optimus/config_utils.py): 1.11T parameters, 58B active
    "deepseek-v3-1.1t": {**_DEEPSEEK_V3, "name": "deepseek-v3-1.1t", "num_layers": 96, "num_experts": 264},
}  # fmt: skip
