"""gemma3_text (sliding/full alternation, local and global RoPE, sandwich norms, 1 + weight
RMSNorm, scaled embeddings, final softcapping): logits against transformers' Gemma3ForCausalLM.

Tiny re-randomised checkpoints (transformers' init hides bugs), float32, atol 1e-4 (independent
float32 implementations agree to ~1e-5; a wrong window, rope or norm moves logits by 1e-1).
The window is 6 tokens, so every prompt here runs well past it: chunks shorter and longer than
the window, a chunk boundary inside a window, decode steps past it.
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import checkpoints as ckpt

import mlxc
from mlxc.runtime.model import layers
from mlxc.runtime.model.cache import KVCache, WindowedKVCache, enforce_max_kv

ATOL = 1e-4
WINDOW = 6
HUB_CONFIG = Path(__file__).parent / "fixtures" / "gemma3" / "gemma-3-1b-it.config.json"
# The hub config of google/gemma-3-1b-it with every key kept, sizes shrunk.
TINY = {
    "head_dim": 16,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_hidden_layers": 5,
    "num_key_value_heads": 2,
    "query_pre_attn_scalar": 24,
    "sliding_window": WINDOW,
    "sliding_window_pattern": 3,  # layers 2 and 5 full, the others sliding
    "vocab_size": 128,
    "max_position_embeddings": 512,
}


def rerandomise(model: torch.nn.Module, seed: int) -> None:
    """Norm weights around 0 (Gemma scales by 1 + weight), matrices ~ 1.2 / sqrt(fan_in)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 1.2 / p.shape[-1] ** 0.5)


def hub_config(**overrides) -> dict:
    return json.loads(HUB_CONFIG.read_text()) | TINY | overrides


def make_checkpoint(path, config: dict, seed: int = 0, legacy: bool = True):
    """A re-randomised Gemma3ForCausalLM from ``config`` saved to ``path``. ``legacy``: the
    config.json written is ``config`` itself (the hub's transformers-4 form: rope_theta,
    rope_local_base_freq, sliding_window_pattern); otherwise what transformers 5 writes
    (layer_types, rope_parameters per layer type)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    hf_config = Gemma3TextConfig(**config)
    hf_config._attn_implementation = "eager"  # the reference: plain softmax attention
    model = Gemma3ForCausalLM(hf_config).eval()
    rerandomise(model, seed)
    model.save_pretrained(path)
    if legacy:
        (Path(path) / "config.json").write_text(json.dumps(config))
    return model


def reference(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(ids)).logits.numpy()


CONFIGS = {
    "hub": (hub_config(), True),
    "transformers5": (hub_config(), False),
    "softcap-linear-rope": (
        hub_config(
            attn_logit_softcapping=5.0,  # read, and ignored, by transformers' Gemma 3
            final_logit_softcapping=3.0,
            rope_scaling={"rope_type": "linear", "factor": 4.0},
            tie_word_embeddings=False,
        ),
        True,
    ),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request, tmp_path_factory):
    config, legacy = CONFIGS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    return make_checkpoint(path, config, legacy=legacy), path


def test_layer_types_and_windows(checkpoint):
    hf, path = checkpoint
    model = mlxc.load_model(path)
    kinds = [type(c) for c in model.make_cache()]
    expected = [
        WindowedKVCache if t == "sliding_attention" else KVCache for t in hf.config.layer_types
    ]
    assert kinds == expected and KVCache in kinds and WindowedKVCache in kinds
    assert {c.window for c in model.make_cache()} == {None, WINDOW}


def test_logits_match_transformers(checkpoint):
    hf, path = checkpoint
    ids = np.random.default_rng(0).integers(0, 128, size=(2, 23))
    model = mlxc.load_model(path)
    got = np.array(model(mx.array(ids)))
    want = reference(hf, ids)
    assert np.std(want) > 0.5  # real spread: the tolerance means something
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)


def test_long_chunk_past_the_window_matches_transformers(checkpoint, on_cpu, monkeypatch):
    """A 150-token chunk on the CPU: its sliding layers attend in blocks, each from its first
    query's window (``masks.Window``), its full layers in causal blocks."""
    from mlxc.runtime.model import layers, masks

    windows = []
    real = layers._query_blocks
    monkeypatch.setattr(
        layers,
        "_query_blocks",
        lambda *a, window=None, **kw: windows.append(window) or real(*a, window=window, **kw),
    )
    hf, path = checkpoint
    ids = np.random.default_rng(2).integers(0, 128, size=(1, 150))
    model = mlxc.load_model(path)
    got = np.array(model(mx.array(ids)))
    assert any(isinstance(w, masks.Window) for w in windows) and None in windows
    np.testing.assert_allclose(got, reference(hf, ids), atol=ATOL, rtol=0)


