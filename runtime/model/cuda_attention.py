"""Attention for a few queries per row on CUDA, where MLX 0.32's own kernels stop.

MLX's CUDA ``scaled_dot_product_attention`` has two fast paths: cuDNN, and a vector kernel for
one to three queries per row. Neither takes an array mask for a one-query forward (MLX then
falls back to separate matmul, mask and softmax kernels), and for two or more queries cuDNN
builds a graph per shape, keyed by the key length, which changes every step. Three of mlxc's
forwards land there:

- a decode batch whose rows have different lengths (the server, always): one query per row,
  a boolean ``key_valid`` mask (``runtime.model.batch``);
- a speculative verification forward: ``K + 1`` queries, a causal mask, a key length that
  moves on by the accepted tokens every step;
- a decode step on quantised keys and values (``--kv-bits``): MLX's CUDA ``quantized_matmul``
  is not used there (``layers.packed_attention``), so the live keys were dequantised per step.

``attention`` is one kernel launch for all three (keys split across blocks, merged by the last
of them to finish): rows and heads of any strides, GQA without broadcasting the keys, a boolean
mask of any broadcast shape or a bottom-right causal one, attention sinks, and keys and values
read either as floats or packed (4 or 8 bits, MLX's affine layout) and dequantised in registers,
packed ones optionally followed by a quantised cache's staged float tokens, which each block
quantises as MLX would store them (``cache.StagingMixin``). ``applies`` says when
``layers.attend`` takes it.

``latent_attention`` is a second kernel of the same header, for MLA's decode step
(``latent.absorbed_attention``): one query a head against its row's latents (the keys' first
part and the values alike) and rope keys, where MLX has no fused kernel for a 512-wide head and
the composed form was five kernels a layer, three of them cuBLAS products shaped by the key
count. ``latent_applies`` says when it runs.

MLX compiles a custom kernel (NVRTC) the first time each variant runs in a process, a second or
more each, and keeps no disk cache for them: a server that met them at its first ragged batch
stalled every stream for ~5 s (H200, 2026-12-01). So variants are few (dtype, head dim, rows
per block, packing; queries, lengths, strides, the mask kind and sinks are arguments) and
``warm`` compiles a model's before it serves: the scheduler at start, speculation before its
prefill, ``generate`` after loading (``--kv-bits``, or an MLA model: ``warm_latent``).

Checked against MLX's own attention on the H200 by ``tests/test_cuda_attention.py`` (it
skips without CUDA: CI has none), in CI by ``tests/test_cuda_emulated.py`` (the same source
compiled for the CPU against an emulator of CUDA's threads, barriers and shuffles), and timed
against it by ``bench/attention_kernels.py``.
"""

from __future__ import annotations

import functools
import math
import threading
from pathlib import Path

import mlx.core as mx

# The most queries per row the kernel takes (a verification forward of up to 15 drafts).
MAX_QUERIES = 16
# The most tokens a quantised cache stages in float (``cache.StagingMixin``): a block of the
# kernel quantises those it reads into shared memory (``MAX_STAGED`` in the header).
MAX_STAGED = 2 * MAX_QUERIES
HEAD_DIMS = (64, 128)
WARPS = 4  # warps per block; each walks its own keys of the block's chunk

# The kernel's code is ``cuda_attention.cuh``, beside this module, #included by its absolute
# path: MLX's ``cuda_kernel`` assembles each call's kernel source from these strings and hashes
# it when encoding the call, host work that grows with the string (on an H100, s25: a call
# with the whole kernel inline, 14.5 KB, took 6.5 us to build and 10 to encode; one of a
# 1.6 KB kernel with the same inputs 3 and 4.4).
KERNEL_FILE = Path(__file__).with_name("cuda_attention.cuh")


