"""bench.graph_nodes counts the kernels of a decode step as a GPU builds it. On a CPU mlxc takes
paths of its own (the gated MLP's activation through a compiled polynomial exp, whose bit trick
is a ``LeftShift``; a quantised product shared out over the cores); the kernel counts must be of
the graph mlxc builds for a GPU (``gpu_paths``), the CPU graph of the one it runs."""

from __future__ import annotations

import json

import mlx.core as mx

from bench import graph_nodes, models
from bench.run import peer_convert
from mlxc.runtime.model import dequantized

TINY = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}


def _checkpoint(path, **sizes):
    cfg = {**models.config("llama", "small"), **TINY, "num_hidden_layers": 2, "vocab_size": 256}
    path.mkdir()
    (path / "config.json").write_text(json.dumps({**cfg, **sizes}))
    models.write_tensors(path, models.shapes({**cfg, **sizes}), seed=1)
    return path


def test_mlxc_counted_on_its_gpu_paths(tmp_path):
    path = str(_checkpoint(tmp_path / "m"))
    on_cpu = graph_nodes._mlxc_step(path, on_gpu_paths=False)
    assert any("LeftShift" in name for name in on_cpu["by_primitive"])  # the CPU's own exp
    counts = graph_nodes.mlxc_step(path)
    assert not any("LeftShift" in name for name in counts["by_primitive"])
    assert counts["kernels"] < on_cpu["kernels"]
    assert counts["cpu_graph"] == on_cpu["cpu_graph"]  # the CPU graph stays the CPU's


def test_a_quantised_step_counted_on_its_gpu_paths(tmp_path, monkeypatch):
    """4-bit: on the CPU each product of the fused gate|up (128 KiB packed) goes out to two
    streams, two ``QuantizedMatmul`` where a GPU runs one."""
    q4 = peer_convert(_checkpoint(tmp_path / "m", intermediate_size=2048), tmp_path / "q4")
    streams = (mx.new_stream(mx.cpu), mx.new_stream(mx.cpu))
    monkeypatch.setattr(dequantized, "cpu_streams", lambda: streams)
    monkeypatch.setattr(dequantized, "SPLIT_BYTES", 100 << 10)
    on_cpu = graph_nodes._mlxc_step(str(q4), on_gpu_paths=False)
    counts = graph_nodes.mlxc_step(str(q4))
    assert (
        on_cpu["by_primitive"]["QuantizedMatmul"] == counts["by_primitive"]["QuantizedMatmul"] + 2
    )


def test_fast_calls_inside_a_compiled_function_count_once(tmp_path, monkeypatch):
    """Attention's ``project`` runs compiled on a GPU's steps (``layers.step_compiled``); traced
    on the CPU, each fast call in it would be its fallback's ops, fused, so its stand-in is a
    primitive mx.compile leaves alone, and the traces are made under the stand-ins."""
    from mlxc.runtime.model import layers

    path = str(_checkpoint(tmp_path / "m"))
    compiled = graph_nodes.mlxc_step(path)["by_primitive"]
    monkeypatch.setattr(layers, "STEP_TOKENS", 0)
    as_written = graph_nodes.mlxc_step(path)["by_primitive"]
    assert compiled["fast.rope"] == as_written["fast.rope"] == 2  # q|k turned at once, 2 layers
    assert not {"Sin", "Cos", "Square", "Rsqrt"} & set(compiled)
    assert compiled == as_written  # nothing in llama's project for mx.compile to fuse


def test_mla_decode_attention_counted_as_its_cuda_kernel(tmp_path):
    """On CUDA an MLA layer's decode attention is one custom kernel
    (``cuda_attention.latent_attention``): counted as one stand-in node a layer, no softmax of
    composed scores beside it; the CPU graph is the CPU's attention."""
    sizes = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4}
    layers = {"num_hidden_layers": 2, "vocab_size": 256, "first_k_dense_replace": 2}
    # kv_lora_rank: a multiple of 32 of the kernel's float32 vectors (16 bytes: 4 floats)
    mla = {"kv_lora_rank": 128, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16}
    cfg = {**models.config("deepseek_v2", "small"), **sizes, **layers, **mla}
    path = tmp_path / "m"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg))
    models.write_tensors(path, models.shapes(cfg), seed=1)
    counts = graph_nodes.mlxc_step(str(path))
    assert counts["by_primitive"]["cuda_attention.latent_attention"] == 2
    assert "Softmax" not in counts["by_primitive"]
    assert "ErfInv" not in counts["cpu_graph"]["by_primitive"]  # the CPU runs its own attention


def test_mlxc_attention_kernel_counted_where_cuda_takes_it(tmp_path):
    """Under ``gpu_paths`` mlxc's CUDA attention runs its own Python to a stand-in node a call:
    a verification's queries, and a 4-bit cache's step on its packed and staged tokens
    (replayed through ``mx.compile``, as on CUDA); outside it the CPU's graph is as before."""
    from mlxc import load_model
    from mlxc.runtime.model.cache import KVQuant, cache_arrays, make_caches

    heads = {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1}
    model = load_model(str(_checkpoint(tmp_path / "m", **heads, head_dim=64)))
    prompt = mx.array([list(range(10, 50))])

    def counted(quant, step):
        cache = make_caches(model, quant)
        mx.eval(model(prompt, cache=cache), cache_arrays(cache))
        return graph_nodes.count(model(step, cache=cache)), cache

    with graph_nodes.gpu_paths():
        verification, _ = counted(None, mx.array([[5, 6, 7]]))
        quantised, cache = counted(KVQuant(4, 64), mx.array([[5]]))
    assert verification["Sort"] == 2 and "Softmax" not in verification  # one kernel a layer
    assert quantised["Sort"] == 2 and cache[0].staged == 1  # the new token staged in float
    on_cpu, _ = counted(None, mx.array([[5, 6, 7]]))
    # the CPU composes its attention: scores and values, two products a layer more
    assert "Sort" not in on_cpu and on_cpu["Matmul"] == verification["Matmul"] + 4