def test_logits_with_the_cpu_gelu_match_transformers(checkpoint, on_cpu, monkeypatch):
    """On the CPU a float32 GeGLU gate goes through ``layers.gelu_approx_by_polynomial`` in
    blocks of rows (here of 2 rows of 96), still transformers'."""
    monkeypatch.setattr(layers, "CPU_ACT_BLOCK", 2 * TINY["intermediate_size"])
    taken = []
    real = layers.gelu_approx_by_polynomial
    monkeypatch.setitem(
        layers.CPU_ACTIVATIONS, layers.gelu_approx, lambda x: taken.append(x.shape) or real(x)
    )
    layers.glu.cache_clear()  # glu(act) takes its CPU function when first built
    hf, path = checkpoint
    ids = np.random.default_rng(0).integers(0, 128, size=(2, 23))
    try:
        model = mlxc.load_model(path)
        got = np.array(model(mx.array(ids)))
    finally:
        layers.glu.cache_clear()  # the next glu(gelu_approx) takes the real function again
    assert taken and all(shape == (2, TINY["intermediate_size"]) for shape in taken[:-1])
    np.testing.assert_allclose(got, reference(hf, ids), atol=ATOL, rtol=0)


# Chunks shorter and longer than the window, boundaries inside it, then decode past it.
CHUNKS = [(0, 4), (4, 13), (13, 18), (18, 19), (19, 27), (27, 28), (28, 29), (29, 30)]


def test_chunked_prefill_and_decode_equal_transformers(checkpoint):
    hf, path = checkpoint
    ids = np.random.default_rng(1).integers(0, 128, size=(1, 30))
    model = mlxc.load_model(path)
    cache, parts = model.make_cache(), []
    for a, b in CHUNKS:
        parts.append(np.array(model(mx.array(ids[:, a:b]), cache=cache)))
    np.testing.assert_allclose(np.concatenate(parts, axis=1), reference(hf, ids), atol=ATOL)
    assert cache.offset == 30


def test_bounded_cache_trims_full_layers_only(checkpoint):
    """--max-kv-size below the prompt: the full layers are trimmed (with sinks), the windowed
    ones keep their own bound; logits equal transformers until the first trim."""
    hf, path = checkpoint
    ids = np.random.default_rng(2).integers(0, 128, size=(1, 40))
    model = mlxc.load_model(path)
    cache, parts = model.make_cache(), []
    for a in range(0, 40, 5):
        parts.append(np.array(model(mx.array(ids[:, a : a + 5]), cache=cache)))
        enforce_max_kv(cache, 16, keep=2)
    for c in cache:
        assert c.offset == 40
        if c.window is None:
            assert c.live_len == 16
        else:
            assert c.live_len == WINDOW - 1 and c.held < 2 * WINDOW - 1
    # The first trim happens after the chunk that passes 16 tokens: chunks 0-3 are exact.
    np.testing.assert_allclose(
        np.concatenate(parts[:4], axis=1), reference(hf, ids)[:, :20], atol=ATOL
    )


