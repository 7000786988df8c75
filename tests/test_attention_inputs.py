"""Every generated model resolves its attention inputs once per forward (TextModel), not once
per layer: one mask per attention window, one set of MRoPE tables, one Llama-4 scale, whatever the layer count."""

from __future__ import annotations

from collections import Counter

import mlx.core as mx
import pytest
from checkpoints import SPEC_NAMES, spec_model

from mlxc.runtime.model import masks, mrope, yarn


@pytest.mark.parametrize("name", SPEC_NAMES)
def test_attention_inputs_are_built_once_per_forward(name, monkeypatch):
    model = spec_model(name)
    calls = Counter()

    def counting(name, fn):
        def counted(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return counted

    for owner, fn in [(masks, "causal"), (mrope, "rotation"), (yarn, "llama4_attn_scale")]:
        monkeypatch.setattr(owner, fn, counting(fn, getattr(owner, fn)))
    cache = model.make_cache()
    assert len(cache) >= 2  # several attention layers share what was built
    model(mx.array([[1, 2, 3]]), cache=cache)
    model(mx.array([[4]]), cache=cache)
    assert calls["causal"] == 2 * len(cache.windows())  # one mask per window per forward
    assert calls["rotation"] in (0, 2) and calls["llama4_attn_scale"] in (0, 2)
    assert calls["rotation"] or calls["llama4_attn_scale"] or name not in ("qwen2_vl", "mistral4")
