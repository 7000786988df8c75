"""Mixture-of-experts block shared by the MoE architectures, and checkpoint layout conversion.

One block serves qwen3_vl_moe / qwen2_moe (softmax, top-k), deepseek_v2 (softmax, greedy or
group-limited), mistral4 (softmax, group-limited, shared experts), deepseek_v3 /
glm4_moe_lite (sigmoid with ``e_score_correction_bias``, group-limited) and gpt_oss (router
and expert biases, clamped SwiGLU, MXFP4 experts). Experts run through
``mx.gather_mm`` (``mx.gather_qmm`` once quantised) over stacked weights; with many
(token, expert) pairs the tokens are sorted by expert first so each expert's weights are read
once in a contiguous run. On the CPU, where MLX's gather matmul multiplies row by row, a prefill
with enough rows per expert multiplies each expert's run in one plain matmul instead
(``Experts.by_expert``). Quantised experts multiply through a dequantised copy where MLX's
quantised kernels are slow (``runtime.model.dequantized``): each expert's run of rows on the
CPU, and on CUDA a prefill's gather sorted by expert.

Internal parameter layout (what the model's ``sanitize`` must produce), under the MoE's path::

    gate.weight                      [E, H]     router; nn.Linear (quantisable) for softmax
    gate.bias                        [E]        softmax router with ``router_bias`` (gpt_oss)
    gate.e_score_correction_bias     [E]        sigmoid router only (kept float, as mlx-lm)
    experts.gate_proj.weight         [E, I, H]  (out, in) per expert, as nn.Linear stores it
                                                (none with ``gated=False``: nemotron_h)
    experts.up_proj.weight           [E, I, H]
    experts.down_proj.weight         [E, H, I]
    experts.{gate,up}_proj.bias      [E, I]     with ``expert_bias`` (gpt_oss)
    experts.down_proj.bias           [E, H]
    shared_experts.{gate,up,down}_proj.weight   SwiGLU of width ``shared_hidden`` (ungated: up, down;
                                                ``shared_fused``: input_linear, output_linear)
    fc1_latent_proj.weight [L, H], fc2_latent_proj.weight [H, L]   with ``latent`` (nemotron_h)
    shared_expert.{gate,up,down}_proj.weight    qwen2_moe style instead (``shared_gate=True``)
    shared_expert_gate.weight        [1, H]     qwen2_moe style

Checkpoint layouts that :func:`convert_expert_weights` turns into it (E experts, H hidden,
I expert intermediate; ``P`` is ``experts`` under any prefix, e.g. ``model.layers.3.mlp.experts``;
tf5 = what transformers 5 ``save_pretrained`` writes):

  | layout     | keys                                | shapes            | seen in                 |
  |------------|-------------------------------------|-------------------|-------------------------|
  | per-expert | P.{e}.{gate,up,down}_proj.weight    | [I,H] [I,H] [H,I] | deepseek_v2/v3, glm4_   |
  |            | (+ .scales/.biases when quantised)  |                   | moe_lite, qwen2/3_moe   |
  |            |                                     |                   | hub, and their tf5 save |
  | fused      | P.gate_up_proj, P.down_proj         | [E,2I,H] [E,H,I]  | mistral4 hub + tf5;     |
  | out-major  | (no ``.weight`` suffix)             |                   | qwen3_vl_moe tf5 save   |
  | fused      | P.gate_up_proj, P.down_proj         | [E,H,2I] [E,I,H]  | qwen3_vl_moe hub;       |
  | in-major   | (+ P.gate_up_proj_bias [E,2I],      |                   | gpt_oss bf16 hub + tf5  |
  |            | P.down_proj_bias [E,H]: gpt_oss)    |                   |                         |
  | fused,     | P.up_proj, P.down_proj              | [E,I,H] [E,H,I]   | nemotron_h tf5 (its hub |
  | ungated    | (no ``.weight`` suffix; no gate)    |                   | is per-expert up/down)  |
  | MXFP4      | P.{gate_up,down}_proj_blocks        | [E,2I,H/32,16]    | gpt_oss hub             |
  |            | P.{gate_up,down}_proj_scales        | [E,2I,H/32] and   | (quant_method: mxfp4)   |
  |            | (+ the _bias tensors above)         | [E,H,I/32,16] ... |                         |
  | mlx-lm     | ...switch_mlp.{gate,up,down}_proj.* | [E,I,H] [E,H,I]   | mlx-community, also     |
  |            | (weight, scales, biases)            |                   | quantised               |

Fused ``gate_up_proj`` (its bias and its MXFP4 blocks and scales too) holds gate and up
along its output axis as ``gate_up``, a property of the family: ``halves`` (gate in the first I,
up in the last I: transformers' ``.chunk(2, dim=-1)``) or ``interleaved`` (gate at the even
outputs, up at the odd: gpt_oss's ``[..., ::2]`` / ``[..., 1::2]``). Dense fused tensors are
oriented by ``fused``: ``in_out`` (gpt_oss) takes them as ``[E, in, out]`` whatever the sizes
(gpt_oss has ``H == I``, so no shape can tell); ``by_shape`` tells them apart exactly as
transformers' ``Transpose(1, 2, check_dims=True)`` does: a tensor already shaped ``[E, 2I, H]``
(``[E, H, I]`` for down) is taken as is, anything else is transposed; so when ``H == 2I`` (or
``H == I``) we read the checkpoint as transformers reads it. mistral4 has no transformers
conversion rule, so its HF-format hub checkpoints are already in the fused out-major layout.
FP8 ``*_scale_inv`` tensors must be dequantised before conversion.

MXFP4 (OCP microscaling FP4: E2M1 values in groups of 32 along the input axis, one E8M0 scale
``2**(s - 127)`` per group) is MLX's ``mxfp4`` mode bit for bit: a block's 16 bytes hold 32
values, the low nibble first, which read as four little-endian uint32 are MLX's packed weight;
the scales are MLX's as they are. So the blocks are reinterpreted, never dequantised, and the
loader (``runtime/checkpoint/loading.py: quantization``) makes those experts
``QuantizedExpertLinear`` in ``mxfp4`` mode with group size 32.
"""

