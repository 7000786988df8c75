"""What a row joining or leaving costs the server's decode batch, against one decode step's
cache write::

    python -m bench.batch_churn

A 64-row ``BatchKVCache`` per layer (16 layers, 8 KV heads of 64, bf16: the medium llama's
KV) at two widths. Three timings, each evaluated: appending one column to every row (what a
decode step writes), a row leaving (``keep_rows``: a gather of every other row), and a row of
130 tokens joining (``extend``: every row copied into a wider buffer). In a server whose
requests end and arrive every few steps, the last two happen about as often as the first.
"""

from __future__ import annotations  # noqa: I001  (mlxc before MLX: it loads a BLAS first)

import statistics
import time

from mlxc.runtime.model.batch import BatchKVCache
from mlxc.runtime.model.cache import KVCache

import mlx.core as mx

LAYERS, ROWS, HEADS, HEAD_DIM, JOINING = 16, 64, 8, 64, 130


def _kv(rows: int, columns: int) -> mx.array:
    return mx.random.normal((rows, HEADS, columns, HEAD_DIM)).astype(mx.bfloat16)


def _evaluated(layers: list) -> None:
    mx.eval([a for c in layers for a in c.arrays()])


def _batch(width: int) -> list[BatchKVCache]:
    layers = []
    for _ in range(LAYERS):
        cache = BatchKVCache()
        cache.start_rows([width] * ROWS)
        cache.update_and_fetch(_kv(ROWS, width), _kv(ROWS, width))
        layers.append(cache)
    _evaluated(layers)
    return layers


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(width: int, repeats: int = 10) -> dict:
    """Median milliseconds of each operation on a batch ``width`` columns wide."""
    layers = _batch(width)

    def append():
        mx.eval([c.update_and_fetch(_kv(ROWS, 1), _kv(ROWS, 1)) for c in layers])

    def leave():
        for c in layers:
            c.keep_rows(list(range(1, ROWS)))
        _evaluated(layers)

    append_ms, leave_ms, join_ms = [], [], []
    for _ in range(repeats):
        append_ms.append(_timed(append))
        leave_ms.append(_timed(leave))
        joining = []
        for _ in layers:
            single = KVCache()
            single.update_and_fetch(_kv(1, JOINING), _kv(1, JOINING))
            joining.append(single)
        _evaluated(joining)

        def join(joining=joining):
            for c, single in zip(layers, joining):
                c.extend([single])
            _evaluated(layers)

        join_ms.append(_timed(join))
    return {
        name: 1e3 * statistics.median(times)
        for name, times in (("append", append_ms), ("leave", leave_ms), ("join", join_ms))
    }


def main() -> None:
    print(f"MLX {mx.__version__}, {mx.default_device()}; {ROWS} rows x {LAYERS} layers")
    for width in (300, 700):
        ms = measure(width)
        print(
            f"width {width}: append one column to every row {ms['append']:.2f} ms; "
            f"a row leaves (keep_rows) {ms['leave']:.2f} ms; "
            f"a row of {JOINING} joins (extend) {ms['join']:.2f} ms",
            flush=True,
        )


if __name__ == "__main__":
    main()
