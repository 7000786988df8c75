"""The Mamba2 mixer and its recurrent-state cache (runtime/model/ssm.py) against transformers'
NemotronHMamba2Mixer (its torch path, CPU, float32) on re-randomised weights.

Tolerance: atol 1e-4 (float32; the chunked scan and the recurrence sum the same terms in
different orders).
"""

import math

import mlx.core as mx
import numpy as np
import pytest

from mlxc.runtime.model.batch import BatchCache, BatchKVCache
from mlxc.runtime.model.cache import KVCache, LayerCache, WindowedKVCache, enforce_max_kv
from mlxc.runtime.model.multimodal import SequenceCache
from mlxc.runtime.model.ssm import (
    BatchRecurrentCache,
    Mamba2Mixer,
    RecurrentCache,
    convert_conv_weights,
)

torch = pytest.importorskip("torch")

# nvidia/NVIDIA-Nemotron-Nano-9B-v2's Mamba keys, shrunk: 8 heads in 2 groups, a 4-wide
# convolution, SSD chunks of 8 (the test lengths are not multiples of it).
CONFIG = {
    "model_type": "nemotron_h",
    "hidden_size": 32,
    "hybrid_override_pattern": "M",
    "mamba_num_heads": 8,
    "mamba_head_dim": 4,
    "n_groups": 2,
    "ssm_state_size": 8,
    "conv_kernel": 4,
    "chunk_size": 8,
    "expand": 2,
    "use_conv_bias": True,
    "mamba_proj_bias": False,
    "use_bias": False,
    "mamba_hidden_act": "silu",
    "time_step_min": 0.001,
    "time_step_max": 0.1,
    "time_step_floor": 0.0001,
    "time_step_limit": [0.0, math.inf],
    "layer_norm_epsilon": 1e-5,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "intermediate_size": 64,
    "vocab_size": 64,
}
L = 37


def _reference(seed=0, time_step_limit=(CONFIG["time_step_min"], math.inf)):
    """transformers' mixer with every parameter re-randomised, and ours with its weights, both
    clamping the time step to ``time_step_limit``.

    The default is the clamp older transformers releases used, ``(time_step_min, inf)``,
    set explicitly: later releases read the config's ``time_step_limit``, ``(0, inf)``, as the
    published implementation does (transformers PR #48989, mlx-lm PR #1026)."""
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

    config = NemotronHConfig(**CONFIG)
    ref = NemotronHMamba2Mixer(config, layer_idx=0).eval()
    ref.time_step_limit = time_step_limit
    g = torch.Generator().manual_seed(seed)
    H = config.mamba_num_heads
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if p.ndim > 1:
                p.copy_(torch.randn(p.shape, generator=g) * 1.2 / p.shape[-1] ** 0.5)
            else:
                p.copy_((1.0 if "norm" in name else 0.0) + 0.2 * torch.randn(p.shape, generator=g))
        # Mamba2's own init with real spread: A = -[1, 16], dt in [time_step_min, max] (low
        # ones fall under time_step_min once the input moves them: the clamp matters), D ~ 1.
        ref.A_log.copy_(torch.log(1 + 15 * torch.rand(H, generator=g)))
        lo, hi = math.log(config.time_step_min), math.log(config.time_step_max)
        dt = torch.exp(lo + (hi - lo) * torch.rand(H, generator=g))
        ref.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        ref.D.copy_(1 + 0.5 * torch.randn(H, generator=g))
    ours = Mamba2Mixer(
        hidden_size=config.hidden_size,
        num_heads=H,
        head_dim=config.mamba_head_dim,
        state_size=config.ssm_state_size,
        n_groups=config.n_groups,
        conv_kernel=config.conv_kernel,
        chunk_size=config.chunk_size,
        time_step_limit=ref.time_step_limit,  # transformers': (time_step_min, inf)
        rms_norm_eps=config.layer_norm_epsilon,
        bias=config.use_bias,
        conv_bias=config.use_conv_bias,
    )
    weights = {k: mx.array(v.detach().numpy()) for k, v in ref.state_dict().items()}
    ours.load_weights(list(convert_conv_weights(weights).items()), strict=True)
    return ref, ours


