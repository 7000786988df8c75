"""On the CPU a float32 SwiGLU / GeGLU activation is computed from MLX's element-wise ops
(``layers.silu_by_polynomial``, ``layers.gelu_approx_by_polynomial``: MLX's CPU ``exp`` and
``tanh`` cost ~12-25 ns an element), compiled, instead of ``act(gate) * up``, in blocks of
rows: as exact as the float32 functions, against float64, over float32's whole range, and
taken only for float32 gates on the CPU. Models whose every gate takes it are checked against
transformers in ``test_logits`` (silu) and ``test_gemma3`` (tanh GELU)."""

from __future__ import annotations

import io
import re

import mlx.core as mx
import numpy as np
import pytest
from mlx import nn

from mlxc.runtime.model import layers

VALUES = np.linspace(-120, 120, 1_000_001)
EXTREMES = [0.0, -0.0, 1e-30, -1e-30, 87.5, -87.5, 88.8, -88.8, 1e4, -1e4, 3e38, -3e38]


def _x_sigmoid(x: np.ndarray, z: np.ndarray) -> np.ndarray:
    """``x * sigmoid(z)`` in float64, without overflow."""
    return x * np.exp(-np.logaddexp(0.0, -z))


@pytest.mark.usefixtures("on_cpu")
@pytest.mark.parametrize(
    "ours, mlx_own, z",
    [
        (layers.silu_by_polynomial, nn.silu, lambda x: x),
        # The tanh GELU is x * sigmoid(2y): its float64 value without 1 + tanh's cancellation
        # (1 + tanh(y) for y ~ -18 keeps one float64 digit).
        (
            layers.gelu_approx_by_polynomial,
            nn.gelu_approx,
            lambda x: 2 * np.sqrt(2 / np.pi) * (x + 0.044715 * x**3),
        ),
    ],
    ids=["silu", "gelu_approx"],
)
def test_activation_by_polynomial_is_as_exact_as_float32(ours, mlx_own, z):
    x = np.concatenate([VALUES, EXTREMES]).astype(np.float32)
    got = np.array(ours(mx.array(x)), np.float64)
    wide = x.astype(np.float64)
    with np.errstate(over="ignore"):
        want = _x_sigmoid(wide, z(wide))
    assert np.isfinite(got).all()
    # float32 keeps 24 bits (2**-24 = 6e-8 relative): within 3 of them, or an absolute 2e-6
    # where the result is tiny (x far below 0: x * exp(z), whose float32 inputs round first).
    np.testing.assert_allclose(got, want, rtol=1.8e-7, atol=2e-6)
    theirs = np.array(mlx_own(mx.array(x)), np.float64)
    assert np.abs(got - want).max() <= 1.5 * np.nanmax(np.abs(theirs - want))


@pytest.mark.usefixtures("on_cpu")
@pytest.mark.parametrize("act", [nn.silu, layers.gelu_approx], ids=["silu", "gelu_approx"])
def test_glu_takes_the_polynomial_for_a_float32_gate_on_the_cpu_only(rng, monkeypatch, act):
    """float32 gates take the polynomial, in blocks of rows (a decode step's one row, a gate of
    several blocks, the last one short, and a [B, L, I] gate whose rows are a split's strided
    view); a bf16 gate takes MLX's function; the same values."""
    monkeypatch.setattr(layers, "CPU_ACT_BLOCK", 64)  # 16 rows of 4: several blocks below
    calls = []
    real = layers.in_row_blocks
    monkeypatch.setattr(layers, "in_row_blocks", lambda fn, *xs: calls.append(1) or real(fn, *xs))
    glu = layers.glu(act)
    for shape, dtype, taken in [
        ((1, 4), mx.float32, True),
        ((37, 4), mx.float32, True),
        ((2, 21, 4), mx.float32, True),
        ((37, 4), mx.bfloat16, False),
    ]:
        both = mx.array(rng.standard_normal((*shape[:-1], 8)).astype(np.float32) * 3)
        gate, up = mx.split(both.astype(dtype), 2, axis=-1)
        got = glu(gate, up)
        want = act(gate) * up
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_allclose(
            np.array(got.astype(mx.float32)),
            np.array(want.astype(mx.float32)),
            rtol=1e-6,
            atol=1e-6,
        )
        assert calls == ([1] if taken else []), (shape, dtype)
        calls.clear()
    assert layers.glu(nn.gelu) is not glu


