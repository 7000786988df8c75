"""``runtime.model.cuda_attention``'s kernel runs on the CPU, in CI, against MLX's attention.

The kernel is CUDA source (``cuda_attention.cuh``) that only MLX's CUDA backend runs, and CI has
no GPU, so ``test_cuda_attention.py`` skips there. Here the same source is compiled by the host's
C++ compiler against ``cuda_emulator/emulator.h`` (each CUDA thread a std::thread, barriers for
``__syncwarp``/``__syncthreads``, shuffles through memory) and run block by block, in float32
(the emulator has no bf16: the loads of other dtypes differ only in their type). What this
checks is the kernel's logic: the split of keys across lanes, warps and chunks, the online
softmax and its merges, GQA rows, masks, sinks, strided and packed keys (MLX's own
``mx.quantize`` layout). The oracle is MLX's ``scaled_dot_product_attention`` on the same
float32 (or dequantised) inputs; float32 summation order differs, hence 1e-4.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlxc.runtime.model import cuda_attention as ca

HERE = Path(__file__).parent / "cuda_emulator"
CXX = os.environ.get("CXX", "g++")
TOL = 1e-4

pytestmark = pytest.mark.skipif(
    shutil.which(CXX) is None, reason=f"no C++ compiler ({CXX}); .ci/run installs g++"
)


@dataclass(frozen=True)
class Kernel:
    """One of the header's kernels as MLX's ``cuda_kernel`` is handed it: its inputs (in
    order) with the C++ type each has in a float32 run (the emulator has no bf16), its template
    arguments as C++ declarations, its body, and its output's width (``part`` holds that plus
    a maximum and a sum per row and chunk)."""

    inputs: list[str]
    types: list[str]
    constants: str
    source: str
    width: int


def attention_kernel(kt: str, D: int, R: int, bits: int, group: int) -> Kernel:
    """``cuda_attention.attention``'s kernel, on keys of C++ type ``kt``."""
    types = ["float", kt, kt, *["float"] * 6, "bool", "float", "float", "int32_t", "uint32_t"]
    constants = (
        f"using T = float; using KT = {kt}; using S = float; constexpr int D = {D}, R = {R}, "
        f"BITS = {bits}, GS = {group}, WARPS = {ca.WARPS};"
    )
    return Kernel(ca._INPUTS, types, constants, ca._SOURCE, D)


def latent_kernel(C: int, RD: int, R: int, bits: int = 0, group: int = 1) -> Kernel:
    """``cuda_attention.latent_attention``'s kernel, on float or (``bits``) packed latents."""
    kt = "uint32_t" if bits else "float"
    types = ["float", "float", kt, "float", "float", kt, "float", "float"]
    types += ["bool", "float", "uint32_t"]
    constants = (
        f"using T = float; using KT = {kt}; using S = float; constexpr int C = {C}, RD = {RD}, "
        f"R = {R}, BITS = {bits}, GS = {group}, WARPS = {ca.WARPS};"
    )
    return Kernel(ca._LATENT_INPUTS, types, constants, ca._LATENT_SOURCE, C)


