"""Building blocks that generated models share (the model-specific parts are generated)."""

from __future__ import annotations

import copy
import functools
import math
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx import nn
from mlx.nn.layers.distributed import AllToShardedLinear, QuantizedAllToShardedLinear

from mlxc.runtime import blas
from mlxc.runtime.model import cuda_attention, masks
from mlxc.runtime.model.cache import BufferKV, QuantizedKV, StagedKV


def relu2(x: mx.array) -> mx.array:
    """Squared ReLU (nemotron_h's MLP)."""
    return mx.square(nn.relu(x))


@functools.partial(mx.compile, shapeless=True)
def gelu_approx(x: mx.array) -> mx.array:
    """The tanh GELU as ``x * sigmoid(2 * y)``, ``y = sqrt(2 / pi) * (x + 0.044715 * x**3)``: the
    same function (``(1 + tanh(y)) / 2 = sigmoid(2 * y)``) in fewer ops than ``nn.gelu_approx``,
    grouped so that with ``* up`` (``glu``) it is one kernel: MLX fuses chains of at most a
    dozen nodes, and nn.gelu_approx's GeGLU takes two kernels. In bfloat16 it is also nearer
    the float32 GELU where ``1 + tanh`` rounds away the far negative tail."""
    return x * mx.sigmoid(x * 1.5957691216057308 + (x * x) * (x * 0.07135481627159046))


@functools.partial(mx.compile, shapeless=True)
def add_scaled(x: mx.array, branch: mx.array, scale: float) -> mx.array:
    """``x + branch * scale``, a residual whose branch is scaled (MiniCPM's ``scale_depth``,
    Granite's muP ``residual_multiplier``), in one kernel where it is two written out: a
    batch-1 decode step on a GPU is bound by its kernels' launches, two a layer here."""
    return x + branch * scale


ACTIVATIONS = {
    "silu": nn.silu,
    "gelu": nn.gelu,
    "gelu_approx": gelu_approx,
    "relu": nn.relu,
    "relu2": relu2,
}


@functools.lru_cache
def glu(act):
    """``act(gate) * up`` as one compiled kernel: a decode step runs it once per gated MLP,
    and separate kernels for the activation and the product cost a launch each. On the CPU a
    float32 silu or tanh-GELU gate is computed from fast element-wise ops instead
    (``CPU_ACTIVATIONS``), compiled too."""
    compiled = mx.compile(lambda gate, up: act(gate) * up, shapeless=True)
    by_polynomial = CPU_ACTIVATIONS.get(act)
    if by_polynomial is None:
        return compiled
    # Not shapeless (``exp_by_polynomial``'s bit view): a new block shape costs a trace.
    polynomial = mx.compile(lambda gate, up: by_polynomial(gate) * up)

    def cpu_glu(gate: mx.array, up: mx.array) -> mx.array:
        if gate.dtype == mx.float32 and mx.default_device() == mx.cpu:
            return in_row_blocks(polynomial, gate, up)
        return compiled(gate, up)

    return cpu_glu


# MLX 0.32.4's CPU ``exp`` and ``tanh`` (so ``silu`` and the tanh GELU, compiled or not) cost
# ~12-25 ns an element: a 1,024-token prefill's SwiGLU activation took longer than its down
# projection's matmul (67 against 45 ms a layer of the small llama). Made of MLX's fast
# element-wise ops they take a third to a half of that, as exactly, and compiled into one
# kernel a third to two thirds of that again, bit for bit the same (one decode step's gate
# too: 1 x 2,048 elements 93 against MLX's 140 us). A gate goes through in blocks of rows of
# at most ``CPU_ACT_BLOCK`` elements, which stay in the caches (``docs/performance.md``).
CPU_ACT_BLOCK = 1 << 18