def test_gelu_approx_is_the_tanh_gelu_in_one_kernel_with_its_gate():
    """``layers.gelu_approx`` (the GPU's and a bfloat16 gate's tanh GELU, as ``x * sigmoid(2y)``)
    is float32's tanh GELU within a few ulps, within 8% of it in bfloat16 down to 1e-6, and
    ``glu`` of it is one compiled kernel (MLX 0.32 compiles ``nn.gelu_approx``'s GeGLU to two)."""
    x = np.concatenate([np.linspace(-30, 30, 100_001), EXTREMES[:10]]).astype(np.float32)
    wide = x.astype(np.float64)
    want = _x_sigmoid(wide, 2 * np.sqrt(2 / np.pi) * (wide + 0.044715 * wide**3))
    got = np.array(layers.gelu_approx(mx.array(x)), np.float64)
    # A few float32 ulps, or an absolute 2e-6 where the result is tiny (x far below 0, where
    # MLX's sigmoid keeps fewer bits: 1e-5 relative at 1e-8).
    np.testing.assert_allclose(got, want, rtol=5e-7, atol=2e-6)
    # bfloat16: each of its ops rounds (2**-9), and the sigmoid of the far negative tail turns
    # its argument's error into the result's relative one: within 8% down to 1e-6, where
    # nn.gelu_approx's 1 + tanh gives 0 from x = -3 on.
    half = mx.array(x[:100_001]).astype(mx.bfloat16)
    wide = np.array(half.astype(mx.float32), np.float64)
    want = _x_sigmoid(wide, 2 * np.sqrt(2 / np.pi) * (wide + 0.044715 * wide**3))
    got = np.array(layers.gelu_approx(half).astype(mx.float32), np.float64)
    assert (np.abs(got - want) / (np.abs(want) + 1e-6)).max() < 0.08

    def kernels(act) -> list[str]:
        gate, up = (mx.ones((1, 8), mx.bfloat16) for _ in range(2))
        dot = io.StringIO()
        mx.export_to_dot(dot, layers.glu(act)(gate, up))
        return re.findall(r'label ="(Compiled[^"]*)"', dot.getvalue())

    assert len(kernels(layers.gelu_approx)) == 1


def test_in_row_blocks_covers_every_row_once(monkeypatch):
    monkeypatch.setattr(layers, "CPU_ACT_BLOCK", 12)  # 3 rows of 4: 14 rows -> 3, 3, 3, 3, 2
    x = mx.arange(2 * 7 * 4).reshape(2, 7, 4)
    seen = []
    out = layers.in_row_blocks(lambda a: seen.append(a.shape) or a * 2, x)
    assert seen == [(3, 4)] * 4 + [(2, 4)]
    np.testing.assert_array_equal(np.array(out), 2 * np.array(x))


@pytest.mark.usefixtures("on_cpu")
def test_exp_by_polynomial_is_as_exact_as_float32():
    """The exponentials of a prefill block's softmax on the CPU (``layers._block_attention``):
    over a softmax's range (scores less their row's maximum) within 2 float32 ulps of float64's
    exp, plain and as the compiled kernel (MLX's CPU exp: ~64 ulps); at -87 and below, masked
    scores (-inf) included, ~1.6e-38, which no row sum of at least one 1 notices."""
    x = np.linspace(-87, 0, 1_000_001).astype(np.float32)
    want = np.exp(x.astype(np.float64))
    for got in (
        layers.exp_by_polynomial(mx.array(x)),
        layers._shifted_exp(mx.array(x), mx.zeros((1,))),
    ):
        np.testing.assert_allclose(np.array(got, np.float64), want, rtol=1.2e-7, atol=0)
    tail = np.array(layers.exp_by_polynomial(mx.array([-np.inf, -1e4, -88.0], mx.float32)))
    assert ((tail > 0) & (tail < 2e-38)).all()
