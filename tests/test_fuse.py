"""Projections fused at load (``runtime.model.layers.fuse``): q|k|v, gate|up and MLA's q_a|kv_a
as one matmul.

Loading fuses them by default, so every oracle test against transformers runs the fused
model; here the fused model's logits and greedy tokens equal the unfused model's (the
checkpoint's own layout, ``load_model(fuse=False)``) on a float checkpoint with q/k/v biases
(qwen2), on stacked experts with biases (gpt_oss), on MLA (glm4_moe_lite) and on 4-bit ones
with q/k norms (qwen3), converted by mlxc and by mlx-lm; files keep the hub names; parts that
differ in quantisation stay apart; unfuse gives the parts back exactly. Sharding a fused
model: tests/test_tensor_parallel.py ("llama fused", "qwen3 fused 8-bit").
"""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx import nn
from mlx.utils import tree_flatten

sys.path.insert(0, str(Path(__file__).parent))
import checkpoints as ck

import mlxc
from mlxc.runtime.checkpoint.convert import convert
from mlxc.runtime.model import layers
from mlxc.runtime.serving.generate import generate_tokens

IDS = [[3, 17, 101, 250, 9, 44, 7, 300, 12, 5]]


def names(model) -> list[str]:
    return [k for k, _ in tree_flatten(model.parameters())]


GQA_FUSIONS = (("qkv_proj", "q_proj"), ("gate_up_proj", "gate_proj"))  # (fused, a part)


def check_fused_equals_unfused(path: Path, fusions=GQA_FUSIONS) -> None:
    fused, parts = mlxc.load_model(path), mlxc.load_model(path, fuse=False)
    for name, part in fusions:
        assert any(f".{name}." in k for k in names(fused))
        assert not any(k.split(".")[-2] == part for k in names(fused))
        assert not any(f".{name}." in k for k in names(parts))
    ids = mx.array(IDS)
    np.testing.assert_allclose(np.array(fused(ids)), np.array(parts(ids)), atol=1e-5)
    # Through the cache: a prefill, then one-token decode steps.
    tokens = [list(generate_tokens(m, IDS[0], max_tokens=8)) for m in (fused, parts)]
    assert tokens[0] == tokens[1] and len(tokens[0]) == 8


def test_float_checkpoint_with_qkv_biases(tmp_path):
    check_fused_equals_unfused(ck.make_qwen2(tmp_path / "qwen2"))


def test_experts_with_biases_and_clamped_swiglu(tmp_path):
    """gpt_oss: q/k/v biases, sinks, yarn, a sliding window, and stacked experts whose gate
    and up (with their biases) become one gather matmul."""
    check_fused_equals_unfused(ck.make_gpt_oss(tmp_path / "gpt_oss"))


def test_mla_projections_of_x(tmp_path):
    """glm4_moe_lite's MLA: q's low-rank projection and the latent's (both of x) become one
    matmul, so do the dense and shared experts' gate and up; the decode steps take the absorbed
    path on the fused split."""
    from test_glm4_moe_lite import make_server_checkpoint

    fusions = (("q_kv_a_proj", "kv_a_proj_with_mqa"), ("gate_up_proj", "gate_proj"))
    check_fused_equals_unfused(make_server_checkpoint(tmp_path / "glm4_moe_lite"), fusions)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return ck.make_qwen3(tmp_path_factory.mktemp("fuse") / "qwen3")


def test_mlxc_converted_4bit_checkpoint_keeps_hub_names(qwen3, tmp_path):
    out = tmp_path / "q4"
    convert(qwen3, out, quantize=True, bits=4, group_size=32)
    stored = mx.load(str(out / "model.safetensors"))
    assert "model.layers.0.self_attn.k_proj.scales" in stored
    assert "model.layers.0.mlp.up_proj.biases" in stored
    assert not [k for k in stored if "qkv_proj" in k or "gate_up_proj" in k]
    check_fused_equals_unfused(out)
    fused = mlxc.load_model(out)
    assert isinstance(fused.model.layers[0].self_attn.qkv_proj, nn.QuantizedLinear)


def test_mlx_lm_converted_4bit_checkpoint(qwen3, tmp_path):
    from mlx_lm import convert as lm_convert

    out = tmp_path / "lm-q4"
    lm_convert(str(qwen3), mlx_path=str(out), quantize=True, q_bits=4, q_group_size=32)
    check_fused_equals_unfused(out)


def test_parts_quantised_differently_stay_apart_and_unfuse_is_exact():
    mlp = layers.SwiGLU(64, 96)
    mlp.update(nn.utils.tree_map(lambda p: mx.random.normal(p.shape), mlp.parameters()))
    nn.quantize(mlp, group_size=32, bits=4, class_predicate=lambda p, m: p == "gate_proj")
    x = mx.random.normal((2, 3, 64))
    want = mlp(x)
    layers.fuse(mlp)
    assert mlp.gate_up_proj is None and isinstance(mlp.gate_proj, nn.QuantizedLinear)
    mlp = layers.SwiGLU(64, 96, bias=True)
    mlp.update(nn.utils.tree_map(lambda p: mx.random.normal(p.shape), mlp.parameters()))
    nn.quantize(mlp, group_size=32, bits=4, class_predicate=lambda p, m: p != "down_proj")
    before = dict(tree_flatten(mlp.parameters()))
    want = mlp(x)
    layers.fuse(mlp)
    assert isinstance(mlp.gate_up_proj, nn.QuantizedLinear) and "gate_proj" not in mlp
    np.testing.assert_allclose(np.array(mlp(x)), np.array(want), atol=1e-5)
    assert layers.unfuse(mlp) and mlp.gate_up_proj is None
    after = dict(tree_flatten(mlp.parameters()))
    assert after.keys() == before.keys()
    assert all(mx.array_equal(after[k], before[k]).item() for k in before)
    assert not layers.unfuse(mlp)
