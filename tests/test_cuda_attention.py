"""``runtime.model.cuda_attention`` against MLX's own attention, on CUDA.

CI has no GPU, so all but the last test skip there; they ran on the lent H200
(``bench/results/cuda-attention-tests-gpu-h200.log``). The oracle is ``mx.fast.scaled_dot_product_attention`` on the CPU stream in float32, on
the same bf16 (or dequantised) inputs: the kernel accumulates in float32 and rounds once to
bf16, so it should agree to bf16's half-ulp at |out| < 2 (4e-3) plus float32 summation order;
1e-2 absolute leaves room for that and catches any wrong key, mask column or weight (those
move outputs by ~0.1 on these inputs).
"""

from __future__ import annotations

import checkpoints as ckpt
import mlx.core as mx
import numpy as np
import pytest

from mlxc.runtime.checkpoint.loading import load_model
from mlxc.runtime.model import cuda_attention, layers, masks
from mlxc.runtime.model.cache import KVQuant

cuda_only = pytest.mark.skipif(
    not cuda_attention.available(), reason="the kernels run on MLX's CUDA backend only"
)

TOL = 1e-2


def _inputs(B, Hq, Hkv, L, T, D, seed):
    key = mx.random.key(seed)
    k1, k2, k3 = mx.random.split(key, 3)
    # Queries as attention layers make them: [B, L, H, D] transposed (not row-contiguous).
    q = mx.random.normal((B, L, Hq, D), key=k1).astype(mx.bfloat16).transpose(0, 2, 1, 3)
    # Keys and values as slices of a larger cache buffer (strided views).
    cap = T + 37
    kb = mx.random.normal((B, Hkv, cap, D), key=k2).astype(mx.bfloat16)
    vb = mx.random.normal((B, Hkv, cap, D), key=k3).astype(mx.bfloat16)
    return q, kb[:, :, :T], vb[:, :, :T]