def _case_source(files: dict, kernel: Kernel, rows: int, chunks: int, blocks: int) -> str:
    """C++ running ``kernel`` on ``files``, laid out as MLX's ``cuda_kernel`` lays out a
    kernel: ``cuda_attention.cuh`` #included, then a function of concrete parameter types with
    the template arguments as constants and type aliases at its top, whose body (the module's
    source string) calls the kernel's template; ``rows`` output rows."""
    params = ", ".join(
        f"const {t}* {n}, const mlx::core::cu::Shape {n}_shape, "
        f"const mlx::core::cu::Strides {n}_strides"
        for n, t in zip(kernel.inputs, kernel.types, strict=True)
    )
    lines = [
        f'#include "{HERE / "emulator.h"}"',
        ca._HEADER,
        f"void kernel({params}, float* out, float* part) {{",
        kernel.constants,
        kernel.source,
        "}",
        "int main() {",
    ]
    args = []
    for n, ctype in zip(kernel.inputs, kernel.types, strict=True):
        path, offset, shape, strides = files[n]
        pad = 8 - len(shape)
        dims = ", ".join(map(str, [*shape, *[1] * pad]))
        steps = ", ".join(map(str, [*strides, *[0] * pad]))
        lines.append(
            f'auto {n}_buf = load<{ctype}>("{path}"); '
            f"mlx::core::cu::Shape {n}_shape{{{{{dims}}}}}; "
            f"mlx::core::cu::Strides {n}_strides{{{{{steps}}}}};"
        )
        args.append(f"{n}_buf.data() + {offset}, {n}_shape, {n}_strides")
    width = kernel.width
    lines += [
        f"std::vector<float> out({rows * width}), part({rows * chunks * (width + 2)});",
        (
            f"launch({{{chunks}, {blocks}, 1}}, {ca.WARPS * 32}, [&] {{ kernel("
            f"{', '.join(args)}, out.data(), part.data()); }});"
        ),
        "std::ofstream(OUT, std::ios::binary).write((char*)out.data(), out.size() * 4);",
        "}",
    ]
    return "\n".join(lines)