def include_header(file: Path) -> str:
    """A kernel header that #includes ``file`` by its absolute path (or holds its code, where
    an #include cannot spell the path)."""
    path = str(file.resolve())
    if path.isascii() and not any(c in path for c in '"\\\n'):
        return f'#include "{path}"\n'
    return file.read_text()


_HEADER = include_header(KERNEL_FILE)
# The kernel: one call of ``mlxc::attention`` (``cuda_attention.cuh``), which also names the
# inputs whose shapes and strides MLX then passes.
_SOURCE = """
  ::mlxc::attention<T, KT, S, D, R, BITS, GS, WARPS>(q, q_shape, q_strides, k, k_shape,
      k_strides, v, v_strides, k_scales, k_scales_strides, k_biases, k_biases_strides,
      v_scales, v_scales_strides, v_biases, v_biases_strides, k_recent, k_recent_strides,
      v_recent, v_recent_strides, mask, mask_shape, mask_strides, sinks, flags, lengths,
      tickets, out, part);
"""

_INPUTS = [
    "q", "k", "v", "k_scales", "k_biases", "v_scales", "v_biases", "k_recent", "v_recent",
    "mask", "sinks", "flags", "lengths", "tickets",
]  # fmt: skip
_OUTPUTS = ["out", "part"]


def _cuda_kernel(name: str, inputs: list[str], source: str):
    """One of the header's kernels as MLX's ``cuda_kernel`` (strided inputs as they are)."""
    return mx.fast.cuda_kernel(
        name=name,
        input_names=inputs,
        output_names=_OUTPUTS,
        source=source,
        header=_HEADER,
        ensure_row_contiguous=False,
    )


@functools.cache
def _kernel():
    return _cuda_kernel("mlxc_attention", _INPUTS, _SOURCE)


def available() -> bool:
    """Whether the kernels can run: MLX's CUDA backend, on the default device (asked by every
    attention layer of every forward: the backend's answer is read once)."""
    return mx.default_device() == mx.gpu and _cuda_backend()


@functools.cache
def _cuda_backend() -> bool:
    return mx.cuda.is_available()


def applies(
    queries: mx.array,
    values_dim: int,
    mask: mx.array | str | None,
    quantized: bool,
    buffers: bool = False,
) -> bool:
    """Whether ``layers.attend`` should take ``attention`` for these queries on this device:
    where MLX has no fused kernel (one query with an array mask, or quantised keys) or builds
    a graph per key length (two or more queries), for the head dims and dtypes it is built
    for; and one query on a float cache's whole buffers (``buffers``: ``cache.BufferKV``)
    where BUFFER_DECODE says."""
    L, D = queries.shape[-2], queries.shape[-1]
    if not (1 <= L <= MAX_QUERIES and D == values_dim and D in HEAD_DIMS):
        return False
    if queries.dtype not in (mx.bfloat16, mx.float16, mx.float32):
        return False
    if isinstance(mask, mx.array) and mask.dtype != mx.bool_:
        return False  # additive masks (MLA's rope scores) stay with MLX
    if (
        L == 1
        and not isinstance(mask, mx.array)
        and not quantized
        and not (buffers and BUFFER_DECODE)
    ):
        return False  # MLX's own decode kernels (cuDNN, vector) are exact and fast here
    return available()


# Whether a one-query step on a float cache takes ``attention`` on its whole buffers
# (``cache.BufferKV``), replayed compiled, rather than MLX's own decode kernel on the live
# slices. Off: on an H100 (s43, ``kv-step-parts-gpu-h100-s43b``, llama medium) decode took
# 0.89x MLX's tokens/s on the buffers, though its graph built in 0.72x the time.
BUFFER_DECODE = False

# Query rows per block, at most: registers hold each row's query and sums.
MAX_ROWS = 8


def _rows(rows_per_kv_head: int) -> int:
    """Rows per block for a KV head's query rows: a power of two up to MAX_ROWS (a template
    argument, so few variants: 1, 2, 4, 8)."""
    return 1 << (min(rows_per_kv_head, MAX_ROWS) - 1).bit_length()


