"""Deterministic random checkpoints for the benchmark, in Hugging Face layout, written with MLX.

Each architecture is a config.json (the keys the hub checkpoints carry) plus bf16 safetensors
with hub tensor names, so mlxc and the peer (mlx-lm) load the *same file*. Values are
``N(0, 1/fan_in)`` from one MLX key per tensor (the tensor's name hashed into the seed), so a
checkpoint is the same on every machine and in every run. No transformers or torch needed.

Sizes:
  medium (GPU): hidden 2048, 16 layers, realistic head dims, vocab and expert counts
                (gemma3_text: Gemma-3-1B's widths, 18 layers; qwen3_moe: experts 256 wide;
                nemotron_h: Nemotron-H-8B's layer mix and Mamba2 widths, 16 layers;
                deepseek_v3, glm4_moe_lite: their attention widths, experts 512 wide)
  small  (CPU): hidden 1024, 8 layers, vocab 32k, so a CPU run takes minutes
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx

SIZES = ("small", "medium")

# --- configs ---------------------------------------------------------------------------------


def _llama(size: str) -> dict:
    # Llama-3.2-1B shape at medium (hidden 2048, 16 layers, 32 x 64 heads, 8 kv heads, tied).
    small = size == "small"
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 1024 if small else 2048,
        "num_hidden_layers": 8 if small else 16,
        "num_attention_heads": 16 if small else 32,
        "num_key_value_heads": 4 if small else 8,
        "head_dim": 64,
        "intermediate_size": 4096 if small else 8192,
        "vocab_size": 32000 if small else 128256,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "torch_dtype": "bfloat16",
    }


def _qwen3(size: str) -> dict:
    # Qwen3-1.7B shape at medium, 16 of its 28 layers (Qwen3-0.6B widths at small).
    small = size == "small"
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 1024 if small else 2048,
        "num_hidden_layers": 8 if small else 16,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 3072 if small else 6144,
        "vocab_size": 32000 if small else 151936,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": True,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "torch_dtype": "bfloat16",
    }


def _nemotron_block(attn: str, ffn_mult: float | None, group: int = 8) -> dict:
    return {
        "attention": {
            "n_heads_in_group": group if attn == "gqa" else None,
            "no_op": attn == "no_op",
            "num_sink_tokens": None,
            "replace_with_linear": False,
            "sparsify": None,
            "unshifted_sink": False,
            "use_prefill_window_in_sink_attention": False,
            "window_length": None,
        },
        "ffn": {
            "ffn_mult": ffn_mult,
            "no_op": ffn_mult is None,
            "replace_with_linear": False,
            "sparsify": None,
        },
    }


def _nemotron_nas(size: str) -> dict:
    # DeciLM / Llama-Nemotron-Super style: per-layer kv heads and FFN widths, some attention
    # blocks removed (no_op). Linear replacements are left out: mlx-lm names them differently.
    small = size == "small"
    n = 8 if small else 16
    pattern = [("gqa", 2.625, 8), ("gqa", 1.3125, 4), ("no_op", 2.625, 8), ("gqa", 5.25, 8)]
    blocks = [_nemotron_block(a, f, g) for a, f, g in (pattern * n)[:n]]
    return {
        "architectures": ["DeciLMForCausalLM"],
        "model_type": "nemotron-nas",
        "hidden_size": 1024 if small else 2048,
        "num_hidden_layers": n,
        "num_attention_heads": 16,
        "num_key_value_heads": None,
        "intermediate_size": None,
        "block_configs": blocks,
        "vocab_size": 32000 if small else 128256,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "torch_dtype": "bfloat16",
    }


def _mistral4(size: str) -> dict:
    # Mistral-Small-4 text model, scaled down: MLA (q LoRA, latent KV), MoE with a shared
    # expert and one dense first layer, yarn RoPE and the Llama-4 query scale.
    small = size == "small"
    return {
        "architectures": ["Mistral4ForCausalLM"],
        "model_type": "mistral4",
        "hidden_size": 1024 if small else 2048,
        "num_hidden_layers": 8 if small else 16,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "q_lora_rank": 384 if small else 768,
        "kv_lora_rank": 256,
        "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 64,
        "qk_head_dim": 128,
        "head_dim": 128,
        "v_head_dim": 64 if small else 128,
        "intermediate_size": 3072 if small else 6144,
        "moe_intermediate_size": 512,
        "n_routed_experts": 16 if small else 32,
        "num_experts_per_tok": 4,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
        "vocab_size": 32768 if small else 131072,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "attention_bias": False,
        "rope_interleave": True,
        "tie_word_embeddings": False,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 8192,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "llama_4_scaling_beta": 0.1,
            "partial_rotary_factor": 0.5,
        },
        "dtype": "bfloat16",
    }


def _gemma3_text(size: str) -> dict:
    # Gemma-3-1B's widths (hidden 1152, 4 x 256 heads, 1 kv head, GeGLU 6912) at medium with 18
    # of its 26 layers: five sliding-window layers (window 512) to each full one, as released.
    # Every key of gemma-3-1b-it's config.json (tests/fixtures/gemma3).
    small = size == "small"
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_logit_softcapping": None,
        "bos_token_id": 2,
        "cache_implementation": "hybrid",
        "eos_token_id": [1, 106],
        "final_logit_softcapping": None,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 1024 if small else 1152,
        "initializer_range": 0.02,
        "intermediate_size": 4096 if small else 6912,
        "max_position_embeddings": 32768,
        "model_type": "gemma3_text",
        "num_attention_heads": 4,
        "num_hidden_layers": 8 if small else 18,
        "num_key_value_heads": 1,
        "pad_token_id": 0,
        "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-06,
        "rope_local_base_freq": 10000,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": 512,
        "sliding_window_pattern": 6,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.50.0.dev0",
        "use_cache": True,
        "vocab_size": 32000 if small else 262144,
    }


def _qwen3_moe(size: str) -> dict:
    # Qwen3-30B-A3B's attention (32 x 128 heads, 4 kv heads), router (128 experts, top 8) and
    # vocabulary at medium, with 16 of its 48 layers and experts a third as wide (256 of 768) so
    # the checkpoint is 7.7 GB rather than 19; small: 32 experts of 256, top 4. Every key of
    # its config.json.
    small = size == "small"
    n = 8 if small else 16
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "decoder_sparse_step": 1,
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 1024 if small else 2048,
        "initializer_range": 0.02,
        "intermediate_size": 3072 if small else 6144,
        "max_position_embeddings": 40960,
        "max_window_layers": n,
        "mlp_only_layers": [],
        "model_type": "qwen3_moe",
        "moe_intermediate_size": 256,
        "norm_topk_prob": True,
        "num_attention_heads": 16 if small else 32,
        "num_experts": 32 if small else 128,
        "num_experts_per_tok": 4 if small else 8,
        "num_hidden_layers": n,
        "num_key_value_heads": 4,
        "output_router_logits": False,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 32000 if small else 151936,
    }


def _nemotron_h(size: str) -> dict:
    # Nemotron-H-8B's layer mix and Mamba2 widths (64-wide heads, state 128, 8 groups, conv 4,
    # SSD chunks of 128; attention without positional encoding, 128-wide heads, 8 kv heads;
    # squared-ReLU MLPs) at hidden 2048 with 16 layers: 7 Mamba2, 2 attention, 7 MLP (its
    # pattern's first 16). small: hidden 1024, 8 layers. Every key of nvidia/Nemotron-H-8B-Base-8K's
    # config.json.
    small = size == "small"
    pattern = "M-M*-M-M" if small else "M-M-M-M*-M-M-M-M"
    hidden = 1024 if small else 2048
    return {
        "architectures": ["NemotronHForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attention_head_dim": 128,
        "bos_token_id": 1,
        "chunk_size": 128,
        "conv_kernel": 4,
        "eos_token_id": 2,
        "expand": 2,
        "head_dim": 128,
        "hidden_dropout": 0.0,
        "hidden_size": hidden,
        "hybrid_override_pattern": pattern,
        "initializer_range": 0.02,
        "intermediate_size": 4 * hidden,
        "layer_norm_epsilon": 1e-05,
        "mamba_head_dim": 64,
        "mamba_hidden_act": "silu",
        "mamba_num_heads": 2 * hidden // 64,
        "mamba_proj_bias": False,
        "max_position_embeddings": 8192,
        "mlp_bias": False,
        "mlp_hidden_act": "relu2",
        "model_type": "nemotron_h",
        "n_groups": 8,
        "num_attention_heads": hidden // 128,
        "num_hidden_layers": len(pattern),
        "num_key_value_heads": 8 if not small else 2,
        "num_logits_to_keep": 1,
        "pad_token_id": 0,
        "rescale_prenorm_residual": True,
        "residual_in_fp32": False,
        "rms_norm_eps": 1e-05,
        "sliding_window": None,
        "ssm_state_size": 128,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.48.0.dev0",
        "use_bias": False,
        "use_cache": True,
        "use_conv_bias": True,
        "use_mamba_kernels": True,
        "vocab_size": 32000 if small else 131072,
    }


def _deepseek_v3(size: str) -> dict:
    # DeepSeek-V3's attention (q LoRA 1536, latent 512, 128 + 64 qk dims, 128 v dims), router
    # (sigmoid with e_score_correction_bias, 8 of 64 experts in 4 of 8 groups, scaling 2.5,
    # one shared expert) and vocabulary at medium, hidden 2048 with 16 layers (one dense) of
    # its 61 and experts 512 wide (of 2048), so the checkpoint is ~8 GB; small: hidden 1024,
    # 8 layers, 16 experts of 256. Every key of its config.json but quantization_config (these
    # weights are bf16).
    small = size == "small"
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "auto_map": {
            "AutoConfig": "configuration_deepseek.DeepseekV3Config",
            "AutoModel": "modeling_deepseek.DeepseekV3Model",
            "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
        },
        "bos_token_id": 0,
        "eos_token_id": 1,
        "ep_size": 1,
        "first_k_dense_replace": 1,
        "hidden_act": "silu",
        "hidden_size": 1024 if small else 2048,
        "initializer_range": 0.02,
        "intermediate_size": 3072 if small else 6144,
        "kv_lora_rank": 256 if small else 512,
        "max_position_embeddings": 163840,
        "model_type": "deepseek_v3",
        "moe_intermediate_size": 256 if small else 512,
        "moe_layer_freq": 1,
        "n_group": 4 if small else 8,
        "n_routed_experts": 16 if small else 64,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_attention_heads": 16,
        "num_experts_per_tok": 4 if small else 8,
        "num_hidden_layers": 8 if small else 16,
        "num_key_value_heads": 16,
        "num_nextn_predict_layers": 1,
        "q_lora_rank": 384 if small else 1536,
        "qk_nope_head_dim": 64 if small else 128,
        "qk_rope_head_dim": 32 if small else 64,
        "rms_norm_eps": 1e-06,
        "rope_scaling": {
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 40,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
            "type": "yarn",
        },
        "rope_theta": 10000,
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",
        "tie_word_embeddings": False,
        "topk_group": 2 if small else 4,
        "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16",
        "transformers_version": "4.46.3",
        "use_cache": True,
        "v_head_dim": 64 if small else 128,
        "vocab_size": 32000 if small else 129280,
    }


def _glm4_moe_lite(size: str) -> dict:
    # GLM-4.7-Flash's widths at medium (hidden 2048, 20 heads, q LoRA 768, latent 512, 192 + 64
    # qk dims, 256 v dims, 4 of 64 experts plus a shared one, scaling 1.8, vocabulary), with 16
    # of its 47 layers (one dense) and experts a third as wide (512 of 1536): ~8 GB; small:
    # hidden 1024, 8 layers, 16 experts of 256. Every key of its config.json.
    small = size == "small"
    return {
        "architectures": ["Glm4MoeLiteForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "dtype": "bfloat16",
        "eos_token_id": [1, 2],
        "first_k_dense_replace": 1,
        "hidden_act": "silu",
        "hidden_size": 1024 if small else 2048,
        "intermediate_size": 3072 if small else 10240,
        "kv_lora_rank": 256 if small else 512,
        "max_position_embeddings": 202752,
        "model_type": "glm4_moe_lite",
        "moe_intermediate_size": 256 if small else 512,
        "n_group": 1,
        "n_routed_experts": 16 if small else 64,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_attention_heads": 16 if small else 20,
        "num_experts_per_tok": 4,
        "num_hidden_layers": 8 if small else 16,
        "num_key_value_heads": 16 if small else 20,
        "num_nextn_predict_layers": 1,
        "pad_token_id": 0,
        "partial_rotary_factor": 1.0,
        "q_lora_rank": 384 if small else 768,
        "qk_nope_head_dim": 64 if small else 192,
        "qk_rope_head_dim": 32 if small else 64,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "routed_scaling_factor": 1.8,
        "tie_word_embeddings": False,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "transformers_version": "5.0.0.dev0",
        "use_cache": True,
        "v_head_dim": 128 if small else 256,
        "vocab_size": 32000 if small else 154880,
    }


def _qwen2(size: str) -> dict:
    # Qwen2.5-3B's widths at medium (hidden 2048, 16 x 128 heads, 2 kv heads, q/k/v biases,
    # SwiGLU 11008, tied, vocabulary) with 16 of its 36 layers; small: hidden 1024, 8 layers,
    # 16 x 64 heads. Every key of its config.json.
    small = size == "small"
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151643,
        "hidden_act": "silu",
        "hidden_size": 1024 if small else 2048,
        "initializer_range": 0.02,
        "intermediate_size": 4096 if small else 11008,
        "max_position_embeddings": 32768,
        "max_window_layers": 8 if small else 16,
        "model_type": "qwen2",
        "num_attention_heads": 16,
        "num_hidden_layers": 8 if small else 16,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 32768,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.40.1",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 32000 if small else 151936,
    }


def _deepseek_v2(size: str) -> dict:
    # DeepSeek-V2-Lite's attention (no q LoRA, latent 512, 128 + 64 qk dims, 128 v dims), router
    # (softmax, greedy top 6 of 64, two shared experts) and vocabulary at medium, hidden 2048
    # with 16 of its 27 layers (one dense) and experts 512 wide (of 1408), ~7 GB; small: hidden
    # 1024, 8 layers, 16 experts of 256. Every key of its config.json.
    small = size == "small"
    return {
        "architectures": ["DeepseekV2ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "auto_map": {
            "AutoConfig": "configuration_deepseek.DeepseekV2Config",
            "AutoModel": "modeling_deepseek.DeepseekV2Model",
            "AutoModelForCausalLM": "modeling_deepseek.DeepseekV2ForCausalLM",
        },
        "aux_loss_alpha": 0.001,
        "bos_token_id": 100000,
        "eos_token_id": 100001,
        "ep_size": 1,
        "first_k_dense_replace": 1,
        "hidden_act": "silu",
        "hidden_size": 1024 if small else 2048,
        "initializer_range": 0.02,
        "intermediate_size": 3072 if small else 10944,
        "kv_lora_rank": 256 if small else 512,
        "max_position_embeddings": 163840,
        "model_type": "deepseek_v2",
        "moe_intermediate_size": 256 if small else 512,
        "moe_layer_freq": 1,
        "n_group": 1,
        "n_routed_experts": 16 if small else 64,
        "n_shared_experts": 2,
        "norm_topk_prob": False,
        "num_attention_heads": 16,
        "num_experts_per_tok": 6,
        "num_hidden_layers": 8 if small else 16,
        "num_key_value_heads": 16,
        "pretraining_tp": 1,
        "q_lora_rank": None,
        "qk_nope_head_dim": 64 if small else 128,
        "qk_rope_head_dim": 32 if small else 64,
        "rms_norm_eps": 1e-06,
        "rope_scaling": {
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 40,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
            "original_max_position_embeddings": 4096,
            "type": "yarn",
        },
        "rope_theta": 10000,
        "routed_scaling_factor": 1.0,
        "scoring_func": "softmax",
        "seq_aux": True,
        "tie_word_embeddings": False,
        "topk_group": 1,
        "topk_method": "greedy",
        "torch_dtype": "bfloat16",
        "transformers_version": "4.33.1",
        "use_cache": True,
        "v_head_dim": 64 if small else 128,
        "vocab_size": 32000 if small else 102400,
    }


def _minicpm3(size: str) -> dict:
    # MiniCPM3-4B's widths at medium (hidden 2560, 40 heads, q LoRA 768, latent 256, 64 + 32 qk
    # dims, v dims hidden / heads, SwiGLU 6400, vocabulary, scale_emb / dim_model_base /
    # scale_depth) with 16 of its 62 layers; small: hidden 1024, 16 heads, 8 layers. LongRoPE
    # with 16 factors each (one per rotary pair), smooth made-up values, not the released ones:
    # they set the rotary frequencies, not the work. Every key of its config.json.
    small = size == "small"
    pairs = 16  # qk_rope_head_dim / 2
    return {
        "architectures": ["MiniCPM3ForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_minicpm.MiniCPM3Config",
            "AutoModel": "modeling_minicpm.MiniCPM3Model",
            "AutoModelForCausalLM": "modeling_minicpm.MiniCPM3ForCausalLM",
        },
        "bos_token_id": 1,
        "eos_token_id": [2, 73440],
        "hidden_act": "silu",
        "initializer_range": 0.1,
        "hidden_size": 1024 if small else 2560,
        "num_hidden_layers": 8 if small else 16,
        "intermediate_size": 2560 if small else 6400,
        "max_position_embeddings": 32768,
        "model_type": "minicpm3",
        "num_attention_heads": 16 if small else 40,
        "num_key_value_heads": 16 if small else 40,
        "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 2 * pairs,
        "q_lora_rank": 384 if small else 768,
        "kv_lora_rank": 256,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "type": "longrope",
            "long_factor": [round(1.0 + 0.5 * i, 2) for i in range(pairs)],
            "short_factor": [round(1.0 + 0.05 * i, 2) for i in range(pairs)],
            "original_max_position_embeddings": 32768,
        },
        "rope_theta": 10000.0,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.41.0",
        "use_cache": True,
        "vocab_size": 32000 if small else 73448,
        "scale_emb": 12,
        "dim_model_base": 256,
        "scale_depth": 1.4,
    }


def _gpt_oss(size: str) -> dict:
    # gpt-oss-20b's attention (64 x 64 heads, 8 kv heads, biases, sinks, 128-token windows on
    # every other layer, yarn), router (4 of 32 experts) and vocabulary at medium, hidden 2880
    # with 16 of its 24 layers and experts a third as wide (960 of 2880), ~12 GB; small: hidden
    # 1024, 16 heads, 8 layers, 16 experts of 256. bf16 experts, as the bf16 hub conversions
    # and transformers 5 name them (the released MXFP4 blocks are a different file layout).
    # Every key of its config.json but quantization_config.
    small = size == "small"
    layers = 8 if small else 16
    return {
        "architectures": ["GptOssForCausalLM"],
        "attention_bias": True,
        "attention_dropout": 0.0,
        "eos_token_id": 200002,
        "experts_per_token": 4,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 1024 if small else 2880,
        "initial_context_length": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 256 if small else 960,
        "layer_types": ["sliding_attention", "full_attention"] * (layers // 2),
        "max_position_embeddings": 131072,
        "model_type": "gpt_oss",
        "num_attention_heads": 16 if small else 64,
        "num_experts_per_tok": 4,
        "num_hidden_layers": layers,
        "num_key_value_heads": 4 if small else 8,
        "num_local_experts": 16 if small else 32,
        "output_router_logits": False,
        "pad_token_id": 31999 if small else 199999,  # within the vocabulary
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "rope_type": "yarn",
            "truncate": False,
        },
        "rope_theta": 150000,
        "router_aux_loss_coef": 0.9,
        "sliding_window": 128,
        "swiglu_limit": 7.0,
        "tie_word_embeddings": False,
        "transformers_version": "4.55.0.dev0",
        "use_cache": True,
        "vocab_size": 32000 if small else 201088,
    }


def _jamba(size: str) -> dict:
    # Jamba-1.5-Mini's layer plan (attention every 8th layer from 4, 16 experts, top 2, on every
    # other layer from 1; Mamba state 16, conv 4, expand 2) at hidden 2048 with 16 of its 32
    # layers, 16 x 128 heads, 8 kv heads, SwiGLU 7168 (3.5x hidden, as released), ~13 GB; small:
    # hidden 1024, 8 layers, 8 experts of 2048. Every key of its config.json.
    small = size == "small"
    hidden = 1024 if small else 2048
    return {
        "architectures": ["JambaForCausalLM"],
        "attention_dropout": 0.0,
        "attn_layer_offset": 4,
        "attn_layer_period": 8,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "expert_layer_offset": 1,
        "expert_layer_period": 2,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": 2048 if small else 7168,
        "mamba_conv_bias": True,
        "mamba_d_conv": 4,
        "mamba_d_state": 16,
        "mamba_dt_rank": hidden // 16,
        "mamba_expand": 2,
        "mamba_proj_bias": False,
        "max_position_embeddings": 262144,
        "model_type": "jamba",
        "num_attention_heads": 16,
        "num_experts": 8 if small else 16,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 8 if small else 16,
        "num_key_value_heads": 4 if small else 8,
        "num_logits_to_keep": 1,
        "output_router_logits": False,
        "pad_token_id": 0,
        "rms_norm_eps": 1e-06,
        "router_aux_loss_coef": 0.001,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.40.2",
        "use_cache": True,
        "use_mamba_kernels": True,
        "vocab_size": 32000 if small else 65536,
    }


def _granitemoehybrid(size: str) -> dict:
    # granite-4.0-h-tiny's widths at medium (hidden 1536, 12 x 128 heads, 4 kv heads, no
    # positional encoding, 6 of 64 experts 512 wide plus a 1024-wide shared MLP on every layer,
    # Mamba2 48 x 64 heads, state 128, one group, vocabulary, tied) with the first 16 of its 40
    # layers (two attention); small: hidden 1024, 8 layers (one attention), 16 experts of 256.
    # Every key of its config.json.
    small = size == "small"
    layers = (
        ["mamba"] * 5
        + ["attention"]
        + ["mamba"] * (2 if small else 9)
        + ([] if small else ["attention"])
    )
    hidden = 1024 if small else 1536
    return {
        "architectures": ["GraniteMoeHybridForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attention_multiplier": 0.0078125,
        "bos_token_id": 100257,
        "eos_token_id": 100257,
        "embedding_multiplier": 12,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.1,
        "intermediate_size": 256 if small else 512,
        "layer_types": layers,
        "logits_scaling": 6,
        "mamba_chunk_size": 256,
        "mamba_conv_bias": True,
        "mamba_d_conv": 4,
        "mamba_d_head": 64,
        "mamba_d_state": 128,
        "mamba_expand": 2,
        "mamba_n_groups": 1,
        "mamba_n_heads": 2 * hidden // 64,
        "mamba_proj_bias": False,
        "max_position_embeddings": 131072,
        "model_type": "granitemoehybrid",
        "normalization_function": "rmsnorm",
        "num_attention_heads": 8 if small else 12,
        "num_experts_per_tok": 6,
        "num_hidden_layers": len(layers),
        "num_key_value_heads": 4,
        "num_local_experts": 16 if small else 64,
        "output_router_logits": False,
        "pad_token_id": 31999 if small else 100256,  # within the vocabulary
        "position_embedding_type": "nope",
        "residual_multiplier": 0.22,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 10000,
        "router_aux_loss_coef": 0.0,
        "shared_intermediate_size": 512 if small else 1024,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.56.0",
        "use_cache": True,
        "vocab_size": 32000 if small else 100352,
    }


CONFIGS = {
    "llama": _llama,
    "qwen3": _qwen3,
    "nemotron_nas": _nemotron_nas,
    "mistral4": _mistral4,
    "gemma3_text": _gemma3_text,
    "qwen3_moe": _qwen3_moe,
    "nemotron_h": _nemotron_h,
    "deepseek_v3": _deepseek_v3,
    "glm4_moe_lite": _glm4_moe_lite,
    "qwen2": _qwen2,
    "deepseek_v2": _deepseek_v2,
    "minicpm3": _minicpm3,
    "gpt_oss": _gpt_oss,
    "jamba": _jamba,
    "granitemoehybrid": _granitemoehybrid,
}
ARCHS = tuple(CONFIGS)


def config(arch: str, size: str) -> dict:
    if arch not in CONFIGS:
        raise ValueError(f"unknown arch {arch!r}; known: {', '.join(ARCHS)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; known: {', '.join(SIZES)}")
    return CONFIGS[arch](size)


# --- tensor names and shapes -----------------------------------------------------------------


def _nemotron_ffn(mult: float, hidden: int) -> int:
    n = int(2 * round(mult, 6) * hidden / 3)  # DeciLM / mlx-lm rounding: up to 256
    return n if n % 256 == 0 else n + 256 - n % 256


def shapes(cfg: dict) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Hub tensor names and shapes of ``cfg`` (what the HF checkpoint would hold)."""
    mt = cfg["model_type"]
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    if mt == "nemotron_h":
        yield from _nemotron_h_shapes(cfg)
        return
    yield "model.embed_tokens.weight", (v, h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        if mt in ("llama", "qwen3", "qwen3_moe", "gemma3_text"):
            nh, kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
            yield p + "input_layernorm.weight", (h,)
            yield from _gqa(p, h, nh, kv, hd)
            if mt != "llama":
                yield p + "self_attn.q_norm.weight", (hd,)
                yield p + "self_attn.k_norm.weight", (hd,)
            yield p + "post_attention_layernorm.weight", (h,)
            if mt == "gemma3_text":
                yield p + "pre_feedforward_layernorm.weight", (h,)
                yield p + "post_feedforward_layernorm.weight", (h,)
            if mt == "qwen3_moe":
                yield from _qwen3_moe_mlp(p + "mlp.", cfg)
            else:
                yield from _swiglu(p + "mlp.", h, cfg["intermediate_size"])
        elif mt == "nemotron-nas":
            blk = cfg["block_configs"][i]
            nh = cfg["num_attention_heads"]
            if not blk["attention"]["no_op"]:
                yield p + "input_layernorm.weight", (h,)
                kv = nh // blk["attention"]["n_heads_in_group"]
                yield from _gqa(p, h, nh, kv, h // nh)
            if not blk["ffn"]["no_op"]:
                yield p + "post_attention_layernorm.weight", (h,)
                yield from _swiglu(p + "mlp.", h, _nemotron_ffn(blk["ffn"]["ffn_mult"], h))
        elif mt in ("mistral4", "deepseek_v3", "glm4_moe_lite", "deepseek_v2", "minicpm3"):
            yield from _mla_layer(p, cfg, i)
        elif mt == "qwen2":
            yield p + "input_layernorm.weight", (h,)
            nh, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
            yield from _gqa(p, h, nh, kv, h // nh, qkv_bias=True)
            yield p + "post_attention_layernorm.weight", (h,)
            yield from _swiglu(p + "mlp.", h, cfg["intermediate_size"])
        elif mt == "gpt_oss":
            yield from _gpt_oss_layer(p, cfg)
        elif mt == "jamba":
            yield from _jamba_layer(p, cfg, i)
        elif mt == "granitemoehybrid":
            yield from _granite_layer(p, cfg, i)
        else:
            raise ValueError(mt)
    yield ("model.final_layernorm.weight" if mt == "jamba" else "model.norm.weight"), (h,)
    # Gemma's configs leave tie_word_embeddings out: tied, and the hub files hold no lm_head.
    if not cfg.get("tie_word_embeddings", mt == "gemma3_text"):
        yield "lm_head.weight", (v, h)


def _gqa(p: str, h: int, nh: int, kv: int, hd: int, qkv_bias=False, o_bias=False):
    for name, rows in (("q", nh * hd), ("k", kv * hd), ("v", kv * hd)):
        yield f"{p}self_attn.{name}_proj.weight", (rows, h)
        if qkv_bias:
            yield f"{p}self_attn.{name}_proj.bias", (rows,)
    yield p + "self_attn.o_proj.weight", (h, nh * hd)
    if o_bias:
        yield p + "self_attn.o_proj.bias", (h,)


def _swiglu(p: str, h: int, inter: int):
    yield p + "gate_proj.weight", (inter, h)
    yield p + "up_proj.weight", (inter, h)
    yield p + "down_proj.weight", (h, inter)


def _qwen3_moe_mlp(p: str, cfg: dict):
    # Every layer sparse (mlp_only_layers [], step 1); experts one tensor each, as on the hub.
    h, mi = cfg["hidden_size"], cfg["moe_intermediate_size"]
    yield p + "gate.weight", (cfg["num_experts"], h)
    for e in range(cfg["num_experts"]):
        yield from _swiglu(f"{p}experts.{e}.", h, mi)


def _nemotron_h_shapes(cfg: dict):
    # The hub's names: backbone.*, one `mixer` and one `norm` per layer.
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    yield "backbone.embeddings.weight", (v, h)
    for i, kind in enumerate(cfg["hybrid_override_pattern"]):
        p = f"backbone.layers.{i}."
        yield p + "norm.weight", (h,)
        if kind == "M":
            heads, n = cfg["mamba_num_heads"], cfg["ssm_state_size"]
            inner = heads * cfg["mamba_head_dim"]
            conv = inner + 2 * cfg["n_groups"] * n
            yield p + "mixer.in_proj.weight", (inner + conv + heads, h)
            yield p + "mixer.conv1d.weight", (conv, 1, cfg["conv_kernel"])
            yield p + "mixer.conv1d.bias", (conv,)
            yield p + "mixer.dt_bias", (heads,)
            yield p + "mixer.A_log", (heads,)
            yield p + "mixer.D", (heads,)
            yield p + "mixer.norm.weight", (inner,)
            yield p + "mixer.out_proj.weight", (h, inner)
        elif kind == "*":
            nh, kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
            yield p + "mixer.q_proj.weight", (nh * hd, h)
            yield p + "mixer.k_proj.weight", (kv * hd, h)
            yield p + "mixer.v_proj.weight", (kv * hd, h)
            yield p + "mixer.o_proj.weight", (h, nh * hd)
        else:
            yield p + "mixer.up_proj.weight", (cfg["intermediate_size"], h)
            yield p + "mixer.down_proj.weight", (h, cfg["intermediate_size"])
    yield "backbone.norm_f.weight", (h,)
    yield "lm_head.weight", (v, h)


def _mla_layer(p: str, cfg: dict, i: int):
    # MLA with q LoRA (or DeepSeek-V2-Lite's full q_proj), then a dense SwiGLU (every layer of
    # MiniCPM3) or routed + shared experts: mistral4's experts fused out-major (hub and tf5),
    # DeepSeek's and GLM's one tensor each, with the sigmoid routers' e_score_correction_bias,
    # as on the hub. MiniCPM3's v dims are hidden / heads (its config has no v_head_dim).
    h, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    qr, kvr = cfg["q_lora_rank"], cfg["kv_lora_rank"]
    nope, rope = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"]
    vd = cfg.get("v_head_dim", h // nh)
    yield p + "input_layernorm.weight", (h,)
    if qr is None:
        yield p + "self_attn.q_proj.weight", (nh * (nope + rope), h)
    else:
        yield p + "self_attn.q_a_proj.weight", (qr, h)
        yield p + "self_attn.q_a_layernorm.weight", (qr,)
        yield p + "self_attn.q_b_proj.weight", (nh * (nope + rope), qr)
    yield p + "self_attn.kv_a_proj_with_mqa.weight", (kvr + rope, h)
    yield p + "self_attn.kv_a_layernorm.weight", (kvr,)
    yield p + "self_attn.kv_b_proj.weight", (nh * (nope + vd), kvr)
    yield p + "self_attn.o_proj.weight", (h, nh * vd)
    yield p + "post_attention_layernorm.weight", (h,)
    if i < cfg.get("first_k_dense_replace", cfg["num_hidden_layers"]):
        yield from _swiglu(p + "mlp.", h, cfg["intermediate_size"])
        return
    e, mi = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    yield p + "mlp.gate.weight", (e, h)
    if cfg["model_type"] == "mistral4":
        yield p + "mlp.experts.gate_up_proj", (e, 2 * mi, h)  # fused, out-major (hub and tf5)
        yield p + "mlp.experts.down_proj", (e, h, mi)
    else:
        if cfg.get("scoring_func", "sigmoid") == "sigmoid":
            yield p + "mlp.gate.e_score_correction_bias", (e,)
        for j in range(e):
            yield from _swiglu(f"{p}mlp.experts.{j}.", h, mi)
    yield from _swiglu(p + "mlp.shared_experts.", h, mi * cfg["n_shared_experts"])


def _gpt_oss_layer(p: str, cfg: dict):
    # Experts fused in-major, gate and up interleaved, with biases, as the bf16 hub
    # conversions and transformers 5 hold them; per-head attention sinks.
    h, nh, kv, hd = (
        cfg[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim")
    )
    e, inter = cfg["num_local_experts"], cfg["intermediate_size"]
    yield p + "input_layernorm.weight", (h,)
    yield from _gqa(p, h, nh, kv, hd, qkv_bias=True, o_bias=True)
    yield p + "self_attn.sinks", (nh,)
    yield p + "post_attention_layernorm.weight", (h,)
    yield p + "mlp.router.weight", (e, h)
    yield p + "mlp.router.bias", (e,)
    yield p + "mlp.experts.gate_up_proj", (e, h, 2 * inter)
    yield p + "mlp.experts.gate_up_proj_bias", (e, 2 * inter)
    yield p + "mlp.experts.down_proj", (e, inter, h)
    yield p + "mlp.experts.down_proj_bias", (e, h)


def _jamba_layer(p: str, cfg: dict, i: int):
    # Mamba (selective scan) or attention by period / offset; SwiGLU or experts (one tensor
    # each) by period / offset.
    h = cfg["hidden_size"]
    yield p + "input_layernorm.weight", (h,)
    if i % cfg["attn_layer_period"] == cfg["attn_layer_offset"]:
        nh, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        yield from _gqa(p, h, nh, kv, h // nh)
    else:
        inner, n, r = cfg["mamba_expand"] * h, cfg["mamba_d_state"], cfg["mamba_dt_rank"]
        m = p + "mamba."
        yield m + "in_proj.weight", (2 * inner, h)
        yield m + "conv1d.weight", (inner, 1, cfg["mamba_d_conv"])
        yield m + "conv1d.bias", (inner,)
        yield m + "x_proj.weight", (r + 2 * n, inner)
        yield m + "dt_proj.weight", (inner, r)
        yield m + "dt_proj.bias", (inner,)
        yield m + "A_log", (inner, n)
        yield m + "D", (inner,)
        yield m + "dt_layernorm.weight", (r,)
        yield m + "b_layernorm.weight", (n,)
        yield m + "c_layernorm.weight", (n,)
        yield m + "out_proj.weight", (h, inner)
    yield p + "pre_ff_layernorm.weight", (h,)
    inter = cfg["intermediate_size"]
    if i % cfg["expert_layer_period"] == cfg["expert_layer_offset"]:
        yield p + "feed_forward.router.weight", (cfg["num_experts"], h)
        for j in range(cfg["num_experts"]):
            yield from _swiglu(f"{p}feed_forward.experts.{j}.", h, inter)
    else:
        yield from _swiglu(p + "feed_forward.", h, inter)


def _granite_layer(p: str, cfg: dict, i: int):
    # Mamba2 or attention (no positional encoding) by layer_types; then routed experts fused
    # (gate and up stacked, out-major) and a shared MLP, as on the hub.
    h = cfg["hidden_size"]
    yield p + "input_layernorm.weight", (h,)
    if cfg["layer_types"][i] == "attention":
        nh, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        yield from _gqa(p, h, nh, kv, h // nh)
    else:
        heads, n, groups = cfg["mamba_n_heads"], cfg["mamba_d_state"], cfg["mamba_n_groups"]
        inner = heads * cfg["mamba_d_head"]
        conv = inner + 2 * groups * n
        m = p + "mamba."
        yield m + "in_proj.weight", (inner + conv + heads, h)
        yield m + "conv1d.weight", (conv, 1, cfg["mamba_d_conv"])
        yield m + "conv1d.bias", (conv,)
        yield m + "dt_bias", (heads,)
        yield m + "A_log", (heads,)
        yield m + "D", (heads,)
        yield m + "norm.weight", (inner,)
        yield m + "out_proj.weight", (h, inner)
    yield p + "post_attention_layernorm.weight", (h,)
    e, inter, shared = (
        cfg[k] for k in ("num_local_experts", "intermediate_size", "shared_intermediate_size")
    )
    if e:
        yield p + "block_sparse_moe.router.layer.weight", (e, h)
        yield p + "block_sparse_moe.input_linear.weight", (e, 2 * inter, h)
        yield p + "block_sparse_moe.output_linear.weight", (e, h, inter)
    yield p + "shared_mlp.input_linear.weight", (2 * shared, h)
    yield p + "shared_mlp.output_linear.weight", (h, shared)


# --- writing ---------------------------------------------------------------------------------


def _tensor(name: str, shape: tuple[int, ...], seed: int) -> mx.array:
    key = mx.random.key((zlib.crc32(name.encode()) + 1_000_003 * seed) % (2**31))
    if len(shape) == 1:  # norms: ~1
        return (1.0 + 0.05 * mx.random.normal(shape, key=key)).astype(mx.bfloat16)
    return (mx.random.normal(shape, key=key) * shape[-1] ** -0.5).astype(mx.bfloat16)


def write_checkpoint(path: Path, arch: str, size: str, seed: int = 0) -> Path:
    """Write the ``arch``/``size`` checkpoint to ``path`` (bf16, sharded at 2 GB); returns it."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = config(arch, size)
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    write_tensors(path, shapes(cfg), seed)
    return path


def write_tensors(path: Path, named_shapes, seed: int = 0) -> None:
    """Random bf16 tensors of ``(name, shape)`` pairs as hub-style safetensors shards + index."""
    shard: dict[str, mx.array] = {}
    shard_bytes, files, weight_map = 0, [], {}

    def flush():
        nonlocal shard, shard_bytes
        if shard:
            name = f"model-{len(files) + 1:05d}.safetensors"
            mx.save_safetensors(str(path / name), shard, metadata={"format": "pt"})
            files.append(name)
            weight_map.update(dict.fromkeys(shard, name))
            shard, shard_bytes = {}, 0

    for name, shape in named_shapes:
        t = _tensor(name, shape, seed)
        mx.eval(t)
        shard[name] = t
        shard_bytes += t.nbytes
        if shard_bytes > 2 << 30:
            flush()
    flush()
    index = {"metadata": {}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index) + "\n")


def parameter_count(arch: str, size: str) -> int:
    total = 0
    for _, shape in shapes(config(arch, size)):
        n = 1
        for d in shape:
            n *= d
        total += n
    return total


# --- a tokenizer, for serving ----------------------------------------------------------------

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>"
    "{{ message['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def write_tokenizer(
    path: Path,
    vocab_size: int,
    specials: tuple[str, ...] = ("<s>", "</s>", "<pad>", "<unk>"),
    chat_template: str = CHAT_TEMPLATE,
    named: dict[str, str] | None = None,
) -> None:
    """A word-level tokenizer with exactly ``vocab_size`` tokens and a chat template.

    Every id a random model can emit decodes to a visible word (a BPE trained on a small corpus
    would leave most ids without text, and servers stream nothing for them), and prompts made
    of ordinary English words encode to real ids. Enough for ``mlxc serve`` and
    ``mlx_lm.server`` to run a random checkpoint; ``tokenizers`` only. ``specials`` get ids 0,
    1, ... and are matched whole in text (a VL model's image placeholders); ``named``: the
    tokenizer_config.json roles (bos/eos/pad/unk_token), default the first four specials'.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from bench.serve_load import WORDS

    named = named or {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    named = {"unk_token": "<unk>", **named}
    specials = [*dict.fromkeys([*specials, named["unk_token"]])]
    # The words bench.serve_load writes its prompts with, so they encode to real ids.
    words = [*dict.fromkeys(WORDS), "request"]
    vocab = {w: i for i, w in enumerate(specials + [w for w in words if w not in specials])}
    for i in range(len(vocab), vocab_size):
        vocab[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=named["unk_token"]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    path = Path(path)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                **named,
                "chat_template": chat_template,
                "model_max_length": 131072,
            },
            indent=2,
        )
        + "\n"
    )


# --- vision-language checkpoints -------------------------------------------------------------
# Hub-format config.json (transformers-4 keys, as the released checkpoints carry them), hub
# tensor names, a word-level tokenizer with the family's special tokens and chat template, and
# the family's preprocessor/processor files. Tensor shapes come from transformers' own classes
# built on the meta device (no memory, no torch math), renamed to the hub layout.

VL_ARCHS = ("qwen2_vl", "qwen3_vl", "mistral3")
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]

# Qwen VL: the chat template of Qwen2-VL-Instruct (images and videos in content parts).
QWEN_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture "
    "{{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video "
    "{{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN_SPECIALS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
QWEN_IDS = {  # config.json's ids of QWEN_SPECIALS
    "vision_start_token_id": 3,
    "vision_end_token_id": 4,
    "image_token_id": 5,
    "video_token_id": 6,
}
# Mistral 3 / Pixtral: [IMG] placeholders in [INST] turns.
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}[INST]"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for block in message['content'] %}{% if block['type'] == 'text' %}{{ block['text'] }}"
    "{% elif block['type'] == 'image' or block['type'] == 'image_url' %}[IMG]{% endif %}"
    "{% endfor %}{% endif %}[/INST]{% elif message['role'] == 'assistant' %}"
    "{{ message['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)
MISTRAL_SPECIALS = (
    "<unk>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[IMG]",
    "[IMG_BREAK]",
    "[IMG_END]",
)
MISTRAL_IMAGE_TOKEN = MISTRAL_SPECIALS.index("[IMG]")


def _qwen2_vl(size: str) -> dict:
    # Qwen2-VL-2B-Instruct's config.json key for key. medium: its text widths (hidden 1536,
    # 12 x 128 heads, 2 kv heads, MLP 8960, vocab 151936) with 16 of its 28 layers, and its
    # whole vision tower (32 blocks of 1280, patch 14); small: hidden 1024, 8 layers, vocab 32k,
    # a 4-block tower of 512 at the real patch, merge and temporal sizes.
    small = size == "small"
    hidden = 1024 if small else 1536
    return {
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 2,
        **QWEN_IDS,
        "vision_token_id": 6,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": 4096 if small else 8960,
        "max_position_embeddings": 32768,
        "max_window_layers": 8 if small else 16,
        "model_type": "qwen2_vl",
        "num_attention_heads": hidden // 128,
        "num_hidden_layers": 8 if small else 16,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 32768,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.41.2",
        "use_cache": True,
        "use_sliding_window": False,
        "vision_config": {
            "depth": 4 if small else 32,
            "embed_dim": 512 if small else 1280,
            "mlp_ratio": 4,
            "num_heads": 8 if small else 16,
            "in_chans": 3,
            "hidden_size": hidden,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "spatial_patch_size": 14,
            "temporal_patch_size": 2,
        },
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
        "vocab_size": 32000 if small else 151936,
    }


def _qwen3_vl(size: str) -> dict:
    # Qwen3-VL-2B-Instruct's config.json key for key. medium: its text widths (hidden 2048,
    # 16 x 128 heads, 8 kv heads, MLP 6144, vocab 151936) with 16 of its 28 layers and its
    # whole vision tower (24 blocks of 1024, patch 16, deepstack after blocks 5, 11, 17);
    # small: hidden 1024, 8 layers, vocab 32k, 4 blocks of 512, deepstack after 1 and 2.
    small = size == "small"
    hidden = 1024 if small else 2048
    return {
        "architectures": ["Qwen3VLForConditionalGeneration"],
        "image_token_id": QWEN_IDS["image_token_id"],
        "model_type": "qwen3_vl",
        "text_config": {
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": 0,
            "dtype": "bfloat16",
            "eos_token_id": 2,
            "head_dim": 128,
            "hidden_act": "silu",
            "hidden_size": hidden,
            "initializer_range": 0.02,
            "intermediate_size": 3072 if small else 6144,
            "max_position_embeddings": 262144,
            "model_type": "qwen3_vl_text",
            "num_attention_heads": hidden // 128,
            "num_hidden_layers": 8 if small else 16,
            "num_key_value_heads": 4 if small else 8,
            "rms_norm_eps": 1e-06,
            "rope_scaling": {
                "mrope_interleaved": True,
                "mrope_section": [24, 20, 20],
                "rope_type": "default",
            },
            "rope_theta": 5000000,
            "tie_word_embeddings": True,
            "use_cache": True,
            "vocab_size": 32000 if small else 151936,
        },
        "tie_word_embeddings": True,
        "transformers_version": "4.57.0.dev0",
        "video_token_id": QWEN_IDS["video_token_id"],
        "vision_config": {
            "deepstack_visual_indexes": [1, 2] if small else [5, 11, 17],
            "depth": 4 if small else 24,
            "hidden_act": "gelu_pytorch_tanh",
            "hidden_size": 512 if small else 1024,
            "in_channels": 3,
            "initializer_range": 0.02,
            "intermediate_size": 2048 if small else 4096,
            "model_type": "qwen3_vl",
            "num_heads": 8 if small else 16,
            "num_position_embeddings": 2304,
            "out_hidden_size": hidden,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        "vision_end_token_id": QWEN_IDS["vision_end_token_id"],
        "vision_start_token_id": QWEN_IDS["vision_start_token_id"],
    }


def _mistral3(size: str) -> dict:
    # Mistral-Small-3.1-24B-Instruct-2503's config.json key for key. medium: text hidden 3072
    # with its 32 x 128 heads, 8 kv heads and vocab 131072, MLP 8192, 16 layers, and its whole
    # Pixtral tower (24 layers of 1024, patch 14, image_size 1540); small: hidden 1024, 8
    # layers, vocab 32k, 4 tower layers of 512.
    small = size == "small"
    return {
        "architectures": ["Mistral3ForConditionalGeneration"],
        "image_token_index": MISTRAL_IMAGE_TOKEN,
        "model_type": "mistral3",
        "multimodal_projector_bias": False,
        "projector_hidden_act": "gelu",
        "spatial_merge_size": 2,
        "text_config": {
            "attention_dropout": 0.0,
            "head_dim": 128,
            "hidden_act": "silu",
            "hidden_size": 1024 if small else 3072,
            "initializer_range": 0.02,
            "intermediate_size": 3072 if small else 8192,
            "max_position_embeddings": 131072,
            "model_type": "mistral",
            "num_attention_heads": 8 if small else 32,
            "num_hidden_layers": 8 if small else 16,
            "num_key_value_heads": 2 if small else 8,
            "rms_norm_eps": 1e-05,
            "rope_theta": 1000000000.0,
            "sliding_window": None,
            "use_cache": True,
            "vocab_size": 32000 if small else 131072,
        },
        "torch_dtype": "bfloat16",
        "transformers_version": "4.50.0.dev0",
        "vision_config": {
            "attention_dropout": 0.0,
            "head_dim": 64,
            "hidden_act": "silu",
            "hidden_size": 512 if small else 1024,
            "image_size": 1540,
            "initializer_range": 0.02,
            "intermediate_size": 2048 if small else 4096,
            "model_type": "pixtral",
            "num_attention_heads": 8 if small else 16,
            "num_channels": 3,
            "num_hidden_layers": 4 if small else 24,
            "patch_size": 14,
            "rope_theta": 10000.0,
        },
        "vision_feature_layer": -1,
    }


VL_CONFIGS = {"qwen2_vl": _qwen2_vl, "qwen3_vl": _qwen3_vl, "mistral3": _mistral3}
# transformers' class per family, and its state-dict prefixes -> the hub checkpoints' names.
_VL_CLASSES = {
    "qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration"),
    "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration"),
    "mistral3": ("Mistral3Config", "Mistral3ForConditionalGeneration"),
}
_HUB_PREFIXES = {
    "qwen2_vl": {"model.visual.": "visual.", "model.language_model.": "model."},
    "qwen3_vl": {},  # released with transformers 4.57: the hub already has these names
    "mistral3": {
        "model.vision_tower.": "vision_tower.",
        "model.multi_modal_projector.": "multi_modal_projector.",
        "model.language_model.": "language_model.model.",
        "lm_head.": "language_model.lm_head.",
    },
}


VL_SIZES = ("tiny", *SIZES)


def vl_config(arch: str, size: str) -> dict:
    """``size``: small, medium, or tiny (the tests' size: small's keys, a few hundred wide)."""
    if arch not in VL_CONFIGS:
        raise ValueError(f"unknown VL arch {arch!r}; known: {', '.join(VL_ARCHS)}")
    if size not in VL_SIZES:
        raise ValueError(f"unknown size {size!r}; known: {', '.join(VL_SIZES)}")
    if size != "tiny":
        return VL_CONFIGS[arch](size)
    cfg = VL_CONFIGS[arch]("small")
    text, vision = vl_text_config(cfg), cfg["vision_config"]
    text.update(hidden_size=256, intermediate_size=512, num_hidden_layers=2, vocab_size=512)
    text.update(num_attention_heads=2, num_key_value_heads=2)
    text.update({"max_window_layers": 2} if "max_window_layers" in text else {})
    width = {"embed_dim": 64} if arch == "qwen2_vl" else {"hidden_size": 64}
    vision.update(width, **{"intermediate_size": 128} if arch != "qwen2_vl" else {})
    depth = "num_hidden_layers" if arch == "mistral3" else "depth"
    vision.update({depth: 2, "num_attention_heads" if arch == "mistral3" else "num_heads": 1})
    if arch == "qwen2_vl":
        vision["hidden_size"] = 256
    if arch == "qwen3_vl":
        vision.update(out_hidden_size=256, deepstack_visual_indexes=[0])
    return cfg


def vl_shapes(arch: str, cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Hub tensor names and shapes of ``cfg``: transformers' model on the meta device."""
    import torch
    import transformers

    conf_cls, model_cls = (getattr(transformers, n) for n in _VL_CLASSES[arch])
    with torch.device("meta"):
        model = model_cls(conf_cls(**cfg))
    tied = cfg.get("tie_word_embeddings", False)
    out = []
    for name, t in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue  # the hub files of tied models hold no lm_head
        for old, new in _HUB_PREFIXES[arch].items():
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        out.append((name, tuple(t.shape)))
    return out


def vl_text_config(cfg: dict) -> dict:
    """The text model's keys: nested in text_config, or at the top (Qwen2-VL)."""
    return cfg.get("text_config", cfg)


def write_pixtral_processor(path: Path, patch: int, merge: int, longest_edge: int) -> None:
    """Mistral 3's two processor files as the hub ships them (Mistral-Small-3.1)."""
    pre = {
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": CLIP_MEAN,
        "image_std": CLIP_STD,
        "image_processor_type": "PixtralImageProcessor",
        "patch_size": {"height": patch, "width": patch},
        "processor_class": "PixtralProcessor",
        "resample": 3,
        "rescale_factor": 1 / 255,
        "size": {"longest_edge": longest_edge},
    }
    proc = {
        "image_break_token": "[IMG_BREAK]",
        "image_end_token": "[IMG_END]",
        "image_token": "[IMG]",
        "patch_size": patch,
        "processor_class": "PixtralProcessor",
        "spatial_merge_size": merge,
    }
    (Path(path) / "preprocessor_config.json").write_text(json.dumps(pre, indent=2) + "\n")
    (Path(path) / "processor_config.json").write_text(json.dumps(proc, indent=2) + "\n")


def qwen_preprocessor(arch: str, patch: int, min_pixels: int, max_pixels: int) -> dict:
    """preprocessor_config.json as the hub ships it: Qwen2-VL's top-level min/max_pixels and
    CLIP mean/std, Qwen3-VL's size {shortest_edge, longest_edge} and mean/std 0.5."""
    common = {"patch_size": patch, "temporal_patch_size": 2, "merge_size": 2}
    if arch == "qwen2_vl":
        return {
            "min_pixels": min_pixels,
            "max_pixels": max_pixels,
            **common,
            "image_mean": CLIP_MEAN,
            "image_std": CLIP_STD,
            "image_processor_type": "Qwen2VLImageProcessor",
            "processor_class": "Qwen2VLProcessor",
        }
    return {
        "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
        **common,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "image_processor_type": "Qwen2VLImageProcessorFast",
        "processor_class": "Qwen3VLProcessor",
    }


def write_vl_checkpoint(path: Path, arch: str, size: str, seed: int = 0) -> Path:
    """A complete VL checkpoint directory: config.json, bf16 weights in the hub layout, a
    tokenizer with the family's specials and chat template, and its processor files."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = vl_config(arch, size)
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    write_tensors(path, vl_shapes(arch, cfg), seed)
    vocab = vl_text_config(cfg)["vocab_size"]
    if arch == "mistral3":
        named = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
        write_tokenizer(path, vocab, MISTRAL_SPECIALS, MISTRAL_TEMPLATE, named)
        patch = cfg["vision_config"]["patch_size"]
        write_pixtral_processor(path, patch, cfg["spatial_merge_size"], 1540)
    else:
        named = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
        write_tokenizer(path, vocab, QWEN_SPECIALS, QWEN_TEMPLATE, named)
        patch = cfg["vision_config"]["patch_size"]
        # The hub's pixel bounds: Qwen2-VL 56x56 .. 14x14x4x16384; Qwen3-VL 65536 .. 16777216.
        bounds = (3136, 12845056) if arch == "qwen2_vl" else (65536, 16777216)
        pre = qwen_preprocessor(arch, patch, *bounds)
        (path / "preprocessor_config.json").write_text(json.dumps(pre, indent=2) + "\n")
    return path


def vl_parameter_count(arch: str, size: str) -> int:
    total = 0
    for _, shape in vl_shapes(arch, vl_config(arch, size)):
        n = 1
        for d in shape:
            n *= d
        total += n
    return total


def main(argv: list[str] | None = None) -> None:
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m bench.models",
        description="Write one benchmark checkpoint (with a tokenizer).",
    )
    p.add_argument("--arch", choices=ARCHS, default="llama")
    p.add_argument("--size", choices=SIZES, default="small")
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    out = write_checkpoint(Path(args.out), args.arch, args.size, args.seed)
    write_tokenizer(out, config(args.arch, args.size)["vocab_size"])
    print(f"wrote {out} ({parameter_count(args.arch, args.size) / 1e6:.0f}M parameters)")


if __name__ == "__main__":
    main()
