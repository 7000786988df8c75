"""Numerical correctness oracle: mlxc logits against independent implementations.

Tiny random float32 checkpoints (tests/checkpoints.py) are loaded with ``mlxc.load_model`` and
compared with transformers (llama, qwen2, qwen3) or mlx-lm (nemotron-nas, itself checked here
against a PyTorch assembly of transformers' Llama blocks).

Tolerance: atol 1e-4 on float32 logits of standard deviation ~1.5 (max |logit| ~6). Two
independent float32 implementations of the same network (different matmul blocking, softmax
and RMSNorm reduction orders, RoPE via cos/sin tables vs a fused kernel) agree to ~1e-5 on these
models: measured 5e-6 .. 1.2e-5 between transformers and mlx-lm. 1e-4 leaves a ~10x margin for
rounding while any real bug (wrong RoPE frequencies or theta, missing bias, GQA head mapping,
a norm skipped or misplaced, llama3 scaling ignored) moves the logits by 0.05 .. 4.

The oracle tests (``test_oracle_*``) do not need mlxc and must pass on their own.
"""

from __future__ import annotations

import checkpoints as ck
import numpy as np
import pytest

ATOL = 1e-4  # see module docstring
RTOL = 0.0

# name -> (factory, factory kwargs)
CASES = {
    # MHA, no biases, theta 5e5
    "llama": (ck.make_llama, {}),
    "llama_bias": (ck.make_llama, {"attention_bias": True, "mlp_bias": True}),
    "llama_gqa": (ck.make_llama, {"num_key_value_heads": 2}),
    # MQA + llama3 rope scaling, transformers-5 config form (rope_parameters)
    "llama_mqa_llama3": (
        ck.make_llama,
        {"num_key_value_heads": 1, "rope_scaling": ck.LLAMA3_ROPE},
    ),
    # same scaling in the hub (pre-5) config form: rope_theta + rope_scaling, torch_dtype;
    # weights sharded with model.safetensors.index.json
    "llama_llama3_legacy_sharded": (
        ck.make_llama,
        {
            "num_key_value_heads": 2,
            "rope_scaling": ck.LLAMA3_ROPE,
            "legacy_config": True,
            "max_shard_size": "100KB",
        },
    ),
    # q/k/v biases, GQA 4/2, theta 1e6
    "qwen2": (ck.make_qwen2, {}),
    # tied lm_head (no lm_head.weight in the file), hub config form
    "qwen2_tied": (ck.make_qwen2, {"tie_word_embeddings": True, "legacy_config": True}),
    # q/k RMSNorm per head, GQA 4/2
    "qwen3": (ck.make_qwen3, {}),
    # head_dim 32 != hidden / heads (q_proj is [128, 64]), as in real Qwen3 checkpoints; a
    # theta that is nobody's default (catches a loader that ignores rope_parameters)
    "qwen3_head_dim32": (ck.make_qwen3, {"head_dim": 32, "rope_theta": 20_000.0}),
    # mixed blocks: no-op / linear / GQA 2 and 4 attention, no-op / linear / two-width FFN,
    # llama3 rope scaling
    "nemotron_nas": (ck.make_nemotron_nas, {}),
    "nemotron_nas_sharded": (ck.make_nemotron_nas, {"shards": 3, "tokenizer": False}),
}


def _mlxc():
    # Imported lazily so that the oracle tests run even while mlxc is incomplete; a failure
    # here fails the mlxc tests (deliberately not a skip).
    import mlxc

    return mlxc


@pytest.fixture(scope="module", params=sorted(CASES))
def ckpt(request, tmp_path_factory):
    factory, kwargs = CASES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    return factory(path, **kwargs)


def _ids(rng, batch, length):
    return rng.integers(0, ck.VOCAB_SIZE, size=(batch, length)).astype(np.int32)


def _np(x):
    import mlx.core as mx

    mx.eval(x)
    return np.array(x.astype(mx.float32))


def _assert_close(actual, expected, what):
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    err = np.abs(actual - expected)
    worst = np.unravel_index(np.argmax(err), err.shape)
    assert np.allclose(actual, expected, atol=ATOL, rtol=RTOL), (
        f"{what}: max |diff| {err.max():.3g} at {worst} "
        f"(mean {err.mean():.3g}, {int((err > ATOL).sum())} of {err.size} over {ATOL})"
    )


# ------------------------------------------------------------------------------------------
# mlxc against the reference
# ------------------------------------------------------------------------------------------


