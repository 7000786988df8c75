"""minicpm3 (MiniCPM3-4B): logits against transformers on the latent cache.

Every key of MiniCPM3-4B's config.json, sizes shrunk: dense MLA with q LoRA, LongRoPE
(rotate-half) whose original context (16) the prompts pass, so the long factors and the
attention factor act, scale_emb, scale_depth and dim_model_base (16 of hidden 64: the head sees
a quarter of the hidden states). The hub form has no ``v_head_dim`` (hidden / heads) and no
``tie_word_embeddings`` (untied, as the checkpoint). LongRoPE switches tables when a forward's
last position passes the original context, so a chunked prefill differs from a full forward:
chunks and decode steps are checked against transformers run on the same chunks.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
import torch
from _mla import ATOL, check_full_forward, check_latent_cache, reference, rerandomise

import mlxc

FIELDS = {
    "bos_token_id": 1,
    "eos_token_id": [2, 3],
    "hidden_act": "silu",
    "initializer_range": 0.1,
    "hidden_size": 64,
    "num_hidden_layers": 3,
    "intermediate_size": 96,
    "max_position_embeddings": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8,
    "q_lora_rank": 32,
    "kv_lora_rank": 24,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0, 1.1, 1.3, 1.7],
        "long_factor": [1.0, 2.0, 5.0, 9.0],
        "original_max_position_embeddings": 16,
    },
    "use_cache": True,
    "vocab_size": 128,
    "scale_emb": 12,
    "dim_model_base": 16,
    "scale_depth": 1.4,
    "tie_word_embeddings": False,
}
HUB_ONLY = {
    "architectures": ["MiniCPM3ForCausalLM"],
    "auto_map": {
        "AutoConfig": "configuration_minicpm.MiniCPM3Config",
        "AutoModel": "modeling_minicpm.MiniCPM3Model",
        "AutoModelForCausalLM": "modeling_minicpm.MiniCPM3ForCausalLM",
    },
    "transformers_version": "4.41.0",
}
CHUNKS = [(0, 13), (13, 30), (30, 33), (33, 34), (34, 35), (35, 36)]


def make_model(seed=0, **overrides):
    from transformers import MiniCPM3Config, MiniCPM3ForCausalLM

    model = MiniCPM3ForCausalLM(MiniCPM3Config(**(FIELDS | overrides))).eval()
    rerandomise(model, seed)
    return model


def save_hub(model, path):
    """Hub form: ``rope_scaling`` (type longrope), no v_head_dim, head_dim or tie key."""
    model.save_pretrained(path)
    cfg = json.loads((path / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    rope.pop("type", None)
    cfg["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}
    for key in ("v_head_dim", "head_dim", "tie_word_embeddings", "dtype"):
        cfg.pop(key, None)
    cfg |= HUB_ONLY | {"torch_dtype": "bfloat16"}
    (path / "config.json").write_text(json.dumps(cfg, indent=2))


@pytest.fixture(scope="module", params=["tf5", "hub"])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"minicpm3-{request.param}")
    hf = make_model()
    if request.param == "hub":
        save_hub(hf, path)
    else:
        hf.save_pretrained(path)
    return hf, path


def reference_chunked(model, ids: np.ndarray) -> np.ndarray:
    """transformers' logits for ``ids`` fed in CHUNKS through its cache."""
    from transformers import DynamicCache

    cache, parts = DynamicCache(config=model.config), []
    with torch.no_grad():
        for a, b in CHUNKS:
            out = model(input_ids=torch.from_numpy(ids[:, a:b]), cache=cache, use_cache=True)
            parts.append(out.logits.numpy())
    return np.concatenate(parts, axis=1)


def test_logits_match_transformers(checkpoint):
    check_full_forward(*checkpoint)


def test_chunked_prefill_and_decode_match_transformers_chunks(checkpoint):
    hf, path = checkpoint
    ids = np.random.default_rng(1).integers(0, 128, size=(1, 36))
    model = mlxc.load_model(path)
    cache, parts = model.make_cache(), []
    for a, b in CHUNKS:
        parts.append(np.array(model(mx.array(ids[:, a:b]), cache=cache)))
    want = reference_chunked(hf, ids)
    np.testing.assert_allclose(np.concatenate(parts, axis=1), want, atol=ATOL, rtol=0)
    # The first chunk (13 <= 16) rotated its keys with the short factors; one forward does not.
    assert np.abs(want - reference(hf, ids))[:, 13:].max() > 1e-2


def test_latent_cache_holds_the_latent_not_per_head_kv(checkpoint):
    check_latent_cache(checkpoint[1], FIELDS["kv_lora_rank"], FIELDS["qk_rope_head_dim"])