from __future__ import annotations

import functools
import itertools
import math
import re
from functools import partial
from typing import NamedTuple

import mlx.core as mx
import numpy as np
from mlx import nn

from mlxc.runtime.model import dequantized
from mlxc.runtime.model.layers import ACTIVATIONS, MLP, STEP_TOKENS, FusedSwiGLU, SwiGLU, glu

PROJS = ("gate_proj", "up_proj", "down_proj")
# On the CPU, pairs per expert (on average) from which one matmul per expert's run of rows beats
# the sorted gather matmul: its cost per expert is fixed, the gather's per row. Measured on the
# bench's small MoE models, crossing over at 10-28 (mistral4, qwen3_moe, gpt_oss).
BY_EXPERT_ROWS = 16
# Tokens a row up to which a MoE block runs compiled (``MoE._compiled_step``): a decode step's
# one, a verification's K + 1, as an attention layer's projections (``layers.STEP_TOKENS``).
COMPILED_TOKENS = STEP_TOKENS


# --- expert linears ------------------------------------------------------------------------


def _add_bias(layer: nn.Module, y: mx.array, indices: mx.array) -> mx.array:
    """``y`` plus each row's expert bias (``bias [E, out]``), if the layer has one."""
    if "bias" not in layer:
        return y
    return y + mx.expand_dims(layer["bias"][indices], -2).astype(y.dtype)


def _add_run_bias(layer: nn.Module, parts: list[mx.array], runs) -> mx.array:
    """The per-expert products of ``by_runs`` joined, each plus its expert's bias, if any."""
    if "bias" in layer:
        parts = [y + layer["bias"][e].astype(y.dtype) for y, (e, _, _) in zip(parts, runs)]
    return mx.concatenate(parts) if len(parts) > 1 else parts[0]


@functools.lru_cache(maxsize=64)
def _rows(batch: tuple[int, ...]) -> mx.array:
    """``gather_mm``'s ``lhs_indices`` for an ``x`` of batch shape ``batch``: each row its own
    (what MLX builds when none is given, with an ``Arange`` kernel per call), made once per
    shape and kept evaluated, so a decode step's expert matmuls launch no index kernels."""
    rows = mx.arange(math.prod(batch), dtype=mx.uint32).reshape(batch)
    mx.eval(rows)
    return rows


def _lhs_indices(x: mx.array, sorted_indices: bool) -> mx.array | None:
    """``lhs_indices`` for a gather matmul of ``x``: None when the rows are sorted by expert,
    because MLX takes its grouped-GEMM path (CUDA, Metal) only when no ``lhs_indices`` are
    given (``GatherMM``'s ``right_sorted`` is ``sorted_indices and lhs_indices is None``);
    passing them made the H200's bf16 MoE prefill ~3.5x slower. Unsorted (decode): ``_rows``."""
    return None if sorted_indices else _rows(x.shape[:-2])


class ExpertLinear(nn.Module):
    """``E`` linears stacked as ``weight [E, out, in]`` (+ ``bias [E, out]``); each row of ``x``
    goes to its expert."""

    def __init__(self, input_dims: int, output_dims: int, num_experts: int, bias: bool = False):
        super().__init__()
        scale = input_dims**-0.5
        self.weight = mx.random.uniform(-scale, scale, (num_experts, output_dims, input_dims))
        if bias:
            self.bias = mx.zeros((num_experts, output_dims))

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        y = _gather_mm(x, self.weight, indices, sorted_indices)
        return _add_bias(self, y, indices)

    def by_runs(self, x: mx.array, runs: list[tuple[int, int, int]]) -> mx.array:
        """``x [R, in]``, its rows grouped by expert: ``runs`` holds ``(expert, start, stop)``;
        one plain matmul per expert (``Experts.by_expert``)."""
        w = self.weight
        parts = [x[a:b] @ w[e].T for e, a, b in runs]
        return _add_run_bias(self, parts, runs)

    def to_quantized(self, group_size: int = 64, bits: int = 4, mode: str = "affine"):
        # nn.quantize calls this for every module that has it (checkpoint/loading.py's predicate).
        return QuantizedExpertLinear.from_dense(self, group_size, bits, mode)


def _gather_mm(x: mx.array, weight: mx.array, indices: mx.array, sorted_indices: bool) -> mx.array:
    """Each row of ``x`` times its expert's ``weight [E, out, in]`` transposed."""
    w = weight.swapaxes(-1, -2)
    lhs = _lhs_indices(x, sorted_indices)
    if x.dtype != mx.float32 and mx.default_device() == mx.cpu:
        # MLX's CPU gather_mm takes float32 only: widen for the product, hand back x's dtype.
        return mx.gather_mm(
            x.astype(mx.float32),
            w.astype(mx.float32),
            lhs_indices=lhs,
            rhs_indices=indices,
            sorted_indices=sorted_indices,
        ).astype(x.dtype)
    return mx.gather_mm(x, w, lhs_indices=lhs, rhs_indices=indices, sorted_indices=sorted_indices)