def in_row_blocks(fn, *xs: mx.array) -> mx.array:
    """``fn(*xs)`` of same-shaped arrays, computed on blocks of rows (all axes but the last
    flattened) of at most ``CPU_ACT_BLOCK`` elements and concatenated."""
    shape, width = xs[0].shape, xs[0].shape[-1]
    rows = max(1, CPU_ACT_BLOCK // width)
    if xs[0].size <= rows * width:
        return fn(*xs)
    flat = [x.reshape(-1, width) for x in xs]
    n = flat[0].shape[0]
    blocks = [fn(*(x[i : i + rows] for x in flat)) for i in range(0, n, rows)]
    return mx.concatenate(blocks).reshape(shape)


def exp_by_polynomial(t: mx.array) -> mx.array:
    """float32 ``exp(t)`` of ``t`` clipped to [-87, 88] (float32's exponent range), as ``2**n *
    p(r)``: Cody and Waite's reduction (``n`` the integer nearest ``t / ln 2``, ``ln 2`` in two
    parts so ``r`` keeps its bits, ``|r| <= ln 2 / 2``), the Cephes ``expf`` polynomial for
    ``p``, and ``2**n`` made from its float32 exponent bits. Within 2e-6 of ``mx.exp``.

    ``n`` is rounded by adding and taking away 1.5 * 2**23 (where a float32's last bit is 1),
    not by ``mx.floor``: MLX compiles its CPU kernels for SSE2, which has no vector floor, and
    the exponentials of a block of scores or of a gate took 0.58-0.72x the time this way
    (``docs/performance.md``). Exact without fast-math, which MLX's compiler flags leave off."""
    n_t = mx.clip(t, -87.0, 88.0)
    n = (n_t * 1.4426950408889634 + 12582912.0) - 12582912.0
    r = n_t - n * 0.693359375 + n * 2.12194440e-4
    p = 1.9875691500e-4
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 0.5):
        p = p * r + c
    two_n = ((n.astype(mx.int32) + 127) << 23).view(mx.float32)
    return (p * r * r + r + 1.0) * two_n


def _over_one_plus_exp(x: mx.array, t: mx.array) -> mx.array:
    """``x / (1 + exp(t))``; past float32's range (``t > 88``: the quotient under ``|x| *
    1e-38``) 0."""
    return mx.where(t > 88.0, 0.0, x / (1.0 + exp_by_polynomial(t)))


def silu_by_polynomial(x: mx.array) -> mx.array:
    """``x * sigmoid(x) = x / (1 + exp(-x))``."""
    return _over_one_plus_exp(x, -x)


def gelu_approx_by_polynomial(x: mx.array) -> mx.array:
    """The tanh GELU, ``x / 2 * (1 + tanh(y))`` with ``y = sqrt(2 / pi) * (x + 0.044715 *
    x**3)``, as ``x / (1 + exp(-2 * y))`` (the same function: ``(1 + tanh(y)) / 2 =
    sigmoid(2 * y)``), which also keeps its far negative tail that ``1 + tanh`` rounds to 0."""
    return _over_one_plus_exp(x, x * (-1.5957691216057308 - 0.07135481627159046 * x * x))


CPU_ACTIVATIONS = {nn.silu: silu_by_polynomial, gelu_approx: gelu_approx_by_polynomial}


def retype(model: nn.Module, classes: dict[type, type]) -> nn.Module:
    """Give every submodule of ``model`` whose type is exactly a key of ``classes`` the class it
    maps to (a subclass with another product), in place: parameters stay. Returns ``model``."""
    for _, module in model.named_modules():
        if (new := classes.get(type(module))) is not None:
            module.__class__ = new
    return model


# --- projections fused at load ---------------------------------------------------------------
#
# One decode step of one sequence is bound by kernel launches, not by weight reads: three
# [dim, *] matmuls of one input cost three launches where one [dim, q + k + v] matmul does
# the same work. A module declares ``fusions`` (pairs: a fused attribute and the linears it
# replaces, each named as the checkpoint names it), holds the fused attribute as None, and
# runs the parts while it is None. ``fuse`` concatenates the parts' outputs once the weights
# (and any quantisation) are in: a quantised linear's weight, scales and biases all run along
# the outputs (groups run along the inputs), so they concatenate there too; stacked experts
# ``[E, out, in]`` concatenate per expert.
# Checkpoints keep the parts' names; ``unfuse`` gives the parts back (tensor parallelism
# splits each part by its own heads or width).


# A rank's share of a tensor-parallel linear computes, forward, as the plain kind on its slice
# (the sharded class adds only an all-reduce of gradients): parts fuse across the two.
_PLAIN = {AllToShardedLinear: nn.Linear, QuantizedAllToShardedLinear: nn.QuantizedLinear}
_QUANT = ("group_size", "bits", "mode")


def _fusible(parts: list) -> bool:
    """Whether ``parts`` can be one linear: one kind (plain, quantised alike, stacked experts),
    the same parameters and inputs."""
    first = parts[0]
    kind, keys = _PLAIN.get(type(first), type(first)), set(first.parameters())
    if "weight" not in keys:
        return False
    for p in parts:
        if _PLAIN.get(type(p), type(p)) is not kind or set(p.parameters()) != keys:
            return False
        if any(_without_outputs(p, k) != _without_outputs(first, k) for k in keys):
            return False
        if any(getattr(p, a, None) != getattr(first, a, None) for a in _QUANT):
            return False
    return True


def _outputs_axis(name: str) -> int:
    """The axis of a linear's parameter that runs along its outputs: a bias ``[..., out]``; a
    weight, its scales and biases ``[..., out, in]`` (``[E, out, in]`` for stacked experts)."""
    return -1 if name == "bias" else -2