# 150 tokens: on the CPU, attention over three blocks of queries (layers.CAUSAL_BLOCK).
@pytest.mark.parametrize("shape", [(1, 13), (2, 9), (1, 150)], ids=["b1_l13", "b2_l9", "b1_l150"])
def test_full_forward_matches_reference(ckpt, rng, shape):
    import mlx.core as mx

    mlxc = _mlxc()
    ids = _ids(rng, *shape)
    expected = ck.reference_logits(ckpt, ids)

    model = mlxc.load_model(ckpt)
    out = model(mx.array(ids), cache=model.make_cache())
    assert out.dtype == mx.float32, f"float32 checkpoint gave {out.dtype} logits"
    _assert_close(_np(out), expected, f"full forward {shape}")


@pytest.mark.usefixtures("on_cpu")
def test_full_forward_with_the_cpu_silu_matches_reference(ckpt, rng, monkeypatch):
    """On the CPU with every SwiGLU gate through ``layers.silu_by_polynomial`` in blocks of
    rows (here small blocks), the forward still matches the reference."""
    import mlx.core as mx

    from mlxc.runtime.model import layers

    taken = []
    real = layers.in_row_blocks
    monkeypatch.setattr(layers, "in_row_blocks", lambda fn, *xs: taken.append(1) or real(fn, *xs))
    ids = _ids(rng, 2, 9)
    model = _mlxc().load_model(ckpt)
    monkeypatch.setattr(layers, "CPU_ACT_BLOCK", 256)  # the tiny gates' 18 rows in blocks
    out = _np(model(mx.array(ids), cache=model.make_cache()))
    assert taken  # every case here has SwiGLU MLPs
    _assert_close(out, ck.reference_logits(ckpt, ids), "full forward, CPU silu")


def test_chunked_prefill_and_decode_match_full_forward(ckpt, rng):
    """Chunks 5, 5, 3 into one cache, then 3 single-token decode steps (16 tokens, batch 2),
    against one full forward of the same model and against the reference."""
    import mlx.core as mx

    mlxc = _mlxc()
    ids = _ids(rng, 2, 16)
    model = mlxc.load_model(ckpt)

    cache = model.make_cache()
    pieces, start = [], 0
    for n in (5, 5, 3, 1, 1, 1):
        out = model(mx.array(ids[:, start : start + n]), cache=cache)
        assert tuple(out.shape) == (2, n, ck.VOCAB_SIZE)
        pieces.append(_np(out))
        start += n
    assert start == ids.shape[1]
    incremental = np.concatenate(pieces, axis=1)

    full = _np(model(mx.array(ids), cache=model.make_cache()))
    _assert_close(incremental, full, "chunked prefill + decode vs full forward")
    _assert_close(incremental, ck.reference_logits(ckpt, ids), "chunked vs reference")


@pytest.mark.parametrize(
    "factory", [ck.make_llama, ck.make_nemotron_nas], ids=["llama", "nemotron_nas"]
)
def test_load_returns_model_and_tokenizer(tmp_path, rng, factory):
    import mlx.core as mx
    from tokenizers import Tokenizer

    mlxc = _mlxc()
    path = factory(tmp_path / "ckpt")
    model, tok = mlxc.load(path)
    assert tok is not None
    text = "hello world, the quick brown fox"
    expected_ids = Tokenizer.from_file(str(path / "tokenizer.json")).encode(text).ids
    assert list(tok.encode(text)) == expected_ids
    assert tok.eos_token_id == ck.EOS_ID

    ids = _ids(rng, 1, 7)
    out = model(mx.array(ids), cache=model.make_cache())
    _assert_close(_np(out), ck.reference_logits(path, ids), "mlxc.load model")


@pytest.mark.parametrize(
    "factory", [ck.make_qwen3, ck.make_nemotron_nas], ids=["qwen3", "nemotron_nas"]
)
def test_load_without_tokenizer_files_gives_none(tmp_path, rng, factory):
    import mlx.core as mx

    mlxc = _mlxc()
    path = factory(tmp_path / "ckpt", tokenizer=False)
    assert not list(path.glob("tokenizer*"))
    model, tok = mlxc.load(path)
    assert tok is None
    ids = _ids(rng, 1, 6)
    out = model(mx.array(ids), cache=model.make_cache())
    _assert_close(_np(out), ck.reference_logits(path, ids), "mlxc.load model (no tokenizer)")


# ------------------------------------------------------------------------------------------
# the oracle itself (no mlxc needed)
# ------------------------------------------------------------------------------------------


def test_oracle_reference_has_real_spread(ckpt, rng):
    ids = _ids(rng, 2, 9)
    ref = ck.reference_logits(ckpt, ids)
    assert ref.shape == (2, 9, ck.VOCAB_SIZE) and ref.dtype == np.float32
    assert np.isfinite(ref).all()
    # logits vary across the vocabulary (re-randomised weights, not transformers' ~0 init) ...
    assert 0.7 < ref.std(axis=-1).mean() < 5.0
    # ... and across positions: the model is not ignoring context
    assert np.abs(np.diff(ref, axis=1)).max() > 0.5


