"""Prototype: a fixed-capacity KV cache and an ``mx.compile``-d decode step, measured.

    python -m bench.proto_compiled_decode [--device cpu|gpu] [--shapes small,heavy]

Decode is bound by host-side per-op overhead (Python builds ~25 MLX ops per layer per token).
``mx.compile`` of the whole step replaces that with one cached tape replay, but needs inputs
whose shapes do not change per token. ``runtime.cache.KVCache`` returns ``keys[..., :live, :]``
(a new width every token), so this prototype, outside the product code, uses instead:

* per-layer K/V buffers ``[B, H, capacity, D]``, written with
  ``mx.slice_update(buf, new, start_indices=pos_array, axes=(2,))`` (a dynamic start index:
  no retrace as the position moves);
* attention over the whole capacity with the boolean mask ``arange(capacity) <= position``
  (sized from the width of the keys the buffer returns, so ``layers.attend``'s check holds);
* RoPE via ``mx.fast.rope(..., offset=pos_array)``;
* the whole step (embedding, layers, norm, lm_head, argmax) under ``mx.compile``, the buffers
  passed in and returned (functional), or captured with ``inputs=/outputs=``.

It reuses the generated qwen3 model's modules (projections, norms, RoPE, MLP), so the math is
the model's; correctness is checked against ``runtime.generate.generate_tokens`` (tokens equal,
logits within a tolerance), then decode tokens/s are measured for: ``generate_tokens``, the
fixed-capacity step uncompiled, compiled (functional), compiled with state capture, and
``shapeless=True`` compiled (reported as failing if MLX refuses it). Every loop pipelines with
``mx.async_eval`` the way ``generate_tokens`` does. Also: the (re)compile cost, and the cost of
growing the capacity (a new trace per capacity).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
)
SHAPES = {
    # host-overhead-bound: tiny matmuls, many layers
    "small": dict(zip(KEYS, (256, 28, 8, 2, 64, 768, 4096), strict=True)),
    # heavier matmuls, few layers
    "heavy": dict(zip(KEYS, (1024, 8, 16, 8, 64, 3072, 32768), strict=True)),
    # Qwen3-1.7B's shape (for the GPU: ~2B parameters)
    "qwen3-1.7b": dict(zip(KEYS, (2048, 28, 16, 8, 128, 6144, 151936), strict=True)),
}


def config(shape: str) -> dict:
    return dict(
        SHAPES[shape],
        model_type="qwen3",
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
        max_position_embeddings=40960,
    )


# ---------------------------------------------------------------------------------------------
# The fixed-capacity step


class FixedStep:
    """A decode/prefill step over fixed-capacity K/V buffers, built from a generated qwen3 model.

    ``forward(tokens [B, L], pos int32 scalar array, key_pos [capacity], *buffers)`` ->
    ``(next_ids [B], logits [B, V], *new_buffers)``; ``buffers`` is ``k0, v0, k1, v1, ...``;
    ``key_pos`` is ``arange(capacity)``, passed in (not built inside) so that a shapeless trace
    would not bake the capacity in.
    ``traces`` counts how often the Python body ran (under ``mx.compile``: traces).
    """

    def __init__(self, model) -> None:
        self.model = model
        self.traces = 0

    def forward(self, tokens, pos, key_pos, *buffers):
        import mlx.core as mx

        from mlxc.runtime.layers import attend

        self.traces += 1
        m = self.model
        B, L = tokens.shape
        # live-window mask sized from the keys the buffers return: [L, capacity]
        q_pos = pos + mx.arange(L, dtype=mx.int32)
        mask = key_pos[None, :] <= q_pos[:, None]
        start = pos.reshape(1)
        h = m.model.embed_tokens(tokens)
        new = []
        for i, layer in enumerate(m.model.layers):
            a = layer.self_attn
            x = layer.input_layernorm(h)
            q = a.q_proj(x).reshape(B, L, a.n_heads, a.head_dim)
            k = a.k_proj(x).reshape(B, L, a.n_kv_heads, a.head_dim)
            v = a.v_proj(x).reshape(B, L, a.n_kv_heads, a.head_dim)
            q = a.q_norm(q).transpose(0, 2, 1, 3)
            k = a.k_norm(k).transpose(0, 2, 1, 3)
            v = v.transpose(0, 2, 1, 3)
            q = a.rope(q, offset=pos)  # runtime RoPE passes the array offset to mx.fast.rope
            k = a.rope(k, offset=pos)
            kb = mx.slice_update(buffers[2 * i], k, start_indices=start, axes=(2,))
            vb = mx.slice_update(buffers[2 * i + 1], v, start_indices=start, axes=(2,))
            new += [kb, vb]
            out = attend(q, kb, vb, scale=a.scale, mask=mask)
            h = h + a.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        if L > 1:
            h = h[:, -1:, :]
        h = m.model.norm(h)
        h = h.reshape(B, -1)
        if m.args.tie_word_embeddings:
            logits = m.model.embed_tokens.as_linear(h)
        else:
            logits = m.lm_head(h)
        return (mx.argmax(logits, axis=-1).astype(mx.int32), logits, *new)


def empty_buffers(model, capacity: int, dtype, batch: int = 1) -> list:
    import mlx.core as mx

    a = model.model.layers[0].self_attn
    shape = (batch, a.n_kv_heads, capacity, a.head_dim)
    return [mx.zeros(shape, dtype) for _ in range(2 * len(model.model.layers))]


def key_positions(buffers: list):
    import mlx.core as mx

    return mx.arange(buffers[0].shape[2], dtype=mx.int32)


def grow(buffers: list, capacity: int) -> list:
    """Buffers with ``capacity`` slots holding the old contents (a new shape: a new trace)."""
    import mlx.core as mx

    out = []
    for b in buffers:
        B, H, C, D = b.shape
        out.append(mx.concatenate([b, mx.zeros((B, H, capacity - C, D), b.dtype)], axis=2))
    return out


class StatefulStep:
    """The same step compiled with ``inputs=/outputs=`` state capture (buffers not passed)."""

    def __init__(self, fixed: FixedStep) -> None:
        import mlx.core as mx

        self.state: list = []  # the buffers; the compiled function replaces them in place

        def step(tokens, pos, key_pos):
            y, logits, *new = fixed.forward(tokens, pos, key_pos, *self.state)
            self.state[:] = new
            return y, logits

        self.fn = mx.compile(step, inputs=self.state, outputs=self.state)

    def reset(self, buffers: list) -> StatefulStep:
        self.state[:] = buffers
        self.key_pos = key_positions(buffers)
        return self

    def __call__(self, tokens, pos):
        return self.fn(tokens, pos, self.key_pos)


# ---------------------------------------------------------------------------------------------
# Loops


def decode_fixed(call, first_y, start_pos: int, n: int, record: list | None = None):
    """Decode ``n`` tokens pipelined like ``generate_tokens``: yields (token, t_after_item).

    ``call(ids [1,1], pos) -> (y [1], logits)``; the first ``y`` is given (from the prefill).
    """
    import mlx.core as mx

    y = first_y
    pos = start_pos
    for i in range(n):
        if i + 1 < n:
            ny, nl = call(y[:, None], mx.array(pos, dtype=mx.int32))
            pos += 1
            if record is not None:
                record.append(nl)
            mx.async_eval(ny)
        token = y.item()
        yield token, time.perf_counter()
        if i + 1 < n:
            y = ny


def functional(fn):
    """factory(buffers) -> call(ids, pos) -> (y, logits), threading the buffers through ``fn``."""

    def factory(buffers):
        state = {"b": list(buffers), "k": key_positions(buffers)}

        def call(ids, pos):
            y, logits, *new = fn(ids, pos, state["k"], *state["b"])
            state["b"] = new  # drop the old buffers: slice_update then updates in place
            return y, logits

        return call

    return factory


def build_callers(model) -> dict:
    """name -> (factory(buffers holding the prompt) -> call(ids, pos) -> (y, logits), its
    FixedStep, whose ``traces`` counts the Python body's runs)."""
    import mlx.core as mx

    f = [FixedStep(model) for _ in range(4)]
    return {
        "fixed, eager": (functional(f[0].forward), f[0]),
        "fixed, compiled": (functional(mx.compile(f[1].forward)), f[1]),
        "fixed, compiled state-capture": (StatefulStep(f[2]).reset, f[2]),
        "fixed, compiled shapeless": (functional(mx.compile(f[3].forward, shapeless=True)), f[3]),
    }


def graph_nodes(arrays) -> int:
    """Primitives in the (unevaluated) graph of ``arrays``, via ``mx.export_to_dot``."""
    import io

    import mlx.core as mx

    buf = io.StringIO()
    mx.export_to_dot(buf, *arrays)
    return buf.getvalue().count("shape=rectangle")


def prefill_fixed(model, prompt_ids: list[int], capacity: int, dtype):
    """Prefill through the fixed-capacity step, eager: (first y, first logits, buffers)."""
    import mlx.core as mx

    buffers = empty_buffers(model, capacity, dtype)
    y, logits, *buffers = FixedStep(model).forward(
        mx.array([prompt_ids], dtype=mx.int32),
        mx.array(0, dtype=mx.int32),
        key_positions(buffers),
        *buffers,
    )
    mx.eval(y, logits, buffers)
    return y, logits, buffers


def run_generate_tokens(model, prompt_ids, n, record=None):
    import mlx.core as mx

    from mlxc.runtime.generate import generate_tokens

    def sampler(logits):
        if record is not None:
            record.append(logits)
        return mx.argmax(logits, axis=-1)

    times, tokens = [], []
    for tok in generate_tokens(model, prompt_ids, max_tokens=n, sampler=sampler):
        times.append(time.perf_counter())
        tokens.append(tok)
    return tokens, times


def tok_per_s(times: list[float]) -> float:
    # decode rate after the first token (as bench.run reports decode)
    return (len(times) - 1) / (times[-1] - times[0])


# ---------------------------------------------------------------------------------------------


def check_correctness(model, prompt_ids, capacity, dtype, n, tol):
    import mlx.core as mx

    ref_logits: list = []
    ref_tokens, _ = run_generate_tokens(model, prompt_ids, n, ref_logits)
    mx.eval(ref_logits)
    rows = []
    for name, (factory, _) in build_callers(model).items():
        try:
            y, l0, buffers = prefill_fixed(model, prompt_ids, capacity, dtype)
            logits = [l0]  # the prefill's, then one per decode step
            toks = [t for t, _ in decode_fixed(factory(buffers), y, len(prompt_ids), n, logits)]
            mx.eval(logits)
            diff = max(
                mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item()
                for a, b in zip(logits, ref_logits, strict=True)
            )
            ok = toks == ref_tokens and diff <= tol
            equal = sum(a == b for a, b in zip(toks, ref_tokens))
            rows.append((name, "ok" if ok else "MISMATCH", f"{equal}/{n}", f"{diff:.2e}"))
        except Exception as e:  # noqa: BLE001 - report the variant as failing
            rows.append((name, f"error: {type(e).__name__}: {str(e)[:80]}", "-", "-"))
    return rows


def measure(model, callers, capacity, dtype, prompt_ids, n, repeats):
    """name -> (median decode tok/s, median host ms per step call (pipelined), traces over
    ``repeats + 1`` runs) or (None, error, "-")."""
    results = {}
    rates = []
    for _ in range(repeats):
        _, times = run_generate_tokens(model, prompt_ids, n)
        rates.append(tok_per_s(times))
    results["generate_tokens (growing KVCache)"] = (statistics.median(rates), None, "-")
    for name, (factory, fixed) in callers.items():
        try:
            rates, host = [], []
            traces = fixed.traces
            for r in range(repeats + 1):  # the first run warms the trace
                y, _, buffers = prefill_fixed(model, prompt_ids, capacity, dtype)
                call = factory(buffers)

                def timed(ids, pos, call=call, host=host):
                    t0 = time.perf_counter()
                    out = call(ids, pos)
                    host.append(time.perf_counter() - t0)
                    return out

                times = [t for _, t in decode_fixed(timed, y, len(prompt_ids), n)]
                if r:
                    rates.append(tok_per_s(times))
                else:
                    host.clear()
            results[name] = (
                statistics.median(rates),
                1e3 * statistics.median(host),
                fixed.traces - traces,
            )
        except Exception as e:  # noqa: BLE001
            results[name] = (None, f"{type(e).__name__}: {str(e)[:80]}", "-")
    return results


def sync_split(model, callers, capacity, dtype, prompt_ids, steps=24, warmup=4):
    """Unpipelined steps, per path: median ms to build the step's graph (host) and to evaluate
    it, the build ms "hot" (steps built back to back with no eval between: on a CPU an eval
    evicts the host's caches and slows the next build), and the graph's primitives."""
    import mlx.core as mx

    def run(step, y, hot_build=True):
        build, ev = [], []
        for i in range(warmup + steps):
            t0 = time.perf_counter()
            y = step(y, len(prompt_ids) + i)
            t1 = time.perf_counter()
            if i == 0:
                nodes = graph_nodes([y])
            mx.eval(y)
            t2 = time.perf_counter()
            if i >= warmup:
                build.append(t1 - t0)
                ev.append(t2 - t1)
        # built back to back: the graph chains up unevaluated and is dropped afterwards
        hot = [] if hot_build else [float("nan")]
        for i in range(steps if hot_build else 0):
            t0 = time.perf_counter()
            y = step(y, len(prompt_ids) + warmup + steps + i)
            hot.append(time.perf_counter() - t0)
        return (*(1e3 * statistics.median(t) for t in (build, ev, hot)), nodes)

    def product_step():
        cache = model.make_cache()
        logits = model(mx.array([prompt_ids], dtype=mx.int32), cache=cache, last_only=True)
        y = mx.argmax(logits[:, -1, :], axis=-1)
        mx.eval(y)

        def step(y, _):
            return mx.argmax(model(y[:, None], cache=cache, last_only=True)[:, -1, :], -1)

        return step, y

    def fixed_step(name):
        y, _, buffers = prefill_fixed(model, prompt_ids, capacity, dtype)
        call = callers[name][0](buffers)
        return (lambda y, pos: call(y[:, None], mx.array(pos, mx.int32))[0]), y

    # no hot build here: KVCache's slice assignments into lazy buffers are not comparable
    rows = {"generate_tokens' step (model + KVCache)": run(*product_step(), hot_build=False)}
    for name in ("fixed, eager", "fixed, compiled"):
        rows[name] = run(*fixed_step(name))
    return rows


def compile_costs(model, capacity, dtype, prompt_ids, doublings=3):
    """Trace + compile cost of the first call at a capacity, against the steady step, for the
    starting capacity, ``doublings`` growths (each a new input shape, so one new trace), then a
    return to the starting capacity (already traced: no new trace). Rows for ``table``."""
    import mlx.core as mx

    fixed = FixedStep(model)
    fn = mx.compile(fixed.forward)
    y, _, buffers = prefill_fixed(model, prompt_ids, capacity, dtype)
    state = {"pos": len(prompt_ids), "y": y, "b": buffers, "k": key_positions(buffers)}

    def one():
        t0 = time.perf_counter()
        y, _, *b = fn(
            state["y"][:, None], mx.array(state["pos"], mx.int32), state["k"], *state["b"]
        )
        t1 = time.perf_counter()
        mx.eval(y, b)
        state.update(y=y, b=b, pos=state["pos"] + 1)
        return 1e3 * (t1 - t0), 1e3 * (time.perf_counter() - t1)

    def resize(cap):
        t0 = time.perf_counter()
        if cap > state["b"][0].shape[2]:
            state["b"] = grow(state["b"], cap)
        else:
            state["b"] = [b[:, :, :cap, :] for b in state["b"]]
        state["k"] = key_positions(state["b"])
        mx.eval(state["b"], state["k"])
        return 1e3 * (time.perf_counter() - t0)

    def row(label, copy_ms):
        traces = fixed.traces
        first_build, first_eval = one()
        rest = [one() for _ in range(10)]
        build = statistics.median(b for b, _ in rest)
        ev = statistics.median(e for _, e in rest)
        return (
            label,
            copy_ms,
            f"{first_build:.1f}",
            f"{first_eval:.1f}",
            f"{build:.2f}",
            f"{ev:.2f}",
            fixed.traces - traces,
        )

    rows = [row(f"start at {capacity}", "-")]
    cap = capacity
    for _ in range(doublings):
        cap *= 2
        rows.append(row(f"grow to {cap}", f"{resize(cap):.1f}"))
    rows.append(row(f"back to {capacity} (traced before)", f"{resize(capacity):.1f}"))
    return rows


def capacity_sweep(model, prompt_ids, capacities, dtype, n):
    """Compiled decode tok/s (pipelined) with the same live length at growing capacities."""
    import mlx.core as mx

    fn = functional(mx.compile(FixedStep(model).forward))
    out = []
    for cap in capacities:
        rates = []
        for r in range(2):
            y, _, buffers = prefill_fixed(model, prompt_ids, cap, dtype)
            times = [t for _, t in decode_fixed(fn(buffers), y, len(prompt_ids), n)]
            if r:
                rates.append(tok_per_s(times))
        out.append((str(cap), f"{statistics.median(rates):.1f}"))
    return out


def table(headers, rows):
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]

    def line(r):
        return "| " + " | ".join(str(x).ljust(w) for x, w in zip(r, widths)) + " |"

    return "\n".join(
        [line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
        + [line(r) for r in rows]
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.proto_compiled_decode")
    p.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    p.add_argument(
        "--shapes",
        default=None,
        help=f"comma list of {sorted(SHAPES)} (default: small,heavy on cpu, "
        "plus qwen3-1.7b on gpu)",
    )
    p.add_argument("--dtype", default=None, help="float32 (cpu default) or bfloat16 (gpu default)")
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--tokens", type=int, default=64, help="tokens decoded per measured run")
    p.add_argument("--capacity", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    from mlxc.runtime import blas

    st = blas.preload(args.device)
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlxc.generated import qwen3

    mx.set_default_device(mx.gpu if args.device == "gpu" else mx.cpu)
    dtype = getattr(mx, args.dtype or ("float32" if args.device == "cpu" else "bfloat16"))
    shapes = (
        args.shapes or ("small,heavy" if args.device == "cpu" else "small,heavy,qwen3-1.7b")
    ).split(",")
    tol = 1e-4 if dtype == mx.float32 else 5e-2
    if args.prompt + args.tokens > args.capacity:
        sys.exit("--capacity must hold --prompt + --tokens")
    print(f"device={args.device} dtype={dtype} blas: {st.reason}", file=sys.stderr)

    for shape in shapes:
        mx.random.seed(args.seed)
        cfg = config(shape)
        model = qwen3.Model(qwen3.ModelArgs.from_config(cfg))
        model.set_dtype(dtype)
        mx.eval(model.parameters())
        n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
        prompt_ids = mx.random.randint(0, cfg["vocab_size"], (args.prompt,)).tolist()
        print(
            f"\n## {shape}: hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers, "
            f"heads {cfg['num_attention_heads']}/{cfg['num_key_value_heads']}x"
            f"{cfg['head_dim']}, vocab {cfg['vocab_size']}, {n_params / 1e6:.1f}M params, "
            f"{dtype}; capacity {args.capacity}, prompt {args.prompt}, {args.tokens} tokens"
        )

        rows = check_correctness(model, prompt_ids, args.capacity, dtype, args.tokens, tol)
        print(
            f"\ncorrectness vs generate_tokens (greedy tokens equal, max |logit diff| <= {tol}"
            f" over the prefill's and every decode step's logits):"
        )
        print(table(["variant", "result", "tokens equal", "max |logit diff|"], rows))

        callers = build_callers(model)
        res = measure(model, callers, args.capacity, dtype, prompt_ids, args.tokens, args.repeats)
        base = res["generate_tokens (growing KVCache)"][0]
        out = []
        for name, (rate, host, traces) in res.items():
            if rate is None:
                out.append((name, "failed", "-", host, traces))
            else:
                out.append(
                    (
                        name,
                        f"{rate:.1f}",
                        f"{rate / base:.2f}x",
                        "-" if host is None else f"{host:.3f}",
                        traces,
                    )
                )
        print(
            f"\ndecode, async_eval pipelined (median of {args.repeats}; traces = Python body "
            f"runs over {args.repeats + 1} runs x {args.tokens - 1} steps):"
        )
        print(
            table(["path", "tok/s", "vs generate_tokens", "host ms per step call", "traces"], out)
        )

        split = sync_split(model, callers, args.capacity, dtype, prompt_ids)
        print("\none step unpipelined (build the graph, then mx.eval it), medians:")
        print(
            table(
                ["path", "build ms (host)", "eval ms", "total ms", "build ms, hot", "graph nodes"],
                [
                    (
                        k,
                        f"{b:.3f}",
                        f"{e:.3f}",
                        f"{b + e:.3f}",
                        "-" if math.isnan(h) else f"{h:.3f}",
                        n,
                    )
                    for k, (b, e, h, n) in split.items()
                ],
            )
        )

        print(
            "\ncompile cost and capacity growth (compiled, functional, unpipelined; first "
            "call's build = trace + compile):"
        )
        print(
            table(
                [
                    "capacity",
                    "resize ms",
                    "1st build ms",
                    "1st eval ms",
                    "steady build ms",
                    "steady eval ms",
                    "new traces",
                ],
                compile_costs(model, args.capacity, dtype, prompt_ids),
            )
        )

        caps = [args.capacity * f for f in (1, 4, 16)]
        print("\ncompiled decode tok/s vs capacity (same live length; attention reads it all):")
        print(
            table(
                ["capacity", "tok/s"], capacity_sweep(model, prompt_ids, caps, dtype, args.tokens)
            )
        )


if __name__ == "__main__":
    main()