def _without_outputs(layer: nn.Module, name: str) -> tuple:
    shape = list(layer[name].shape)
    del shape[_outputs_axis(name)]
    return (*shape, layer[name].dtype)


def _like(layer: nn.Module, params: dict[str, mx.array]) -> nn.Module:
    """A linear of ``layer``'s type and settings holding ``params``."""
    out = copy.copy(layer)
    out.__dict__["_no_grad"] = set(layer._no_grad)  # copy.copy would share the frozen set
    for k, v in params.items():
        out[k] = v
    return out


def fuse(model: nn.Module) -> nn.Module:
    """Fuse the ``fusions`` of every submodule of ``model``, in place (parts that differ in
    type or quantisation stay apart). Returns ``model``."""
    for _, module in model.named_modules():
        for name, parts in getattr(module, "fusions", ()):
            layers = [module.get(p) for p in parts]
            if module.get(name) is not None or any(p is None for p in layers):
                continue
            if not _fusible(layers):
                continue
            params = {
                k: mx.concatenate([p[k] for p in layers], axis=_outputs_axis(k))
                for k in layers[0].parameters()
            }
            fused = _like(layers[0], params)
            sizes = [p.weight.shape[-2] for p in layers]  # outputs of each part, for unfuse
            module.__dict__.setdefault("fused_sizes", {})[name] = sizes
            for p in parts:
                del module[p]
            setattr(module, name, fused)
            mx.eval(fused.parameters())  # one layer's parts at a time, not the model's copy
    return model


def unfuse(model: nn.Module) -> bool:
    """Split every fused projection of ``model`` back into its parts, in place (as the
    checkpoint names them). Returns whether any was fused."""
    any_fused = False
    for _, module in model.named_modules():
        for name, parts in getattr(module, "fusions", ()):
            if (fused := module.get(name)) is None:
                continue
            sizes = module.__dict__["fused_sizes"].pop(name)
            cuts = [sum(sizes[: i + 1]) for i in range(len(sizes) - 1)]
            pieces = {
                k: mx.split(v, cuts, axis=_outputs_axis(k)) for k, v in fused.parameters().items()
            }
            for i, p in enumerate(parts):
                setattr(module, p, _like(fused, {k: v[i] for k, v in pieces.items()}))
            del module[name]
            setattr(module, name, None)
            any_fused = True
    return any_fused


# Inputs of at most this many tokens a row (a decode step, a speculative verification of K + 1,
# a batch of them) replay an attention layer's projections through ``mx.compile`` on a GPU
# (``step_compiled``), as ``moe.MoE`` does its block.
STEP_TOKENS = cuda_attention.MAX_QUERIES


def step_compiled(project, x: mx.array, *positions: int | mx.array):
    """``project(x, *positions)``: an attention layer's work before its cache (projections,
    norms, RoPE), through ``mx.compile`` where that pays: on a GPU, for ``x`` of at most
    ``STEP_TOKENS`` tokens a row, in a layer not split over ranks.

    Such a step is bound by the host (``docs/performance.md``): replayed from its trace, the
    layer's graph is built in C++ instead of Python (a dozen MLX calls: a fast RoPE call alone
    costs microseconds of Python). One compiled function per layer, its arrays inputs of the
    trace (so weights loaded later are used), a trace per shape: per batch size and token
    count, which are few for steps; a prompt's lengths would each cost one, so prompts run
    ``project`` as written, as does the CPU (its quantised products evaluate inside). An int
    position (a sequence's offset) goes in as an array, so one trace serves every step.
    """
    module = project.__self__
    # A layer split over ranks (parallel.split_module marks it) is left as written, as the MoE
    # block is: its forward may hold a collective.
    if (
        x.shape[-2] > STEP_TOKENS
        or mx.default_device() == mx.cpu
        or "split_over" in module.__dict__
    ):
        return project(x, *positions)
    compiled = module.__dict__.get("_step_compiled")
    if compiled is None:
        compiled = module.__dict__["_step_compiled"] = mx.compile(project, inputs=module)
    return compiled(x, *(_position(p) if isinstance(p, int) else p for p in positions))


@functools.lru_cache(maxsize=8)
def _position(offset: int) -> mx.array:
    """``offset`` as the array a compiled step takes: made once for every layer of a step."""
    return mx.array(offset, mx.int32)


# Layers a piece of a forward of several tokens sends to the GPU at once (``early_dispatch``);
# 0 sends nothing early. Measured in ``bench.verify_probe`` (``docs/performance.md``).
PIECE_LAYERS = 4


