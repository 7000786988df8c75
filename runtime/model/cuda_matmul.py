"""Products of a few rows on CUDA, where MLX 0.32 calls cuBLAS.

A decode batch of B rows, or a verification forward of K + 1 tokens, multiplies every weight
by a few rows. MLX runs one row through its own matrix-vector kernel, and two or more through
cuBLASLt, whose every call costs the host more: MLX builds its descriptors, asks cuBLASLt's
heuristic for an algorithm and captures the call into its CUDA graph each time. On an H100
(s28, ``bench/results/rows-shapes-gpu-h100-s28.md``) such a call took ~19 us of the host
to encode against ~7 for one row, and a decode step of mlx-lm's llama medium (65 products)
went from 1.72 ms at one row to 3.1 ms at two: a step that the host bounds paid for its rows in
host time, not device time.

``matmul`` is one launch of mlxc's kernel (``cuda_matmul.cuh``: tensor-core mmas, each weight
byte read once, the K axis split over a block's warps) for 2 to ``MAX_ROWS`` rows of bf16 or
fp16 activations against a weight of the same dtype. ``route`` gives a loaded model's dense
projections this path (``RowsLinear``, ``RowsEmbedding``); one row, other dtypes, quantised
and sharded layers keep MLX's.

Checked against MLX's matmul by ``tests/test_cuda_matmul.py`` on CUDA and, in CI, through the
emulator (``tests/cuda_emulator``, which emulates the mma instruction).
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import mlx.core as mx
from mlx import nn

from mlxc.runtime.model import cuda_attention

MAX_ROWS = 64  # four tiles of 16 rows; more rows go to cuBLAS, whose cost then pays for itself
TILE_COLS = 2  # tiles of 8 columns a block computes (NT)
WARPS = 4  # warps of a block, splitting K (KW)
K_STEP = 32  # the kernel takes K in steps of 32

KERNEL_FILE = Path(__file__).with_name("cuda_matmul.cuh")
# One call of the kernel's template (the code is #included by path, as cuda_attention's).
_SOURCE = "  ::mlxc::rows_matmul<T, BF16, MT, NT, KW>(x, x_shape, w, w_shape, y);\n"


@functools.cache
def _kernel():
    return mx.fast.cuda_kernel(
        name="mlxc_rows_matmul",
        input_names=["x", "w"],
        output_names=["y"],
        source=_SOURCE,
        header=cuda_attention.include_header(KERNEL_FILE),
        ensure_row_contiguous=True,
    )


def applies(x: mx.array, weight: mx.array) -> bool:
    """Whether ``x @ weight.T`` should take ``matmul`` on this device: 2 to MAX_ROWS rows of
    bf16 or fp16, the weight's dtype, K a multiple of 32, on CUDA."""
    K = x.shape[-1]
    rows = x.size // K if K else 0
    return (
        2 <= rows <= MAX_ROWS
        and K % K_STEP == 0
        and x.dtype == weight.dtype
        and x.dtype in (mx.bfloat16, mx.float16)
        and weight.ndim == 2
        and cuda_attention.available()
    )


def matmul(x: mx.array, weight: mx.array) -> mx.array:
    """``x @ weight.T`` for ``x [..., K]`` of 2 to MAX_ROWS rows and ``weight [N, K]``
    (``applies``), float sums rounded to ``x``'s dtype."""
    *lead, K = x.shape
    rows, N = x.size // K, weight.shape[0]
    (y,) = _kernel()(
        inputs=[x.reshape(rows, K), weight],
        template=_template(x.dtype, _tiles(rows)),
        grid=(math.ceil(N / (8 * TILE_COLS)) * WARPS * 32, 1, 1),
        threadgroup=(WARPS * 32, 1, 1),
        output_shapes=[(rows, N)],
        output_dtypes=[x.dtype],
    )
    return y.reshape(*lead, N)


def _tiles(rows: int) -> int:
    """Tiles of 16 rows a variant takes for ``rows``: 1, 2 or 4 (few variants to compile)."""
    return 1 << (math.ceil(rows / 16) - 1).bit_length()


@functools.cache
def _template(dtype: mx.Dtype, tiles: int) -> list:
    """Template arguments: one compiled variant per dtype and tile count."""
    bf16 = dtype == mx.bfloat16
    return [("T", dtype), ("BF16", bf16), ("MT", tiles), ("NT", TILE_COLS), ("KW", WARPS)]


class RowsLinear(nn.Linear):
    """``nn.Linear`` whose products of 2 to MAX_ROWS rows take ``matmul`` (``route``)."""

    def __call__(self, x: mx.array) -> mx.array:
        if not applies(x, self.weight):
            return super().__call__(x)
        y = matmul(x, self.weight)
        return y + self.bias if "bias" in self else y


class RowsEmbedding(nn.Embedding):
    """``nn.Embedding`` whose ``as_linear`` (a tied LM head) takes ``matmul`` for 2 to
    MAX_ROWS rows (``route``)."""

    def as_linear(self, x: mx.array) -> mx.array:
        return matmul(x, self.weight) if applies(x, self.weight) else super().as_linear(x)


def route(model: nn.Module) -> nn.Module:
    """On CUDA, give every ``nn.Linear`` and ``nn.Embedding`` of ``model`` (exactly those
    types: quantised and sharded layers have their own) ``matmul`` for a few rows, in place:
    their class becomes ``RowsLinear`` / ``RowsEmbedding``, their parameters stay. A no-op
    elsewhere. Returns ``model``."""
    if not cuda_attention.available():
        return model
    for _, module in model.named_modules():
        if type(module) is nn.Linear:
            module.__class__ = RowsLinear
        elif type(module) is nn.Embedding:
            module.__class__ = RowsEmbedding
    return model


def warm(model: nn.Module, rows: int) -> None:
    """Compile the variants a model's products of up to ``rows`` rows take, so the first
    batch that needs one does not wait for NVRTC. A no-op off CUDA or where none is routed."""
    dtypes = {
        m.weight.dtype
        for _, m in model.named_modules()
        if isinstance(m, RowsLinear | RowsEmbedding) and m.weight.dtype in (mx.bfloat16, mx.float16)
    }
    for dtype in sorted(dtypes, key=str):
        for tiles in sorted({_tiles(r) for r in range(2, min(rows, MAX_ROWS) + 1)}):
            _warm(dtype, tiles)


@functools.cache
def _warm(dtype: mx.Dtype, tiles: int) -> None:
    x = mx.zeros((16 * tiles, K_STEP), dtype)
    mx.eval(matmul(x, mx.zeros((8, K_STEP), dtype)))
