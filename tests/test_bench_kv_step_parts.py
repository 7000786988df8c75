"""bench.kv_step_parts --gpu-paths: on the CPU, each variant's step built as CUDA builds it
(mlxc's CUDA attention a stand-in node, ``bench.graph_nodes.gpu_paths``), so the CUDA-only
variants run and their build column is measured; the patches are undone afterwards."""

from __future__ import annotations

import json

import pytest

from bench import kv_step_parts
from mlxc.runtime.model import cuda_attention


def test_cuda_variants_built_on_the_cpu(tmp_path, capsys):
    out, replays = tmp_path / "parts", cuda_attention._REPLAYS
    warmed = cuda_attention._warm.cache_info().currsize
    args = ["--device", "cpu", "--size", "small", "--prompt", "16", "--tokens", "4"]
    kv_step_parts.main([*args, "--repeats", "1", "--gpu-paths", "--out", str(out)])
    rows = json.loads((tmp_path / "parts.json").read_text())["variants"]
    assert {"kv4, packed slices", "kv4, unstaged", "float, mlxc kernel on buffers"} <= set(rows)
    assert all(r["build_ms"] > 0 for r in rows.values())
    assert "only the build column is a GPU's figure" in (tmp_path / "parts.md").read_text()
    # gpu_paths left: no CUDA, and the calls traced or warmed with its stand-in went with it
    assert not cuda_attention.available() and cuda_attention._REPLAYS is replays
    assert cuda_attention._warm.cache_info().currsize == warmed


def test_gpu_paths_only_on_the_cpu():
    with pytest.raises(SystemExit):
        kv_step_parts.main(["--device", "gpu", "--gpu-paths"])
