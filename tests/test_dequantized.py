"""``runtime.model.dequantized``: quantised products through a float copy on the CPU.

The oracle is MLX's own ``quantized_matmul`` on the same packed weights. Both multiply the same
dequantised values and sum in float32 (only the order of the sums differs), so they agree to
float32 rounding: 1e-4 relative to the output's largest magnitude, where a wrong scale, a
transposed piece or a piece out of place is off by a whole weight's worth. The copy is taken
only with an optimised BLAS, so these tests say there is one (the mechanism is the same on
MLX's reference BLAS); a whole model through it is checked by ``test_convert.py`` (a loaded
4-bit checkpoint against its fake-quantised float twin, prefill and decode).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx import nn

from mlxc.runtime import blas
from mlxc.runtime.model import dequantized
from mlxc.runtime.model.dequantized import CPU_ROWS, CPUQuantizedEmbedding, CPUQuantizedLinear

QUANTS = [  # (group size, bits, mode)
    (32, 4, "affine"),
    (64, 8, "affine"),
    (32, 4, "mxfp4"),
]


@pytest.fixture(autouse=True)
def fast_blas(monkeypatch):
    monkeypatch.setattr(blas, "fast_cpu_matmul", lambda: True)


def _close(got: mx.array, want: mx.array) -> None:
    want = np.array(want)
    assert np.abs(want).max() > 1  # not two near-zero tensors
    np.testing.assert_allclose(np.array(got), want, atol=1e-4 * np.abs(want).max(), rtol=0)


def _quantized(shape: tuple[int, ...], group: int, bits: int, mode: str, seed: int):
    """A quantised layer's parameters (``weight``, ``scales``, ``biases``) and settings."""
    layer = nn.Module()
    layer.group_size, layer.bits, layer.mode = group, bits, mode
    w = mx.random.normal(shape, key=mx.random.key(seed))
    layer.weight, layer.scales, *biases = mx.quantize(w, group, bits, mode=mode)
    if biases:
        layer.biases = biases[0]
    return layer


def _peer(x: mx.array, layer, expert: int | None = None) -> mx.array:
    pick = (lambda a: a) if expert is None else (lambda a: a[expert])
    biases = layer.get("biases")
    return mx.quantized_matmul(
        x,
        pick(layer["weight"]),
        pick(layer["scales"]),
        None if biases is None else pick(biases),
        transpose=True,
        group_size=layer.group_size,
        bits=layer.bits,
        mode=layer.mode,
    )


@pytest.mark.parametrize(("group", "bits", "mode"), QUANTS)
def test_product_in_pieces_equals_quantized_matmul(monkeypatch, group, bits, mode):
    """Whole, in pieces (the last one short) and for one expert of a stack: MLX's product."""
    layer = _quantized((100, 128), group, bits, mode, seed=1)
    x = mx.random.normal((2, 5, 128), key=mx.random.key(2))
    whole = dequantized.product(x, layer)
    _close(whole, _peer(x, layer))
    monkeypatch.setattr(dequantized, "PIECE_BYTES", 30 * 128 * 4)  # 30 rows: 4 pieces
    _close(dequantized.product(x, layer), _peer(x, layer))
    stack = _quantized((3, 100, 128), group, bits, mode, seed=3)
    _close(dequantized.product(x[0], stack, 2), _peer(x[0], stack, 2))


