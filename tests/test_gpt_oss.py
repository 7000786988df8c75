"""gpt_oss (GQA with sinks, alternating sliding/full layers, yarn, biased-router MoE with clamped
SwiGLU experts): logits against transformers' GptOssForCausalLM.

Tiny re-randomised float32 checkpoints (tests/checkpoints.make_gpt_oss: window 8, yarn with an
original context of 16, swiglu_limit 2 so that the clamps act), atol 1e-4, in the hub's config
form (rope_scaling, no swiglu_alpha) and transformers 5's (rope_parameters, swiglu_alpha: set
off its default here so that reading it counts); the tensor names are the same in both. Chunked
prefill runs chunks below and above the window, then decodes well past it.
"""

from __future__ import annotations

import json
import shutil
from itertools import pairwise

import mlx.core as mx
import numpy as np
import pytest
from checkpoints import make_gpt_oss, reference_logits

import mlxc

pytest.importorskip("transformers")

ATOL = 1e-4
WINDOW = 8


@pytest.fixture(scope="module", params=["hub", "tf5"])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"gpt_oss_{request.param}")
    if request.param == "hub":
        return make_gpt_oss(path, tokenizer=False, legacy_config=True)
    return make_gpt_oss(path, tokenizer=False, swiglu_alpha=1.3)


def _ids(seed: int, shape=(1, 30)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 384, size=shape)


def test_logits_match_transformers(checkpoint):
    ids = _ids(0, (2, 30))
    model = mlxc.load_model(checkpoint)
    got = np.array(model(mx.array(ids), cache=model.make_cache()))
    np.testing.assert_allclose(got, reference_logits(checkpoint, ids), atol=ATOL, rtol=0)


def test_chunked_prefill_and_decode_past_the_window_equal_full_forward(checkpoint):
    ids = _ids(1)
    model = mlxc.load_model(checkpoint)
    cache, parts = model.make_cache(), []
    # 3 < window, 13 > window, 4 < window; then one token at a time to 30, far past it.
    bounds = [0, 3, 16, 20, *range(21, 31)]
    for a, b in pairwise(bounds):
        parts.append(np.array(model(mx.array(ids[:, a:b]), cache=cache)))
    np.testing.assert_allclose(
        np.concatenate(parts, axis=1), reference_logits(checkpoint, ids), atol=ATOL, rtol=0
    )
    assert [c.window for c in cache] == [WINDOW, None]  # layer_types: sliding, full
    assert all(c.offset == 30 for c in cache)


def test_the_window_and_the_sinks_matter(checkpoint, tmp_path):
    """Guards for the tolerance above: without the window, or without sinks, logits move."""
    ids = _ids(2)
    want = reference_logits(checkpoint, ids)
    wide = tmp_path / "wide"
    shutil.copytree(checkpoint, wide)
    config = json.loads((wide / "config.json").read_text())
    (wide / "config.json").write_text(json.dumps(config | {"sliding_window": 64}))
    unwindowed = np.array(mlxc.load_model(wide)(mx.array(ids)))
    assert np.abs(unwindowed - want)[:, WINDOW:].max() > 1e-2
    assert np.abs(unwindowed - want)[:, :WINDOW].max() < ATOL  # the window holds them all
    model = mlxc.load_model(checkpoint)
    for layer in model.model.layers:
        layer.self_attn.sinks = mx.full(layer.self_attn.sinks.shape, -1e9)
    assert np.abs(np.array(model(mx.array(ids))) - want).max() > 1e-2