def early_dispatch(tokens: int, n_layers: int) -> frozenset[int]:
    """The layers after which the generated ``TextModel`` sends the hidden state to the device
    (``mx.async_eval``): every ``PIECE_LAYERS``-th on a GPU, for a forward of several tokens a
    row; none otherwise.

    Such a forward (a prompt chunk, a speculative verification) is read back as soon as it is
    built, and MLX would start its device work only once the host had built and encoded every
    layer: for a verification's few tokens, where host and device take about as long, that
    serialises the two. Sent in pieces, the first layers run while the host builds the next.
    A one-token decode step is left whole: its loop already overlaps a step's device work with
    the next step's building (``generate_tokens``, the scheduler), and each piece costs a
    launch of its own. The CPU is left whole too: its forward is bound by its arithmetic, done
    by the same cores that would build the pieces.
    """
    every = PIECE_LAYERS
    if tokens < 2 or every < 1 or mx.default_device() == mx.cpu:
        return frozenset()
    return frozenset(range(every - 1, n_layers - 1, every))


@dataclass
class AttentionInputs:
    """What every attention layer of one forward reads, resolved once from the cache by the
    generated ``TextModel`` (as mlx-lm builds its mask once per forward); layers read no cache
    field for them.

    - ``masks`` (``live-window``): one mask per sliding window (key None: no window), sized to
      the live keys once the chunk is appended. ``attend`` checks it against the keys of each
      layer's cache.
    - ``offset`` (``monotonic-position``): absolute position of the chunk's first token, an int
      or a per-row ``[B]`` array (a decode batch). RoPE starts there.
    - ``rope``: MRoPE's rotation (``mrope.rotation``: the first positions ``(start,)`` or the
      cos/sin tables); ``attn_scale``: the Llama-4 query multiplier. Both come from monotonic
      positions; None where the model has neither.
    """

    masks: dict[int | None, mx.array | str | None]
    offset: int | mx.array | None = None
    rope: tuple[mx.array, ...] | None = None
    attn_scale: mx.array | None = None


def attend(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    *,
    scale: float,
    mask: mx.array | masks.Window | str | None,
    sinks: mx.array | None = None,
) -> mx.array:
    """Scaled dot-product attention (GQA-aware) that refuses a mask not sized to the keys.

    ``sinks`` ``[n_heads]``: learned logits of a virtual key that takes softmax mass and adds
    nothing (gpt-oss).
    """
    masks.check(mask, queries.shape[-2], keys.shape[-2])
    if isinstance(keys, StagedKV) and keys.recent.dtype != queries.dtype:
        keys, values = keys.dequantize(), values.dequantize()  # the kernel reads the queries'
    quantized = isinstance(keys, QuantizedKV | StagedKV)
    L, T = queries.shape[-2], keys.shape[-2]
    cpu = mx.default_device() == mx.cpu
    rows = _cpu_rows(queries, T) if cpu else 0  # queries a composed call takes (0: none)
    causal = isinstance(mask, masks.Window) or (isinstance(mask, str) and mask == "causal")
    if rows and L > rows and not (causal and rows * T * math.prod(queries.shape[:2]) <= CPU_SCORES):
        rows = 0  # many blocks against many keys: MLX's fused kernel (see CPU_SCORES)
    blocked = cpu and causal and L > (rows or CAUSAL_BLOCK)
    if isinstance(mask, masks.Window) and not blocked:  # a Window is the CPU's (masks.causal)
        mask = mask.array()
    buffers = isinstance(keys, BufferKV)
    if cuda_attention.applies(queries, values.shape[-1], mask, quantized, buffers):
        return cuda_attention.attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
    if buffers:  # a float cache's whole buffers, for that kernel: the rest read the live keys
        keys, values = keys.live(), values.live()
    if isinstance(keys, StagedKV):  # staged for that kernel (an additive mask stays with MLX)
        keys, values, quantized = keys.dequantize(), values.dequantize(), False
    if quantized:
        if queries.shape[-2] <= QUANTIZED_MATMUL_QUERIES and packed_attention():
            return composed_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        # A prefill chunk: its L x T scores would be materialised; dequantising the live keys
        # once lets it take the fused kernel (same values: dequantize is what the matmul reads).
        keys, values = keys.dequantize(), values.dequantize()
    if _composed_on_cuda(queries, keys):
        return composed_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
    if blocked:
        window = mask if isinstance(mask, masks.Window) else None
        return _query_blocks(
            queries, keys, values, scale=scale, sinks=sinks, window=window, rows=rows
        )
    if L <= rows:
        return composed_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
    return mx.fast.scaled_dot_product_attention(
        queries, keys, values, scale=scale, mask=mask, sinks=sinks
    )