class ExpertGroup(NamedTuple):
    """Experts ``first .. stop - 1`` of a stack and their rows ``start .. end - 1`` in a gather
    sorted by expert; ``copy``: multiplied through the group's experts dequantised, else
    through MLX's ``gather_qmm`` (``Experts.copy_groups``)."""

    first: int
    stop: int
    start: int
    end: int
    copy: bool


class QuantizedExpertLinear(nn.Module):
    """Quantised :class:`ExpertLinear` (weight/scales/biases as mlx-lm's SwitchLinear saves;
    ``biases`` are affine mode's zero points, ``bias`` the layer's own bias)."""

    def __init__(self, group_size: int, bits: int, mode: str = "affine") -> None:
        super().__init__()
        self.group_size, self.bits, self.mode = group_size, bits, mode

    @classmethod
    def from_dense(cls, dense: ExpertLinear, group_size: int, bits: int, mode: str = "affine"):
        q = cls(group_size, bits, mode)
        q.weight, q.scales, *biases = mx.quantize(dense.weight, group_size, bits, mode=mode)
        if biases:
            q.biases = biases[0]
        if "bias" in dense:
            q.bias = dense.bias
        q.freeze()
        return q

    def __call__(
        self,
        x: mx.array,
        indices: mx.array,
        sorted_indices: bool = False,
        experts: slice | None = None,
    ) -> mx.array:
        """MLX's ``gather_qmm``; ``experts``: over that slice of the stack only (``indices``
        counted from its start, no bias: ``by_groups``)."""
        w, scales, biases = self["weight"], self["scales"], self.get("biases")
        if experts is not None:
            w, scales = w[experts], scales[experts]
            biases = None if biases is None else biases[experts]
        y = mx.gather_qmm(
            x,
            w,
            scales,
            biases,
            lhs_indices=_lhs_indices(x, sorted_indices),
            rhs_indices=indices,
            transpose=True,
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
            sorted_indices=sorted_indices,
        )
        return y if experts is not None else _add_bias(self, y, indices)

    def by_groups(self, x: mx.array, indices: mx.array, groups: list[ExpertGroup]) -> mx.array:
        """A gather of rows sorted by expert (``indices``), group of experts by group
        (``Experts.copy_groups``): a group's experts dequantised to ``x``'s dtype, then MLX's
        ``gather_mm``, the copies alive at once bounded (``dequantized.admit``); or
        ``gather_qmm`` over its slice of the stack."""
        parts: list[mx.array] = []
        for g in groups:
            rows, idx = x, indices
            if (g.start, g.end) != (0, indices.size):
                rows, idx = x[g.start : g.end], indices[g.start : g.end]
            if g.first:
                idx = idx - g.first
            experts = slice(g.first, g.stop)
            if g.copy:
                w = dequantized.weight(self, x.dtype, experts)
                parts.append(dequantized.admit(_gather_mm(rows, w, idx, True)))
            else:
                parts.append(self(rows, idx, True, experts))
        y = parts[0] if len(parts) == 1 else mx.concatenate(parts)
        return _add_bias(self, y, indices)

    def by_runs(self, x: mx.array, runs: list[tuple[int, int, int]]) -> mx.array:
        """As :meth:`ExpertLinear.by_runs`, through ``quantized_matmul``, or for a run of
        several rows on the CPU through the expert dequantised (``dequantized.on_cpu``), each
        expert's copy made after the product before it."""
        biases = self.get("biases")
        parts: list[mx.array] = []
        for e, a, b in runs:
            if dequantized.on_cpu(x[a:b]):
                parts.append(dequantized.product(x[a:b], self, e, parts[-1] if parts else None))
                continue
            parts.append(
                mx.quantized_matmul(
                    x[a:b],
                    self["weight"][e],
                    self["scales"][e],
                    None if biases is None else biases[e],
                    transpose=True,
                    group_size=self.group_size,
                    bits=self.bits,
                    mode=self.mode,
                )
            )
        return _add_run_bias(self, parts, runs)


def clamped_swiglu(gate: mx.array, up: mx.array, alpha: float, limit: float) -> mx.array:
    """gpt_oss's gated activation: gate clamped from above and up both ways at ``limit``, then
    ``(up + 1) * gate * sigmoid(alpha * gate)``."""
    gate = mx.minimum(gate, limit)
    up = mx.clip(up, -limit, limit)
    return (up + 1) * (gate * mx.sigmoid(alpha * gate))