def _run(tmp: Path, arrays: dict, kernel: Kernel, rows: int, chunks: int, blocks: int):
    """Compile and run one case; ``arrays``: name -> numpy array (views keep their strides)."""
    files = {}
    for n, a in arrays.items():
        base = a if a.base is None else a.base
        assert base.flags.c_contiguous and base.base is None
        offset = (
            a.__array_interface__["data"][0] - base.__array_interface__["data"][0]
        ) // a.itemsize
        base.tofile(tmp / f"{n}.bin")
        strides = [s // a.itemsize for s in a.strides]
        files[n] = (tmp / f"{n}.bin", offset, list(a.shape), strides)
    src = tmp / "case.cpp"
    src.write_text(_case_source(files, kernel, rows, chunks, blocks))
    exe, out = tmp / "case", tmp / "out.bin"
    build = [CXX, "-std=c++20", "-O1", "-w", "-pthread", f'-DOUT="{out}"', str(src), "-o", str(exe)]
    done = subprocess.run(build, check=False, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    subprocess.run([str(exe)], check=True, timeout=120)
    return np.fromfile(out, np.float32)


CASES = [
    # B, Hq, Hkv, L, T, D, bits, group, mask kind, sinks, chunks, strided head dim, recent
    (1, 8, 2, 1, 300, 64, 0, 1, "ragged", False, 3, False, 0),  # a decode batch row, GQA 4
    (2, 4, 4, 1, 70, 128, 0, 1, "ragged", False, 1, False, 0),  # one block per row, no merge
    (1, 4, 1, 1, 600, 64, 0, 1, "ragged", False, 40, False, 0),  # many chunks, masked ones
    (2, 8, 2, 3, 200, 64, 0, 1, "causal", False, 2, False, 0),  # a verification, 12 rows a head
    (2, 8, 2, 4, 90, 64, 0, 1, "ragged", False, 2, False, 0),  # per-query rows of a tailed batch
    (1, 8, 2, 1, 150, 64, 0, 1, "ragged", True, 2, True, 0),  # sinks, element-wise loads
    (2, 8, 2, 1, 150, 128, 0, 1, "none", True, 1, True, 0),
    (2, 8, 2, 1, 260, 64, 4, 64, "ragged", False, 2, False, 0),  # 4-bit keys and values
    (1, 8, 2, 2, 100, 64, 4, 32, "causal", False, 1, False, 0),
    (2, 4, 2, 1, 140, 128, 8, 64, "ragged", True, 2, False, 0),  # 8-bit, sinks
    (1, 4, 1, 1, 40, 128, 4, 64, "none", False, 1, False, 0),
    # A quantised cache's staged tokens: packed keys, then its newest in float (a chunk
    # boundary inside them, a verification's causal rows over them, 8 bits, strided rows)
    (1, 8, 2, 1, 200, 64, 4, 64, "none", False, 2, False, 17),
    (2, 8, 2, 3, 150, 128, 4, 32, "causal", True, 3, False, 5),
    (2, 4, 2, 1, 90, 64, 8, 64, "ragged", False, 1, True, 32),
    # a chunk boundary (60) inside the staged tokens [58, 90): each block codes its own
    (1, 8, 2, 1, 90, 128, 4, 64, "none", False, 3, False, 32),
    (1, 4, 1, 2, 120, 128, 8, 32, "causal", False, 2, False, 31),  # 8 rounds of codes a block
]


@pytest.mark.parametrize(
    "B, Hq, Hkv, L, T, D, bits, group, kind, with_sinks, chunks, strided, recent", CASES
)
def test_kernel_matches_mlx(
    tmp_path, B, Hq, Hkv, L, T, D, bits, group, kind, with_sinks, chunks, strided, recent
):
    rng = np.random.default_rng(T + D + L)
    q = rng.standard_normal((B, Hq, L, D), np.float32)
    cap = T + 5  # the keys are the first T columns of a wider buffer, as a cache's are
    k_buf, v_buf = (rng.standard_normal((B, Hkv, cap, D), np.float32) for _ in range(2))
    none = np.zeros(1, np.float32)
    k_recent = v_recent = np.zeros((1, 1, 1, 1), np.float32)  # the kernel's "none"
    lengths = np.array([T, 0], np.int32)  # the keys the kernel reads of each buffer
    if bits:
        # Tokens [packed, T) go in as floats (a cache's staged tokens), which the kernel
        # rounds as quantising them does: the oracle reads every token dequantised. The
        # packed buffers go in whole, their first ``packed`` tokens live, as a cache's do.
        packed = T - recent
        lengths = np.array([packed, recent], np.int32)
        parts = {}
        for name, buf in (("k", k_buf), ("v", v_buf)):
            w, s, b = mx.quantize(mx.array(buf), group_size=group, bits=bits)
            parts[name] = [np.array(p) for p in (w, s, b)]
            dequant = mx.dequantize(w, s, b, group_size=group, bits=bits)
            parts[name + "_ref"] = np.array(dequant)[:, :, :T]
        k, k_scales, k_biases = parts["k"]
        v, v_scales, v_biases = parts["v"]
        k_ref, v_ref = parts["k_ref"], parts["v_ref"]
        if recent:
            staged = [np.zeros((B, Hkv, 40, 2 * D), np.float32) for _ in range(2)]
            step = 2 if strided else 1  # strided: every other element (no vector loads)
            for buf, own in zip((k_buf, v_buf), staged):
                own[:, :, :recent, : D * step : step] = buf[:, :, packed:T]
            k_recent, v_recent = (a[:, :, :, : D * step : step] for a in staged)
    else:
        k_scales = k_biases = v_scales = v_biases = none
        if strided:  # every other element of a twice-wider head dim: no vector loads
            wide = [np.zeros((B, Hkv, cap, 2 * D), np.float32) for _ in range(2)]
            wide[0][..., ::2], wide[1][..., ::2] = k_buf, v_buf
            k, v = wide[0][..., ::2], wide[1][..., ::2]
        else:
            k, v = k_buf, v_buf
        k_ref, v_ref = k_buf[:, :, :T], v_buf[:, :, :T]

    column, query = np.arange(T)[None, :], np.arange(L)[:, None]
    causal = column <= T - L + query  # [L, T]: the queries are the last L columns
    if kind == "ragged":
        pad = rng.integers(0, T // 3, B)[:, None, None, None]
        valid = (column[None, None] >= pad) & causal[None, None]  # [B, 1, L, T]
        mask, mask_kind = valid, 2
    else:
        valid = np.broadcast_to(causal if kind == "causal" else True, (B, 1, L, T))
        mask, mask_kind = np.ones((1, 1, 1, 1), bool), 1 if kind == "causal" else 0
    sinks = (rng.standard_normal(Hq) * 2).astype(np.float32) if with_sinks else None
    scale = D**-0.5

    R = ca._rows(Hq // Hkv * L)
    blocks = B * Hkv * -(-(Hq // Hkv * L) // R)
    flags = np.array([scale, mask_kind, float(with_sinks)], np.float32)
    inputs = [
        q, k, v, k_scales, k_biases, v_scales, v_biases, k_recent, v_recent, mask, sinks, flags,
        lengths, np.zeros(blocks, np.uint32),  # the chunks' tickets
    ]  # fmt: skip
    arrays = dict(zip(ca._INPUTS, [none if a is None else a for a in inputs], strict=True))
    kt = "uint32_t" if bits else "float"
    kernel = attention_kernel(kt, D, R, bits, group)
    got = _run(tmp_path, arrays, kernel, B * Hq * L, chunks, blocks)

    want = mx.fast.scaled_dot_product_attention(
        mx.array(q), mx.array(k_ref), mx.array(v_ref), scale=scale,
        mask=mx.array(np.ascontiguousarray(valid)),
        sinks=None if sinks is None else mx.array(sinks), stream=mx.cpu,
    )  # fmt: skip
    err = np.abs(got.reshape(B, Hq, L, D) - np.array(want)).max()
    assert err < TOL, f"max error {err}"


def test_the_chunk_limit_is_the_kernels():
    """The merge holds MAX_CHUNKS chunks' sums in shared memory: Python plans no more. A
    block codes up to MAX_STAGED staged tokens there: a quantised cache stages no more."""
    from mlxc.runtime.model.cache import StagingMixin

    source = ca.KERNEL_FILE.read_text()
    assert f"constexpr int MAX_CHUNKS = {ca.MAX_CHUNKS};" in source
    assert f"constexpr int MAX_STAGED = {ca.MAX_STAGED};" in source
    assert StagingMixin.STAGE <= ca.MAX_STAGED
    assert ca._chunks(1, 10_000) == ca.MAX_CHUNKS
    with pytest.raises(ValueError, match="chunks"):
        ca._launch(1, 8, 1, 64, 2, 4, mx.float32, mx.float32, mx.float32, 0, 1, ca.MAX_CHUNKS + 1)


def test_each_call_takes_tickets_of_its_own(monkeypatch):
    """Chunked calls count on zeroed tickets: each takes a slice of a zeros array no other
    call was given (MLX may run two calls at once), and a new array when it runs out."""
    monkeypatch.setattr(ca.Tickets, "SIZE", 8)
    tickets = ca.Tickets()
    first = tickets.take(3)
    zeros = tickets._zeros
    second = tickets.take(5)  # fills the array: [0, 3) and [3, 8)
    assert tickets._zeros is zeros and tickets._used == 8
    third = tickets.take(2)  # no room left: a new array
    assert tickets._zeros is not zeros and tickets._used == 2
    big = tickets.take(20)  # more than SIZE: an array of its own size
    assert tickets._zeros.shape == (20,) and tickets._used == 20
    for t, n in ((first, 3), (second, 5), (third, 2), (big, 20)):
        assert t.shape == (n,) and t.dtype == mx.uint32 and not t.any().item()


def _emulated_kernel(tmp: Path):
    """A stand-in for MLX's ``cuda_kernel`` call that runs the emulated kernel on the arrays,
    template and launch ``cuda_attention.attention`` hands it (float32 only)."""

    def call(*, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
        t = dict(template)
        assert t["T"] == mx.float32 and t["WARPS"] == ca.WARPS
        assert threadgroup == (ca.WARPS * 32, 1, 1) and output_dtypes[0] == mx.float32
        arrays = {n: np.array(a) for n, a in zip(ca._INPUTS, inputs, strict=True)}
        kt = "uint32_t" if t["BITS"] else "float"
        chunks, blocks = grid[0] // threadgroup[0], grid[1]
        rows = math.prod(output_shapes[0][:3])
        if chunks > 1:  # the tickets the merge counts on start at zero, one a block row
            assert arrays["tickets"].shape == (blocks,) and not arrays["tickets"].any()
            assert output_shapes[1] == (rows, chunks, t["D"] + 2)
        kernel = attention_kernel(kt, t["D"], t["R"], t["BITS"], t["GS"])
        got = _run(tmp, arrays, kernel, rows, chunks, blocks)
        return mx.array(got.reshape(output_shapes[0])), None

    return call


@pytest.mark.parametrize(
    "B, Hq, Hkv, L, T, D, bits, mask_kind, with_sinks, recent",
    [
        (2, 8, 2, 1, 300, 64, 0, "ragged", False, 0),  # a decode batch: chunks merged
        (1, 4, 4, 4, 200, 64, 0, "causal array", False, 0),  # an [L, T] mask, raised to 4-d
        (1, 8, 2, 1, 270, 64, 4, "none", False, 9),  # one stream on a staged 4-bit cache
        (1, 8, 2, 3, 150, 64, 4, "causal", False, 6),  # a verification on a staged cache
        (2, 8, 2, 1, 200, 64, 4, "ragged", False, 5),  # a staged decode batch
        (2, 4, 2, 3, 150, 128, 8, "causal", True, 0),  # a verification on 8-bit keys, sinks
    ],
)
def test_attention_call_matches_mlx(
    tmp_path, monkeypatch, B, Hq, Hkv, L, T, D, bits, mask_kind, with_sinks, recent
):
    """``attention`` itself, its launch included (rows per block, chunks, tickets, the mask's
    rank, the flags, the live lengths), run by the emulator in place of MLX's kernel call. A
    staged cache's whole buffers (``StagedKV.buffers``, live tokens first) go through the
    compiled call unless a mask array comes with them; here ``mx.compile`` is the identity
    (the emulator runs on real arrays, not a trace) that counts its calls."""
    from mlxc.runtime.model.cache import KVQuant, StagedKV

    monkeypatch.setattr(ca, "_kernel", lambda: _emulated_kernel(tmp_path))
    replays = []

    def counted(fn):
        return lambda *inputs: replays.append(1) or fn(*inputs)

    monkeypatch.setattr(mx, "compile", counted)
    monkeypatch.setattr(ca, "_REPLAYS", {})  # calls compiled elsewhere are MLX's
    rng = np.random.default_rng(T + L)
    q, k, v = (
        mx.array(rng.standard_normal(shape, np.float32))
        for shape in [(B, Hq, L, D), (B, Hkv, T, D), (B, Hkv, T, D)]
    )
    keys, values, k_ref, v_ref = k, v, k, v
    if bits:
        quant = KVQuant(bits, 64)
        packed = T - recent
        keys, values = (quant.quantize(x[:, :, :packed]) for x in (k, v))
        if recent:  # the cache's buffers, 7 tokens wider than the live ones
            more = [mx.array(rng.standard_normal((B, Hkv, 7, D), np.float32)) for _ in "kv"]
            keys, values = (
                StagedKV(
                    quant.quantize(mx.concatenate([x[:, :, :packed], m], axis=2)),
                    mx.concatenate([x[:, :, packed:], m], axis=2),
                    packed,
                    recent,
                    buffers=True,
                )
                for x, m in zip((k, v), more)
            )
            assert keys.shape == (B, Hkv, T, D)
        k_ref, v_ref = keys.dequantize(), values.dequantize()
    column, query = np.arange(T)[None, :], np.arange(L)[:, None]
    mask = None
    if mask_kind == "ragged":
        pad = rng.integers(0, T // 3, B)[:, None, None, None]
        mask = mx.array((column[None, None] >= pad) & (column <= T - L + query))
    elif mask_kind == "causal array":
        mask = mx.array(column <= T - L + query)
    elif mask_kind == "causal":
        mask = "causal"
    sinks = mx.array(rng.standard_normal(Hq).astype(np.float32)) if with_sinks else None
    got = ca.attention(q, keys, values, scale=D**-0.5, mask=mask, sinks=sinks)
    assert len(replays) == (recent > 0 and not isinstance(mask, mx.array))
    want = mx.fast.scaled_dot_product_attention(
        q, k_ref, v_ref, scale=D**-0.5, mask=mask, sinks=sinks, stream=mx.cpu
    )
    err = mx.abs(got - want).max().item()
    assert err < TOL, f"max error {err}"


@pytest.mark.parametrize("L, mask_kind", [(1, "none"), (3, "causal"), (1, "ragged")])
def test_attention_on_a_caches_buffers(tmp_path, monkeypatch, L, mask_kind):
    """A float cache's whole buffers and live count (``BufferKV``, as ``KVCache`` hands them
    where the kernel reads its keys): the kernel reads the live keys only, through the
    compiled call unless a mask array comes along (``mx.compile`` the counting identity, as
    above)."""
    from mlxc.runtime.model.cache import BufferKV

    monkeypatch.setattr(ca, "_kernel", lambda: _emulated_kernel(tmp_path))
    replays = []
    monkeypatch.setattr(mx, "compile", lambda fn: lambda *a: replays.append(1) or fn(*a))
    monkeypatch.setattr(ca, "_REPLAYS", {})
    B, Hq, Hkv, T, D, cap = 2, 8, 2, 150, 64, 256
    rng = np.random.default_rng(L)
    q = mx.array(rng.standard_normal((B, Hq, L, D), np.float32))
    k_buf, v_buf = (mx.array(rng.standard_normal((B, Hkv, cap, D), np.float32)) for _ in "kv")
    keys, values = BufferKV(k_buf, T), BufferKV(v_buf, T)
    assert keys.shape == (B, Hkv, T, D)
    column, query = np.arange(T)[None, :], np.arange(L)[:, None]
    mask = {"none": None, "causal": "causal"}.get(mask_kind)
    if mask_kind == "ragged":
        pad = rng.integers(0, T // 3, B)[:, None, None, None]
        mask = mx.array((column[None, None] >= pad) & (column <= T - L + query))
    got = ca.attention(q, keys, values, scale=D**-0.5, mask=mask)
    assert len(replays) == (mask_kind != "ragged")
    want = mx.fast.scaled_dot_product_attention(
        q, keys.live(), values.live(), scale=D**-0.5, mask=mask, stream=mx.cpu
    )
    err = mx.abs(got - want).max().item()
    assert err < TOL, f"max error {err}"
    if mask_kind != "ragged":  # the next step: fewer live keys, the same compiled call
        keys, values = BufferKV(k_buf, T - 7), BufferKV(v_buf, T - 7)
        got = ca.attention(q, keys, values, scale=D**-0.5, mask=mask)
        assert len(replays) == 2 and len(ca._REPLAYS) == 1
        want = mx.fast.scaled_dot_product_attention(
            q, keys.live(), values.live(), scale=D**-0.5, mask=mask, stream=mx.cpu
        )
        assert mx.abs(got - want).max().item() < TOL


def _latent_reference(q_lat, q_pe, latents, k_pe, scale, valid):
    """MLA's decode attention by MLX's own attention: the two halves of each query and key
    joined, one shared key head, the latents as the values."""
    q = mx.concatenate([mx.array(q_lat), mx.array(q_pe)], axis=-1)
    k = mx.concatenate([mx.array(latents), mx.array(k_pe)], axis=-1)
    mask = None if valid is None else mx.array(np.ascontiguousarray(valid))
    return mx.fast.scaled_dot_product_attention(
        q, k, mx.array(latents), scale=scale, mask=mask, stream=mx.cpu
    )


LATENT_CASES = [
    # B, H, T, C, RD, mask, chunks, strided rows, bits, group
    (2, 16, 300, 512, 64, "ragged", 3, False, 0, 1),  # deepseek's widths, a batch, 4 tiles
    (1, 40, 600, 256, 32, "none", 5, False, 0, 1),  # minicpm3's: 8 heads a block, 5 tiles
    (1, 5, 70, 256, 32, "per head", 1, False, 0, 1),  # a tile with idle rows, a mask per head
    (2, 8, 200, 256, 32, "ragged", 40, True, 0, 1),  # chunks past short rows, element loads
    (2, 16, 260, 512, 64, "ragged", 3, False, 4, 64),  # --kv-bits 4: packed latents, rope keys
    (1, 8, 150, 256, 32, "none", 2, False, 8, 32),  # 8 bits, groups of 32
]


@pytest.mark.parametrize("B, H, T, C, RD, kind, chunks, strided, bits, group", LATENT_CASES)
def test_latent_kernel_matches_mlx(tmp_path, B, H, T, C, RD, kind, chunks, strided, bits, group):
    rng = np.random.default_rng(T + C)
    q_lat, q_pe = (rng.standard_normal((B, H, 1, n), np.float32) for n in (C, RD))
    cap = T + 7  # the first T rows of a cache's wider buffer
    lat_buf, pe_buf = (rng.standard_normal((B, 1, cap, n), np.float32) for n in (C, RD))
    none = np.zeros(1, np.float32)
    scales = [none] * 4  # latents' scales and biases, then the rope keys'
    if bits:  # as a quantised cache holds them; the oracle reads them dequantised
        parts = [
            mx.quantize(mx.array(buf), group_size=group, bits=bits) for buf in (lat_buf, pe_buf)
        ]
        latents, k_pe = (np.array(p[0])[:, :, :T] for p in parts)
        scales = [np.array(x)[:, :, :T] for p in parts for x in p[1:]]
        lat_ref, pe_ref = (
            np.array(mx.dequantize(*p, group_size=group, bits=bits))[:, :, :T] for p in parts
        )
    elif strided:  # every other element of twice-wider rows: no vector loads
        wide = [np.zeros((B, 1, cap, 2 * n), np.float32) for n in (C, RD)]
        wide[0][..., ::2], wide[1][..., ::2] = lat_buf, pe_buf
        latents, k_pe = wide[0][:, :, :T, ::2], wide[1][:, :, :T, ::2]
    else:
        latents, k_pe = lat_buf[:, :, :T], pe_buf[:, :, :T]
    if not bits:
        lat_ref, pe_ref = latents, k_pe
    column = np.arange(T)
    if kind == "ragged":  # [B, 1, 1, T]: a batch's rows of different lengths
        valid = column >= rng.integers(0, T // 2, B)[:, None, None, None]
    elif kind == "per head":  # [1, H, 1, T]
        valid = column >= rng.integers(0, T - 1, H)[None, :, None, None]
    else:
        valid = None
    mask = np.ones((1, 1, 1, 1), bool) if valid is None else valid
    scale = 0.3
    R = ca._latent_rows(H, C)
    blocks = B * -(-H // R)
    flags = np.array([scale, float(valid is not None), 0.0], np.float32)
    tickets = np.zeros(blocks, np.uint32)
    k_scales, k_biases, pe_scales, pe_biases = scales
    inputs = [q_lat, q_pe, latents, k_scales, k_biases, k_pe, pe_scales, pe_biases]
    arrays = dict(zip(ca._LATENT_INPUTS, [*inputs, mask, flags, tickets], strict=True))
    got = _run(tmp_path, arrays, latent_kernel(C, RD, R, bits, group), B * H, chunks, blocks)

    want = _latent_reference(q_lat, q_pe, lat_ref, pe_ref, scale, valid)
    err = np.abs(got.reshape(B, H, 1, C) - np.array(want)).max()
    assert err < TOL, f"max error {err}"


def _emulated_latent_kernel(tmp: Path):
    """``_emulated_kernel`` for ``cuda_attention.latent_attention``."""

    def call(*, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
        t = dict(template)
        assert t["T"] == mx.float32 and t["WARPS"] == ca.WARPS
        arrays = {n: np.array(a) for n, a in zip(ca._LATENT_INPUTS, inputs, strict=True)}
        chunks, blocks = grid[0] // threadgroup[0], grid[1]
        rows = math.prod(output_shapes[0][:3])
        if chunks > 1:
            assert arrays["tickets"].shape == (blocks,) and not arrays["tickets"].any()
            assert output_shapes[1] == (rows, chunks, t["C"] + 2)
        kernel = latent_kernel(t["C"], t["RD"], t["R"], t["BITS"], t["GS"])
        got = _run(tmp, arrays, kernel, rows, chunks, blocks)
        return mx.array(got.reshape(output_shapes[0])), None

    return call


@pytest.mark.parametrize(
    "B, H, T, C, RD, ragged, bits",
    [
        (3, 16, 500, 512, 64, True, 0),
        (1, 40, 90, 256, 32, False, 0),
        (2, 16, 300, 512, 64, True, 4),
    ],
)
def test_latent_call_matches_mlx(tmp_path, monkeypatch, B, H, T, C, RD, ragged, bits):
    """``latent_attention`` itself, its launch included (heads per block, chunks, tickets, the
    mask's rank, a quantised cache's ``QuantizedKV``), run by the emulator in place of MLX's
    kernel call; ``latent_applies`` takes the same inputs (CUDA taken as there)."""
    from mlxc.runtime.model.cache import KVQuant

    monkeypatch.setattr(ca, "_latent_kernel", lambda: _emulated_latent_kernel(tmp_path))
    rng = np.random.default_rng(T)
    q_lat, q_pe = (mx.array(rng.standard_normal((B, H, 1, n), np.float32)) for n in (C, RD))
    latents, k_pe = (mx.array(rng.standard_normal((B, 1, T, n), np.float32)) for n in (C, RD))
    lat_ref, pe_ref = latents, k_pe
    if bits:
        quant = KVQuant(bits, 64)
        latents, k_pe = quant.quantize(latents), quant.quantize(k_pe)
        lat_ref, pe_ref = latents.dequantize(), k_pe.dequantize()
    monkeypatch.setattr(ca, "available", lambda: True)
    assert ca.latent_applies(q_lat, q_pe, latents, k_pe)
    if ragged:  # [B, 1, 1, T]: a decode batch's rows of different lengths
        valid = np.arange(T) >= rng.integers(0, T // 2, B)[:, None, None, None]
    else:  # [1, T]: raised to 4-d by the call
        valid = (np.arange(T) >= 3)[None]
    got = ca.latent_attention(q_lat, q_pe, latents, k_pe, scale=0.2, mask=mx.array(valid))
    want = _latent_reference(q_lat, q_pe, lat_ref, pe_ref, 0.2, valid)
    err = mx.abs(got - want).max().item()
    assert err < TOL, f"max error {err}"


def test_replayed_calls_follow_their_changing_inputs(monkeypatch):
    """``_replayed`` through MLX's own ``mx.compile`` (a stand-in kernel made of MLX ops, on
    the CPU): a compiled function per launch and constants, its trace replayed with each
    call's lengths, keys and queries (a trace that kept the first call's would repeat its
    answer), the stand-ins and flags its constants."""
    calls = []

    def stand_in(*, inputs, output_shapes, **launch):
        calls.append(1)  # once per trace: replays do not call it
        q, k, flags, lengths = inputs[0], inputs[1], inputs[11], inputs[12]
        live = (k * (mx.arange(k.shape[2]) < lengths[0])[:, None]).sum(axis=2, keepdims=True)
        return [q * flags[0] + live.sum() + lengths[1], None]

    monkeypatch.setattr(ca, "_kernel", lambda: stand_in)
    monkeypatch.setattr(ca, "_REPLAYS", {})
    q = mx.ones((1, 4, 1, 8))
    buf = mx.ones((1, 2, 32, 8))
    flags = ca._flags(0.5, 0, False)
    launch = {"output_shapes": [(1, 4, 1, 8)]}
    for n, staged, scale in ((10, 0, 1.0), (11, 0, 2.0), (3, 4, 1.0)):
        inputs = [q * scale, buf, buf, *[ca._dummy(mx.float32)] * 4]
        inputs += [ca._dummy(mx.float32, 4)] * 2 + [ca._dummy(mx.bool_, 4), ca._dummy(mx.float32)]
        inputs += [flags, ca._lengths(n, staged), ca._dummy(mx.uint32)]
        got = ca._replayed(launch, inputs, packed=False)
        want = q * scale * 0.5 + 2 * 8 * n + staged
        assert mx.allclose(got, want).item(), (n, staged, scale)
    assert len(ca._REPLAYS) == 1 and len(calls) == 1
