"""deepseek_v3 (DeepSeek-V3 / R1, Kimi-K2): logits against transformers on the latent cache.

Every key of DeepSeek-V3's config.json, sizes shrunk: q LoRA, yarn with mscale and
mscale_all_dim (the prompt passes original_max_position_embeddings, 16, so yarn acts), one dense
layer then sigmoid-routed experts with e_score_correction_bias, 2 of 4 expert groups, a shared
expert. Checkpoints in transformers-5 form (``rope_parameters``, what ``save_pretrained``
writes) and hub form (``rope_theta`` + ``rope_scaling``, the multi-token-prediction layer
``model.layers.{num_hidden_layers}`` stored after the stack, FP8 block-scaled linears); and
Kimi-K2's (``model_type: kimi_k2``, one expert group, its scaling factor and RoPE).
"""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch
from _mla import (
    check_chunked_prefill_and_decode,
    check_decode_in_cuda_layout,
    check_full_forward,
    check_latent_cache,
    reference,
    rerandomise,
    to_hub_config,
)
from safetensors.torch import load_file, save_file
from test_fp8 import BLOCK, from_fp8, to_fp8

FIELDS = {
    "attention_bias": False,
    "attention_dropout": 0.0,
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
    "moe_intermediate_size": 24,
    "moe_layer_freq": 1,
    "n_group": 4,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 4,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 3,
    "num_key_value_heads": 4,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 32,
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
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "tie_word_embeddings": False,
    "topk_group": 2,
    "topk_method": "noaux_tc",
    "use_cache": True,
    "v_head_dim": 12,
    "vocab_size": 128,
}
HUB_ONLY = {  # hub keys transformers 5 does not write back
    "architectures": ["DeepseekV3ForCausalLM"],
    "auto_map": {
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModel": "modeling_deepseek.DeepseekV3Model",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
    },
    "transformers_version": "4.46.3",
}


def make_model(seed=0, **overrides):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    model = DeepseekV3ForCausalLM(DeepseekV3Config(**(FIELDS | overrides))).eval()
    rerandomise(model, seed)
    return model


def add_mtp_layer(path, n_layers: int) -> int:
    """Append DeepSeek's multi-token-prediction layer ``model.layers.{n_layers}`` as the hub
    stores it (a decoder layer plus its embedding, norms, projection and head); its count."""
    weights = load_file(str(path / "model.safetensors"))
    last = f"model.layers.{n_layers - 1}."
    mtp = f"model.layers.{n_layers}."
    extra = {mtp + k[len(last) :]: v.clone() for k, v in weights.items() if k.startswith(last)}
    h = FIELDS["hidden_size"]
    extra |= {
        mtp + "embed_tokens.weight": weights["model.embed_tokens.weight"].clone(),
        mtp + "enorm.weight": torch.ones(h),
        mtp + "hnorm.weight": torch.ones(h),
        mtp + "eh_proj.weight": torch.randn(h, 2 * h),
        mtp + "shared_head.norm.weight": torch.ones(h),
        mtp + "shared_head.head.weight": weights["lm_head.weight"].clone(),
    }
    save_file(weights | extra, str(path / "model.safetensors"))
    return len(extra)


KIMI_K2 = {  # Kimi-K2's differences: one expert group, its scaling and RoPE, no MTP layer
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 2.827,
    "num_nextn_predict_layers": 0,
    "rms_norm_eps": 1e-5,
    "rope_parameters": dict(FIELDS["rope_parameters"], rope_theta=50000.0, factor=32.0),
    "max_position_embeddings": 512,
}


@pytest.fixture(scope="module", params=["tf5", "hub", "kimi-k2-hub"])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"deepseek_v3-{request.param}")
    hf = make_model(**(KIMI_K2 if request.param.startswith("kimi") else {}))
    hf.save_pretrained(path)
    if request.param == "hub":
        to_hub_config(path, HUB_ONLY)
        add_mtp_layer(path, FIELDS["num_hidden_layers"])
    elif request.param == "kimi-k2-hub":
        to_hub_config(path, HUB_ONLY | {"model_type": "kimi_k2"})
    return hf, path


def test_logits_match_transformers(checkpoint):
    check_full_forward(*checkpoint)


def test_chunked_prefill_and_decode_equal_full_forward(checkpoint):
    check_chunked_prefill_and_decode(*checkpoint)


def test_decode_in_cuda_layout_equals_transformers(checkpoint, monkeypatch):
    check_decode_in_cuda_layout(*checkpoint, monkeypatch)


def test_latent_cache_holds_the_latent_not_per_head_kv(checkpoint):
    check_latent_cache(checkpoint[1], FIELDS["kv_lora_rank"], FIELDS["qk_rope_head_dim"])


def test_mtp_layer_is_dropped_with_one_log_line(tmp_path, caplog):
    import mlxc

    make_model().save_pretrained(tmp_path)
    to_hub_config(tmp_path, HUB_ONLY)
    n = add_mtp_layer(tmp_path, FIELDS["num_hidden_layers"])
    with caplog.at_level(logging.INFO, logger="mlxc.load"):
        mlxc.load_model(tmp_path)
    lines = [r.getMessage() for r in caplog.records if r.name == "mlxc.load"]
    assert len(lines) == 1 and f"dropped {n} tensors of layers 3" in lines[0]