# On the CPU MLX 0.32.4's fused attention exponentiates every score with its CPU exp (~12 ns
# an element); ``composed_attention``'s CPU form takes a compiled polynomial (~3 ns) and
# normalises after the values' product: 1.3-3.8x faster for a decode step or a verification
# (one call, up to 8k keys measured) and 1.5-1.7x for a prompt of 512-4,096 tokens in blocks
# of queries whose scores stay within this many elements. Past that a block's passes leave
# the caches, and many blocks against many keys (a 64-token chunk after 8k tokens: 0.87x)
# lose to the fused kernel, which such chunks keep (``docs/performance.md``).
CPU_SCORES = 1 << 20
CPU_MIN_ROWS = 16  # fewer queries a block would reread the keys too often


def _cpu_rows(queries: mx.array, n_keys: int) -> int:
    """Queries one composed call on the CPU takes (``attend``): float32 ones, up to
    CAUSAL_BLOCK while their scores stay within CPU_SCORES, at least CPU_MIN_ROWS; 0 (MLX's
    fused kernel) for other dtypes."""
    if queries.dtype != mx.float32:
        return 0
    fit = CPU_SCORES // (math.prod(queries.shape[:2]) * n_keys)
    return min(CAUSAL_BLOCK, max(CPU_MIN_ROWS, fit))


# On the CPU, MLX's attention materialises every score of a chunk and exponentiates each one
# (at ~12 ns an element, most of a prefill chunk's attention), masked or not. Under a causal
# mask a block of queries sees no key past its last query, so a chunk attended in blocks of
# this many queries skips the scores above the diagonal (almost half of a first chunk's) and
# holds one block's scores at a time: a 512-token first chunk's attention 1.7x faster, a
# 2,048-token one 2x (``docs/performance.md``). Under a sliding window a block also skips the
# keys before its first query's window. Fused GPU kernels skip those tiles themselves. Blocks
# composed on the CPU (``_cpu_rows``) take fewer queries where many keys would make their
# scores too many.
CAUSAL_BLOCK = 64


def _query_blocks(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    *,
    scale: float,
    sinks: mx.array | None,
    window: masks.Window | None = None,
    rows: int = 0,
) -> mx.array:
    """``attend`` under the string ``"causal"`` mask (or a ``window``), ``rows`` queries at a
    time (0: CAUSAL_BLOCK, through MLX's fused kernel), each block against the keys from its
    first query's window (the first key without one) up to its last query: the block's queries
    are then the last of its keys, so its mask is ``"causal"``, or the window's over those
    keys. Blocks of ``rows`` attend composed (``composed_attention``'s CPU form)."""
    L, T = queries.shape[-2], keys.shape[-2]
    attend_block = composed_attention if rows else mx.fast.scaled_dot_product_attention
    size = rows or CAUSAL_BLOCK
    blocks = []
    for start in range(0, L, size):
        end = min(start + size, L)
        seen = T - L + end
        first = 0 if window is None else max(0, T - L + start - window.window + 1)
        mask = "causal"
        if window is not None and seen - first > window.window:
            mask = masks.causal_array(end - start, seen - first, window.window)
        blocks.append(
            attend_block(
                queries[:, :, start:end],
                keys[..., first:seen, :],
                values[..., first:seen, :],
                scale=scale,
                mask=mask,
                sinks=sinks,
            )
        )
    return mx.concatenate(blocks, axis=2)


# Not shapeless: ``exp_by_polynomial``'s bit view has no shape rule for it; a new shape costs
# a trace (~3 ms), not a new kernel.
_shifted_exp = mx.compile(lambda scores, top: exp_by_polynomial(scores - top))


# Up to this many queries (decode steps, short continuations) attention reads the quantised
# keys and values directly; longer chunks dequantise them for the fused kernel (``attend``).
QUANTIZED_MATMUL_QUERIES = 8

# On CUDA, chunks of fewer queries than this attend through ``composed_attention``, not MLX's
# fused kernel, while their scores stay within COMPOSED_SCORES elements: MLX 0.32 runs a chunk
# of two or more queries through cuDNN, which builds (NVRTC compiles) a graph for each new
# shape of queries and keys: 45-170 ms each on the H200, where a server's prompts (and prompt
# groups) rarely repeat a shape. Composed, a 512-token prompt prefilled as fast as through
# cuDNN (57.6k against 56.4k tokens/s, built graph); at 2048, full chunks, which repeat their
# shapes, cuDNN's fused kernel is 1.7x faster and holds no L x T scores, and a chunk against a
# long context would hold too many (``docs/performance.md``).
CUDNN_QUERIES = 1024
COMPOSED_SCORES = 2**27  # 256 MiB of bf16 scores (a 512-token chunk, 32 heads, 8k keys)