# The most chunks a row's keys split into (``MAX_CHUNKS`` in ``cuda_attention.cuh``, whose
# merge holds each chunk's maximum and sum in shared memory).
MAX_CHUNKS = 64


def _chunks(blocks: int, key_rounds: int, target: int = 512) -> int:
    """Chunks of keys per block of rows: about ``target`` blocks in all (512 for ``attention``:
    about four per SM of an H200; more chunks than that cost their partial sums and the merge
    more than they hide: 64 rows of 512-1,024 keys ran 20-25% faster as one chunk than as four,
    one row fastest at 5-16), no fewer keys per block than its warps take in one round
    (``key_rounds``: the keys over WARPS x 32), at most MAX_CHUNKS."""
    return max(1, min(math.ceil(target / blocks), key_rounds, MAX_CHUNKS))


def attention(
    queries: mx.array,
    keys,
    values,
    *,
    scale: float,
    mask: mx.array | str | None,
    sinks: mx.array | None = None,
    chunks: int | None = None,
) -> mx.array:
    """``softmax(scale * q k^T + mask) v`` for ``queries [B, Hq, L, D]`` (L <= MAX_QUERIES)
    against ``keys``/``values`` ``[B, Hkv, T, D]``, float arrays, ``BufferKV``, ``QuantizedKV``
    or ``StagedKV`` (packed, then recent tokens in the queries' dtype: ``cache.StagingMixin``); ``mask``:
    None, ``"causal"`` (queries last) or a boolean array broadcastable to ``[B, Hq, L, T]``.
    ``chunks``: blocks per (row, head) along the keys (default: by the shapes). Returns
    ``[B, Hq, L, D]`` in the queries' dtype.

    Called by every attention layer of a step on a host-bound device, so it does as little
    Python as it can: what follows from the shapes comes from ``_launch``, cached. A
    cache's whole buffers (a ``BufferKV``, or a ``StagedKV`` with ``buffers``) without a
    mask array keep their shapes from step to step (the live lengths are an input): the call
    is replayed through ``mx.compile`` (``_replayed``), where a direct call has MLX assemble
    the kernel's source again (an H100, s43: a call with its inputs prebuilt ~9 us of the
    host to build compiled, ~14 direct)."""
    B, Hq, L, D = queries.shape
    dtype = queries.dtype
    k_recent = v_recent = _dummy(dtype, 4)
    n_recent = 0
    replay = False
    if isinstance(keys, mx.array):  # the live keys themselves (a decode batch's): no lookups
        n_live = keys.shape[2]
    elif hasattr(keys, "recent"):  # a StagedKV: packed tokens, then the newest still in float
        k_recent, v_recent, n_recent = keys.recent, values.recent, keys.n_recent
        replay = keys.buffers and not isinstance(mask, mx.array)
        n_live = keys.n_packed
        keys, values = keys.packed, values.packed
    elif hasattr(keys, "buffer"):  # a BufferKV: a float cache's buffers, its first n live
        replay = not isinstance(mask, mx.array)
        n_live = keys.n
        keys, values = keys.buffer, values.buffer
    else:  # a QuantizedKV: the live tokens, packed
        n_live = keys.shape[2]
    if isinstance(keys, mx.array):
        k, v = keys, values
        k_scales = k_biases = v_scales = v_biases = _dummy(dtype)
        bits, group, scale_dtype = 0, 1, dtype
    else:
        k, k_scales, k_biases = keys.parts
        v, v_scales, v_biases = values.parts
        bits, group = keys.quant.bits, keys.quant.group_size
        scale_dtype = k_scales.dtype
    _, n_kv, n_held, _ = k.shape
    if isinstance(mask, mx.array):
        kind = 2
        if mask.ndim < 4:
            mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    else:
        kind = 1 if mask == "causal" else 0
        mask = _dummy(mx.bool_, 4)
    # From the shapes, not the live lengths: a replayed call's launch holds while its
    # buffers do (its chunks then split the live keys at run time).
    n_recent_held = k_recent.shape[2] if n_recent else 0
    key_rounds = -(-(n_held + n_recent_held) // (WARPS * 32))
    n_tickets, launch = _launch(
        B, Hq, L, D, n_kv, key_rounds, dtype, k.dtype, scale_dtype, bits, group, chunks
    )
    sink_arr = _dummy(dtype) if sinks is None else sinks
    # With one chunk a block writes its rows' output; with more, each its chunk's share
    # (``part``), and the last of a block row's chunks to finish merges them, counting on
    # zeroed tickets of the call's own.
    tickets = TICKETS.take(n_tickets) if n_tickets else _dummy(mx.uint32)
    inputs = [queries, k, v, k_scales, k_biases, v_scales, v_biases, k_recent, v_recent, mask]
    inputs += [sink_arr, _flags(scale, kind, sinks is not None), _lengths(n_live, n_recent)]
    inputs.append(tickets)
    if replay:
        return _replayed(launch, inputs, packed=bits != 0)
    out, _ = _kernel()(inputs=inputs, **launch)
    return out


# The inputs that change from call to call of a replayed launch: the queries, the keys and
# values (and, packed, their scales, biases and staged tokens), the lengths and the tickets. The
# others (the stand-ins a variant does not read, the mask's, the sinks, the flags) are the
# trace's constants: each input a compiled call is handed costs the host ~1 us (an H100, s43:
# 4 inputs ~9 us a call, all 14 ~13).
_PACKED_SLOTS = tuple(i for i, n in enumerate(_INPUTS) if n not in ("mask", "sinks", "flags"))
_FLOAT_SLOTS = tuple(_INPUTS.index(n) for n in ("q", "k", "v", "lengths", "tickets"))
_SINKS, _FLAGS = _INPUTS.index("sinks"), _INPUTS.index("flags")
_REPLAYS: dict[tuple, object] = {}


def _replayed(launch: dict, inputs: list[mx.array], packed: bool) -> mx.array:
    """The kernel's call through ``mx.compile``: a compiled function per launch and constants
    (a trace replayed while the inputs keep their shapes; MLX looks through a compiled
    function's traces one by one, so they stay few)."""
    slots = _PACKED_SLOTS if packed else _FLOAT_SLOTS
    key = (id(launch), packed, id(inputs[_SINKS]), id(inputs[_FLAGS]))  # held: ids stay theirs
    call = _REPLAYS.get(key)
    if call is None:
        if len(_REPLAYS) >= 1024:
            _REPLAYS.clear()
        constants = [None if i in slots else a for i, a in enumerate(inputs)]
        # Evaluated first: MLX replays a captured array that still has its op (a stand-in's
        # zeros) as part of the trace, a kernel every call; an evaluated one is a constant.
        mx.eval([a for a in constants if a is not None])

        def traced(*changing: mx.array) -> mx.array:
            full = list(constants)
            for i, a in zip(slots, changing, strict=True):
                full[i] = a
            return _kernel()(inputs=full, **launch)[0]

        call = _REPLAYS[key] = mx.compile(traced)
    return call(*(inputs[i] for i in slots))


@functools.lru_cache(maxsize=512)
def _lengths(keys: int, staged: int) -> mx.array:
    """The kernel's live lengths (keys of ``k``/``v``, then staged ones): one small array a
    step shared by its layers."""
    return mx.array([keys, staged], mx.int32)


# MLA's decode attention (``latent_attention`` in ``cuda_attention.cuh``): the latents are the
# keys' first C elements and the values, the rope keys the rest of the keys.
_LATENT_SOURCE = """
  ::mlxc::latent_attention<T, KT, S, C, RD, R, BITS, GS, WARPS>(q, q_shape, q_strides, q_pe,
      q_pe_strides, k, k_shape, k_strides, k_scales, k_scales_strides, k_biases,
      k_biases_strides, k_pe, k_pe_strides, pe_scales, pe_scales_strides, pe_biases,
      pe_biases_strides, mask, mask_shape, mask_strides, flags, tickets, out, part);
"""
_LATENT_INPUTS = [
    "q", "q_pe", "k", "k_scales", "k_biases", "k_pe", "pe_scales", "pe_biases", "mask", "flags",
    "tickets",
]  # fmt: skip


@functools.cache
def _latent_kernel():
    return _cuda_kernel("mlxc_latent_attention", _LATENT_INPUTS, _LATENT_SOURCE)


# Each lane holds C / 32 of a head's weighted sums per row of its block: at most this many in
# all (registers), so 8 heads a block at C = 256, 4 at 512.
LATENT_SUMS = 64


# Blocks in all times the latent width that ``latent_attention`` aims at (``_chunks``'s target
# is this over C): far fewer blocks than ``attention``'s 512, as the last of a row's chunks merges
# their C + 2 partial sums a head alone, so a chunk costs more the wider the latents. An H100
# (s42, ``bench.attention_kernels --latent-chunks``: 512-32k keys, 16-128 heads, one to 16 rows):
# at C = 512 2-8 chunks a block row ran 10-40% faster than the 32-64 that 512 blocks asked for;
# at C = 256 (MiniCPM3's 40 heads, 5 tiles) 16 chunks 15% faster than 8.
LATENT_BLOCK_SUMS = 32 * 512


# Where ``latent_attention`` is faster than the composed form (``latent.composed_attention``),
# in keys summed over a call's rows (``B x T``, "row keys"). Each tile of heads reads its row's
# latents itself, where the composed form's products read them once for all heads. An H100
# (s42, ``bench.attention_kernels`` and its chunk sweeps, 512-32k keys, one to 16 rows): with
# 4 tiles (DeepSeek's 16 heads) the kernel's time grew with the row keys about as the composed
# form's and stayed 1.16-3.22x faster up to 32k row keys (131k tile keys, the most measured);
# with 32 tiles (128 heads) 1.15-1.64x at 1k keys, 0.76-1.03x at 4k. So: row keys x tiles at most
# LATENT_TILE_KEYS (past the measured, memory reads would favour the products), and row keys x
# tiles beyond the fourth at most LATENT_EXTRA_TILE_KEYS.
LATENT_TILE_KEYS = 160 * 1024
LATENT_EXTRA_TILE_KEYS = 32 * 1024


def latent_applies(q_lat: mx.array, q_pe: mx.array, latents, k_pe) -> bool:
    """Whether ``latent_attention`` takes this MLA decode step: on CUDA, one query per row,
    latents and rope keys as floats of the queries' dtype or both packed alike (a quantised
    cache's ``QuantizedKV``, not a staged one), widths its loads divide (16-byte vectors, or
    words of packed values: C a multiple of 32 of them, RD of one; C at most 32 *
    LATENT_SUMS), and no more work than it was measured faster for (LATENT_TILE_KEYS,
    LATENT_EXTRA_TILE_KEYS)."""
    if not (available() and q_lat.shape[-2] == 1):
        return False
    dtype = q_lat.dtype
    if dtype not in (mx.bfloat16, mx.float16, mx.float32) or q_pe.dtype != dtype:
        return False
    if isinstance(latents, mx.array):
        if latents.dtype != dtype or not isinstance(k_pe, mx.array) or k_pe.dtype != dtype:
            return False
        per_vector = 16 // dtype.size
    else:  # packed: QuantizedKV both, one quantisation (StagedKV, with recent floats: not here)
        if hasattr(latents, "recent") or hasattr(k_pe, "recent") or latents.quant != k_pe.quant:
            return False
        per_vector = 32 // latents.quant.bits
    B, H, _, C = q_lat.shape
    if not (C % (32 * per_vector) == 0 and C <= 32 * LATENT_SUMS):
        return False
    tiles = -(-H // _latent_rows(H, C))
    row_keys = B * latents.shape[2]
    return (
        q_pe.shape[-1] % per_vector == 0
        and row_keys * tiles <= LATENT_TILE_KEYS
        and row_keys * max(0, tiles - 4) <= LATENT_EXTRA_TILE_KEYS
    )


def latent_attention(
    q_lat: mx.array,
    q_pe: mx.array,
    latents,
    k_pe,
    *,
    scale: float,
    mask: mx.array | None,
    chunks: int | None = None,
) -> mx.array:
    """MLA's decode attention in one launch: ``softmax(scale * (q_lat c^T + q_pe k_pe^T)) c``
    for ``q_lat [B, H, 1, C]`` and ``q_pe [B, H, 1, RD]`` against the latents ``c [B, 1, T, C]``
    and rope keys ``k_pe [B, 1, T, RD]`` (float arrays, or a quantised cache's ``QuantizedKV``
    both, read packed); ``mask``: None or a boolean array broadcastable to ``[B, H, 1, T]``.
    Returns ``[B, H, 1, C]`` in the queries' dtype (``latent_applies`` says when it runs)."""
    B, H, _, C = q_lat.shape
    dtype = q_lat.dtype
    if isinstance(mask, mx.array):
        if mask.ndim < 4:
            mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
        masked = True
    else:
        mask, masked = _dummy(mx.bool_, 4), False
    if isinstance(latents, mx.array):
        k, k_scales, k_biases = latents, _dummy(dtype), _dummy(dtype)
        pe, pe_scales, pe_biases = k_pe, _dummy(dtype), _dummy(dtype)
        bits, group, scale_dtype = 0, 1, dtype
    else:  # packed (QuantizedKV): words, scales and biases
        (k, k_scales, k_biases), (pe, pe_scales, pe_biases) = latents.parts, k_pe.parts
        bits, group, scale_dtype = latents.quant.bits, latents.quant.group_size, k_scales.dtype
    key_rounds = -(-k.shape[2] // (WARPS * 32))
    n_tickets, launch = _latent_launch(
        B, H, C, q_pe.shape[-1], key_rounds, dtype, k.dtype, scale_dtype, bits, group, chunks
    )
    tickets = TICKETS.take(n_tickets) if n_tickets else _dummy(mx.uint32)
    flags = _flags(scale, int(masked), False)
    out, _ = _latent_kernel()(
        inputs=[q_lat, q_pe, k, k_scales, k_biases, pe, pe_scales, pe_biases, mask, flags, tickets],
        **launch,
    )
    return out


@functools.lru_cache(maxsize=1024)
def _latent_launch(B, H, C, RD, key_rounds, dtype, key_dtype, scale_dtype, bits, group, chunks):
    """``_launch`` for ``latent_attention``: the tickets and the kernel call's arguments."""
    R = _latent_rows(H, C)
    template = _latent_template(dtype, key_dtype, scale_dtype, C, RD, R, bits, group)
    blocks, target = B * math.ceil(H / R), LATENT_BLOCK_SUMS // C
    return _chunked_launch(template, blocks, key_rounds, chunks, (B, H, 1, C), dtype, target)


def _latent_rows(heads: int, latent_dim: int) -> int:
    """Heads per block of ``latent_attention``: a power of two, at most MAX_ROWS and as many
    as a lane's LATENT_SUMS registers hold."""
    return min(_rows(heads), max(1, LATENT_SUMS // (latent_dim // 32)))


@functools.cache
def _latent_template(
    dtype, key_dtype, scale_dtype, latent_dim: int, rope_dim: int, rows: int, bits: int, group: int
):
    return [
        ("T", dtype),
        ("KT", key_dtype),
        ("S", scale_dtype),
        ("C", latent_dim),
        ("RD", rope_dim),
        ("R", rows),
        ("BITS", bits),
        ("GS", group),
        ("WARPS", WARPS),
    ]


class Tickets:
    """Zeroed tickets for chunked calls, each call its own slice of a shared zeros array,
    zeroed once for many calls: a zeros array a call was a kernel a call, whose graph node,
    encoding and launch cost a decode step on an H200 ~0.1 of its time (s27). Slices, never
    handed out twice: MLX may run kernels whose data do not depend on each other at once, and
    two launches counting on the same tickets would miscount both. No call's tickets depend
    on another call (as tickets one call left zeroed for the next would), so a forward that
    fails takes no other with it."""

    SIZE = 1 << 16  # a zeros array: ~8 decode steps of 64 rows, 8 KV heads, 16 layers

    def __init__(self) -> None:
        self._lock = threading.Lock()  # two threads must not take the same slice
        self._zeros: mx.array | None = None
        self._size = self._used = 0

    def take(self, n: int) -> mx.array:
        """``n`` zeroed tickets no other call has."""
        with self._lock:
            if self._used + n > self._size:
                self._size, self._used = max(self.SIZE, n), 0
                self._zeros = mx.zeros((self._size,), mx.uint32)
            start = self._used
            self._used += n
            return self._zeros[start : self._used]


TICKETS = Tickets()


@functools.lru_cache(maxsize=1024)
def _launch(B, Hq, L, D, n_kv, key_rounds, dtype, key_dtype, scale_dtype, bits, group, chunks):
    """A call's launch from its shapes: the tickets its chunks need (0 for one chunk) and the
    kernel call's keyword arguments (template, grid, block, outputs)."""
    rows_per_kv = Hq // n_kv * L
    R = _rows(rows_per_kv)
    blocks = B * n_kv * math.ceil(rows_per_kv / R)
    template = _template(dtype, key_dtype, scale_dtype, D, R, bits, group)
    return _chunked_launch(template, blocks, key_rounds, chunks, (B, Hq, L, D), dtype)


def _chunked_launch(
    template, blocks: int, key_rounds: int, chunks, out_shape, dtype, target: int = 512
):
    """Either kernel's launch: ``blocks`` block rows, each over ``chunks`` chunks of keys (by
    default ``_chunks`` towards ``target`` blocks), the output ``out_shape`` (its last dim the
    weighted sums a row) and, chunked, the chunks' shares; and the tickets the chunks need (0
    for one chunk)."""
    if chunks is not None and not 1 <= chunks <= MAX_CHUNKS:
        raise ValueError(f"chunks must be 1 to {MAX_CHUNKS}, not {chunks}")
    n_chunks = chunks or _chunks(blocks, key_rounds, target)
    part = (1,) if n_chunks == 1 else (math.prod(out_shape[:-1]), n_chunks, out_shape[-1] + 2)
    launch = {
        "template": template,
        "grid": (n_chunks * WARPS * 32, blocks, 1),
        "threadgroup": (WARPS * 32, 1, 1),
        "output_shapes": [out_shape, part],
        "output_dtypes": [dtype, mx.float32],
    }
    return (blocks if n_chunks > 1 else 0), launch


@functools.cache
def _dummy(dtype: mx.Dtype, ndim: int = 1) -> mx.array:
    """A one-element stand-in for an input a kernel variant does not read."""
    return mx.zeros((1,) * ndim, dtype)


@functools.lru_cache(maxsize=256)
def _flags(scale: float, mask_kind: int, sinks: bool) -> mx.array:
    """The kernel's run-time values, one small array per attention configuration."""
    return mx.array([scale, mask_kind, float(sinks)], mx.float32)


@functools.cache
def _template(dtype, key_dtype, scale_dtype, head_dim: int, rows: int, bits: int, group: int):
    """The kernel's template arguments: one compiled variant per distinct list."""
    return [
        ("T", dtype),
        ("KT", key_dtype),
        ("S", scale_dtype),
        ("D", head_dim),
        ("R", rows),
        ("BITS", bits),
        ("GS", group),
        ("WARPS", WARPS),
    ]


def warm(model, queries: tuple[int, ...] = (1,), quant=None) -> None:
    """Compile the kernels ``model``'s attention layers will take for these query counts, on
    float keys and (``quant``) packed ones, so the first forward that needs them does not wait
    for NVRTC. A no-op off CUDA; each variant compiles once per process."""
    if not available():
        return
    dtype = _activation_dtype(model)
    for heads, kv_heads, head_dim in sorted(_attention_shapes(model)):
        if head_dim in HEAD_DIMS:
            for rows in sorted({_rows(heads // kv_heads * n) for n in queries}):
                _warm(dtype, head_dim, rows, quant)
    warm_latent(model, quant)


def warm_latent(model, quant=None) -> None:
    """Compile ``latent_attention``'s variants for ``model``'s MLA layers (every decode step
    of one takes it on CUDA, a single stream's too), on float latents or (``quant``) packed
    ones. A no-op off CUDA or without MLA."""
    if not available():
        return
    dtype = _activation_dtype(model)
    for heads, latent_dim, rope_dim in sorted(_latent_shapes(model)):
        q_lat, q_pe = (mx.zeros((1, heads, 1, n), dtype) for n in (latent_dim, rope_dim))
        latents, k_pe = (mx.zeros((1, 1, 128, n), dtype) for n in (latent_dim, rope_dim))
        if quant is not None:
            latents, k_pe = quant.quantize(latents), quant.quantize(k_pe)
        if latent_applies(q_lat, q_pe, latents, k_pe):
            out = latent_attention(q_lat, q_pe, latents, k_pe, scale=1.0, mask=None, chunks=2)
            mx.eval(out)


def _latent_shapes(model) -> set[tuple[int, int, int]]:
    """(heads, latent dim, rope dim) of the generated MLA attention layers: their
    ``n_heads``, ``kv_lora_rank``, ``qk_rope_head_dim``."""
    names = ("n_heads", "kv_lora_rank", "qk_rope_head_dim")
    return {
        tuple(getattr(m, a) for a in names)
        for _, m in model.named_modules()
        if all(isinstance(getattr(m, a, None), int) for a in names)
    }


@functools.cache
def _warm(dtype: mx.Dtype, head_dim: int, rows: int, quant) -> None:
    # One KV head of ``rows`` query heads, one query each: a block of exactly ``rows`` rows.
    q = mx.zeros((1, rows, 1, head_dim), dtype)
    k = mx.zeros((1, 1, 128, head_dim), dtype)
    kinds = [k] if quant is None else [k, quant.quantize(k)]  # float keys, and packed ones
    mx.eval([attention(q, keys, keys, scale=1.0, mask=None, chunks=2) for keys in kinds])


def _attention_shapes(model) -> set[tuple[int, int, int]]:
    """(query heads, KV heads, head dim) of the layers ``layers.attend`` serves with float keys
    and values alike: the generated GQA attention's ``n_heads``, ``n_kv_heads``, ``head_dim``."""
    return {
        (m.n_heads, m.n_kv_heads, m.head_dim)
        for _, m in model.named_modules()
        if all(isinstance(getattr(m, a, None), int) for a in ("n_heads", "n_kv_heads", "head_dim"))
    }


def _activation_dtype(model) -> mx.Dtype:
    """The dtype attention computes in: the first floating parameter's (a quantised
    model's scales are in it)."""
    from mlx.utils import tree_flatten

    for _, p in tree_flatten(model.parameters()):
        if mx.issubdtype(p.dtype, mx.floating):
            return p.dtype
    return mx.float32
