"""qwen3_moe (qwen3 attention + routed experts): logits against transformers.

Tiny random checkpoints, every parameter re-randomised (transformers' init hides bugs), float32,
atol 1e-4. transformers 5 ``save_pretrained`` writes per-expert tensors
(``mlp.experts.{e}.gate_proj.weight``, the hub layout) and ``num_local_experts`` in config.json;
the hub writes ``num_experts``, ``rope_theta``. The fused layout transformers keeps in memory
(``mlp.experts.gate_up_proj [E, 2I, H]``) is tested by saving its state dict as is.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch
from checkpoints import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, rerandomise, write_tokenizer

import mlxc

ATOL = 1e-4
FIELDS = {  # every key of Qwen3-30B-A3B's config.json, sizes shrunk
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 128,
    "num_experts": 6,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 24,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "max_position_embeddings": 128,
    "max_window_layers": 4,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "attention_bias": False,
    "attention_dropout": 0.0,
    "hidden_act": "silu",
    "sliding_window": None,
    "use_sliding_window": False,
    "router_aux_loss_coef": 0.001,
    "output_router_logits": False,
    "tie_word_embeddings": False,
}


def to_hub_config(path: Path) -> None:
    """config.json as the hub ships it: ``num_experts``, top-level ``rope_theta``."""
    cfg_path = path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["num_experts"] = cfg.pop("num_local_experts")
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"], cfg["rope_scaling"] = rope["rope_theta"], None
    cfg["torch_dtype"] = cfg.pop("dtype")
    cfg_path.write_text(json.dumps(cfg, indent=2))


def make_checkpoint(path, *, seed=0, layout="per-expert", hub_config=False, **overrides):
    """A tiny re-randomised Qwen3MoeForCausalLM saved to ``path``; ``layout`` "per-expert"
    (what save_pretrained writes) or "fused" (transformers' in-memory tensors)."""
    from safetensors.torch import save_file
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    path = Path(path)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**(FIELDS | overrides))).eval()
    rerandomise(model, seed)
    model.save_pretrained(path)
    if layout == "fused":
        for f in path.glob("*.safetensors"):
            f.unlink()
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    if hub_config:
        to_hub_config(path)
    return model


def make_qwen3_moe(path, seed: int = 0) -> Path:
    """qwen3_moe with dense and sparse layers and the factory tokenizer (its vocab and ids)."""
    make_checkpoint(
        path,
        seed=seed,
        mlp_only_layers=[0],
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=512,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    write_tokenizer(path)
    return Path(path)


def reference(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(ids)).logits.numpy()


def logits(path, ids: np.ndarray) -> np.ndarray:
    model = mlxc.load_model(path)
    return np.array(model(mx.array(ids), cache=model.make_cache()))


IDS = np.random.default_rng(0).integers(0, 128, size=(2, 24))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_moe")
    return make_checkpoint(path, mlp_only_layers=[1]), path


@pytest.mark.parametrize("batch", [1, 2])
def test_logits_match_transformers(checkpoint, batch):
    hf, path = checkpoint
    np.testing.assert_allclose(logits(path, IDS[:batch]), reference(hf, IDS[:batch]), atol=ATOL)


def test_chunked_prefill_and_decode_equal_full_forward(checkpoint):
    hf, path = checkpoint
    ids = IDS[:1]
    model = mlxc.load_model(path)
    cache, parts = model.make_cache(), []
    for a, b in [(0, 9), (9, 20), (20, 22), (22, 23), (23, 24)]:
        parts.append(np.array(model(mx.array(ids[:, a:b]), cache=cache)))
    np.testing.assert_allclose(np.concatenate(parts, axis=1), reference(hf, ids), atol=ATOL)
    assert cache.offset == 24


@pytest.mark.parametrize("layout", ["per-expert", "fused"])
@pytest.mark.parametrize("hub_config", [False, True], ids=["tf5-config", "hub-config"])
def test_weight_layouts_and_config_forms(tmp_path, layout, hub_config):
    hf = make_checkpoint(tmp_path, seed=1, layout=layout, hub_config=hub_config)
    names = set().union(*(mx.load(str(f)).keys() for f in tmp_path.glob("*.safetensors")))
    fused = any(n.endswith("experts.gate_up_proj") for n in names)
    assert fused == (layout == "fused")  # the layout under test is the one on disk
    np.testing.assert_allclose(logits(tmp_path, IDS[:1]), reference(hf, IDS[:1]), atol=ATOL)


def test_sparse_layers_follow_mlp_only_layers_and_sparse_step(tmp_path):
    """decoder_sparse_step 2 makes layers 1 and 3 sparse; mlp_only_layers [3] keeps 3 dense."""
    hf = make_checkpoint(tmp_path, seed=2, decoder_sparse_step=2, mlp_only_layers=[3])
    model = mlxc.load_model(tmp_path)
    sparse = [type(layer.mlp).__name__ == "MoE" for layer in model.model.layers]
    assert sparse == [False, True, False, False]
    assert sparse == [
        type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in hf.model.layers
    ]
    np.testing.assert_allclose(logits(tmp_path, IDS[:1]), reference(hf, IDS[:1]), atol=ATOL)


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_norm_topk_prob(tmp_path, norm_topk_prob):
    hf = make_checkpoint(tmp_path, seed=3, norm_topk_prob=norm_topk_prob)
    np.testing.assert_allclose(logits(tmp_path, IDS[:1]), reference(hf, IDS[:1]), atol=ATOL)


def test_norm_topk_prob_matters(tmp_path):
    """Guard for the test above: renormalising the top-k weights moves transformers' logits."""
    a = reference(make_checkpoint(tmp_path / "a", seed=3, norm_topk_prob=False), IDS[:1])
    b = reference(make_checkpoint(tmp_path / "b", seed=3, norm_topk_prob=True), IDS[:1])
    assert np.abs(a - b).max() > 1e-2


def test_factory_checkpoint_loads_with_its_tokenizer(tmp_path):
    make_qwen3_moe(tmp_path)
    model, tokenizer = mlxc.load(tmp_path)
    ids = tokenizer.encode("hello world")
    out = model(mx.array([ids]), cache=model.make_cache())
    assert out.shape == (1, len(ids), VOCAB_SIZE)