def _composed_on_cuda(queries: mx.array, keys: mx.array) -> bool:
    """Whether ``attend`` composes this chunk's attention on CUDA (see CUDNN_QUERIES)."""
    B, n_heads, L, _ = queries.shape
    if not 1 < L < CUDNN_QUERIES or B * n_heads * L * keys.shape[-2] > COMPOSED_SCORES:
        return False
    return cuda_attention.available()


def packed_attention() -> bool:
    """Whether ``attend`` reads quantised keys packed through ``composed_attention`` on this
    device: on the CPU and Metal. MLX 0.32.4's CUDA ``quantized_matmul`` gave wrong scores for
    batched 64-wide quantised keys (max error ~30 on N(0, 1) inputs, or NaN; H200,
    2026-12-01), so CUDA reads them packed through ``cuda_attention`` (its head dims) or
    dequantises: the resident KV stays quantised."""
    return mx.default_device() == mx.cpu or mx.metal.is_available()


def composed_attention(
    queries: mx.array,
    keys: mx.array | QuantizedKV,
    values: mx.array | QuantizedKV,
    *,
    scale: float,
    mask: mx.array | str | None,
    sinks: mx.array | None = None,
) -> mx.array:
    """``attend`` as its ops: ``softmax(q k^T) v``, the scores materialised. On quantised keys
    and values (``--kv-bits``) both products go through ``mx.quantized_matmul``, so the keys
    are read packed, never expanded; on float ones through ``mx.matmul`` (``CUDNN_QUERIES``).

    GQA: the ``n_heads / n_kv_heads`` query heads of one KV head attend as ``rep * L`` rows of
    that head (as MLA's decode does), so each product is one plain batched matmul per KV head,
    nothing broadcast; the masks see the scores as ``[B, kv, rep, L, T]``.

    On the CPU float32 scores are exponentiated by the compiled ``exp_by_polynomial`` (MLX's
    CPU ``exp`` costs 4x as much), a boolean mask is added as 0 / a large negative (built at
    the mask's size, not the scores'), and each row is divided by its sum after the values'
    product (``Dv`` columns instead of ``T``): ``attend`` takes this form on the CPU.
    """
    B, n_heads, L, _ = queries.shape
    n_kv = keys.shape[1]
    rep = n_heads // n_kv
    if isinstance(keys, QuantizedKV):
        product = quantized_product
    else:

        def product(a: mx.array, b: mx.array, transpose: bool) -> mx.array:
            return a @ (b.swapaxes(-1, -2) if transpose else b)

    rows = (queries * scale).reshape(B, n_kv, rep * L, -1)
    scores = product(rows, keys, True).reshape(B, n_kv, rep, L, -1)
    cpu = scores.dtype == mx.float32 and mx.default_device() == mx.cpu
    if isinstance(mask, str):
        mask = masks.causal_array(L, scores.shape[-1])
    if mask is not None:
        mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)  # as [B | 1, H | 1, L, T]
        if mask.shape[1] == 1:  # one mask for every head
            mask = mx.expand_dims(mask, 2)
        else:  # a mask per query head: head kv * rep + r is row r of KV head kv
            mask = mask.reshape(mask.shape[0], n_kv, rep, *mask.shape[2:])
        if mask.dtype == mx.bool_ and cpu:
            scores = scores + mx.where(mask, 0.0, mx.finfo(scores.dtype).min)
        elif mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
        else:
            scores = scores + mask
    if cpu:
        top = scores.max(axis=-1, keepdims=True)
        if sinks is not None:  # a virtual key per head: it joins the maximum and the sum
            sink = sinks.astype(mx.float32).reshape(1, n_kv, rep, 1, 1)
            top = mx.maximum(top, sink)
        e = _shifted_exp(scores, top)
        total = e.sum(axis=-1, keepdims=True)
        if sinks is not None:
            total = total + _shifted_exp(sink, top)
        out = product(e.reshape(B, n_kv, rep * L, -1), values, False)
        return (out / total.reshape(B, n_kv, rep * L, 1)).reshape(B, n_heads, L, -1)
    if sinks is not None:  # a virtual key per head that takes softmax mass and adds nothing
        sink = mx.broadcast_to(
            sinks.astype(scores.dtype).reshape(n_kv, rep, 1, 1), (*scores.shape[:-1], 1)
        )
        scores = mx.concatenate([sink, scores], axis=-1)
    probs = mx.softmax(scores, axis=-1, precise=True)
    if sinks is not None:
        probs = probs[..., 1:]
    probs = probs.reshape(B, n_kv, rep * L, -1).astype(queries.dtype)
    out = product(probs, values, False)  # [B, kv, rep * L, Dv]
    return out.reshape(B, n_heads, L, -1)


