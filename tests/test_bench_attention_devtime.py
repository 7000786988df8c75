"""bench.attention_devtime's variants on the CPU at tiny shapes: every variant runs and is
reported, and the module flags it patches (the kernel's chunks, staging, buffer decode) are
restored after. The device times themselves need CUDA (CUPTI's records are empty here)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from bench import attention_devtime


def test_every_variant_runs_and_the_flags_are_restored(monkeypatch):
    from mlxc.runtime.model import cache, cuda_attention

    for name, value in {"HQ": 4, "HKV": 2, "LAYERS": 2, "STEPS": 2}.items():
        monkeypatch.setattr(attention_devtime, name, value)
    before = cuda_attention._chunks, cache.staging, cuda_attention.BUFFER_DECODE
    rows = attention_devtime.run([40], [2])
    assert (cuda_attention._chunks, cache.staging, cuda_attention.BUFFER_DECODE) == before
    names = [r["variant"] for r in rows]
    assert names == [
        "float", "float, mlxc kernel on buffers", "kv4", "kv4, unstaged", "kv4, 2 chunks"
    ]  # fmt: skip
    assert all(r["keys"] == 40 and r["wall_us"] > 0 and r["device_us"] >= 0 for r in rows)
    text = attention_devtime.report(
        {"device": "cpu", "command": "c", "mlx": "m", "commit": "x", "rows": rows}
    )
    assert text.count("\n| 40 |") == len(rows)