def test_decode_batch_rows_switch_tables_by_their_own_positions(checkpoint):
    """A decode batch of a row past the original context (long factors) and one inside it
    (short) gives each row what it gets decoding alone."""
    from mlxc.runtime.model.batch import BatchCache

    _, path = checkpoint
    model = mlxc.load_model(path)
    rng = np.random.default_rng(4)
    rows = []
    for n in (20, 5):
        tokens = rng.integers(0, 128, size=n + 3)
        pair = [model.make_cache(), model.make_cache()]
        for cache in pair:
            model(mx.array(tokens[None, :n]), cache=cache)
        rows.append((tokens[n:], *pair))
    batch = BatchCache.like(rows[0][1])
    batch.extend([r[2] for r in rows])
    for step in range(3):
        ids = mx.array([[int(r[0][step])] for r in rows])
        batched = np.array(model(ids, cache=batch))
        for b, (_, alone, _) in enumerate(rows):
            want = np.array(model(ids[b : b + 1], cache=alone))
            np.testing.assert_allclose(batched[b], want[0], atol=ATOL, rtol=0)


def test_the_mup_scales_matter():
    """Guard for the tolerance above: each of the three scales moves transformers' logits."""
    ids = np.random.default_rng(2).integers(0, 128, size=(1, 12))
    want = reference(make_model(seed=3), ids)
    for change in ({"scale_emb": 1}, {"scale_depth": 3.0}, {"dim_model_base": 64}):
        assert np.abs(reference(make_model(seed=3, **change), ids) - want).max() > 1e-2, change


def make_server_checkpoint(path, seed: int = 0):
    """For tests/test_server.py: hub form, the factory tokenizer's vocab and special ids,
    LongRoPE over a 64-token original context."""
    import checkpoints as ckpt

    rope = dict(FIELDS["rope_parameters"], original_max_position_embeddings=64)
    model = make_model(
        seed,
        rope_parameters=rope,
        vocab_size=ckpt.VOCAB_SIZE,
        max_position_embeddings=512,
        bos_token_id=ckpt.BOS_ID,
        eos_token_id=ckpt.EOS_ID,
        pad_token_id=ckpt.PAD_ID,
    )
    save_hub(model, path)
    ckpt.write_tokenizer(path)
    return path


@pytest.mark.parametrize("offset", [10, 13, 14, 40])  # with 3 tokens past 16: short, long
def test_longrope_offset_as_array_turns_as_the_int(offset):
    """A compiled step passes one sequence's offset as an array (``layers.step_compiled``) and a
    decode batch one a row: LongRoPE must pick the same table for each as for the int."""
    from mlxc.runtime.model.rope import LongRoPE, RopeConfig

    rope = LongRoPE(8, RopeConfig.from_config(FIELDS))
    assert rope.mscale != 1.0  # the attention factor acts too
    x = mx.array(np.random.default_rng(0).standard_normal((1, 4, 3, 8)).astype(np.float32))
    want = rope(x, offset)
    for as_array in (mx.array(offset), mx.array([offset])):
        assert mx.allclose(rope(x, as_array), want, atol=1e-6).item()
    # a batch of two rows on either side of the switch, each with its own table
    rows = mx.concatenate([x, x * 2])
    other = 40 if offset < 14 else 10
    both = rope(rows, mx.array([offset, other]))
    assert mx.allclose(both[:1], want, atol=1e-6).item()
    assert mx.allclose(both[1:], rope(x * 2, other), atol=1e-6).item()


def test_scaled_residual_is_one_kernel_with_the_same_values():
    """``layers.add_scaled`` (the decoder layers' ``x + branch * residual_scale``) gives what the
    two ops give, bit for bit, in one compiled kernel where they launch two."""
    import io
    import re

    from mlxc.runtime.model import layers

    rng = np.random.default_rng(1)
    for dtype in (mx.float32, mx.bfloat16):
        x, branch = (mx.array(rng.standard_normal((2, 3, 16))).astype(dtype) for _ in range(2))
        mx.eval(x, branch)
        got = layers.add_scaled(x, branch, 0.35)
        dot = io.StringIO()
        mx.export_to_dot(dot, got)  # before any evaluation: the graph that builds it
        kernels = [k for k in re.findall(r'label ="(\w+)"', dot.getvalue()) if k != "Broadcast"]
        assert len(kernels) == 1 and kernels[0].startswith("Compiled"), kernels
        assert got.dtype == dtype
        assert mx.array_equal(got, x + branch * 0.35).item()