class Experts(nn.Module):
    """``E`` gated experts: ``down(glu(gate(x), up(x)))`` for each (token, chosen expert).

    ``act``: a name of ``layers.ACTIVATIONS`` (``glu = act(gate) * up``: SwiGLU for silu) or
    ``clamped_swiglu`` (gpt_oss, with ``swiglu_alpha`` and ``swiglu_limit``). ``bias``: every
    expert linear has a bias. ``gated=False``: no gate, ``down(act(up(x)))`` (nemotron_h's
    relu2 experts). Loading fuses gate and up into one gather matmul (``layers.fuse``:
    ``gate_up_proj``, ``[E, 2I, H]``).
    """

    fusions = (("gate_up_proj", ("gate_proj", "up_proj")),)  # (fused, its parts)

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        num_experts: int,
        act: str = "silu",
        sort_threshold: int = 64,
        *,
        bias: bool = False,
        swiglu_alpha: float = 1.702,
        swiglu_limit: float = 7.0,
        gated: bool = True,
    ) -> None:
        super().__init__()
        if gated:
            self.gate_proj = ExpertLinear(hidden, intermediate, num_experts, bias)
        self.up_proj = ExpertLinear(hidden, intermediate, num_experts, bias)
        self.gate_up_proj = None  # gate_proj | up_proj, set by layers.fuse
        self.down_proj = ExpertLinear(intermediate, hidden, num_experts, bias)
        if not gated and act not in ACTIVATIONS:
            raise ValueError(f"ungated expert act must be one of {', '.join(ACTIVATIONS)}")
        if not gated:
            self.act = ACTIVATIONS[act]
        elif act == "clamped_swiglu":
            self.glu = partial(clamped_swiglu, alpha=swiglu_alpha, limit=swiglu_limit)
        elif act in ACTIVATIONS:
            self.glu = glu(ACTIVATIONS[act])
        else:
            known = ", ".join([*ACTIVATIONS, "clamped_swiglu"])
            raise ValueError(f"expert act must be one of {known}, got {act!r}")
        # Sorting costs two argsorts and a gather; it pays once the pairs outnumber the experts
        # a few times over (prefill), not for one decode token. 64 is mlx-lm's choice too.
        self.sort_threshold = sort_threshold
        self.num_experts = num_experts

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        """``x [N, H]``, ``indices [N, k]`` -> ``[N, k, H]`` (one output per chosen expert)."""
        indices = mx.stop_gradient(indices)
        if self._by_expert_here(indices.size):
            return self.by_expert(x, indices)
        return self.gathered(x, indices, indices.size >= self.sort_threshold)

    def syncs(self, pairs: int, dtype: mx.Dtype) -> bool:
        """Whether a forward of ``pairs`` (token, expert) pairs in ``dtype`` evaluates part of
        its graph on the way (so cannot be compiled): ``by_expert`` reads the router's choice on
        the host (the CPU); copies of the experts (CUDA, ``copy_groups``) wait for earlier
        ones to be freed, and in several groups read the expert counts."""
        return self._by_expert_here(pairs) or self.experts_per_copy(pairs, dtype) > 0

    def _by_expert_here(self, pairs: int) -> bool:
        """Whether ``pairs`` take ``by_expert``: on the CPU, from ``BY_EXPERT_ROWS`` pairs per
        expert."""
        return (
            mx.default_device() == mx.cpu
            and pairs >= self.sort_threshold
            and pairs >= BY_EXPERT_ROWS * self.num_experts
        )

    def experts_per_copy(self, pairs: int, dtype: mx.Dtype) -> int:
        """How many experts each dequantised copy holds in a gather of ``pairs`` rows sorted by
        expert (``dequantized.experts_per_copy``); 0: none, MLX's ``gather_qmm`` (or experts
        not all quantised)."""
        if not dequantized.copies_experts(pairs, self.num_experts):
            return 0  # first, and cheap: asked by every forward of a MoE block
        linears = [self[name] for name in self._linear_names()]
        if not all(isinstance(linear, QuantizedExpertLinear) for linear in linears):
            return 0
        largest = max(
            dequantized.copy_bytes(linear["weight"].shape, linear.bits, dtype) for linear in linears
        )
        return dequantized.experts_per_copy(self.num_experts, largest)

    def copy_groups(self, indices: mx.array, dtype: mx.Dtype) -> list[ExpertGroup] | None:
        """For a gather whose rows are sorted by expert (``indices [R]``), the groups of
        experts it multiplies through dequantised copies (``experts_per_copy``), or None. One
        group (the whole stack) needs nothing from the host; several are bounded by the rows
        of each expert, counted on the host. A group with fewer than ``EXPERT_ROWS`` pairs per
        expert keeps ``gather_qmm``; a group with none is left out."""
        per = self.experts_per_copy(indices.size, dtype)
        if not per:
            return None
        E = self.num_experts
        if per >= E:
            return [ExpertGroup(0, E, 0, indices.size, True)]
        starts = _expert_starts(indices, E)
        groups = []
        for first in range(0, E, per):
            stop = min(first + per, E)
            start, end = int(starts[first]), int(starts[stop])
            if end > start:
                copy = end - start >= dequantized.EXPERT_ROWS * (stop - first)
                groups.append(ExpertGroup(first, stop, start, end, copy))
        return groups

    def gathered(self, x: mx.array, indices: mx.array, do_sort: bool) -> mx.array:
        """``__call__`` through MLX's gather matmuls, the pairs sorted by expert or not; sorted,
        quantised experts may multiply through dequantised copies (``copy_groups``)."""
        N, k = indices.shape
        H = x.shape[-1]
        # The one-row matrices are made by reshape, not by indexing with None: an inserted axis
        # has a stride MLX's CPU gather_mm reads as a transposed operand (its check_transpose),
        # and OpenBLAS's GEMM on a transposed one-row operand runs 3-5x slower.
        if not do_sort:
            x = x.reshape(N, 1, 1, H)  # broadcasts against indices [N, k]

            def chosen(idx: mx.array) -> mx.array:
                return self._experts(x, lambda linear, rows: linear(rows, idx, False))

            y = dequantized.split_choices(chosen, indices) if self._quantized() else None
            return (chosen(indices) if y is None else y).squeeze(-2)
        flat, order, inverse = _by_expert_order(indices)
        idx = flat[order]  # [N*k]
        x = x[order // k].reshape(N * k, 1, H)
        groups = self.copy_groups(idx, x.dtype)
        if groups is None:
            y = self._experts(x, lambda linear, rows: linear(rows, idx, True))
        else:
            y = self._experts(x, lambda linear, rows: linear.by_groups(rows, idx, groups))
        return y[inverse].reshape(N, k, -1)

    def by_expert(self, x: mx.array, indices: mx.array) -> mx.array:
        """``__call__`` with the (token, expert) pairs sorted by expert and each expert's run
        of rows multiplied in one plain matmul: what a prefill takes on the CPU (from
        ``BY_EXPERT_ROWS`` pairs per expert), where MLX's gather matmul multiplies row by row
        (3-9x the time of the same FLOPs in one GEMM). Reads the expert counts on the host, so
        it evaluates the router first."""
        N, k = indices.shape
        flat, order, inverse = _by_expert_order(indices)
        starts = _expert_starts(flat, self.num_experts)
        runs = [(e, int(a), int(b)) for e, (a, b) in enumerate(itertools.pairwise(starts)) if b > a]
        x = x[order // k]  # [N*k, H], grouped by expert
        y = self._experts(x, lambda linear, rows: linear.by_runs(rows, runs))
        return y[inverse].reshape(N, k, -1)

    def _linear_names(self) -> list[str]:
        """The stacked linears this block holds: gate|up fused or gate and up, or up alone
        (ungated); down."""
        if self.gate_up_proj is not None:
            return ["gate_up_proj", "down_proj"]
        return [name for name in PROJS if name in self]

    def _quantized(self) -> bool:
        return isinstance(self.down_proj, QuantizedExpertLinear)

    def _experts(self, x: mx.array, product) -> mx.array:
        """``down(glu(gate(x), up(x)))`` (ungated: ``down(act(up(x)))``), ``product(linear,
        rows)`` making each expert linear's product, however the rows are laid out."""
        if self.gate_up_proj is not None:
            gate, up = mx.split(product(self.gate_up_proj, x), 2, axis=-1)
            h = self.glu(gate, up)
        elif "gate_proj" in self:
            h = self.glu(product(self.gate_proj, x), product(self.up_proj, x))
        else:
            h = self.act(product(self.up_proj, x))
        return product(self.down_proj, h)


def _expert_starts(indices: mx.array, num_experts: int) -> np.ndarray:
    """Where each expert's rows start once the pairs ``indices`` are sorted by expert, and
    where the last ends (``[E + 1]``): counted on the host, so the router is evaluated."""
    counts = np.bincount(np.asarray(indices).reshape(-1), minlength=num_experts)
    return np.concatenate([[0], np.cumsum(counts)])


def _by_expert_order(indices: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """``indices [N, k]`` flattened, the order that groups its pairs by expert, and the order
    that undoes it."""
    flat = indices.flatten()
    order = mx.argsort(flat)
    return flat, order, mx.argsort(order)


# --- routers -------------------------------------------------------------------------------


class SigmoidRouter(nn.Module):
    """DeepSeek-V3 router parameters: ``weight [E, H]`` and ``e_score_correction_bias [E]``.

    Scores in float32, as transformers computes them (its router weight is float32)."""

    def __init__(self, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.weight = mx.zeros((num_experts, hidden))
        self.e_score_correction_bias = mx.zeros((num_experts,))

    def __call__(self, x: mx.array, weight: mx.array | None = None) -> mx.array:
        """Router logits in float32; ``weight``: ``float32()``'s, where the caller has it."""
        return x.astype(mx.float32) @ (self.float32()[0] if weight is None else weight).T

    def float32(self) -> tuple[mx.array, mx.array]:
        """``weight`` and ``e_score_correction_bias`` in float32, cast once: a cast per step
        would be two kernels a layer on a GPU (bf16 checkpoints). Kept outside the parameter
        tree and keyed on the arrays themselves, so weights loaded later are cast anew."""
        params = self.weight, self.e_score_correction_bias
        cached = self.__dict__.get("_float32")
        if cached is None or any(a is not b for a, b in zip(cached[0], params)):
            # Lazy: the first forward evaluates the casts, later ones reuse them.
            cast = tuple(a.astype(mx.float32) for a in params)
            cached = self.__dict__["_float32"] = (params, cast)
        return cached[1]


def route(
    logits: mx.array,
    top_k: int,
    *,
    scoring: str = "softmax",
    bias: mx.array | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    group_score: str = "top2",
    norm_topk_prob: bool = False,
    routed_scaling_factor: float = 1.0,
) -> tuple[mx.array, mx.array]:
    """Router logits ``[N, E]`` -> (expert indices ``[N, k]``, float32 weights ``[N, k]``).

    ``scoring``: softmax (qwen, mistral4, deepseek_v2) or sigmoid (deepseek_v3, glm4_moe_lite;
    ``bias`` = ``e_score_correction_bias`` shifts the choice only, not the weights).
    ``n_group``/``topk_group``: keep the ``topk_group`` best of ``n_group`` expert groups, a
    group scored by the sum of its two best experts (``top2``: deepseek_v3, mistral4) or by its
    best one (``max``: deepseek_v2 ``group_limited_greedy``).
    """
    scores = logits.astype(mx.float32)
    if scoring == "softmax":
        scores = mx.softmax(scores, axis=-1)
        choice = scores if bias is None else scores + bias.astype(mx.float32)
    elif bias is None:
        scores = choice = mx.sigmoid(scores)
    else:
        scores, choice = _sigmoid_and_biased(scores, bias.astype(mx.float32))
    if n_group > 1 and topk_group < n_group:
        grouped = mx.unflatten(choice, -1, (n_group, -1))  # [N, G, E/G]
        if group_score == "top2":
            gscore = mx.topk(grouped, 2, axis=-1).sum(axis=-1)
        else:
            gscore = grouped.max(axis=-1)
        drop = mx.argpartition(gscore, n_group - topk_group - 1, axis=-1)
        drop = drop[..., : n_group - topk_group, None]  # the worst groups
        # -inf, not 0: sigmoid scores plus a negative bias can be below zero.
        grouped = mx.put_along_axis(grouped, drop, mx.array(-mx.inf, mx.float32), axis=-2)
        choice = mx.flatten(grouped, -2, -1)
    # The k largest, taken from the top of the partition (no negated copy of the scores).
    inds = mx.argpartition(choice, -top_k, axis=-1)[..., -top_k:]
    inds = mx.stop_gradient(inds)
    weights = mx.take_along_axis(scores, inds, axis=-1)
    if norm_topk_prob:
        # softmax weights are positive; sigmoid ones may all be tiny
        eps = 0.0 if scoring == "softmax" else 1e-20
        total = weights.sum(axis=-1, keepdims=True)
        weights = _normalised(eps, routed_scaling_factor)(weights, total)
    elif routed_scaling_factor != 1.0:  # a decode step pays a kernel per operation
        weights = weights * routed_scaling_factor
    return inds, weights


# A decode step pays a kernel launch per operation: the routers' element-wise chains run as
# one compiled kernel each.


@partial(mx.compile, shapeless=True)  # element-wise: one trace whatever the batch size
def _sigmoid_and_biased(logits: mx.array, bias: mx.array) -> tuple[mx.array, mx.array]:
    """Sigmoid scores and the biased scores experts are chosen by, in one kernel."""
    scores = mx.sigmoid(logits)
    return scores, scores + bias


@partial(mx.compile, shapeless=True)
def _weighted_sum(y: mx.array, weights: mx.array) -> mx.array:
    """The chosen experts' outputs ``[N, k, H]`` weighted by ``weights [N, k]`` (float32) and
    summed: the cast and the product one kernel, the sum another."""
    return (y * weights[..., None].astype(y.dtype)).sum(axis=-2)


@functools.lru_cache
def _normalised(eps: float, factor: float):
    """``weights / (total + eps) * factor`` as one kernel."""
    return mx.compile(lambda weights, total: weights / (total + eps) * factor, shapeless=True)


# --- the block -----------------------------------------------------------------------------


class MoE(nn.Module):
    """Routed SwiGLU experts plus optional shared experts; ``[..., H] -> [..., H]``.

    Settings by family (config keys in brackets):
      qwen3_vl_moe: softmax, norm_topk_prob=True (transformers always normalises), no shared.
      qwen2_moe:    softmax, [norm_topk_prob], shared_hidden=[shared_expert_intermediate_size],
                    shared_gate=True.
      mistral4:     softmax, [n_group, topk_group] group_score="top2", [norm_topk_prob],
                    [routed_scaling_factor], shared_hidden=moe_intermediate_size*n_shared_experts.
      deepseek_v2:  softmax, norm_topk_prob=False (transformers ignores the key),
                    [topk_method]="group_limited_greedy" -> n_group/topk_group with
                    group_score="max", [routed_scaling_factor], shared as mistral4.
      deepseek_v3, glm4_moe_lite: scoring="sigmoid", group_score="top2", otherwise as mistral4.
      gpt_oss:      softmax, norm_topk_prob=True (transformers' softmax over the top-k logits is
                    the renormalised top-k of the softmax), router_bias=True, expert_bias=True,
                    act="clamped_swiglu", [swiglu_alpha] (1.702), [swiglu_limit].
      nemotron_h:   scoring="sigmoid", group_score="top2", [n_group, topk_group],
                    [norm_topk_prob], [routed_scaling_factor], act="relu2", gated=False (experts
                    and the shared expert are down(relu2(up(x)))),
                    shared_hidden=[moe_shared_expert_intermediate_size], latent=[moe_latent_size]
                    (the routed experts run in a latent width between fc1_latent_proj and
                    fc2_latent_proj; the shared expert on the input).
      granitemoehybrid: softmax, norm_topk_prob=True (the softmax of the top-k logits),
                    shared_hidden=[shared_intermediate_size], shared_fused=True (its shared
                    MLP's gate and up are one input_linear).
    """

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        num_experts: int,
        top_k: int,
        *,
        scoring: str = "softmax",
        norm_topk_prob: bool = False,
        routed_scaling_factor: float = 1.0,
        n_group: int = 1,
        topk_group: int = 1,
        group_score: str = "top2",
        shared_hidden: int = 0,
        shared_gate: bool = False,
        act: str = "silu",
        sort_threshold: int = 64,
        router_bias: bool = False,
        expert_bias: bool = False,
        swiglu_alpha: float = 1.702,
        swiglu_limit: float = 7.0,
        gated: bool = True,
        latent: int | None = None,
        shared_fused: bool = False,
    ) -> None:
        super().__init__()
        if scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"MoE scoring must be softmax or sigmoid, got {scoring!r}")
        if group_score not in ("top2", "max"):
            raise ValueError(f"MoE group_score must be top2 or max, got {group_score!r}")
        if num_experts % n_group or not 1 <= topk_group <= n_group:
            raise ValueError(f"bad expert groups: {num_experts} experts, {n_group=} {topk_group=}")
        self.top_k = top_k
        self.scoring = scoring
        self.norm_topk_prob = norm_topk_prob
        self.routed_scaling_factor = routed_scaling_factor
        self.n_group, self.topk_group, self.group_score = n_group, topk_group, group_score
        self.shared_gate = shared_gate
        if shared_hidden and act not in ACTIVATIONS:
            raise ValueError(f"shared experts are SwiGLU layers: act {act!r} is not theirs")
        if scoring == "sigmoid" and router_bias:
            raise ValueError("a sigmoid router's bias is its e_score_correction_bias")
        if scoring == "sigmoid":
            self.gate = SigmoidRouter(hidden, num_experts)
        else:
            self.gate = nn.Linear(hidden, num_experts, bias=router_bias)
        if latent is not None:
            self.fc1_latent_proj = nn.Linear(hidden, latent, bias=False)
            self.fc2_latent_proj = nn.Linear(latent, hidden, bias=False)
        self.experts = Experts(
            hidden if latent is None else latent,
            intermediate,
            num_experts,
            act,
            sort_threshold,
            bias=expert_bias,
            swiglu_alpha=swiglu_alpha,
            swiglu_limit=swiglu_limit,
            gated=gated,
        )
        shared = (FusedSwiGLU if shared_fused else SwiGLU) if gated else MLP
        if shared_hidden and shared_gate:
            self.shared_expert = shared(hidden, shared_hidden, act=act)
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)
        elif shared_hidden:
            self.shared_experts = shared(hidden, shared_hidden, act=act)
        # Tensor parallelism (runtime.model.parallel): each rank holds a slice of every
        # expert's width, and the block's output is the sum over this group's ranks.
        self.sharding_group: mx.distributed.Group | None = None

    def __call__(self, x: mx.array) -> mx.array:
        # A sigmoid router's float32 weights go in as arguments: cast once and cached outside
        # the compiled step, which would otherwise cast them in its graph every step.
        router = self.gate.float32() if self.scoring == "sigmoid" else ()
        if x.shape[-2] <= COMPILED_TOKENS and self.sharding_group is None:
            tokens = math.prod(x.shape[:-1])
            if not self.experts.syncs(tokens * self.top_k, x.dtype):
                return self._compiled_step()(x, *router)
        return self._forward(x, *router)

    def _compiled_step(self):
        """``_forward`` compiled, for inputs of a few tokens a row (``COMPILED_TOKENS``: a
        decode step, a speculative verification of K + 1, a batch of them). Such a forward is
        bound by the host (``docs/performance.md``): replayed from its trace, the block's graph
        costs C++ time instead of Python's, and its element-wise runs fuse (on an H200,
        glm4_moe_lite's decode step 9.3 -> 8.4 ms). The weights are inputs of the trace
        (``inputs=self``), so weights loaded later are used; a trace per shape, so per batch
        size and token count: a decode or verification's shapes are few, a prompt's lengths
        (past COMPILED_TOKENS) are not."""
        step = self.__dict__.get("_step")
        if step is None:
            step = self.__dict__["_step"] = mx.compile(self._forward, inputs=self)
        return step

    def _forward(self, x: mx.array, *router: mx.array) -> mx.array:
        """``router``: the sigmoid router's float32 weight and bias; none for softmax."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        inds, weights = route(
            self.gate(x, *router[:1]),
            self.top_k,
            scoring=self.scoring,
            bias=router[1] if router else None,
            n_group=self.n_group,
            topk_group=self.topk_group,
            group_score=self.group_score,
            norm_topk_prob=self.norm_topk_prob,
            routed_scaling_factor=self.routed_scaling_factor,
        )
        routed = self.fc1_latent_proj(x) if "fc1_latent_proj" in self else x
        y = _weighted_sum(self.experts(routed, inds), weights)  # [N, k, H] -> [N, H]
        if "fc2_latent_proj" in self:
            y = self.fc2_latent_proj(y)
        if "shared_experts" in self:
            y = y + self.shared_experts(x)
        elif "shared_expert" in self:
            y = y + mx.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        if self.sharding_group is not None:  # one all-reduce for routed and shared experts
            y = mx.distributed.all_sum(y, group=self.sharding_group)
        return y.reshape(shape)


# --- checkpoint conversion -----------------------------------------------------------------

_PER_EXPERT = re.compile(
    r"^((?:.*\.)?experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|scales|biases|bias)$"
)
_FUSED = re.compile(
    r"^((?:.*\.)?experts)\.(gate_up_proj|up_proj|down_proj)(|_bias|_blocks|_scales)$"
)  # up_proj: ungated experts (nemotron_h), fused by transformers 5
_SWITCH = re.compile(
    r"^((?:.*\.)?)switch_mlp\.(gate_proj|up_proj|down_proj)\.(weight|scales|biases|bias)$"
)
GATE_UP = ("halves", "interleaved")
FUSED = ("by_shape", "in_out")
MXFP4_GROUP = 32  # values per E8M0 scale, 16 bytes per block


def convert_expert_weights(
    weights: dict[str, mx.array],
    *,
    hidden: int,
    intermediate: int,
    num_experts: int,
    gate_up: str = "halves",
    fused: str = "by_shape",
) -> dict[str, mx.array]:
    """Rewrite every expert tensor in ``weights`` into the internal stacked layout.

    Pure: returns a new dict; tensors that are not expert weights pass through unchanged.
    Raises ValueError on a shape that fits no layout or an incomplete per-expert set.
    See the module docstring for the layouts, ``gate_up`` and ``fused``.
    """
    if gate_up not in GATE_UP or fused not in FUSED:
        raise ValueError(f"gate_up must be one of {GATE_UP}, fused one of {FUSED}")
    E, H, I = num_experts, hidden, intermediate
    out: dict[str, mx.array] = {}
    per_expert: dict[tuple[str, str, str], dict[int, mx.array]] = {}
    for name, w in weights.items():
        if m := _PER_EXPERT.match(name):
            prefix, e, proj, kind = m.groups()
            per_expert.setdefault((prefix, proj, kind), {})[int(e)] = w
        elif m := _SWITCH.match(name):
            out[f"{m[1]}experts.{m[2]}.{m[3]}"] = w
        elif m := _FUSED.match(name):
            prefix, proj, part = m.groups()
            outs, ins = {"gate_up_proj": (2 * I, H), "up_proj": (I, H), "down_proj": (H, I)}[proj]
            if part == "":
                w = _as_out_in(name, w, (E, outs, ins), fused == "in_out")
            elif part == "_bias":
                w = _expect(name, w, (E, outs))
            elif part == "_blocks":
                # 16 bytes = 32 nibbles, low first = 4 little-endian uint32 of MLX's packing.
                w = _expect(name, w, (E, outs, ins // MXFP4_GROUP, MXFP4_GROUP // 2), ins)
                w = w.view(mx.uint32).flatten(-2)
            else:
                w = _expect(name, w, (E, outs, ins // MXFP4_GROUP), ins)
            kind = {"": "weight", "_bias": "bias", "_blocks": "weight", "_scales": "scales"}[part]
            if proj == "gate_up_proj":
                gate, up = _split_gate_up(w, gate_up)
                out[f"{prefix}.gate_proj.{kind}"] = gate
                out[f"{prefix}.up_proj.{kind}"] = up
            else:
                out[f"{prefix}.{proj}.{kind}"] = w
        else:
            out[name] = w
    for (prefix, proj, kind), by_expert in per_expert.items():
        if sorted(by_expert) != list(range(E)):
            missing = sorted(set(range(E)) - set(by_expert))
            raise ValueError(f"{prefix}.*.{proj}.{kind}: experts {missing} missing of {E}")
        out[f"{prefix}.{proj}.{kind}"] = mx.stack([by_expert[e] for e in range(E)])
    return out


def _split_gate_up(w: mx.array, gate_up: str) -> tuple[mx.array, mx.array]:
    """(gate, up) of a fused ``[E, 2I, ...]`` tensor, split along its output axis."""
    if gate_up == "halves":
        half = w.shape[1] // 2
        return w[:, :half], w[:, half:]
    # Contiguous copies: a strided view would be copied again by every matmul.
    return mx.contiguous(w[:, 0::2]), mx.contiguous(w[:, 1::2])


def _expect(name: str, w: mx.array, shape: tuple[int, ...], ins: int | None = None) -> mx.array:
    """``w`` if it has ``shape``; ``ins``: the input width of MXFP4 bytes (uint8)."""
    if ins is not None and ins % MXFP4_GROUP:
        raise ValueError(f"{name}: MXFP4 needs an input width divisible by 32, not {ins}")
    if ins is not None and w.dtype != mx.uint8:
        raise ValueError(f"{name}: MXFP4 blocks and scales are uint8, not {w.dtype}")
    if tuple(w.shape) != shape:
        raise ValueError(f"{name}: shape {tuple(w.shape)}, expected {shape}")
    return w


def _as_out_in(
    name: str, w: mx.array, target: tuple[int, int, int], in_out: bool = False
) -> mx.array:
    """``w`` as ``target`` (E, out, in): transposed from (E, in, out) when ``in_out``; else kept
    if already so and transposed otherwise, as transformers. A transpose is copied out, not
    left a view: a weight stored (E, in, out) sends MLX's CPU gather matmul down OpenBLAS's
    slower GEMM orientation (gpt_oss's experts took 1.3x as long in a prefill)."""
    transposed = (target[0], target[2], target[1])
    if tuple(w.shape) == target and not in_out:
        return w
    if tuple(w.shape) == transposed:
        return mx.contiguous(w.swapaxes(1, 2))
    if in_out:
        raise ValueError(f"{name}: shape {tuple(w.shape)}, expected [E, in, out] {transposed}")
    raise ValueError(f"{name}: shape {tuple(w.shape)} fits neither {target} nor its transpose")