def test_the_correction_bias_and_expert_groups_matter():
    """Guards for the tolerance above: the routing options move transformers' logits."""
    ids = np.random.default_rng(2).integers(0, 128, size=(1, 24))
    want = reference(make_model(seed=3), ids)
    unbiased = make_model(seed=3)
    for layer in unbiased.model.layers[1:]:
        layer.mlp.gate.e_score_correction_bias.zero_()
    assert np.abs(reference(unbiased, ids) - want).max() > 1e-2
    ungrouped = reference(make_model(seed=3, topk_group=4), ids)
    assert np.abs(ungrouped - want).max() > 1e-2


def test_fp8_hub_checkpoint_matches_transformers_on_the_dequantised_weights(tmp_path):
    """DeepSeek-V3's hub files: FP8 E4M3 linears and per-expert weights with block
    ``weight_scale_inv``, router and norms unquantised, the MTP layer after the stack."""
    import mlx.core as mx

    import mlxc

    make_model(seed=5).save_pretrained(tmp_path / "src")
    weights = load_file(str(tmp_path / "src" / "model.safetensors"))
    stored, dequantised = {}, {}
    for name, w in weights.items():
        linear = w.ndim == 2 and not any(s in name for s in ("norm", "embed", "lm_head", "gate."))
        if linear:
            q, scale = to_fp8(w)
            stored[name], stored[name[: -len("weight")] + "weight_scale_inv"] = q, scale
            dequantised[name] = from_fp8(q, scale)
        else:
            stored[name] = w
    assert any(".experts.5.down_proj." in k for k in dequantised)  # per-expert, as the hub
    out = tmp_path / "fp8"
    out.mkdir()
    save_file(stored, str(out / "model.safetensors"))
    (out / "config.json").write_text((tmp_path / "src" / "config.json").read_text())
    quant = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [BLOCK, BLOCK],
    }
    to_hub_config(out, HUB_ONLY | {"quantization_config": quant})
    add_mtp_layer(out, FIELDS["num_hidden_layers"])

    ids = np.random.default_rng(0).integers(0, 128, size=(1, 24))
    ref = make_model(seed=5)
    load_dequantised(ref, dequantised)
    model = mlxc.load_model(out, dtype="float32")
    got = np.array(model(mx.array(ids)))
    np.testing.assert_allclose(got, reference(ref, ids), atol=1e-4, rtol=0)
    assert json.loads((out / "config.json").read_text())["quantization_config"]["fmt"] == "e4m3"


def load_dequantised(model, dequantised: dict) -> None:
    """Put the dequantised tensors (hub names, per-expert) into the transformers model, whose
    experts are fused ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``."""
    import re

    state = model.state_dict()
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for name, w in dequantised.items():
        if m := re.match(r"(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$", name):
            experts.setdefault((m[1], m[3]), {})[int(m[2])] = w
        else:
            state[name] = w
    for (prefix, proj), by_e in experts.items():
        stacked = torch.stack([by_e[e] for e in sorted(by_e)])
        if proj == "down_proj":
            state[f"{prefix}.down_proj"] = stacked
        else:
            half = stacked.shape[1]
            fused = state[f"{prefix}.gate_up_proj"].clone()
            if proj == "gate_proj":
                fused[:, :half] = stacked
            else:
                fused[:, half:] = stacked
            state[f"{prefix}.gate_up_proj"] = fused
    model.load_state_dict(state)


def make_server_checkpoint(path, seed: int = 0):
    """For tests/test_server.py: hub form (with the MTP layer), the factory tokenizer's vocab
    and special ids, yarn over a 64-token original context."""
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
    add_mtp_layer(path, FIELDS["num_hidden_layers"])
    ckpt.write_tokenizer(path)
    return path


@pytest.mark.parametrize("quantised", [False, True], ids=["bf16", "q4"])
def test_mlx_lm_layout_loads(tmp_path, quantised):
    """A checkpoint as mlx-lm's convert writes it (mlx-community): experts stacked under
    ``switch_mlp``, kv_b_proj split per head into ``embed_q`` / ``unembed_out``, 4-bit when
    quantised. mlxc's logits equal mlx-lm's on the same file (transformers' unquantised)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model as peer_load
    from mlx_lm.utils import quantize_model

    import mlxc

    src = tmp_path / "hub"
    hf = make_model(seed=6)
    hf.save_pretrained(src)
    to_hub_config(src, HUB_ONLY)  # no MTP layer: mlx-lm drops only DeepSeek-V3's own, layer 61
    peer, config = peer_load(src)
    if quantised:
        peer, config = quantize_model(peer, config, group_size=32, bits=4)
    weights = dict(tree_flatten(peer.parameters()))
    assert any(".embed_q." in k for k in weights) and any(".switch_mlp." in k for k in weights)
    out = tmp_path / "mlx-lm"
    out.mkdir()
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    (out / "config.json").write_text(json.dumps(config))
    ids = mx.array(np.random.default_rng(7).integers(0, 128, size=(1, 24)))
    got = np.array(mlxc.load_model(out)(ids))
    np.testing.assert_allclose(got, np.array(peer(ids)), atol=1e-4, rtol=0)
    if not quantised:
        np.testing.assert_allclose(got, reference(hf, np.array(ids)), atol=1e-4, rtol=0)