def test_products_of_several_rows_take_the_copy(monkeypatch):
    """A routed linear (with a bias) and a tied head: fewer than CPU_ROWS rows keep MLX's
    ``quantized_matmul``, CPU_ROWS or more dequantise; the same numbers either way."""
    model = nn.Sequential(nn.Linear(64, 96, bias=True), nn.Embedding(40, 64))
    model.update(nn.utils.tree_map(lambda p: mx.random.normal(p.shape), model.parameters()))
    plain = {}
    for rows in (1, CPU_ROWS - 1, CPU_ROWS, 9):
        x = mx.random.normal((rows, 64), key=mx.random.key(rows))
        plain[rows] = (model.layers[0](x), model.layers[1].as_linear(x))
    nn.quantize(model, 32, 4)
    unrouted = {}
    for rows in plain:
        x = mx.random.normal((rows, 64), key=mx.random.key(rows))
        unrouted[rows] = (model.layers[0](x), model.layers[1].as_linear(x))
    dequantized.route(model)
    assert type(model.layers[0]) is CPUQuantizedLinear
    assert type(model.layers[1]) is CPUQuantizedEmbedding
    real, calls = mx.quantized_matmul, []
    monkeypatch.setattr(mx, "quantized_matmul", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    for rows, want in unrouted.items():
        del calls[:]
        x = mx.random.normal((rows, 64), key=mx.random.key(rows))
        got = (model.layers[0](x), model.layers[1].as_linear(x))
        assert len(calls) == (2 if rows < CPU_ROWS else 0), rows
        for g, w in zip(got, want):
            _close(g, w)
        # and 4-bit noise, not another weight, away from the float layers
        for g, p in zip(got, plain[rows]):
            assert np.abs(np.array(g - p)).max() < 0.2 * np.abs(np.array(p)).max()


def test_no_copy_without_a_fast_blas_or_off_the_cpu(monkeypatch):
    """MLX's reference BLAS gives the copy no edge: there no product takes it (the layers are
    routed for the split over the cores); where the default device is not the CPU, ``route``
    changes nothing."""
    monkeypatch.setattr(blas, "fast_cpu_matmul", lambda: False)
    model = nn.Sequential(nn.Linear(64, 64))
    nn.quantize(model, 32, 4)
    assert not dequantized.on_cpu(mx.zeros((16, 64)))
    monkeypatch.setattr(blas, "fast_cpu_matmul", lambda: True)
    assert dequantized.on_cpu(mx.zeros((16, 64)))
    assert not dequantized.on_cpu(mx.zeros((1, CPU_ROWS - 1, 64)))
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)
    assert not dequantized.on_cpu(mx.zeros((16, 64)))
    assert type(dequantized.route(model).layers[0]) is nn.QuantizedLinear


@pytest.mark.parametrize(("group", "bits", "mode"), QUANTS)
@pytest.mark.parametrize("fast", [True, False])
def test_products_split_over_the_cores(monkeypatch, group, bits, mode, fast):
    """The products that keep MLX's kernel (fewer than CPU_ROWS rows; any number without an
    optimised BLAS) go out to one stream per core in parts of the output rows, the last one
    short: bit for bit MLX's one product. Under ``SPLIT_BYTES``, or on one core, one product."""
    monkeypatch.setattr(blas, "fast_cpu_matmul", lambda: fast)
    streams = tuple(mx.new_stream(mx.cpu) for _ in range(3))
    monkeypatch.setattr(dequantized, "cpu_streams", lambda: streams)
    monkeypatch.setattr(dequantized, "SPLIT_BYTES", 0)
    linear = nn.QuantizedLinear(128, 100, bias=True, group_size=group, bits=bits, mode=mode)
    linear.bias = mx.random.normal((100,), key=mx.random.key(4))
    head = _quantized((100, 128), group, bits, mode, seed=5)
    embedding = nn.QuantizedEmbedding(100, 128, group_size=group, bits=bits, mode=mode)
    embedding.update({k: head[k] for k in ("weight", "scales", "biases") if k in head})
    model = dequantized.route(nn.Sequential(linear, embedding))
    used, real = [], mx.quantized_matmul
    monkeypatch.setattr(
        mx, "quantized_matmul", lambda *a, **kw: used.append(kw.get("stream")) or real(*a, **kw)
    )
    for rows in (1, CPU_ROWS - 1) if fast else (1, CPU_ROWS, 9):
        x = mx.random.normal((rows, 128), key=mx.random.key(rows))
        want = (
            real(
                x,
                linear.weight,
                linear.scales,
                linear.get("biases"),
                transpose=True,
                group_size=group,
                bits=bits,
                mode=mode,
            )
            + linear.bias,
            _peer(x, head),
        )
        del used[:]
        got = (model.layers[0](x), model.layers[1].as_linear(x))
        assert used == list(streams) * 2  # 100 rows: 34 + 34 + 32
        for g, w in zip(got, want):
            assert mx.array_equal(g, w).item()
    monkeypatch.setattr(dequantized, "SPLIT_BYTES", linear.weight.nbytes + 1)
    assert dequantized.split_product(x, linear) is None
    monkeypatch.setattr(dequantized, "SPLIT_BYTES", 0)
    monkeypatch.setattr(dequantized, "cpu_streams", lambda: ())
    assert dequantized.split_product(x, linear) is None


