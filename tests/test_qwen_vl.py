"""The Qwen VL family end to end (qwen2_vl, qwen2_5_vl, qwen3_vl, qwen3_vl_moe): logits against
transformers on tiny re-randomised checkpoints, float32, atol 1e-4 (independent float32
implementations agree to ~1e-5; a wrong position, section or injection moves logits by 1e-2+).

Pixel values come from transformers' PIL-backend image processor; the model computes the MRoPE
position ids itself from the input ids and the grids.
"""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest
import torch
import transformers
from test_qwen_vision import CONFIGS, TEXT, pixels, randomise

import mlxc
from mlxc.runtime.model.cache import enforce_max_kv

ATOL = 1e-4
IMAGE, VISION_START, VISION_END = 120, 122, 123
MOE_TEXT = {
    "head_dim": 16,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [0],
    "rope_parameters": CONFIGS["qwen3_vl"][3]["rope_parameters"],
}
MODELS = {
    **CONFIGS,
    "qwen3_vl_moe": (
        "Qwen3VLMoeConfig",
        "Qwen3VLMoeForConditionalGeneration",
        CONFIGS["qwen3_vl"][2],
        MOE_TEXT,
    ),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def checkpoint(request, tmp_path_factory):
    config_cls, model_cls, vision, text = MODELS[request.param]
    config = getattr(transformers, config_cls)(
        vision_config=dict(vision),
        text_config={**TEXT, "num_hidden_layers": 2, **text},
        image_token_id=IMAGE,
        video_token_id=121,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
        tie_word_embeddings=False,
    )
    model = getattr(transformers, model_cls)(config).float().eval()
    randomise(model, 1)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return model, path, request.param


def prompt(grids, rng, merge=2, n_text=(5, 4, 6)):
    """Text, then per image <vision_start> image tokens <vision_end> text."""
    ids = [int(t) for t in rng.integers(0, 110, n_text[0])]
    for i, (t, h, w) in enumerate(grids):
        ids += [VISION_START] + [IMAGE] * int(t * h * w // merge**2) + [VISION_END]
        ids += [int(x) for x in rng.integers(0, 110, n_text[1 + i % 2])]
    return np.array([ids])


def reference(model, ids, pv=None, grid=None):
    kwargs = {}
    if pv is not None:
        kwargs = {
            "pixel_values": torch.from_numpy(pv),
            "image_grid_thw": torch.from_numpy(grid),
            # What the processor returns; without it transformers 5 skips MRoPE positions.
            "mm_token_type_ids": torch.from_numpy((ids == IMAGE).astype(np.int64)),
        }
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(ids), **kwargs).logits.numpy()


def ours(model, ids, pv=None, grid=None, cache=None):
    kwargs = {}
    if pv is not None:
        kwargs = {"pixel_values": mx.array(pv), "image_grid_thw": mx.array(grid)}
    return np.array(model(mx.array(ids), cache=cache, **kwargs))


CASES = {"text-only": [], "one-image": [(50, 70)], "two-images": [(50, 70), (90, 40)]}


@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers(checkpoint, case):
    hf, path, _ = checkpoint
    rng = np.random.default_rng(3)
    pv, grid = pixels(CASES[case]) if CASES[case] else (None, None)
    ids = prompt([] if grid is None else grid.tolist(), rng)
    model = mlxc.load_model(path)
    np.testing.assert_allclose(
        ours(model, ids, pv, grid), reference(hf, ids, pv, grid), atol=ATOL, rtol=0
    )


def test_batch_of_two_prompts_with_images(checkpoint):
    hf, path, _ = checkpoint
    pv, grid = pixels([(50, 70), (90, 40)])
    rng = np.random.default_rng(4)
    a = prompt(grid[:1].tolist(), rng, n_text=(3, 4, 4))
    b = prompt(grid[1:].tolist(), rng, n_text=(2, 4, 4))
    n = max(a.shape[1], b.shape[1])  # same length: pad the text of the shorter one
    a = np.concatenate([a, rng.integers(0, 110, (1, n - a.shape[1]))], axis=1)
    b = np.concatenate([b, rng.integers(0, 110, (1, n - b.shape[1]))], axis=1)
    ids = np.concatenate([a, b])
    model = mlxc.load_model(path)
    np.testing.assert_allclose(
        ours(model, ids, pv, grid), reference(hf, ids, pv, grid), atol=ATOL, rtol=0
    )


def test_chunked_prefill_inside_images_and_decode_equal_full(checkpoint):
    hf, path, _ = checkpoint
    pv, grid = pixels([(50, 70), (90, 40)])
    ids = prompt(grid.tolist(), np.random.default_rng(5))
    decode = np.random.default_rng(6).integers(0, 110, (1, 4))
    full_ids = np.concatenate([ids, decode], axis=1)
    want = reference(hf, full_ids, pv, grid)
    model = mlxc.load_model(path)
    first = int(np.argmax(ids[0] == IMAGE))
    cuts = [0, first + 5, first + 11, ids.shape[1] - 3, ids.shape[1]]
    cache, parts = model.make_cache(), []
    for i, (lo, hi) in enumerate(itertools.pairwise(cuts)):
        vision = (pv, grid) if i == 0 else (None, None)
        parts.append(ours(model, ids[:, lo:hi], *vision, cache=cache))
    for t in range(decode.shape[1]):
        parts.append(ours(model, decode[:, t : t + 1], cache=cache))
    np.testing.assert_allclose(np.concatenate(parts, axis=1), want, atol=ATOL, rtol=0)


def test_trim_after_an_image_keeps_positions_monotonic(checkpoint):
    """Prefill in chunks past a small max-kv-size after an image, continue, decode: nothing
    raises, the runs agree byte for byte until the first trim, and positions keep counting."""
    _, path, _ = checkpoint
    pv, grid = pixels([(50, 70)])
    ids = prompt(grid.tolist(), np.random.default_rng(7), n_text=(3, 30, 30))
    more = np.random.default_rng(8).integers(0, 110, (1, 9))
    model = mlxc.load_model(path)
    chunk, max_kv = 8, 24

    def run(limit):
        cache, outs, first_trim = model.make_cache(), [], None
        pieces = [ids[:, i : i + chunk] for i in range(0, ids.shape[1], chunk)]
        pieces += [more[:, :5]] + [more[:, i : i + 1] for i in range(5, 9)]
        for i, piece in enumerate(pieces):
            vision = (pv, grid) if i == 0 else (None, None)
            outs.append(ours(model, piece, *vision, cache=cache))
            if enforce_max_kv(cache, limit, keep=4) and first_trim is None:
                first_trim = i + 1
        return outs, first_trim, cache

    plain, _, plain_cache = run(None)
    trimmed, first_trim, cache = run(max_kv)
    assert first_trim is not None and first_trim < len(trimmed) - 5
    for i in range(first_trim):
        assert np.array_equal(plain[i], trimmed[i])
    assert all(np.isfinite(o).all() for o in trimmed)
    assert cache.offset == plain_cache.offset == ids.shape[1] + 9
    assert max(c.live_len for c in cache) <= max_kv
    # The next position continues from the absolute offset, not from the live count.
    nxt = cache.rope_state(np.array([[1]]), cache.offset).start
    assert np.array_equal(nxt, plain_cache.rope_state(np.array([[1]]), plain_cache.offset).start)
    assert int(nxt.max()) > max_kv


# mlx-vlm's conversion (mlx-community's checkpoints): the text under language_model.model. (its
# head language_model.lm_head.), the tower under vision_tower., its patch kernel channels-last,
# and qwen3_vl_moe's experts as mlx-lm stacks them (switch_mlp, [experts, out, in]).
TO_MLX_VLM = {
    "model.language_model.": "language_model.model.",
    "model.visual.": "vision_tower.",
    "visual.": "vision_tower.",
    "lm_head.": "language_model.lm_head.",
    "model.": "language_model.model.",
}


def test_mlx_vlm_layout_loads_to_the_same_model(checkpoint, tmp_path):
    from safetensors.numpy import load_file, save_file

    _, path, name = checkpoint
    renamed = {}
    for k, v in load_file(str(path / "model.safetensors")).items():
        old = next(p for p in TO_MLX_VLM if k.startswith(p))
        if k.endswith("patch_embed.proj.weight"):  # [out, in, t, p, p] -> [out, t, p, p, in]
            v = np.ascontiguousarray(v.transpose(0, 2, 3, 4, 1))
        k = TO_MLX_VLM[old] + k[len(old) :]
        # transformers 5 saves them out-major: gate_up [E, 2I, H] (gate, then up), down [E, H, I]
        if k.endswith("experts.gate_up_proj"):
            for proj, w in zip(("gate_proj", "up_proj"), np.split(v, 2, axis=1)):
                renamed[k.replace("experts.gate_up_proj", f"switch_mlp.{proj}.weight")] = (
                    np.ascontiguousarray(w)  # safetensors writes a view's buffer, not its values
                )
        elif k.endswith("experts.down_proj"):
            renamed[k.replace("experts.", "switch_mlp.") + ".weight"] = v
        else:
            renamed[k] = v
    if "moe" in name:
        assert any(".switch_mlp." in k for k in renamed)
    save_file(renamed, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    pv, grid = pixels(CASES["one-image"])
    ids = prompt(grid.tolist(), np.random.default_rng(5))
    want = ours(mlxc.load_model(path), ids, pv, grid)
    np.testing.assert_array_equal(ours(mlxc.load_model(tmp_path), ids, pv, grid), want)
