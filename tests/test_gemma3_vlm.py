"""gemma3 (Gemma3ForConditionalGeneration): gemma3_text + the SigLIP tower, logits against
transformers with images, whole and in prefill chunks.

Tiny re-randomised checkpoints, float32, atol 1e-4. transformers is given ``token_type_ids``, as
its processor returns them, so each image's tokens attend to the whole image; without that
overlay the logits move by ~1. Chunked prefills keep each image in one chunk
(``Model.prefill_spans``); a window (3) shorter than an image (4 tokens) is covered too.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from test_gemma3_vision import rerandomise

import mlxc
from mlxc.runtime.serving.generate import prefill_chunks, prefill_spans

ATOL = 1e-4
MM, BOI, EOI, SOFT = 4, 120, 121, 122


def build_hf(window: int):
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    config = Gemma3Config(
        vision_config={
            "hidden_size": 32,
            "image_size": 16,
            "intermediate_size": 48,
            "model_type": "siglip_vision_model",
            "num_attention_heads": 4,
            "num_hidden_layers": 2,
            "patch_size": 4,
            "vision_use_head": False,
        },
        text_config={
            "hidden_size": 64,
            "intermediate_size": 96,
            "model_type": "gemma3_text",
            "num_attention_heads": 4,
            "num_hidden_layers": 5,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "vocab_size": 128,
            "sliding_window": window,
            "sliding_window_pattern": 3,
            "query_pre_attn_scalar": 24,
        },
        boi_token_index=BOI,
        eoi_token_index=EOI,
        image_token_index=SOFT,
        mm_tokens_per_image=MM,
    )
    config._attn_implementation = "eager"
    model = Gemma3ForConditionalGeneration(config).eval()
    randomise(model, seed=window)
    return model


def randomise(model, seed: int) -> None:
    """The tower's and projector's weights as test_gemma3_vision's; Gemma's text norms scale by
    1 + weight: weights around 0."""
    rerandomise(model, seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "language_model" in name and p.ndim == 1:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))


def save_hub(model, path, mlx_vlm: bool = False) -> None:
    """The hub (transformers-4) layout: vision_model. level, language_model.model., tied head.
    ``mlx_vlm``: as mlx-vlm's conversion writes it (mlx-community's): the same names, the patch
    kernel channels-last, and the tied head saved as a tensor of its own."""
    model.save_pretrained(path)
    renames = {
        "model.vision_tower.": "vision_tower.vision_model.",
        "model.multi_modal_projector.": "multi_modal_projector.",
        "model.language_model.": "language_model.model.",
    }
    state = {}
    for k, v in model.state_dict().items():
        for old, new in renames.items():
            k = k.replace(old, new)
        if mlx_vlm and k.endswith("patch_embedding.weight"):
            v = v.permute(0, 2, 3, 1)
        if k != "lm_head.weight":
            state[k] = v.contiguous()
    if mlx_vlm:
        state["language_model.lm_head.weight"] = state[
            "language_model.model.embed_tokens.weight"
        ].clone()
    (path / "model.safetensors").unlink()
    save_file(state, str(path / "model.safetensors"))


@pytest.mark.parametrize("window", [3, 6])
@pytest.mark.parametrize("layout", ["transformers-5", "hub", "mlx-vlm"])
def test_logits_with_images_match_transformers(window, layout, tmp_path, rng):
    hf = build_hf(window)
    if layout != "transformers-5":
        save_hub(hf, tmp_path, mlx_vlm=layout == "mlx-vlm")
    else:
        hf.save_pretrained(tmp_path)
    model = mlxc.load_model(tmp_path)

    image = [BOI] + [SOFT] * MM + [EOI]
    ids = [2, 5, 6, *image, 7, 8, 9, 10, *image, 11, 12, 13, 14, 15, 16]
    pixel_values = rng.standard_normal((2, 3, 16, 16)).astype(np.float32)
    with torch.no_grad():
        want = (
            hf(
                input_ids=torch.tensor([ids]),
                pixel_values=torch.from_numpy(pixel_values),
                token_type_ids=torch.tensor([[int(t == SOFT) for t in ids]]),
            )
            .logits[0]
            .numpy()
        )

    full = model(mx.array([ids]), pixel_values=mx.array(pixel_values))[0]
    np.testing.assert_allclose(np.array(full), want, atol=ATOL, rtol=0)

    spans = prefill_spans(model, ids)
    assert spans == [(4, 4 + MM), (14, 14 + MM)]
    for chunk in (1, 3):
        cache, outs = model.make_cache(), []
        for i, (a, b) in enumerate(prefill_chunks(len(ids), chunk, spans)):
            extra = {"pixel_values": mx.array(pixel_values)} if i == 0 else {}
            outs.append(model(mx.array([ids[a:b]]), cache=cache, **extra)[0])
        got = np.array(mx.concatenate(outs, axis=0))
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=0, err_msg=f"chunk {chunk}")