@pytest.fixture(scope="module")
def mixers():
    return _reference()


def _inputs(batch, n, seed=1):
    return np.random.default_rng(seed).standard_normal(
        (batch, n, CONFIG["hidden_size"]), np.float32
    )


def _close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, rtol=0)


def test_full_sequence_matches_transformers(mixers):
    ref, ours = mixers
    x = _inputs(2, L)
    with torch.no_grad():
        expected = ref(torch.from_numpy(x)).numpy()
        # The data exercises the time-step clamp: some softplus(dt + dt_bias) fall under it.
        dt = ref.in_proj(torch.from_numpy(x))[..., -ref.num_heads :] + ref.dt_bias
        assert (torch.nn.functional.softplus(dt) < ref.time_step_limit[0]).any()
    _close(ours(mx.array(x)), expected)
    cache = ours.new_cache()
    _close(ours(mx.array(x), cache), expected)  # from an empty cache: the same
    assert cache.offset == L and cache.ssm.dtype == mx.float32
    assert cache.conv.shape == (2, CONFIG["conv_kernel"] - 1, ours.conv_dim)

    ref, ours = _reference(time_step_limit=tuple(CONFIG["time_step_limit"]))  # the config's
    with torch.no_grad():
        unclamped = ref(torch.from_numpy(x)).numpy()
    assert np.abs(unclamped - expected).max() > 1e-3  # the limit changes the output
    _close(ours(mx.array(x)), unclamped)


@pytest.mark.parametrize("size", [1, 2, 3, 7, 64])  # 2 < conv_kernel - 1: spans the kernel
def test_chunked_prefill_equals_one_pass(mixers, size):
    _, ours = mixers
    x = mx.array(_inputs(1, L))
    full = ours(x)
    cache = ours.new_cache()
    parts = [ours(x[:, i : i + size], cache) for i in range(0, L, size)]
    _close(mx.concatenate(parts, axis=1), full)
    assert cache.offset == L


def test_decode_after_prefill_equals_full_pass(mixers):
    ref, ours = mixers
    x = _inputs(1, L)
    with torch.no_grad():
        expected = ref(torch.from_numpy(x)).numpy()
    cache = ours.new_cache()
    parts = [ours(mx.array(x[:, :20]), cache)]
    parts += [ours(mx.array(x[:, i : i + 1]), cache) for i in range(20, L)]  # the recurrence
    _close(mx.concatenate(parts, axis=1), expected)


def test_batch_rows_join_and_leave(mixers):
    """Rows of different lengths decode together; each gets what it gets alone."""
    _, ours = mixers
    prompts, steps = [5, 12, 9], 8
    xs = [mx.array(_inputs(1, n + steps, seed=10 + i)) for i, n in enumerate(prompts)]
    alone = [ours(x) for x in xs]
    caches = [ours.new_cache() for _ in xs]
    for x, n, cache in zip(xs, prompts, caches):
        ours(x[:, :n], cache)
    batch = caches[0].batch_layer()
    assert isinstance(batch, BatchRecurrentCache) and batch.batch_layer() is None
    done = [0, 0, 0]  # decode steps taken per sequence

    def step(rows):
        x = mx.concatenate([xs[r][:, prompts[r] + done[r]][:, None] for r in rows])
        out = ours(x, batch)
        for b, r in enumerate(rows):
            _close(out[b, 0], alone[r][0, prompts[r] + done[r]])
            done[r] += 1

    batch.extend(caches[:2])
    step([0, 1])
    step([0, 1])
    batch.extend(caches[2:])
    step([0, 1, 2])
    assert batch.offset.tolist() == [prompts[0] + 3, prompts[1] + 3, prompts[2] + 1]
    batch.keep_rows([2, 1])
    step([2, 1])
    assert batch.row_live_len.tolist() == [0, 0] and batch.key_valid(1) is None
    batch.keep_rows([])
    assert batch.arrays() == [] and batch.nbytes == 0
    with pytest.raises(ValueError):
        batch.extend([ours.new_cache()])  # an empty cache has no state to join with