def quantized_product(a: mx.array, b: QuantizedKV, transpose: bool) -> mx.array:
    """``a @ b^T`` (``transpose``: scores against keys) or ``a @ b`` (weights over values), ``b``
    read packed: ``mx.quantized_matmul``'s result. On a CPU with an optimised BLAS the codes go
    through it as float planes (``QuantizedKV.code_planes``) and each token's scales and biases
    are applied to the products: there MLX 0.32.4's ``quantized_matmul`` takes 2-10x as long
    for the scores of a decode step or a verification, and 1.8-6x for the values of 4-bit
    heads of one group (``bench/results/kv4-cpu-product.md``). Values keep it where their
    planes would outgrow the caches, or not pay for their extra ops (``_values_on_planes``;
    8 bits always), as does MLX's reference BLAS, on which the planes would be the slower."""
    q = b.quant
    groups = b.shape[-1] // q.group_size
    on_blas = mx.default_device() == mx.cpu and blas.fast_cpu_matmul()
    if not on_blas or (not transpose and not _values_on_planes(b, groups)):
        return mx.quantized_matmul(
            a, *b.parts, transpose=transpose, group_size=q.group_size, bits=q.bits
        )
    planes, scales, biases = b.code_planes(a.dtype), b.parts[1], b.parts[2]  # [.., T, groups] each
    p = len(planes)
    *lead, rows, width = a.shape
    if not transpose and groups > 1:
        return _grouped_values(a, planes, scales, biases, q.group_size)
    if not transpose:  # one group: out[r] = sum_t a[r, t] * (scale[t] * codes[t] + bias[t])
        weighted = a * scales.swapaxes(-1, -2)
        parts = [weighted @ plane for plane in planes]
        out = parts[0] if p == 1 else mx.stack(parts, axis=-1).reshape(*lead, rows, -1)
        return out + a @ biases
    # score[r, t] = sum over groups g: scale[t, g] * (a[r, g] . codes[t, g]) + bias[t, g] *
    # sum(a[r, g]); with several groups each row is spread over rows of one group each.
    if groups == 1:  # no group axis to reduce, no matmul for the biases: 1.16-1.23x faster (s44)
        dots = sum(a[..., j::p] @ plane.swapaxes(-1, -2) for j, plane in enumerate(planes))
        return dots * scales.swapaxes(-1, -2) + a.sum(-1, keepdims=True) * biases.swapaxes(-1, -2)
    in_group = mx.arange(width)[None, :] // q.group_size == mx.arange(groups)[:, None]
    spread = (mx.expand_dims(a, -2) * in_group.astype(a.dtype)).reshape(*lead, -1, width)
    dots = sum(spread[..., j::p] @ plane.swapaxes(-1, -2) for j, plane in enumerate(planes))
    dots = dots.reshape(*lead, rows, groups, -1) * mx.expand_dims(scales.swapaxes(-1, -2), -3)
    sums = a.reshape(*lead, rows, groups, q.group_size).sum(-1)  # [.., rows, groups]
    return dots.sum(-2) + sums @ biases.swapaxes(-1, -2)


# Values go through float planes (4 bits) while the planes stay within VALUE_PLANES_BYTES, and
# a head of several groups from VALUE_PLANES_KEYS keys. On this project's CPU (s44, 8 chained
# calls, 4 query rows a KV head) against ``quantized_matmul``: planes of up to 4 MiB 1.9-3.8x
# its speed for one group, 1.5-3.2x for several at 1,024-2,048 keys (0.69-1.07x at 512);
# planes of 8-32 MiB (a long context, a decode batch) 0.49-0.86x in five cases of six (one
# 8 MiB batch 1.32x): they spill from the caches.
VALUE_PLANES_BYTES = 4 << 20
VALUE_PLANES_KEYS = 1024


def _values_on_planes(b: QuantizedKV, groups: int) -> bool:
    """Whether ``quantized_product`` reads values ``b`` through float planes."""
    if b.quant.bits != 4 or math.prod(b.shape) * 4 > VALUE_PLANES_BYTES:  # float32 planes
        return False
    return groups == 1 or b.shape[-2] >= VALUE_PLANES_KEYS


