"""bench.attention_kernels runs on CUDA only (its kernels are CUDA's), where a slip in its
reporting costs lent device time: its metadata and Markdown are checked here, on the CPU."""

from __future__ import annotations

from bench import attention_kernels


def test_meta_and_markdown_without_a_gpu():
    meta = attention_kernels._meta()
    assert set(meta) == {"device", "mlx", "host", "commit"} and meta["mlx"]
    shape = {"batch": 1, "keys": 2048, "queries": 1}
    rows = [
        {"case": "kv4", **shape, "ceiling": 40.0, "mlx": 96.0, "mlxc": 60.0},
        {"case": "latent 16x512+64", **shape, "batch": 16, "ceiling": 438.0, "mlx": 171.0},
    ]
    rows[1].update({"mlxc": 123.0, "mlxc c1": 128.6, "mlxc c4": 156.4})
    for r in rows:
        r["mlx_over_mlxc"] = r["mlx"] / r["mlxc"]
        r["mlxc_over_ceiling"] = r["mlxc"] / r["ceiling"]
    text = attention_kernels._markdown(meta, rows)
    assert f"mlxc @ {meta['commit']}" in text
    assert "| kv4 | 1 | 2048 | 1 | 40.0 | 96.0 | 60.0 | 1.60x | 1.50x |" in text
    # Only the latent row was timed by chunks: one row in that table, each count with its time.
    assert "| latent 16x512+64 | 16 | 2048 | 123.0 | 1: 128.6, 4: 156.4 |" in text
    assert text.count("by chunks") == 1 and "| kv4 | 1 | 2048 | 60.0 |" not in text
