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


def test_an_ab_pairs_each_cell_with_its_median_against_the_other_header():
    def rows(mlxc: float, ratio: float) -> list[dict]:
        return [
            {"case": "kv4", "batch": 1, "keys": 2048, "queries": 1, "ceiling": 40.0,
             "mlx": 96.0, "mlxc": mlxc, "mlx_over_mlxc": 0.0, "mlxc_over_ceiling": 0.0},
            {"case": "ragged", "batch": 16, "keys": 256, "queries": 1, "ceiling": 50.0,
             "mlx": 120.0, "mlxc": mlxc * ratio, "mlx_over_mlxc": 0.0, "mlxc_over_ceiling": 0.0},
        ]  # fmt: skip

    here = [rows(60.0, 1.0), rows(64.0, 1.0), rows(80.0, 1.0)]  # medians 64, 64
    against = [rows(30.0, 3.0), rows(34.0, 3.0), rows(90.0, 3.0)]  # medians 34, 102
    paired = attention_kernels._paired(here, against)
    assert [r["mlxc"] for r in paired] == [64.0, 64.0]
    assert [r["mlxc against"] for r in paired] == [34.0, 102.0]
    assert paired[0]["against_over_here"] == 34.0 / 64.0
    assert paired[0]["mlx_over_mlxc"] == 96.0 / 64.0  # recomputed from the medians
    meta = {"device": "gpu", "mlx": "0.32.4", "commit": "abc", "against": "old.cuh", "rounds": 3}
    text = attention_kernels._markdown(meta, paired)
    assert "against those of `old.cuh` (medians of 3 alternating rounds" in text
    assert "| ragged | 16 | 256 | 1 | 64.0 | 102.0 | 1.59x |" in text
