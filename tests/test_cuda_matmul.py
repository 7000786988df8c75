"""``runtime.model.cuda_matmul``: products of a few rows on CUDA's tensor cores.

On CUDA the kernel is checked against MLX's own matmul (bf16 and fp16, 2 to 32 rows, widths
that do not fill a block's tiles), and a model with its projections routed against the same
model without, both against it in float32. CI has no GPU: there the same source runs through
``tests/cuda_emulator`` (each thread a std::thread; the mma instruction emulated by its PTX
fragment layout, bf16 only) against numpy's product of the same bf16 values in float64. What
the emulator checks is the kernel's logic: the fragments' k order, the column tiles, the K
split over warps and their sum, the rows of blocks (16 rows each), rows and columns past the
edges, rows in several leading dims, unaligned rows. The sums are float32 in any order, then
rounded to bf16 once: half a bf16 step (at most 2^-8 relative) plus float32 summation error.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx import nn

from mlxc.runtime.model import cuda_attention, cuda_matmul

HERE = Path(__file__).parent / "cuda_emulator"
CXX = os.environ.get("CXX", "g++")

cuda = pytest.mark.skipif(not cuda_attention.available(), reason="needs MLX's CUDA backend")
emulated = pytest.mark.skipif(
    shutil.which(CXX) is None, reason=f"no C++ compiler ({CXX}); .ci/run installs g++"
)


def _bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits, rounded to nearest even (as the emulator's and CUDA's casts)."""
    u = a.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _bits_float(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _emulate(tmp: Path, x: np.ndarray, w: np.ndarray, offset: int) -> np.ndarray:
    """The kernel on the CPU: ``x [..., K]``, ``w [N, K]`` as bf16 bits, each stored
    ``offset`` elements into its buffer (1: rows off 16-byte boundaries). Returns ``y`` as
    floats, ``[rows, N]``."""
    K, N = x.shape[-1], w.shape[0]
    M = x.size // K
    dims = ", ".join(map(str, x.shape))
    for name, a in (("x", x), ("w", w)):
        np.concatenate([np.zeros(offset, np.uint16), a.ravel()]).tofile(tmp / f"{name}.bin")
    grid = cuda_matmul._launch(x.shape, mx.bfloat16, N)["grid"]  # the launch a call makes
    blocks, block_rows = grid[0] // (cuda_matmul.WARPS * 32), grid[1]
    src = "\n".join(
        [
            f'#include "{HERE / "emulator.h"}"',
            cuda_attention.include_header(cuda_matmul.KERNEL_FILE),
            "using T = __nv_bfloat16;",
            "void rows_matmul(const T* x, const mlx::core::cu::Shape x_shape, const int x_ndim,",
            "    const T* w, const mlx::core::cu::Shape w_shape, T* y) {",
            "  constexpr bool BF16 = true;",
            f"  constexpr int NT = {cuda_matmul.TILE_COLS}, KW = {cuda_matmul.WARPS};",
            cuda_matmul._SOURCE,
            "}",
            "int main() {",
            f'  auto x = load<T>("{tmp / "x.bin"}"); auto w = load<T>("{tmp / "w.bin"}");',
            f"  std::vector<T> y({M * N});",
            f"  mlx::core::cu::Shape xs{{{{{dims}}}}}, ws{{{{{N}, {K}}}}};",
            f"  launch({{{blocks}, {block_rows}, 1}}, {cuda_matmul.WARPS * 32}, [&] {{",
            f"    rows_matmul(x.data() + {offset}, xs, {x.ndim}, w.data() + {offset}, ws, y.data());",
            "  });",
            f'  std::ofstream out("{tmp / "y.bin"}", std::ios::binary);',
            "  out.write((char*)y.data(), y.size() * 2);",
            "}",
        ]
    )
    (tmp / "case.cpp").write_text(src)
    exe = tmp / "case"
    build = [CXX, "-std=c++20", "-O1", "-w", "-pthread", str(tmp / "case.cpp"), "-o", str(exe)]
    done = subprocess.run(build, check=False, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    subprocess.run([str(exe)], check=True, timeout=120)
    return _bits_float(np.fromfile(tmp / "y.bin", np.uint16)).reshape(M, N)


def _check(got: np.ndarray, x: np.ndarray, w: np.ndarray) -> None:
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    spread = np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T
    bound = 2.0**-8 * np.abs(ref) + 1e-6 * spread + 1e-30  # half a bf16 step: <= 2^-8 |ref|
    assert np.all(np.abs(got - ref) <= bound), np.max(np.abs(got - ref) / bound)


@emulated
@pytest.mark.parametrize(
    "rows, K, N, offset",
    [
        ((2,), 64, 40, 0),  # 2 of the tile's 16 rows; 40 columns: a part-filled block
        ((9,), 96, 16, 0),  # rows on both halves of the fragment (g and g + 8)
        ((16,), 160, 24, 0),  # K of 5 steps over 4 warps: one warp takes two
        ((4, 1), 512, 8, 0),  # a decode batch's [B, 1, K]; 16 K steps, four a warp
        ((3, 5), 32, 16, 0),  # a verification's [B, L, K]; one K step: three warps add zeros
        ((3,), 64, 24, 1),  # rows off 16-byte boundaries: element loads
        ((17,), 64, 40, 0),  # two block rows, the second one row
        ((32,), 96, 24, 0),  # two full block rows
        ((5, 5), 128, 16, 1),  # 25 rows of a [B, L, K], unaligned
    ],
)
def test_emulated_kernel_matches_numpy(tmp_path, rows, K, N, offset):
    rng = np.random.default_rng(sum(rows) * 1000 + K + N)
    xb = _bf16_bits(rng.standard_normal((*rows, K)).astype(np.float32))
    wb = _bf16_bits((rng.standard_normal((N, K)) * 0.05).astype(np.float32))
    got = _emulate(tmp_path, xb, wb, offset)
    _check(got, _bits_float(xb).reshape(-1, K), _bits_float(wb))


def test_applies_only_to_a_few_half_precision_rows(monkeypatch):
    monkeypatch.setattr(cuda_attention, "available", lambda: True)
    w = mx.zeros((48, 64), mx.bfloat16)

    def rows(n, dtype=mx.bfloat16, k=64):
        return mx.zeros((n, k), dtype)

    assert cuda_matmul.applies(rows(2), w) and cuda_matmul.applies(rows(16), w)
    assert cuda_matmul.applies(mx.zeros((4, 1, 64), mx.bfloat16), w)  # rows of any leading shape
    assert not cuda_matmul.applies(rows(1), w)  # MLX's matrix-vector kernel
    assert cuda_matmul.applies(rows(17), w) and cuda_matmul.applies(rows(32), w)
    assert not cuda_matmul.applies(rows(33), w)  # cuBLAS
    assert not cuda_matmul.applies(rows(4, mx.float32), w.astype(mx.float32))
    assert not cuda_matmul.applies(rows(4, mx.float16), w)  # dtypes differ
    assert not cuda_matmul.applies(rows(4, k=48), mx.zeros((48, 48), mx.bfloat16))  # K % 32
    assert not cuda_matmul.applies(rows(4, k=0), mx.zeros((48, 0), mx.bfloat16))
    monkeypatch.setattr(cuda_attention, "available", lambda: False)
    assert not cuda_matmul.applies(rows(4), w)


def test_route_changes_only_dense_layers_and_only_on_cuda(monkeypatch):
    model = nn.Sequential(nn.Linear(64, 32), nn.Embedding(10, 64), nn.Linear(64, 64))
    nn.quantize(model, group_size=32, bits=4, class_predicate=lambda p, m: p == "layers.2")
    monkeypatch.setattr(cuda_attention, "available", lambda: False)
    cuda_matmul.route(model)
    assert type(model.layers[0]) is nn.Linear  # off CUDA: untouched
    monkeypatch.setattr(cuda_attention, "available", lambda: True)
    before = dict(model.parameters()["layers"][0])
    cuda_matmul.route(model)
    assert type(model.layers[0]) is cuda_matmul.RowsLinear
    assert type(model.layers[1]) is cuda_matmul.RowsEmbedding
    assert type(model.layers[2]) is nn.QuantizedLinear
    assert all(model.layers[0][k] is v for k, v in before.items())  # the same parameters


def test_loading_routes_a_models_dense_layers_on_cuda(tmp_path, monkeypatch):
    """``load_model`` hands its model to ``route`` last (after fusing): on CUDA (imitated here,
    no forward runs) the fused projections and the untouched ones alike."""
    import mlxc
    from bench import models

    models.write_checkpoint(tmp_path / "llama", "llama", "small")
    monkeypatch.setattr(cuda_attention, "available", lambda: True)
    model = mlxc.load_model(tmp_path / "llama")
    kinds = {name.rsplit(".", 1)[-1]: type(m) for name, m in model.named_modules()}
    for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
        assert kinds[name] is cuda_matmul.RowsLinear, name
    assert kinds["embed_tokens"] is cuda_matmul.RowsEmbedding


@cuda
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("M", [2, 3, 8, 9, 16, 17, 32])
@pytest.mark.parametrize("K, N", [(2048, 3072), (8192, 200), (96, 40)])
def test_kernel_matches_mlx(dtype, M, K, N):
    mx.random.seed(M + K + N)
    x = mx.random.normal((M, K)).astype(dtype)
    w = (mx.random.normal((N, K)) * K**-0.5).astype(dtype)
    got = cuda_matmul.matmul(x, w).astype(mx.float32)
    ref = x.astype(mx.float32) @ w.astype(mx.float32).T
    spread = mx.abs(x).astype(mx.float32) @ mx.abs(w).astype(mx.float32).T
    eps = 2.0**-8 if dtype == mx.bfloat16 else 2.0**-11
    excess = mx.abs(got - ref) - (eps * mx.abs(ref) + 1e-5 * spread)
    assert mx.max(excess).item() <= 0


@cuda
def test_routed_model_matches_unrouted(tmp_path):
    """A bf16 model's logits over 3 x 4 tokens (12 rows a product) with its projections routed
    are as close to the same model's in float32 as MLX's own products get, within 2x."""
    import mlxc
    from bench import models

    models.write_checkpoint(tmp_path / "llama", "llama", "small")
    model = mlxc.load_model(tmp_path / "llama", dtype=mx.bfloat16)
    routed = [m for _, m in model.named_modules() if isinstance(m, cuda_matmul.RowsLinear)]
    assert routed
    ids = mx.array([[5, 9, 200, 31], [7, 1000, 4, 77], [3, 3, 8, 12]])

    def logits():
        return model(ids, cache=model.make_cache()).astype(mx.float32)

    with_kernel = logits()
    for m in routed:
        m.__class__ = nn.Linear
    for _, m in model.named_modules():
        if isinstance(m, cuda_matmul.RowsEmbedding):
            m.__class__ = nn.Embedding
    with_mlx = logits()
    model.set_dtype(mx.float32)
    exact = logits()
    mlx_error = mx.abs(with_mlx - exact).max().item()
    assert mlx_error > 0  # bf16 rounding is there to compare with
    assert mx.abs(with_kernel - exact).max().item() <= 2 * mlx_error


def test_bench_rows_matmul_runs_both_sides(tmp_path, monkeypatch):
    """``bench.rows_matmul``'s two parts and its table, off CUDA (where both sides are MLX's
    products: this checks the benchmark's plumbing, not a speed)."""
    from bench import models, rows_matmul

    monkeypatch.setattr(rows_matmul, "SHAPES", [(64, 48)])
    table = rows_matmul.products([1, 2], calls=3, repeats=1)
    assert [r["rows"] for r in table] == [1, 2]
    assert all(r[s][k] > 0 for r in table for s in ("mlx", "mlxc") for k in ("build", "wall"))
    models.write_checkpoint(tmp_path / "llama", "llama", "small")
    models.write_tokenizer(tmp_path / "llama", models.config("llama", "small")["vocab_size"])
    steps = rows_matmul.decode(tmp_path / "llama", [2], steps=2, repeats=1)
    assert steps[0]["batch"] == 2 and steps[0]["mlx"] > 0 and steps[0]["mlxc"] > 0
    args = {"rows": "1,2", "batches": "2", "calls": 3, "steps": 2, "repeats": 1}
    report = {"args": args, "device": "cpu", "mlx": mx.__version__}
    md = rows_matmul._markdown(report | {"products": table, "decode": steps})
    assert "| 64x48 | 2 |" in md and "| 2 |" in md
