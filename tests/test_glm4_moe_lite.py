"""glm4_moe_lite (GLM-4.7-Flash): logits against transformers on the latent cache.

Every key of GLM-4.7-Flash's config.json, sizes shrunk: DeepSeek-V3's MLA (q LoRA, default
RoPE, interleaved) and sigmoid router with e_score_correction_bias, routed_scaling_factor 1.8,
a shared expert. Dense or sparse per layer: transformers 5 writes ``mlp_layer_types`` (here not
a prefix, ``sparse, dense, sparse``, so it must win over ``first_k_dense_replace``); the hub
config has only ``first_k_dense_replace`` (and the MTP layer after the stack).
"""

from __future__ import annotations

import json

import pytest
from _mla import (
    check_chunked_prefill_and_decode,
    check_decode_in_cuda_layout,
    check_full_forward,
    check_latent_cache,
    rerandomise,
    to_hub_config,
)
from test_deepseek_v3 import add_mtp_layer

FIELDS = {
    "attention_bias": False,
    "attention_dropout": 0.0,
    "eos_token_id": [1, 2],
    "pad_token_id": 3,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": 64,
    "intermediate_size": 96,
    "kv_lora_rank": 24,
    "max_position_embeddings": 256,
    "moe_intermediate_size": 24,
    "n_group": 1,
    "n_routed_experts": 6,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 4,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 3,
    "num_key_value_heads": 4,
    "num_nextn_predict_layers": 1,
    "partial_rotary_factor": 1.0,
    "q_lora_rank": 32,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "routed_scaling_factor": 1.8,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "use_cache": True,
    "v_head_dim": 12,
    "vocab_size": 128,
}
HUB_ONLY = {"architectures": ["Glm4MoeLiteForCausalLM"], "transformers_version": "4.57.3"}


def make_model(seed=0, **overrides):
    from transformers import Glm4MoeLiteConfig, Glm4MoeLiteForCausalLM

    model = Glm4MoeLiteForCausalLM(Glm4MoeLiteConfig(**(FIELDS | overrides))).eval()
    rerandomise(model, seed)
    return model


def save_hub(model, path):
    """Hub form: no ``mlp_layer_types`` (transformers 4 had none), the MTP layer appended."""
    model.save_pretrained(path)
    cfg = json.loads((path / "config.json").read_text())
    del cfg["mlp_layer_types"]
    (path / "config.json").write_text(json.dumps(cfg))
    to_hub_config(path, HUB_ONLY)
    add_mtp_layer(path, FIELDS["num_hidden_layers"])


@pytest.fixture(scope="module", params=["tf5", "hub"])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"glm4_moe_lite-{request.param}")
    if request.param == "tf5":
        hf = make_model(mlp_layer_types=["sparse", "dense", "sparse"])
        hf.save_pretrained(path)
        assert json.loads((path / "config.json").read_text())["mlp_layer_types"][1] == "dense"
    else:
        hf = make_model()
        assert hf.config.mlp_layer_types == ["dense", "sparse", "sparse"]
        save_hub(hf, path)
    return hf, path


def test_logits_match_transformers(checkpoint):
    check_full_forward(*checkpoint)


def test_chunked_prefill_and_decode_equal_full_forward(checkpoint):
    check_chunked_prefill_and_decode(*checkpoint)


def test_decode_in_cuda_layout_equals_transformers(checkpoint, monkeypatch):
    check_decode_in_cuda_layout(*checkpoint, monkeypatch)


def test_latent_cache_holds_the_latent_not_per_head_kv(checkpoint):
    check_latent_cache(checkpoint[1], FIELDS["kv_lora_rank"], FIELDS["qk_rope_head_dim"])


def make_server_checkpoint(path, seed: int = 0):
    """For tests/test_server.py: hub form, the factory tokenizer's vocab and special ids."""
    import checkpoints as ckpt

    model = make_model(
        seed,
        vocab_size=ckpt.VOCAB_SIZE,
        bos_token_id=ckpt.BOS_ID,
        eos_token_id=ckpt.EOS_ID,
        pad_token_id=ckpt.PAD_ID,
    )
    save_hub(model, path)
    ckpt.write_tokenizer(path)
    return path
