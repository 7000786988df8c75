"""bench.graph_nodes counts the kernels of a decode step as a GPU builds it. On a CPU mlxc takes
paths of its own (here: the gated MLP's activation through a compiled polynomial exp, whose
bit trick is a ``LeftShift``); the kernel counts must be of the graph mlxc builds for a GPU
(``gpu_paths``), the CPU graph of the one it runs."""

from __future__ import annotations

import json

from bench import graph_nodes, models

TINY = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}


def _has_polynomial_exp(by_primitive: dict) -> bool:
    return any("LeftShift" in name for name in by_primitive)


def test_mlxc_counted_on_its_gpu_paths(tmp_path):
    cfg = {**models.config("llama", "small"), **TINY, "num_hidden_layers": 2, "vocab_size": 256}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    models.write_tensors(tmp_path, models.shapes(cfg), seed=1)

    on_cpu = graph_nodes._mlxc_step(str(tmp_path), on_gpu_paths=False)
    assert _has_polynomial_exp(on_cpu["by_primitive"])  # the CPU's own path is there to avoid
    counts = graph_nodes.mlxc_step(str(tmp_path))
    assert not _has_polynomial_exp(counts["by_primitive"])
    assert counts["kernels"] < on_cpu["kernels"]
    assert counts["cpu_graph"] == on_cpu["cpu_graph"]  # the CPU graph stays the CPU's
