"""mistral3 + pixtral, with a mistral text backbone (Mistral-Small 3.x, spec mistral3) and with
a mistral4 one (Mistral-Small-4, spec mistral_small4): logits against transformers.

Tiny random checkpoints (every parameter re-randomised: transformers' near-zero init hides
bugs), float32, atol 1e-4: independent float32 implementations agree to ~1e-5, a real bug moves
logits by 1e-2 or more.
"""

from __future__ import annotations

import importlib
import itertools
import json

import mlx.core as mx
import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.numpy import load_file, save_file

import mlxc
from mlxc.runtime.checkpoint import pixtral_preprocess as pp

ATOL = 1e-4
PATCH, MERGE = 4, 2
IMG, BRK, END = 10, 11, 12


def rerandomise(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                base = 1.0 if name.endswith("norm.weight") else 0.0
                p.copy_(base + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 1.5 / p[0].numel() ** 0.5)


TEXT_CONFIGS = {
    "mistral": {
        "model_type": "mistral",
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 96,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000.0},
        "tie_word_embeddings": False,
    },
    "mistral4": {
        "model_type": "mistral4",
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "vocab_size": 96,
        "q_lora_rank": 32,
        "kv_lora_rank": 24,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 8,
        "v_head_dim": 12,
        "head_dim": 16,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 24,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "max_position_embeddings": 128,
        # Small original length: the prompts run past it, so yarn and the Llama-4 scale act.
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 16,
            "llama_4_scaling_beta": 0.1,
        },
        "tie_word_embeddings": False,
    },
}


@pytest.fixture(scope="module", params=sorted(TEXT_CONFIGS))
def checkpoint(request, tmp_path_factory):
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
        text_config=dict(TEXT_CONFIGS[request.param]),
        image_token_index=IMG,
        spatial_merge_size=MERGE,
        projector_hidden_act="gelu",
        tie_word_embeddings=False,
    )
    model = Mistral3ForConditionalGeneration(config).eval()
    rerandomise(model, 3)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return model, path


def test_text_backbone_picks_the_spec(checkpoint):
    _, path = checkpoint
    model = mlxc.load_model(path)
    text_type = json.loads((path / "config.json").read_text())["text_config"]["model_type"]
    spec = {"mistral": "mistral3", "mistral4": "mistral_small4"}[text_type]
    assert type(model).__module__ == f"mlxc.generated.{spec}"


def prompt(rng, images):
    """Token ids with each image's [IMG]/[IMG_BREAK]/[IMG_END] block, and its pixel inputs."""
    cfg = pp.PixtralProcessorConfig(patch_size=PATCH, spatial_merge_size=MERGE, longest_edge=40)
    text = [int(t) for t in rng.integers(13, 96, size=12)]
    ids = text[:3]
    for _ in images:
        ids += [IMG] + [int(t) for t in rng.integers(13, 96, size=2)]
    ids += text[3:]
    if not images:
        return np.array([ids]), None, None
    pv, sizes = pp.preprocess_images(images, cfg)
    ids = pp.expand_image_tokens(ids, sizes, PATCH, MERGE, IMG, BRK, END)
    return np.array([ids]), pv, sizes


def hf_logits(model, ids, pv, sizes):
    kwargs = {}
    if pv is not None:
        kwargs = {"pixel_values": torch.from_numpy(pv), "image_sizes": torch.from_numpy(sizes)}
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(ids), **kwargs).logits.numpy()


def random_image(rng, h, w):
    return Image.fromarray(rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8))


CASES = {
    "text-only": [],
    "one-image": [(30, 22)],
    "two-images-different-sizes": [(17, 40), (40, 25)],
}


@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers(checkpoint, case):
    hf, path = checkpoint
    rng = np.random.default_rng(5)
    ids, pv, sizes = prompt(rng, [random_image(rng, h, w) for h, w in CASES[case]])
    model = mlxc.load_model(path)
    kwargs = {} if pv is None else {"pixel_values": mx.array(pv), "image_sizes": mx.array(sizes)}
    got = np.array(model(mx.array(ids), cache=model.make_cache(), **kwargs))
    np.testing.assert_allclose(got, hf_logits(hf, ids, pv, sizes), atol=ATOL, rtol=0)