def test_config_without_rope_thetas_takes_gemma3s_defaults(tmp_path):
    """google/gemma-3-4b-it's text_config names neither rope_theta nor rope_local_base_freq:
    Gemma3TextConfig's 1e6 and 1e4 (the 10000 every other model defaults to made the global
    layers rotate at the wrong frequencies)."""
    config = hub_config(rope_scaling={"rope_type": "linear", "factor": 8.0})
    del config["rope_theta"], config["rope_local_base_freq"]
    hf = make_checkpoint(tmp_path, config)
    assert hf.config.rope_parameters["full_attention"]["rope_theta"] == 1e6
    model = mlxc.load_model(tmp_path)
    ids = np.random.default_rng(3).integers(0, 128, size=(1, 40))
    np.testing.assert_allclose(np.array(model(mx.array(ids))), reference(hf, ids), atol=ATOL)


def test_windowed_cache_stays_flat_far_past_the_window(tmp_path):
    """Decoding 10x past the window, each windowed layer's resident keys stay bounded by
    window - 1 + slack (slack = min(256, window) = 6 here), while full layers grow."""
    path = tmp_path / "g"
    make_checkpoint(path, hub_config())
    model = mlxc.load_model(path)
    cache = model.make_cache()
    model(mx.array([[3, 4, 5]]), cache=cache)
    seen = []
    for i in range(10 * WINDOW):
        model(mx.array([[i % 100]]), cache=cache)
        seen.append([(c.window, c.held, c.nbytes) for c in cache])
    for step in seen[WINDOW:]:
        for window, held, _ in step:
            if window is not None:
                assert window - 1 <= held < 2 * window - 1
    full = [nbytes for window, _, nbytes in seen[-1] if window is None]
    windowed = [nbytes for window, _, nbytes in seen[-1] if window is not None]
    assert max(windowed) * 5 < min(full)


def make_gemma3_text(path, seed: int = 0):
    """A gemma3_text checkpoint with the factory tokenizer (tests/checkpoints.py), for the
    server's tests."""
    config = hub_config(
        vocab_size=ckpt.VOCAB_SIZE,
        bos_token_id=ckpt.BOS_ID,
        eos_token_id=ckpt.EOS_ID,
        pad_token_id=ckpt.PAD_ID,
        sliding_window=16,
    )
    make_checkpoint(str(path), config, seed=seed)
    ckpt.write_tokenizer(path)
    return path


def test_unit_offset_norm_keeps_its_scale_with_its_weight():
    """``layers.RMSNorm`` scales by ``1 + weight`` made when the weight is set, not per call: a
    call is the one fast kernel (no add), the scale follows every way the weight is set (a
    compiled call with the module as its inputs included), and it is no parameter."""
    rng = np.random.default_rng(0)
    x = mx.array(rng.standard_normal((2, 3, 8)).astype(np.float32))
    norm = layers.RMSNorm(8, eps=1e-6)
    compiled = mx.compile(lambda x: norm(x), inputs=norm)
    assert list(norm.parameters()) == ["weight"]

    def check(weight):
        want = mx.fast.rms_norm(x, 1.0 + weight, 1e-6)
        for got in (norm(x), compiled(x)):
            assert mx.array_equal(got, want).item()

    check(mx.zeros((8,)))
    for set_weight in (
        lambda w: norm.update({"weight": w}),
        lambda w: norm.load_weights([("weight", w)]),
        lambda w: setattr(norm, "weight", w),
    ):
        weight = mx.array(0.1 * rng.standard_normal(8).astype(np.float32))
        set_weight(weight)
        check(weight)

    def adds(y: mx.array) -> int:  # on a CPU rms_norm's fallback ops hold an add (the eps)
        dot = io.StringIO()
        mx.export_to_dot(dot, y)
        return dot.getvalue().count('label ="Add"')

    assert adds(norm(x)) == adds(mx.fast.rms_norm(x, mx.ones((8,)), 1e-6))  # no 1 + weight
