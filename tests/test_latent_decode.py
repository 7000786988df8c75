"""MLA decode's attention (``latent.absorbed_attention``): the scores composed as CUDA takes them
(latent and rope halves added and scaled in one kernel, the heads as rows of the latent head)
equal ``layers.attend``'s form (the rope half as an additive mask), which the MLA models' tests
check against transformers; for a lone sequence's steps and for a decode batch whose rows sit at
other offsets (a mask). float32 on this CPU: the two forms differ by rounding only."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from checkpoints import spec_model

from mlxc.runtime.model import latent
from mlxc.runtime.model.batch import BatchCache

MLA_SPECS = ["deepseek_v2", "deepseek_v3", "glm4_moe_lite", "minicpm3", "mistral4"]


@pytest.mark.parametrize("masked", [False, True])
def test_composed_scores_equal_the_attend_form(rng, monkeypatch, masked):
    B, H, T, nope, rope, rank, v = 2, 4, 11, 16, 8, 32, 12
    r = lambda *s: mx.array(rng.standard_normal(s).astype(np.float32))
    args = (r(B, H, 1, nope), r(B, H, 1, rope), r(B, 1, T, rank), r(B, 1, T, rope))
    w_k, w_v_t = r(H, nope, rank), r(H, rank, v)
    mask = mx.array(rng.random((B, 1, 1, T)) > 0.3) if masked else None
    outs = []
    for composed in (False, True):
        monkeypatch.setattr(latent, "composes_scores", lambda c=composed: c)
        outs.append(latent.absorbed_attention(*args, w_k, w_v_t, scale=0.3, mask=mask))
    assert outs[0].shape == outs[1].shape == (B, H, 1, v)
    np.testing.assert_allclose(np.array(outs[1]), np.array(outs[0]), rtol=1e-5, atol=1e-5)


def _decode(model) -> list[mx.array]:
    prompt = mx.array([[(5 * i) % 50 + 3 for i in range(12)]])
    cache = model.make_cache()
    out = [model(prompt, cache=cache)]
    for token in (4, 9, 7):
        out.append(model(mx.array([[token]]), cache=cache))
    other = model.make_cache()
    out.append(model(prompt[:, :7], cache=other))
    batch = BatchCache.like(cache)
    batch.extend([cache, other])  # rows at offsets 15 and 7: a mask over the shorter row
    out.append(model(mx.array([[3], [11]]), cache=batch))
    mx.eval(out)
    return out


@pytest.mark.parametrize("name", MLA_SPECS)
def test_models_decode_alike_with_composed_scores(name, monkeypatch):
    runs = []
    for composed in (False, True):
        monkeypatch.setattr(latent, "composes_scores", lambda c=composed: c)
        runs.append(_decode(spec_model(name)))
    for a, b in zip(*runs):
        np.testing.assert_allclose(np.array(b), np.array(a), rtol=1e-4, atol=1e-5)