def test_chunked_prefill_inside_an_image_and_decode_equal_transformers(checkpoint):
    hf, path = checkpoint
    rng = np.random.default_rng(9)
    ids, pv, sizes = prompt(rng, [random_image(rng, 30, 30), random_image(rng, 20, 36)])
    decode = rng.integers(13, 96, size=(1, 3))
    want = hf_logits(hf, np.concatenate([ids, decode], axis=1), pv, sizes)
    model = mlxc.load_model(path)
    first_image = int(np.argmax(ids[0] == IMG))
    cuts = [0, first_image + 3, first_image + 9, ids.shape[1] - 2, ids.shape[1]]
    cache, parts = model.make_cache(), []
    for i, (a, b) in enumerate(itertools.pairwise(cuts)):
        kwargs = {"pixel_values": mx.array(pv), "image_sizes": mx.array(sizes)} if i == 0 else {}
        parts.append(np.array(model(mx.array(ids[:, a:b]), cache=cache, **kwargs)))
    for t in range(decode.shape[1]):
        parts.append(np.array(model(mx.array(decode[:, t : t + 1]), cache=cache)))
    np.testing.assert_allclose(np.concatenate(parts, axis=1), want, atol=ATOL, rtol=0)


TO_TRANSFORMERS_5 = {
    "language_model.model.": "model.language_model.",
    "language_model.lm_head.": "lm_head.",
    "vision_tower.": "model.vision_tower.",
    "multi_modal_projector.": "model.multi_modal_projector.",
}
# mlx-vlm's conversion (mlx-community's checkpoints): the hub names with the pixtral tower one
# level deeper, its patch kernel channels-last.
TO_MLX_VLM = {"vision_tower.": "vision_tower.vision_model."}


@pytest.mark.parametrize("layout", ["transformers-5", "mlx-vlm"])
def test_other_weight_layouts_load_to_the_same_model(checkpoint, layout, tmp_path):
    # save_pretrained writes the hub (transformers 4) names; the in-memory transformers 5 names
    # and mlx-vlm's must load the same model.
    _, path = checkpoint
    weights = load_file(str(path / "model.safetensors"))
    assert any(k.startswith("language_model.model.") for k in weights)
    to = TO_TRANSFORMERS_5 if layout == "transformers-5" else TO_MLX_VLM
    renamed = {}
    for k, v in weights.items():
        old = next((p for p in to if k.startswith(p)), "")
        if layout == "mlx-vlm" and k.endswith("patch_conv.weight"):
            v = np.ascontiguousarray(v.transpose(0, 2, 3, 1))
        renamed[to.get(old, old) + k[len(old) :]] = v
    save_file(renamed, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    rng = np.random.default_rng(2)
    ids, pv, sizes = prompt(rng, [random_image(rng, 24, 24)])
    a = mlxc.load_model(path)(mx.array(ids), pixel_values=mx.array(pv), image_sizes=mx.array(sizes))
    b = mlxc.load_model(tmp_path)(
        mx.array(ids), pixel_values=mx.array(pv), image_sizes=mx.array(sizes)
    )
    assert mx.array_equal(a, b)
    assert json.loads((path / "config.json").read_text())["model_type"] == "mistral3"


def test_a_checkpoint_without_its_tower_loads_as_a_text_model(checkpoint, tmp_path):
    """mlx-lm's conversion of a VL model keeps only the text model (its sanitize drops the
    tower and the projector; here config.json keeps vision_config, as its save_config does with
    keep_vision_config): mlxc loads it as a text model,
    with the whole model's text logits, and reports no tower (no processor; images refused)."""
    from mlxc.runtime.checkpoint import loading, processor

    _, path = checkpoint
    weights = load_file(str(path / "model.safetensors"))
    text = {k: v for k, v in weights.items() if k.startswith("language_model.")}
    assert len(text) < len(weights)
    save_file(text, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    ids, _, _ = prompt(np.random.default_rng(6), [])
    ours, whole = mlxc.load_model(tmp_path), mlxc.load_model(path)
    assert mx.array_equal(ours(mx.array(ids)), whole(mx.array(ids)))
    assert processor.vision_tower(ours) is None and processor.vision_tower(whole) == "pixtral"
    module = importlib.import_module(type(ours).__module__)
    assert loading.checkpoint_tower(module, text) is None
    assert loading.checkpoint_tower(module, weights) == "pixtral"


def test_more_image_tokens_than_features_is_a_clear_error(checkpoint):
    _, path = checkpoint
    rng = np.random.default_rng(4)
    ids, pv, sizes = prompt(rng, [random_image(rng, 24, 24)])
    model = mlxc.load_model(path)
    extra = np.concatenate([ids, [[IMG, IMG]]], axis=1)
    with pytest.raises(ValueError, match="more image tokens"):
        model(mx.array(extra), pixel_values=mx.array(pv), image_sizes=mx.array(sizes))