def _grouped_values(
    a: mx.array, planes: list[mx.array], scales: mx.array, biases: mx.array, group_size: int
) -> mx.array:
    """``a @ values`` for values of several groups, from their code planes: each row, weighted
    by every group's scales, takes one product a plane (``rows x groups`` rows), of which each
    group keeps its own columns (the diagonal blocks; the rest is work thrown away)."""
    *lead, rows, keys = a.shape
    groups, p = scales.shape[-1], len(planes)
    weighted = mx.expand_dims(a, -2) * mx.expand_dims(scales.swapaxes(-1, -2), -3)
    weighted = weighted.reshape(*lead, rows * groups, keys)
    own = []
    for plane in planes:  # [.., rows, the row's group, the column's group, group_size / p]
        full = (weighted @ plane).reshape(*lead, rows, groups, groups, group_size // p)
        own.append(mx.diagonal(full, 0, -3, -2).swapaxes(-1, -2))  # [.., rows, groups, G / p]
    out = mx.stack(own, axis=-1).reshape(*lead, rows, groups, group_size)  # planes interleaved
    return (out + mx.expand_dims(a @ biases, -1)).reshape(*lead, rows, -1)


def softcap(x: mx.array, cap: float | None) -> mx.array:
    """``cap * tanh(x / cap)``: logits bounded smoothly by ``cap`` (None: unchanged)."""
    return x if cap is None else mx.tanh(x / cap) * cap


class RMSNorm(nn.Module):
    """RMSNorm scaled by ``1 + weight``: Gemma stores its norm weights around zero.

    The scale is made once per weight, when the weight is set (a load, an ``update``), not in
    every call: as an op it is a kernel of its own, six a Gemma layer of a decode step, whose
    time on a GPU goes by its kernels. ``_scale`` is not a parameter (its name's underscore),
    so checkpoints and ``mlxc convert`` see only ``weight``; it is in the module's tree, so
    ``mx.compile(..., inputs=module)`` (``step_compiled``) takes it as an input.
    """

    def __init__(self, dims: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = mx.zeros((dims,))
        self.eps = eps

    def __setitem__(self, key: str, value: Any) -> None:
        # Module.__setattr__ and Module.update both set parameters through here (mx.compile's
        # tracers do not: they replace the weight and the scale as two inputs).
        super().__setitem__(key, value)
        if key == "weight":
            super().__setitem__("_scale", 1.0 + value)

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, self._scale, self.eps)


class SwiGLU(nn.Module):
    """``down(act(gate(x)) * up(x))`` with Hugging Face parameter names; gate and up run as
    one matmul once loading fuses them (``fuse``: ``gate_up_proj``)."""

    fusions = (("gate_up_proj", ("gate_proj", "up_proj")),)  # (fused, its parts)

    def __init__(self, dim: int, hidden: int, bias: bool = False, act: str = "silu") -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.gate_up_proj = None  # gate_proj | up_proj, set by fuse
        self.down_proj = nn.Linear(hidden, dim, bias=bias)
        self.glu = glu(ACTIVATIONS[act])

    def __call__(self, x: mx.array) -> mx.array:
        if self.gate_up_proj is not None:
            gate, up = mx.split(self.gate_up_proj(x), 2, axis=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.glu(gate, up))


class FusedSwiGLU(nn.Module):
    """``output_linear(act(gate) * up)``, gate and up the two halves of ``input_linear``'s
    outputs (granite's shared MLP, named as transformers names it)."""

    def __init__(self, dim: int, hidden: int, bias: bool = False, act: str = "silu") -> None:
        super().__init__()
        self.input_linear = nn.Linear(dim, 2 * hidden, bias=bias)
        self.output_linear = nn.Linear(hidden, dim, bias=bias)
        self.glu = glu(ACTIVATIONS[act])

    def __call__(self, x: mx.array) -> mx.array:
        gate, up = mx.split(self.input_linear(x), 2, axis=-1)
        return self.output_linear(self.glu(gate, up))


class MLP(nn.Module):
    """Non-gated ``down(act(up(x)))`` with Hugging Face parameter names."""

    def __init__(self, dim: int, hidden: int, bias: bool = False, act: str = "relu2") -> None:
        super().__init__()
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)
        self.act = ACTIVATIONS[act]

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(self.act(self.up_proj(x)))


class LinearAttention(nn.Module):
    """An attention sublayer replaced by one linear map (nemotron_nas); keeps no cache."""

    def __init__(self, dim: int, bias: bool = False) -> None:
        super().__init__()
        self.linear_attn = nn.Linear(dim, dim, bias=bias)

    def __call__(
        self, x: mx.array, cache: None = None, inputs: AttentionInputs | None = None
    ) -> mx.array:
        # Same call shape as attention so decoder layers need no special case; no keys kept.
        return self.linear_attn(x)


class LinearMLP(nn.Module):
    """An MLP sublayer replaced by one linear map (nemotron_nas)."""

    def __init__(self, dim: int, bias: bool = False) -> None:
        super().__init__()
        self.linear_mlp = nn.Linear(dim, dim, bias=bias)

    def __call__(self, x: mx.array) -> mx.array:
        return self.linear_mlp(x)
