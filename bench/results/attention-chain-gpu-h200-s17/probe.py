"""Probe: mlxc's CUDA attention kernel in a 16-layer chain (as one decode step calls it):
host build time vs evaluated step time, against MLX's own kernels."""

import functools
import statistics
import sys
import time

import mlx.core as mx

from mlxc.runtime.model import cuda_attention as ca

sys.path.insert(0, "scratch")
import ca_old

LAYERS = 16


def case(B, L, T, ragged):
    q0 = mx.random.normal((B, 32, L, 64)).astype(mx.bfloat16)
    ks = [mx.random.normal((B, 8, T, 64)).astype(mx.bfloat16) for _ in range(LAYERS)]
    vs = [mx.random.normal((B, 8, T, 64)).astype(mx.bfloat16) for _ in range(LAYERS)]
    lens = mx.array([T - (b * 7) % 64 for b in range(B)]) if ragged else mx.full((B,), T)
    mask = (mx.arange(T)[None, :] >= (T - lens)[:, None])[:, None, None, :]
    if L > 1:
        causal = mx.arange(T)[None, :] <= (T - L + mx.arange(L))[:, None]
        mask = mask & causal[None, None]
    mx.eval(q0, ks, vs, mask)
    variants = {
        "mlx sdpa no mask": lambda q, k, v: mx.fast.scaled_dot_product_attention(
            q, k, v, scale=0.125
        ),
        "mlx sdpa mask": lambda q, k, v: mx.fast.scaled_dot_product_attention(
            q, k, v, scale=0.125, mask=mask
        ),
        "mlxc new auto": lambda q, k, v: ca.attention(q, k, v, scale=0.125, mask=mask),
        "mlxc old auto": lambda q, k, v: ca_old.attention(q, k, v, scale=0.125, mask=mask),
    }
    for c in (1, 4, 16):
        variants[f"mlxc chunks={c}"] = functools.partial(
            ca.attention, scale=0.125, mask=mask, chunks=c
        )
    res = {n: ([], []) for n in variants}
    for rep in range(12):
        for n, f in variants.items():
            t0 = time.perf_counter()
            q = q0
            for l in range(LAYERS):
                q = f(q, ks[l], vs[l])
            t1 = time.perf_counter()
            mx.eval(q)
            t2 = time.perf_counter()
            if rep >= 2:
                res[n][0].append((t1 - t0) * 1e6)
                res[n][1].append((t2 - t0) * 1e6)
    print(f"B={B} L={L} T={T} ragged={ragged}: per step of {LAYERS} calls, us (build / build+eval)")
    for n, (b, e) in res.items():
        print(
            f"  {n:18s} {statistics.median(b):8.1f} {statistics.median(e):8.1f}  per call {statistics.median(e) / LAYERS:6.1f}"
        )
    sys.stdout.flush()


for args in [
    (1, 1, 640, False),
    (1, 4, 640, False),
    (16, 1, 640, True),
    (64, 1, 512, True),
    (64, 1, 1024, True),
]:
    case(*args)
