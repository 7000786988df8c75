"""ministral3 (Mistral GQA + yarn RoPE + the Llama-4 query scale), alone (spec ministral3) and
as the text backbone of mistral3 + pixtral (spec ministral3_vl): logits against transformers.

Tiny random checkpoints, every parameter re-randomised (transformers' init hides bugs), float32,
atol 1e-4. Prompts run past ``original_max_position_embeddings`` (16), so the scale and yarn
both act.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch
from checkpoints import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, write_tokenizer
from test_mistral3 import IMG, MERGE, PATCH, hf_logits, prompt, random_image, rerandomise

import mlxc

ATOL = 1e-4
ROPE = {  # Ministral-3's rope_parameters, with a short original context
    "rope_type": "yarn",
    "type": "yarn",
    "rope_theta": 1000000.0,
    "factor": 16.0,
    "original_max_position_embeddings": 16,
    "max_position_embeddings": 256,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "llama_4_scaling_beta": 0.1,
}
TEXT = {  # every key of Ministral-3-3B's text_config, sizes shrunk
    "model_type": "ministral3",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 96,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 256,
    "initializer_range": 0.02,
    "attention_dropout": 0.0,
    "sliding_window": None,
    "use_cache": True,
    "tie_word_embeddings": False,
    "rope_parameters": ROPE,
}


def make_checkpoint(path, *, seed=0, rope=ROPE, **overrides):
    """A tiny re-randomised Ministral3ForCausalLM saved to ``path``."""
    from transformers import Ministral3Config, Ministral3ForCausalLM

    fields = TEXT | {"rope_parameters": dict(rope)} | overrides
    fields.pop("model_type")
    model = Ministral3ForCausalLM(Ministral3Config(**fields)).eval()
    rerandomise(model, seed)
    model.save_pretrained(path)
    return model


def make_ministral3(path, seed: int = 0) -> Path:
    """ministral3 with the factory tokenizer (its vocab and special ids); the scale and yarn
    act past position 64."""
    make_checkpoint(
        path,
        seed=seed,
        rope=dict(ROPE, original_max_position_embeddings=64, max_position_embeddings=512),
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=512,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    write_tokenizer(path)
    return Path(path)


def reference(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(ids)).logits.numpy()


def logits(path, ids: np.ndarray) -> np.ndarray:
    model = mlxc.load_model(path)
    return np.array(model(mx.array(ids), cache=model.make_cache()))


IDS = np.random.default_rng(0).integers(0, 96, size=(2, 40))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ministral3")
    return make_checkpoint(path), path


@pytest.mark.parametrize("batch", [1, 2])
def test_logits_match_transformers(checkpoint, batch):
    hf, path = checkpoint
    np.testing.assert_allclose(logits(path, IDS[:batch]), reference(hf, IDS[:batch]), atol=ATOL)


def test_chunked_prefill_and_decode_equal_full_forward(checkpoint):
    hf, path = checkpoint
    ids = IDS[:1]
    model = mlxc.load_model(path)
    cache, parts = model.make_cache(), []
    for a, b in [(0, 11), (11, 30), (30, 37), (37, 38), (38, 39), (39, 40)]:
        parts.append(np.array(model(mx.array(ids[:, a:b]), cache=cache)))
    np.testing.assert_allclose(np.concatenate(parts, axis=1), reference(hf, ids), atol=ATOL)
    assert cache.offset == 40


def test_the_llama4_scale_matters(tmp_path):
    """beta 0 turns the scale off: transformers' logits move past position 16 only, and mlxc
    follows it (so the scale the first tests check is really applied)."""
    with_scale = reference(make_checkpoint(tmp_path / "a", seed=3), IDS[:1])
    hf = make_checkpoint(tmp_path / "b", seed=3, rope=dict(ROPE, llama_4_scaling_beta=0.0))
    without = reference(hf, IDS[:1])
    assert np.abs(with_scale - without)[:, 16:].max() > 1e-2
    assert np.abs(with_scale - without)[:, :16].max() < 1e-5  # positions < 16: the scale is 1
    np.testing.assert_allclose(logits(tmp_path / "b", IDS[:1]), without, atol=ATOL)


def test_yarn_matters(tmp_path):
    """Guard: the same weights under plain RoPE give other logits, so yarn is what matched."""
    yarn = reference(make_checkpoint(tmp_path / "a", seed=4), IDS[:1])
    plain = {"rope_type": "default", "rope_theta": 1000000.0, "llama_4_scaling_beta": 0.1}
    plain["original_max_position_embeddings"] = 16
    default = reference(make_checkpoint(tmp_path / "b", seed=4, rope=plain), IDS[:1])
    assert np.abs(yarn - default).max() > 1e-2


def test_yarn_attention_factor_from_the_factor(tmp_path):
    """Without mscale/mscale_all_dim, yarn's cos/sin factor is 0.1 ln(factor) + 1 (the released
    configs give 1): the path llama, qwen2 and qwen3 yarn configs take through the same rope."""
    rope = {k: v for k, v in ROPE.items() if k not in ("mscale", "mscale_all_dim")}
    hf = make_checkpoint(tmp_path, seed=5, rope=rope)
    np.testing.assert_allclose(logits(tmp_path, IDS[:1]), reference(hf, IDS[:1]), atol=ATOL)


def test_a_sliding_window_matches_transformers(tmp_path):
    """A config's sliding_window makes every layer windowed (transformers' Ministral3 has no
    layer types): chunks below and above the window, decode past it."""
    hf = make_checkpoint(tmp_path, sliding_window=8)
    model = mlxc.load_model(tmp_path)
    assert {c.window for c in model.make_cache()} == {8}
    cache, parts = model.make_cache(), []
    for a, b in [(0, 5), (5, 19), (19, 26), (26, 38), (38, 39), (39, 40)]:
        parts.append(np.array(model(mx.array(IDS[:1, a:b]), cache=cache)))
    want = reference(hf, IDS[:1])
    np.testing.assert_allclose(np.concatenate(parts, axis=1), want, atol=ATOL)
    full = reference(make_checkpoint(tmp_path / "full"), IDS[:1])
    assert np.abs(full - want)[:, 8:].max() > 1e-2  # guard: the window changes the logits


def test_factory_checkpoint_loads_with_its_tokenizer(tmp_path):
    make_ministral3(tmp_path)
    model, tokenizer = mlxc.load(tmp_path)
    ids = tokenizer.encode("hello world")
    out = model(mx.array([ids]), cache=model.make_cache())
    assert out.shape == (1, len(ids), VOCAB_SIZE)


# --- mistral3 + pixtral with a ministral3 text backbone -----------------------------------------


@pytest.fixture(scope="module")
def vl_checkpoint(tmp_path_factory):
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    config = Mistral3Config(
        vision_config={
            "model_type": "pixtral",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "patch_size": PATCH,
            "image_size": 64,
            "hidden_act": "silu",
            "rope_parameters": {"rope_type": "default", "rope_theta": 100.0},
        },
        text_config=dict(TEXT),
        image_token_index=IMG,
        spatial_merge_size=MERGE,
        projector_hidden_act="gelu",
        multimodal_projector_bias=False,
        tie_word_embeddings=False,
    )
    model = Mistral3ForConditionalGeneration(config).eval()
    rerandomise(model, 5)
    path = tmp_path_factory.mktemp("ministral3_vl")
    model.save_pretrained(path)
    return model, path


def test_vl_with_one_image_matches_transformers(vl_checkpoint):
    hf, path = vl_checkpoint
    assert (
        json.loads((path / "config.json").read_text())["text_config"]["model_type"] == "ministral3"
    )
    rng = np.random.default_rng(6)
    ids, pv, sizes = prompt(rng, [random_image(rng, 30, 22)])
    assert ids.shape[1] > 16  # past the original context: the scale and yarn act
    model = mlxc.load_model(path)
    assert type(model).__module__ == "mlxc.generated.ministral3_vl"
    got = model(
        mx.array(ids),
        cache=model.make_cache(),
        pixel_values=mx.array(pv),
        image_sizes=mx.array(sizes),
    )
    np.testing.assert_allclose(np.array(got), hf_logits(hf, ids, pv, sizes), atol=ATOL, rtol=0)