def _ragged_valid(B, T, L, seed):
    """``[B, 1, 1, T]`` as ``BatchKVCache.key_valid`` makes it: a pad, a sink and a gap per row."""
    rng = np.random.default_rng(seed)
    col = np.arange(T)[None]
    pad = rng.integers(0, max(1, T // 3), B)[:, None]
    sink = rng.integers(0, 4, B)[:, None]
    gap = rng.integers(0, max(1, T // 4), B)[:, None]
    valid = (col >= pad) & ~((col >= pad + sink) & (col < pad + sink + gap))
    valid[:, T - L :] = True  # the new tokens
    return mx.array(valid)[:, None, None, :]


def _oracle(q, k, v, scale, mask, sinks=None):
    f = [x.astype(mx.float32) for x in (q, k, v)]
    if sinks is not None:
        sinks = sinks.astype(mx.float32)
    out = mx.fast.scaled_dot_product_attention(
        *f, scale=scale, mask=mask, sinks=sinks, stream=mx.cpu
    )
    return np.array(out)


def _check(out, want):
    got = np.array(out.astype(mx.float32))
    assert got.shape == want.shape
    err = np.abs(got - want).max()
    assert err < TOL, f"max error {err}"


@cuda_only
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("B,Hq,Hkv", [(1, 8, 2), (5, 4, 4)])
@pytest.mark.parametrize("T", [9, 300, 3000])
def test_ragged_decode(B, Hq, Hkv, T, D):
    q, k, v = _inputs(B, Hq, Hkv, 1, T, D, seed=T + D)
    mask = _ragged_valid(B, T, 1, seed=T)
    scale = D**-0.5
    assert cuda_attention.applies(q, D, mask, quantized=False)
    _check(cuda_attention.attention(q, k, v, scale=scale, mask=mask), _oracle(q, k, v, scale, mask))


@cuda_only
def test_independent_calls_in_one_graph():
    """Calls of one shape whose data do not depend on each other, evaluated together: MLX may
    run such kernels at once, so each chunked call counts on tickets of its own, sliced from
    zeros shared with others (``Tickets``). Twice: the second round's slices follow the
    first's."""
    B, Hq, Hkv, T, D = 3, 8, 2, 1000, 64
    cases = [_inputs(B, Hq, Hkv, 1, T, D, seed=s) for s in range(6)]
    mask = _ragged_valid(B, T, 1, seed=5)
    for _ in range(2):
        outs = [cuda_attention.attention(q, k, v, scale=0.125, mask=mask) for q, k, v in cases]
        mx.eval(outs)
        for out, (q, k, v) in zip(outs, cases, strict=True):
            _check(out, _oracle(q, k, v, 0.125, mask))


@cuda_only
@pytest.mark.parametrize("L", [2, 3, 9, 16])
@pytest.mark.parametrize("T", [20, 700])
def test_verify_causal(L, T):
    """A verification forward: L queries last, the string causal mask, and the array form a
    prompt batch gives (causal and ragged rows)."""
    B, Hq, Hkv, D = 2, 8, 2, 64
    q, k, v = _inputs(B, Hq, Hkv, L, T, D, seed=L * T)
    scale = D**-0.5
    causal = mx.array(np.tril(np.ones((L, T), bool), T - L))
    _check(
        cuda_attention.attention(q, k, v, scale=scale, mask="causal"),
        _oracle(q, k, v, scale, causal),
    )
    both = causal & _ragged_valid(B, T, L, seed=L)
    _check(cuda_attention.attention(q, k, v, scale=scale, mask=both), _oracle(q, k, v, scale, both))


@cuda_only
@pytest.mark.parametrize("T", [40, 2000])
def test_sinks(T):
    B, Hq, Hkv, D = 3, 8, 4, 64
    q, k, v = _inputs(B, Hq, Hkv, 1, T, D, seed=T)
    sinks = (mx.random.normal((Hq,), key=mx.random.key(7)) * 2).astype(mx.bfloat16)
    mask = _ragged_valid(B, T, 1, seed=1)
    scale = D**-0.5
    _check(
        cuda_attention.attention(q, k, v, scale=scale, mask=mask, sinks=sinks),
        _oracle(q, k, v, scale, mask, sinks),
    )


@cuda_only
@pytest.mark.parametrize("bits,group", [(4, 64), (4, 32), (8, 64)])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("T", [50, 2500])
def test_quantized(bits, group, D, T):
    """Packed keys and values, read as ``QuantizedKV`` slices; the oracle attends to their
    dequantised floats (the same values the kernel expands in registers)."""
    B, Hq, Hkv = 2, 8, 2
    q, k, v = _inputs(B, Hq, Hkv, 1, T + 5, D, seed=bits + D + T)
    quant = KVQuant(bits=bits, group_size=group)
    kq, vq = quant.quantize(k)[:, :, :T], quant.quantize(v)[:, :, :T]
    scale = D**-0.5
    for mask in (None, _ragged_valid(B, T, 1, seed=3)):
        assert cuda_attention.applies(q, D, mask, quantized=True)
        got = cuda_attention.attention(q, kq, vq, scale=scale, mask=mask)
        _check(got, _oracle(q, kq.dequantize(), vq.dequantize(), scale, mask))


@cuda_only
@pytest.mark.parametrize("bits,group", [(4, 64), (8, 32)])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("L,T,recent", [(1, 50, 7), (1, 2500, 32), (3, 300, 16)])
def test_staged(bits, group, D, L, T, recent):
    """A quantised cache's staged tokens (``StagedKV``): packed keys, then the newest ones in
    bf16, which the kernel rounds as ``mx.quantize`` stores them (decode and a verification's
    causal rows): bit for bit the kernel's output on all the keys packed, and near the oracle
    on their dequantised values."""
    from mlxc.runtime.model.cache import StagedKV

    B, Hq, Hkv = 2, 8, 2
    q, k, v = _inputs(B, Hq, Hkv, L, T, D, seed=bits + D + T)
    quant = KVQuant(bits=bits, group_size=group)
    P = T - recent
    keys = StagedKV(quant.quantize(k)[:, :, :P], k[:, :, P:])
    values = StagedKV(quant.quantize(v)[:, :, :P], v[:, :, P:])
    scale = D**-0.5
    packed_k, packed_v = quant.quantize(k), quant.quantize(v)
    for mask in (None, "causal") if L > 1 else (None, _ragged_valid(B, T, 1, seed=3)):
        got = layers.attend(q, keys, values, scale=scale, mask=mask)
        assert mx.array_equal(got, layers.attend(q, packed_k, packed_v, scale=scale, mask=mask))
        want_mask = masks.causal_array(L, T) if mask == "causal" else mask
        _check(got, _oracle(q, packed_k.dequantize(), packed_v.dequantize(), scale, want_mask))


@cuda_only
def test_staged_cache_steps_replay_compiled():
    """Decode steps on a quantised cache (``QuantizedKVCache``, staging on CUDA) hand the
    kernel its whole buffers and the live lengths, and the call replays compiled while the
    shapes hold: each step's output must follow the new lengths (a replayed trace that kept
    the first step's would read stale keys), across flushes of the stage and the packed
    buffers' growth past 256 tokens."""
    from mlxc.runtime.model.cache import QuantizedKVCache, StagedKV

    B, Hq, Hkv, D = 1, 8, 2, 64
    quant = KVQuant(bits=4, group_size=64)
    cache = QuantizedKVCache(quant)
    key = mx.random.key(7)
    k, v = (
        mx.random.normal((B, Hkv, 200, D), key=kk).astype(mx.bfloat16)
        for kk in mx.random.split(key)
    )
    cache.update_and_fetch(k, v)
    all_k, all_v = k, v
    for step in range(90):
        kk = mx.random.split(mx.random.key(step), 3)
        q = mx.random.normal((B, Hq, 1, D), key=kk[0]).astype(mx.bfloat16)
        k1, v1 = (mx.random.normal((B, Hkv, 1, D), key=x).astype(mx.bfloat16) for x in kk[1:])
        keys, values = cache.update_and_fetch(k1, v1)
        assert isinstance(keys, StagedKV) and keys.buffers
        got = layers.attend(q, keys, values, scale=0.125, mask=None)
        all_k, all_v = mx.concatenate([all_k, k1], axis=2), mx.concatenate([all_v, v1], axis=2)
        want = _oracle(
            q, quant.quantize(all_k).dequantize(), quant.quantize(all_v).dequantize(), 0.125, None
        )
        _check(got, want)


@cuda_only
@pytest.mark.parametrize("L", [1, 4])
def test_float_cache_steps_replay_compiled(monkeypatch, L):
    """Verifications of 4 queries (and decode steps, with BUFFER_DECODE) on a float
    ``KVCache``: it hands its whole buffers (``BufferKV``), which the kernel reads replayed
    while the buffer's shape holds; each step's output follows the new live count, across the
    buffer's growth past 256 tokens."""
    from mlxc.runtime.model.cache import BufferKV, KVCache

    monkeypatch.setattr(cuda_attention, "BUFFER_DECODE", True)

    B, Hq, Hkv, D = 1, 8, 2, 64
    cache = KVCache()
    k, v = (
        mx.random.normal((B, Hkv, 230, D), key=kk).astype(mx.bfloat16)
        for kk in mx.random.split(mx.random.key(3))
    )
    cache.update_and_fetch(k, v)
    all_k, all_v = k, v
    for step in range(40):
        kk = mx.random.split(mx.random.key(step), 3)
        q = mx.random.normal((B, Hq, L, D), key=kk[0]).astype(mx.bfloat16)
        k1, v1 = (mx.random.normal((B, Hkv, L, D), key=x).astype(mx.bfloat16) for x in kk[1:])
        keys, values = cache.update_and_fetch(k1, v1)
        assert isinstance(keys, BufferKV) and keys.shape[2] == all_k.shape[2] + L
        mask = "causal" if L > 1 else None
        got = layers.attend(q, keys, values, scale=0.125, mask=mask)
        all_k, all_v = mx.concatenate([all_k, k1], axis=2), mx.concatenate([all_v, v1], axis=2)
        T = all_k.shape[2]
        want_mask = masks.causal_array(L, T) if L > 1 else None
        _check(got, _oracle(q, all_k, all_v, 0.125, want_mask))


@cuda_only
def test_attend_routes_here_only_where_mlx_has_no_fast_path():
    q, k, v = _inputs(2, 8, 2, 1, 64, 64, seed=0)
    mask = _ragged_valid(2, 64, 1, seed=0)
    assert cuda_attention.applies(q, 64, mask, quantized=False)
    assert not cuda_attention.applies(q, 64, None, quantized=False)  # MLX's decode kernels
    assert not cuda_attention.applies(q, 64, mask.astype(mx.bfloat16), quantized=False)
    q96 = mx.zeros((2, 8, 1, 96), mx.bfloat16)
    assert not cuda_attention.applies(q96, 96, mask, quantized=False)
    # And attend's answer is the kernel's.
    out = layers.attend(q, k, v, scale=0.125, mask=mask)
    _check(out, _oracle(q, k, v, 0.125, mask))


@cuda_only
@pytest.mark.parametrize("H, C, RD", [(16, 512, 64), (40, 256, 32)])  # DeepSeek's, MiniCPM3's
@pytest.mark.parametrize("B, T", [(1, 9), (1, 5000), (4, 700)])
@pytest.mark.parametrize("bits", [0, 4])
def test_latent_decode(H, C, RD, B, T, bits):
    """MLA's decode kernel against MLX's attention on the joined halves (one shared key head,
    the latents as values); a ragged mask where the batch has rows; the latents and rope keys
    packed as ``--kv-bits 4`` stores them (the oracle reads them dequantised)."""
    keys = mx.random.split(mx.random.key(T + C), 4)
    q_lat, q_pe = (
        mx.random.normal((B, 1, H, n), key=k).astype(mx.bfloat16).transpose(0, 2, 1, 3)
        for n, k in zip((C, RD), keys[:2], strict=True)
    )  # as the model makes them: transposed views
    cap = T + 37  # the live rows of a cache's wider buffers
    latents, k_pe = (
        mx.random.normal((B, 1, cap, n), key=k).astype(mx.bfloat16)[:, :, :T]
        for n, k in zip((C, RD), keys[2:], strict=True)
    )
    lat_ref, pe_ref = latents, k_pe
    if bits:
        quant = KVQuant(bits=bits, group_size=32)
        latents, k_pe = quant.quantize(latents), quant.quantize(k_pe)
        # Dequantised in float32, as the kernel does in registers: a bf16 copy would round
        # each latent by up to 2^-9 of itself, ~1e-2 at the output of a 9-key row.
        lat_ref, pe_ref = (
            mx.dequantize(w, sc.astype(mx.float32), bi.astype(mx.float32), 32, bits)
            for w, sc, bi in (latents.parts, k_pe.parts)
        )
    mask = _ragged_valid(B, T, 1, seed=T) if B > 1 else None
    assert cuda_attention.latent_applies(q_lat, q_pe, latents, k_pe)
    out = cuda_attention.latent_attention(q_lat, q_pe, latents, k_pe, scale=0.1, mask=mask)
    q = mx.concatenate([q_lat, q_pe], axis=-1)
    k = mx.concatenate([lat_ref, pe_ref], axis=-1)
    _check(out, _oracle(q, k, lat_ref, 0.1, mask))
    # The widths its loads do not divide stay with the composed form.
    lat_bf, pe_bf = lat_ref.astype(mx.bfloat16), pe_ref.astype(mx.bfloat16)
    assert not cuda_attention.latent_applies(q_lat[..., :200], q_pe, lat_bf[..., :200], pe_bf)


@cuda_only
@pytest.mark.parametrize("L, T", [(100, 300), (33, 33)])
def test_attend_composes_a_short_prefill_chunk(monkeypatch, L, T):
    """A chunk of 17-1,023 queries attends composed on CUDA (``layers.CUDNN_QUERIES``: no
    cuDNN graph built per shape), causal or with a row mask, GQA, strided keys. Its scores
    and probabilities are rounded to bf16 between the products (as MLX's own fallback does),
    each a relative 2^-9, hence 2e-2 rather than the kernel's 1e-2."""
    composed, real = [], layers.composed_attention
    monkeypatch.setattr(
        layers, "composed_attention", lambda *a, **kw: composed.append(1) or real(*a, **kw)
    )
    q, k, v = _inputs(2, 8, 2, L, T, 64, seed=5)
    for mask in ("causal", _ragged_valid(2, T, L, seed=5) & masks.causal_array(L, T)):
        out = layers.attend(q, k, v, scale=0.125, mask=mask)
        want = _oracle(q, k, v, 0.125, mask)
        assert np.abs(np.array(out.astype(mx.float32)) - want).max() < 2e-2
    assert len(composed) == 2


def test_warm_finds_the_models_attention(tmp_path):
    """``warm`` compiles for the head counts, head dim and dtype the model's attention layers
    run with (read off the generated modules: the rows per block, a template argument, follow
    from the heads); on a machine without CUDA it does nothing. Runs everywhere."""
    ckpt.make_llama(tmp_path / "m", head_dim=32, num_attention_heads=4, num_key_value_heads=2)
    model = load_model(tmp_path / "m", dtype=mx.bfloat16)
    assert cuda_attention._attention_shapes(model) == {(4, 2, 32)}
    assert cuda_attention._activation_dtype(model) == mx.bfloat16
    if not cuda_attention.available():
        cuda_attention.warm(model, (1, 4), KVQuant(bits=4, group_size=32))
        assert cuda_attention._warm.cache_info().currsize == 0


def test_warm_finds_the_models_latent_attention(tmp_path):
    """``warm_latent`` compiles for an MLA model's heads, latent and rope widths (read off the
    generated modules); on a machine without CUDA it does nothing. Runs everywhere (its
    checkpoint written by ``bench.models``, not transformers, whose versions differ on the GPU
    machine)."""
    import json

    from bench import models

    mla = {"kv_lora_rank": 256, "qk_nope_head_dim": 16, "qk_rope_head_dim": 32, "v_head_dim": 16}
    sizes = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4}
    cfg = {**models.config("deepseek_v2", "small"), **sizes, **mla}
    cfg.update(num_hidden_layers=1, vocab_size=256, first_k_dense_replace=1)
    path = tmp_path / "m"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg))
    models.write_tensors(path, models.shapes(cfg), seed=1)
    model = load_model(path, dtype=mx.bfloat16)
    assert cuda_attention._latent_shapes(model) == {(4, 256, 32)}
    cuda_attention.warm_latent(model)  # compiles on CUDA, returns at once elsewhere


def test_latent_kernel_takes_the_steps_it_is_faster_for(monkeypatch):
    """``latent_applies`` on CUDA (taken as there on any machine): MLA decode steps up to the
    work the kernel was measured faster for go to it (16 heads to 32k keys a row, 16 rows of
    2k, 128 heads at 1k); more keys, rows or heads than that stay composed (128 heads at 4k:
    measured slower; past the measured: LATENT_TILE_KEYS)."""
    monkeypatch.setattr(cuda_attention, "available", lambda: True)

    def applies(B, H, T, C=512, RD=64):
        q_lat, q_pe = (mx.zeros((B, H, 1, n), mx.bfloat16) for n in (C, RD))
        latents, k_pe = (mx.zeros((B, 1, T, n), mx.bfloat16) for n in (C, RD))
        return cuda_attention.latent_applies(q_lat, q_pe, latents, k_pe)

    assert applies(1, 16, 4096) and applies(1, 40, 16384, 256, 32) and applies(4, 16, 700)
    assert applies(1, 16, 32768) and applies(16, 16, 2048)  # 4 tiles of 4 heads: 131k
    assert applies(1, 128, 1024)  # 32 tiles
    assert not applies(1, 128, 4096)
    assert not applies(1, 16, 65536) and not applies(64, 16, 1024)  # 262k: not measured
    assert not applies(1, 16, 512, C=200)  # widths its loads do not divide
