"""On the CPU a short prefill's SwiGLU activation is computed from MLX's element-wise ops
(``layers.silu_by_polynomial``: MLX's CPU ``exp`` costs ~16 ns an element) instead of the
compiled ``silu(gate) * up``: as exact as the float32 function, against float64, over
float32's whole range, and taken only for float32 gates of its sizes on the CPU. A model whose
every gate takes it is checked against transformers in ``test_logits``."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx import nn

from mlxc.runtime.model import layers


@pytest.mark.usefixtures("on_cpu")
def test_silu_by_polynomial_is_as_exact_as_float32():
    values = np.linspace(-120, 120, 1_000_001)
    extremes = [0.0, -0.0, 1e-30, -1e-30, 87.5, -87.5, 88.8, -88.8, 1e4, -1e4, 3e38, -3e38]
    x = np.concatenate([values, extremes]).astype(np.float32)
    got = np.array(layers.silu_by_polynomial(mx.array(x)), np.float64)
    wide = x.astype(np.float64)
    want = wide * np.exp(-np.logaddexp(0.0, -wide))  # x * sigmoid(x), no overflow
    assert np.isfinite(got).all()
    # float32 keeps 24 bits (2**-24 = 6e-8 relative): within 3 of them, or an absolute 2e-6
    # where the result is tiny (x far below 0: x * exp(x), whose float32 inputs round first).
    np.testing.assert_allclose(got, want, rtol=1.8e-7, atol=2e-6)
    mlx_own = np.array(nn.silu(mx.array(x)), np.float64)
    assert np.abs(got - want).max() <= 1.5 * np.nanmax(np.abs(mlx_own - want))


@pytest.mark.usefixtures("on_cpu")
def test_glu_takes_the_polynomial_for_a_short_prefill_gate_on_the_cpu_only(rng, monkeypatch):
    """Gates of ``CPU_SILU_ELEMENTS`` float32 elements take the polynomial; a decode step's
    (fewer), a long chunk's (more) and a bf16 gate take the compiled kernel; the same values."""
    calls = []
    real = layers.silu_by_polynomial
    monkeypatch.setattr(layers, "silu_by_polynomial", lambda x: calls.append(x.size) or real(x))
    glu = layers.glu(nn.silu)
    low, high = layers.CPU_SILU_ELEMENTS
    for rows, dtype, taken in [
        (1, mx.float32, False),
        (low // 4, mx.float32, True),
        (high // 4, mx.float32, True),
        (high // 4 + 1, mx.float32, False),
        (low // 4, mx.bfloat16, False),
    ]:
        gate, up = (
            mx.array(rng.standard_normal((rows, 4)).astype(np.float32)).astype(dtype)
            for _ in range(2)
        )
        got = glu(gate, up)
        want = nn.silu(gate) * up
        assert got.dtype == want.dtype
        np.testing.assert_allclose(
            np.array(got.astype(mx.float32)),
            np.array(want.astype(mx.float32)),
            rtol=1e-6,
            atol=1e-6,
        )
        assert calls == ([rows * 4] if taken else []), (rows, dtype)
        calls.clear()
    assert layers.glu(nn.gelu) is not glu