def test_recurrent_cache_kind_in_the_protocol(mixers):
    _, ours = mixers
    state = ours.new_cache()
    ours(mx.array(_inputs(1, 6)), state)
    for cache in (state, BatchRecurrentCache()):
        assert isinstance(cache, LayerCache)
        assert not cache.trimmable and not cache.holds_keys and cache.window is None
    assert state.live_len == 0 and state.key_valid(3) is None
    assert state.nbytes == sum(a.nbytes for a in state.arrays()) > 0
    assert len(state.arrays()) == 2

    # No mask is built from it: windows() takes the first cache that holds keys per window.
    full, windowed = KVCache(), WindowedKVCache(4)
    seq = SequenceCache([state, full, RecurrentCache(), windowed])
    assert seq.windows() == {None: full, 4: windowed}
    assert seq.offset == 6  # every kind counts positions
    assert SequenceCache([state]).windows() == {}

    # --max-kv-size trims the attention layers and leaves the state alone.
    full.update_and_fetch(mx.zeros((1, 1, 10, 2)), mx.zeros((1, 1, 10, 2)))
    before = [np.array(a) for a in state.arrays()]
    assert enforce_max_kv([state, full], 4, keep=1) == 6
    assert full.live_len == 4 and state.offset == 6
    assert state.trim_front(5) == 0  # called anyway: nothing to drop, nothing dropped
    for a, b in zip(state.arrays(), before):
        assert np.array_equal(np.array(a), b)
    with pytest.raises(ValueError):
        state.trim_front(-1)

    # The pool's decode batch takes a hybrid's caches, each layer into its kind's batch layer.
    hybrid = SequenceCache([state, full])
    assert BatchCache.accepts(hybrid)
    batch = BatchCache.like(hybrid)
    batch.extend([hybrid])
    assert isinstance(batch[0], BatchRecurrentCache) and isinstance(batch[1], BatchKVCache)
    assert batch.windows() == {None: batch[1]} and batch[0].offset.tolist() == [6]


def test_conv_weight_conversion():
    torch_layout = mx.arange(24, dtype=mx.float32).reshape(6, 1, 4)  # [C, 1, K]
    out = convert_conv_weights({"m.conv1d.weight": torch_layout, "m.in_proj.weight": torch_layout})
    assert out["m.conv1d.weight"].shape == (6, 4, 1)
    assert out["m.conv1d.weight"][2, :, 0].tolist() == torch_layout[2, 0].tolist()
    assert out["m.in_proj.weight"].shape == (6, 1, 4)  # only conv1d weights
    again = convert_conv_weights(out)  # MLX layout (an mlx-lm conversion) passes unchanged
    assert again["m.conv1d.weight"].shape == (6, 4, 1)


def test_selective_scan_in_chunks_equals_one_chunk_and_the_steps():
    """Mamba (v1)'s parallel scan: any chunking of the tokens gives the state and outputs one
    chunk does (the GPU's default, ``SCAN_CHUNK``, is one chunk here; the CPU's is 1), and both
    equal the one-token step applied token by token."""
    from mlxc.runtime.model.ssm import SCAN_CHUNK, _selective_step, selective_scan

    rng = np.random.default_rng(3)
    b, L, I, n = 2, 23, 6, 4

    def r(*shape, scale=1.0):
        return mx.array(scale * rng.standard_normal(shape).astype(np.float32))

    x, B, C, state = r(b, L, I), r(b, L, n), r(b, L, n), r(b, I, n)
    dt = mx.array(rng.uniform(0.01, 0.5, (b, L, I)).astype(np.float32))
    A = -mx.array(rng.uniform(0.5, 4.0, (I, n)).astype(np.float32))
    y, last = selective_scan(x, dt, A, B, C, state, chunk=SCAN_CHUNK)
    for chunk in (None, 1, 4, 7):
        yc, lc = selective_scan(x, dt, A, B, C, state, chunk=chunk)
        _close(yc, y)
        _close(lc, last)
    h, steps = state, []
    for t in range(L):
        yt, h = _selective_step(
            x[:, t : t + 1], dt[:, t : t + 1], A, B[:, t : t + 1], C[:, t : t + 1], h
        )
        steps.append(yt)
    _close(mx.concatenate(steps, axis=1), y)
    _close(h, last)
