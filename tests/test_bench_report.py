"""bench.report's decode-stall note: a decode cell whose mean rate is well under its median
step's is named under its table (the per-step times ``bench.harness.measure`` records)."""

from bench import report


def result(decode_tps: float, step_ms_median: float | None) -> dict:
    steps = {"decode_step_ms_median": step_ms_median, "decode_step_ms_max": 240.0}
    side = {"peak_bytes": 1, "kv_bytes_per_token": 2, "dtype": "bfloat16", "decode_tps": 100.0}
    cell = {
        "arch": "llama",
        "quant": "bf16",
        "cell": "decode@512",
        "kind": "decode",
        "sides": {
            "mlxc": dict(side, decode_tps=decode_tps, **steps),
            "mlx-lm": dict(side, decode_step_ms_median=10.0, decode_step_ms_max=11.0),
        },
    }
    return {
        "command": "python -m bench.run",
        "size": "medium",
        "wall_s": 1.0,
        "machine": {"device": "gpu"},
        "params": {"llama": 1e9},
        "settings": {"quantization": {"group_size": 64}, "decode_tokens": 128, "repeats": 1},
        "passes": {"gpu": {"cells": [cell]}},
    }


def test_a_stalled_decode_run_is_named_under_its_table():
    text = report.markdown(result(decode_tps=50.0, step_ms_median=10.0))  # 100/s per step
    stalls = [line for line in text.splitlines() if line.startswith("Decode runs with stalls")]
    assert len(stalls) == 1
    assert "mlxc llama bf16 (50.0 tokens/s overall, 100 at its median step" in stalls[0]
    assert "longest step 240 ms" in stalls[0] and "mlx-lm" not in stalls[0]


def test_steady_runs_and_older_results_have_no_note():
    for tps, median in ((95.0, 10.0), (50.0, None)):  # None: a result from before step times
        assert "Decode runs with stalls" not in report.markdown(result(tps, median))
