"""deepseek_v2 (DeepSeek-V2 / V2.5 / V2-Lite): logits against transformers on the latent cache.

Every key of DeepSeek-V2-Lite's config.json, sizes shrunk: no q LoRA (a full q_proj), yarn with
mscale = mscale_all_dim = 0.707 (the prompt passes original_max_position_embeddings, 16),
softmax router with greedy top-k, two shared experts. The V2 / V2.5 variant: q LoRA and
group_limited_greedy over 2 of 4 expert groups, routed_scaling_factor 16. V2-Lite in hub form
(``rope_theta`` + ``rope_scaling``), V2 in transformers-5 form (``rope_parameters``).
"""

from __future__ import annotations

import numpy as np
import pytest
from _mla import (
    check_chunked_prefill_and_decode,
    check_full_forward,
    check_latent_cache,
    reference,
    rerandomise,
    to_hub_config,
)

FIELDS = {  # DeepSeek-V2-Lite
    "attention_bias": False,
    "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": 64,
    "initializer_range": 0.02,
    "intermediate_size": 96,
    "kv_lora_rank": 24,
    "max_position_embeddings": 64,
    "moe_intermediate_size": 16,
    "moe_layer_freq": 1,
    "n_group": 1,
    "n_routed_experts": 8,
    "n_shared_experts": 2,
    "norm_topk_prob": False,
    "num_attention_heads": 4,
    "num_experts_per_tok": 3,
    "num_hidden_layers": 3,
    "num_key_value_heads": 4,
    "pretraining_tp": 1,
    "q_lora_rank": None,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 16,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
    },
    "routed_scaling_factor": 1.0,
    "scoring_func": "softmax",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "topk_method": "greedy",
    "use_cache": True,
    "v_head_dim": 12,
    "vocab_size": 128,
}
V2 = {  # DeepSeek-V2 / V2.5's differences
    "q_lora_rank": 32,
    "n_group": 4,
    "topk_group": 2,
    "topk_method": "group_limited_greedy",
    "routed_scaling_factor": 16.0,
}
HUB_ONLY = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "auto_map": {
        "AutoConfig": "configuration_deepseek.DeepseekV2Config",
        "AutoModel": "modeling_deepseek.DeepseekV2Model",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV2ForCausalLM",
    },
    "transformers_version": "4.33.1",
}


def make_model(seed=0, **overrides):
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    model = DeepseekV2ForCausalLM(DeepseekV2Config(**(FIELDS | overrides))).eval()
    rerandomise(model, seed)
    return model


@pytest.fixture(scope="module", params=["v2-lite-hub", "v2-tf5"])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"deepseek_v2-{request.param}")
    hf = make_model(**(V2 if request.param == "v2-tf5" else {}))
    hf.save_pretrained(path)
    if request.param.endswith("hub"):
        to_hub_config(path, HUB_ONLY)
    return hf, path


def test_logits_match_transformers(checkpoint):
    check_full_forward(*checkpoint)


def test_chunked_prefill_and_decode_equal_full_forward(checkpoint):
    check_chunked_prefill_and_decode(*checkpoint)


def test_latent_cache_holds_the_latent_not_per_head_kv(checkpoint):
    check_latent_cache(checkpoint[1], FIELDS["kv_lora_rank"], FIELDS["qk_rope_head_dim"])


def test_group_limited_greedy_matters():
    """Guard for the tolerance above: limiting the groups moves transformers' logits."""
    ids = np.random.default_rng(2).integers(0, 128, size=(1, 24))
    want = reference(make_model(seed=3, **V2), ids)
    greedy = reference(make_model(seed=3, **(V2 | {"topk_method": "greedy"})), ids)
    assert np.abs(greedy - want).max() > 1e-2


def make_server_checkpoint(path, seed: int = 0):
    """For tests/test_server.py: V2-Lite in hub form, the factory tokenizer's vocab and ids,
    yarn over a 64-token original context."""
    import checkpoints as ckpt

    rope = dict(FIELDS["rope_parameters"], factor=8.0, original_max_position_embeddings=64)
    make_model(
        seed,
        rope_parameters=rope,
        vocab_size=ckpt.VOCAB_SIZE,
        max_position_embeddings=512,
        bos_token_id=ckpt.BOS_ID,
        eos_token_id=ckpt.EOS_ID,
        pad_token_id=ckpt.PAD_ID,
    ).save_pretrained(path)
    to_hub_config(path, HUB_ONLY)
    ckpt.write_tokenizer(path)
    return path