@pytest.mark.parametrize(
    ("experts", "gib", "per"),
    [
        (128, 0.75, 128),  # Qwen3-30B-A3B's gate|up: the whole stack
        (128, 1.0, 128),
        (128, 3.0, 32),  # Qwen3-235B-A22B's: at most 42 a copy, so 4 groups of 32
        (256, 14.0, 18),  # DeepSeek-V3's: at most 18, so 15 groups
        (8, 100.0, 1),  # one expert's copy past the limit: one at a time all the same
    ],
)
def test_experts_per_copy_keeps_each_copy_within_the_limit(experts, gib, per):
    """Stacked experts are copied in as few groups of even size as keep each group's copy
    within ``EXPERT_BYTES`` (1 GiB): the counts for real stacks' gate|up copies in bf16."""
    largest = int(gib * 2**30)
    assert dequantized.experts_per_copy(experts, largest) == per
    limit, groups = dequantized.EXPERT_BYTES, -(-experts // per)
    assert per == 1 or per * largest / experts <= limit
    if groups > 1 and per > 1:  # one group fewer would pass the limit
        assert -(-experts // (groups - 1)) * largest / experts > limit


def test_admit_starts_each_product_and_waits_for_the_one_before(monkeypatch):
    """``admit`` starts evaluating a product and waits for the one admitted before it (as a
    one-element array made from it, which holds none of its memory once evaluated), so at most
    two copies' products are in flight; it hands the product back unchanged."""
    monkeypatch.setattr(dequantized, "_admitted", None)
    calls = []
    real_start, real_wait = mx.async_eval, mx.eval
    monkeypatch.setattr(mx, "async_eval", lambda a: calls.append(("start", a)) or real_start(a))
    monkeypatch.setattr(mx, "eval", lambda a: calls.append(("wait", a)) or real_wait(a))
    first, second = (mx.random.normal((4, 1, 8), key=mx.random.key(s)) for s in (1, 2))
    assert dequantized.admit(first) is first
    assert [c[0] for c in calls] == ["start"]
    assert dequantized.admit(second) is second
    assert [c[0] for c in calls] == ["start", "start", "wait"]
    waited = calls[2][1]
    assert waited is calls[0][1] and waited.size == 1
    np.testing.assert_allclose(waited.item(), np.array(first[:1]).sum(), rtol=1e-6)


def test_cpu_threads_setting(monkeypatch):
    """``MLXC_CPU_THREADS`` sets how many streams share a product out; 1: none (MLX's one)."""
    for setting, count in (("3", 3), ("1", 0)):
        monkeypatch.setenv("MLXC_CPU_THREADS", setting)
        dequantized.cpu_streams.cache_clear()
        assert len(dequantized.cpu_streams()) == count
    monkeypatch.setenv("MLXC_CPU_THREADS", "two")
    dequantized.cpu_streams.cache_clear()
    with pytest.raises(ValueError, match="MLXC_CPU_THREADS"):
        dequantized.cpu_streams()
    monkeypatch.delenv("MLXC_CPU_THREADS")
    dequantized.cpu_streams.cache_clear()