def test_oracle_llama3_scaling_changes_logits(tmp_path, rng):
    ids = _ids(rng, 1, 13)
    scaled = ck.reference_logits(
        ck.make_llama(tmp_path / "a", tokenizer=False, rope_scaling=ck.LLAMA3_ROPE), ids
    )
    plain = ck.reference_logits(ck.make_llama(tmp_path / "b", tokenizer=False), ids)
    # same weights (same seed): position 0 has no rotation, later positions must move
    np.testing.assert_array_equal(scaled[:, 0], plain[:, 0])
    assert np.abs(scaled[:, 1:] - plain[:, 1:]).max() > 0.1


def test_oracle_rope_theta_changes_logits(tmp_path, rng):
    ids = _ids(rng, 1, 13)
    a = ck.reference_logits(ck.make_qwen3(tmp_path / "a", tokenizer=False), ids)
    b = ck.reference_logits(ck.make_qwen3(tmp_path / "b", tokenizer=False, rope_theta=1e4), ids)
    assert np.abs(a - b).max() > 0.1


def test_oracle_legacy_config_is_equivalent(tmp_path, rng):
    ids = _ids(rng, 1, 13)
    kw = {"tokenizer": False, "rope_scaling": ck.LLAMA3_ROPE, "num_key_value_heads": 2}
    new = ck.make_llama(tmp_path / "new", **kw)
    old = ck.make_llama(tmp_path / "old", legacy_config=True, **kw)
    new_cfg, old_cfg = ck.read_config(new), ck.read_config(old)
    assert "rope_parameters" in new_cfg and "rope_theta" not in new_cfg
    assert "rope_parameters" not in old_cfg and old_cfg["rope_scaling"]["rope_type"] == "llama3"
    np.testing.assert_array_equal(ck.reference_logits(new, ids), ck.reference_logits(old, ids))


def test_oracle_nemotron_mlx_lm_agrees_with_torch_assembly(tmp_path, rng):
    path = ck.make_nemotron_nas(tmp_path / "n", tokenizer=False)
    ids = _ids(rng, 2, 13)
    a = ck.reference_logits(path, ids)  # mlx-lm
    b = ck.nemotron_torch_reference(path, ids)  # transformers Llama blocks, PyTorch
    _assert_close(a, b, "mlx-lm nemotron-nas vs torch assembly")


def test_oracle_nemotron_layer_types_differ(tmp_path):
    from safetensors.numpy import load_file

    path = ck.make_nemotron_nas(tmp_path / "n", tokenizer=False)
    w = load_file(str(path / "model.safetensors"))
    names = set(w)
    layer = "model.layers.{}.".format
    # no-op attention (layer 1): no input norm, no attention weights
    assert not any(n.startswith(layer(1) + "self_attn") for n in names)
    assert layer(1) + "input_layernorm.weight" not in names
    # linear attention (layer 3) and linear FFN (layer 2)
    assert w[layer(3) + "self_attn.linear_attn.weight"].shape == (64, 64)
    assert w[layer(2) + "mlp.linear_mlp.weight"].shape == (64, 64)
    # no-op FFN (layer 4): no post-attention norm, no MLP weights
    assert not any(n.startswith(layer(4) + "mlp") for n in names)
    assert layer(4) + "post_attention_layernorm.weight" not in names
    # two GQA group sizes -> 2 and 1 kv heads of dim 16; two FFN widths
    assert {w[layer(i) + "self_attn.k_proj.weight"].shape[0] for i in (0, 2, 4, 5)} == {32, 16}
    assert {w[layer(i) + "mlp.up_proj.weight"].shape[0] for i in (0, 1, 3, 5)} == {256, 512}
    # each special sub-block actually affects the output
    ids = np.arange(3, 16, dtype=np.int32)[None]
    base = ck.reference_logits(path, ids)
    from safetensors.numpy import save_file

    for name in (
        layer(3) + "self_attn.linear_attn.weight",
        layer(2) + "mlp.linear_mlp.weight",
        layer(1) + "mlp.up_proj.weight",
        layer(5) + "self_attn.k_proj.weight",
    ):
        changed = dict(w)
        changed[name] = w[name] * 1.5
        save_file(changed, str(path / "model.safetensors"), metadata={"format": "pt"})
        assert np.abs(ck.reference_logits(path, ids) - base).max() > 0.01, name
    save_file(w, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_oracle_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    path = ck.make_qwen2(tmp_path / "q")
    assert (path / "tokenizer.json").exists()
    tok = AutoTokenizer.from_pretrained(str(path))
    assert len(tok) <= ck.VOCAB_SIZE
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (
        ck.BOS_ID,
        ck.EOS_ID,
        ck.PAD_ID,
    )
    text = "héllo world"
    assert tok.decode(tok.encode(text)) == text
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<s><|user|>hi</s><|assistant|>"
