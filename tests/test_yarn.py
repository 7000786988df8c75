"""runtime/model/yarn.py against transformers' rope init, rotary application and MLA attention."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx import nn

from mlxc.runtime.model import masks
from mlxc.runtime.model.cache import KVCache
from mlxc.runtime.model.rope import RopeConfig, make_rope
from mlxc.runtime.model.yarn import (
    YarnRoPE,
    llama4_attn_scale,
    mla_softmax_scale,
    yarn_inv_freq,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as ds2
from transformers.models.mistral4 import modeling_mistral4 as m4

ATOL = 1e-4
NOPE, ROPE, V, HEADS = 8, 8, 12, 4

# (factor, original_max, beta_fast, beta_slow, mscale, mscale_all_dim, truncate)
YARN_CASES = {
    "mistral4-default": (128.0, 8192, 32.0, 1.0, 1.0, 1.0, True),
    "small-orig": (4.0, 16, 32.0, 1.0, 1.0, 1.0, True),
    "deepseek-v2": (40.0, 4096, 32.0, 1.0, 0.707, 0.707, True),
    "mscale-ratio": (8.0, 32, 16.0, 2.0, 1.0, 0.5, False),
    "no-mscale-all-dim": (8.0, 32, 32.0, 1.0, 1.0, 0.0, True),
}


def rope_params(case: str, llama4_beta: float | None = 0.1) -> dict:
    f, orig, bf, bs, ms, msa, trunc = YARN_CASES[case]
    p = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": f,
        "original_max_position_embeddings": orig,
        "beta_fast": bf,
        "beta_slow": bs,
        "mscale": ms,
        "mscale_all_dim": msa,
        "truncate": trunc,
    }
    if llama4_beta is not None:
        p["llama_4_scaling_beta"] = llama4_beta
    return p


def mistral4_config(case: str, q_lora_rank=12, rope_interleave=True, **kw):
    cfg = transformers.Mistral4Config(
        vocab_size=32,
        hidden_size=32,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=16,
        qk_nope_head_dim=NOPE,
        qk_rope_head_dim=ROPE,
        v_head_dim=V,
        rope_interleave=rope_interleave,
        max_position_embeddings=4096,
        rope_parameters=rope_params(case),
        **kw,
    )
    cfg._attn_implementation = "eager"
    return cfg


def rope_config(cfg) -> RopeConfig:
    return RopeConfig.from_config(cfg.to_dict())


@pytest.mark.parametrize("case", list(YARN_CASES))
def test_inv_freq_and_attention_factor_match_transformers(case):
    cfg = mistral4_config(case)
    want_inv, want_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg)
    rope = YarnRoPE.from_config(ROPE, rope_config(cfg))
    np.testing.assert_allclose(np.array(1 / rope._periods), want_inv.numpy(), rtol=1e-6)
    assert rope.mscale == pytest.approx(want_factor, rel=1e-7)
    # the ramp really mixes interpolated and extrapolated frequencies in these cases
    base = 1 / 10000.0 ** (np.arange(0, ROPE, 2) / ROPE)
    if case != "mistral4-default":
        assert not np.allclose(want_inv.numpy(), base) and not np.allclose(
            want_inv.numpy(), base / YARN_CASES[case][0]
        )


@pytest.mark.parametrize("case", ["small-orig", "mscale-ratio"])
def test_deepseek_v2_yarn_table(case):
    """DeepseekV2Config: rope dim is qk_rope_head_dim (its head_dim), no partial factor."""
    cfg = transformers.DeepseekV2Config(
        hidden_size=32,
        num_attention_heads=HEADS,
        qk_nope_head_dim=NOPE,
        qk_rope_head_dim=ROPE,
        v_head_dim=V,
        rope_parameters=rope_params(case, llama4_beta=None),
    )
    want_inv, want_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg)
    np.testing.assert_allclose(
        np.array(yarn_inv_freq(ROPE, 10000.0, *YARN_CASES[case][:4], YARN_CASES[case][6])),
        want_inv.numpy(),
        rtol=1e-6,
    )
    assert YarnRoPE.from_config(ROPE, rope_config(cfg)).mscale == pytest.approx(want_factor)


def _qk(seed: int, L: int):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((2, HEADS, L, ROPE)).astype(np.float32) for _ in range(2))


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("offset", [0, 37])
def test_rope_application_matches_mistral4(interleave, offset):
    cfg = mistral4_config("mscale-ratio", rope_interleave=interleave)  # attention_factor != 1
    L = 6
    q, k = _qk(1, L)
    pos = torch.arange(offset, offset + L)[None]
    cos, sin = m4.Mistral4RotaryEmbedding(cfg)(torch.from_numpy(q), pos)
    apply = m4.apply_rotary_pos_emb_interleave if interleave else m4.apply_rotary_pos_emb
    want_q, want_k = (t.numpy() for t in apply(torch.from_numpy(q), torch.from_numpy(k), cos, sin))
    rope = make_rope(ROPE, rope_config(cfg), traditional=interleave)
    got_q, got_k = (np.array(rope(mx.array(t), offset=offset)) for t in (q, k))
    if interleave:
        # transformers writes the rotated even features, then the odd ones; mx.fast.rope keeps
        # the pairs in place. Same numbers after that permutation, and the same q.k without it.
        perm = np.r_[0:ROPE:2, 1:ROPE:2]
        np.testing.assert_allclose(
            got_q @ got_k.swapaxes(-1, -2), want_q @ want_k.swapaxes(-1, -2), atol=ATOL
        )
        got_q, got_k = got_q[..., perm], got_k[..., perm]
    np.testing.assert_allclose(got_q, want_q, atol=ATOL)
    np.testing.assert_allclose(got_k, want_k, atol=ATOL)


def test_rope_application_matches_deepseek_v2_complex_form():
    cfg = transformers.DeepseekV2Config(
        hidden_size=32,
        num_attention_heads=HEADS,
        qk_nope_head_dim=NOPE,
        qk_rope_head_dim=ROPE,
        v_head_dim=V,
        rope_parameters=rope_params("mscale-ratio", llama4_beta=None),
    )
    L, offset = 5, 11
    q, k = _qk(2, L)
    freqs_cis = ds2.DeepseekV2RotaryEmbedding(cfg)(
        torch.from_numpy(q), torch.arange(offset, offset + L)[None]
    )
    want = ds2.apply_rotary_emb(torch.from_numpy(q), torch.from_numpy(k), freqs_cis)
    rope = make_rope(ROPE, rope_config(cfg), traditional=True)
    for got, w in zip((rope(mx.array(t), offset) for t in (q, k)), want):
        np.testing.assert_allclose(np.array(got), w.numpy(), atol=ATOL)


@pytest.mark.parametrize("case", list(YARN_CASES))
def test_softmax_scale_matches_attention_scaling(case):
    cfg = mistral4_config(case)
    want = m4.Mistral4Attention(cfg, 0).scaling
    assert mla_softmax_scale(NOPE + ROPE, rope_config(cfg)) == pytest.approx(want, rel=1e-7)
    ds_cfg = transformers.DeepseekV2Config(
        hidden_size=32,
        num_attention_heads=HEADS,
        qk_nope_head_dim=NOPE,
        qk_rope_head_dim=ROPE,
        rope_parameters=rope_params(case, llama4_beta=None),
    )
    want = ds2.DeepseekV2Attention(ds_cfg, 0).scaling
    assert mla_softmax_scale(NOPE + ROPE, rope_config(ds_cfg)) == pytest.approx(want, rel=1e-7)
    # default rope: plain 1/sqrt(d)
    assert mla_softmax_scale(16, RopeConfig()) == 0.25


def test_llama4_attn_scale_matches_transformers():
    pos = np.array([0, 1, 7, 8, 9, 15, 16, 23, 24, 100, 1000, 123457])
    want = m4.get_llama_4_attn_scale(torch.from_numpy(pos)[None], 0.1, 8)[0, 0, :, 0].numpy()
    got = np.concatenate([np.array(llama4_attn_scale(int(p), 1, 0.1, 8)).reshape(-1) for p in pos])
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert got[0] == 1.0 and got[3] > 1.0 and np.all(np.diff(got) >= 0)
    # a run of L positions from one offset: shape [1, 1, L, 1], broadcast over [B, H, L, D]
    run = llama4_attn_scale(5, 20, 0.1, 8)
    assert run.shape == (1, 1, 20, 1) and run.dtype == mx.float32
    want = m4.get_llama_4_attn_scale(torch.arange(5, 25)[None], 0.1, 8)[0, 0, :, 0].numpy()
    np.testing.assert_allclose(np.array(run).reshape(-1), want, rtol=1e-6)
    # no beta: no multiply at all
    assert llama4_attn_scale(3, 4, None, 8) is None
    assert llama4_attn_scale(mx.array([3, 9]), 4, 0.0, 8) is None


def test_llama4_attn_scale_per_row_offsets():
    """Batched decode: ``cache.offset`` is ``[B]``; each row gets its own int-offset scale."""
    offsets = [0, 7, 8, 31, 1000]
    for L in (1, 3):
        got = llama4_attn_scale(mx.array(offsets), L, 0.1, 8)
        assert got.shape == (len(offsets), 1, L, 1)
        for b, off in enumerate(offsets):
            np.testing.assert_array_equal(
                np.array(got[b : b + 1]), np.array(llama4_attn_scale(off, L, 0.1, 8))
            )
    # bf16 queries stay bf16 once the scale is cast, as the generated code does
    q = mx.ones((len(offsets), 2, 1, 4), mx.bfloat16)
    scale = llama4_attn_scale(mx.array(offsets), 1, 0.1, 8)
    assert (q * scale.astype(q.dtype)).dtype == mx.bfloat16


# --- the MLA recipe handed to the compiler, checked end to end ------------------------------


def randomize(module, seed: int, std: float = 0.3) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in module.state_dict().items():
            if t.is_floating_point():
                # norms around 1 so the latent keeps its scale; everything else random
                t.copy_(torch.randn(t.shape, generator=g) * std + ("layernorm" in name))


class RefMLA(nn.Module):
    """MLA as the report describes it (not the generated class): caches the latent + k_pe."""

    def __init__(self, cfg) -> None:
        super().__init__()
        self.cfg, H = cfg, cfg.hidden_size
        self.qk_head = NOPE + ROPE
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(H, HEADS * self.qk_head, bias=False)
        else:
            self.q_a_proj = nn.Linear(H, cfg.q_lora_rank, bias=cfg.attention_bias)
            self.q_a_layernorm = nn.RMSNorm(cfg.q_lora_rank, eps=1e-6)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, HEADS * self.qk_head, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(H, cfg.kv_lora_rank + ROPE, bias=cfg.attention_bias)
        self.kv_a_layernorm = nn.RMSNorm(cfg.kv_lora_rank, eps=1e-6)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, HEADS * (NOPE + V), bias=False)
        self.o_proj = nn.Linear(HEADS * V, H, bias=cfg.attention_bias)
        rc = RopeConfig.from_config(cfg.to_dict())
        self.rope = make_rope(ROPE, rc, traditional=cfg.rope_interleave)
        self.scale = mla_softmax_scale(self.qk_head, rc)
        self.beta = rc.params.get("llama_4_scaling_beta")
        self.orig = rc.params.get("original_max_position_embeddings")

    def __call__(self, x: mx.array, cache: KVCache) -> mx.array:
        B, L, _ = x.shape
        if "q_proj" in self:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.reshape(B, L, HEADS, self.qk_head).transpose(0, 2, 1, 3)
        q_nope, q_pe = q[..., :NOPE], q[..., NOPE:]
        kv = self.kv_a_proj_with_mqa(x)
        latent = self.kv_a_layernorm(kv[..., : self.cfg.kv_lora_rank])[:, None]  # [B,1,L,r]
        k_pe = kv[..., self.cfg.kv_lora_rank :][:, None]  # [B,1,L,rope]
        offset = cache.offset  # monotonic-position
        q_pe = self.rope(q_pe, offset)
        k_pe = self.rope(k_pe, offset)
        latent, k_pe = cache.update_and_fetch(latent, k_pe)
        S = latent.shape[2]
        kv = self.kv_b_proj(latent[:, 0]).reshape(B, S, HEADS, NOPE + V).transpose(0, 2, 1, 3)
        k_nope, v = kv[..., :NOPE], kv[..., NOPE:]
        k = mx.concatenate([k_nope, mx.broadcast_to(k_pe, (B, HEADS, S, ROPE))], axis=-1)
        q = mx.concatenate([q_nope, q_pe], axis=-1)
        q = q * llama4_attn_scale(offset, L, self.beta, self.orig).astype(q.dtype)
        mask = masks.causal(L, cache.live_len)  # live-window
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


@pytest.mark.parametrize(
    "q_lora_rank,interleave,case",
    [(12, True, "small-orig"), (None, True, "mscale-ratio"), (12, False, "small-orig")],
    ids=["qlora", "noq", "rotate-half"],
)
def test_mla_recipe_matches_mistral4_attention(q_lora_rank, interleave, case):
    # both cases have original_max_position_embeddings < L, so the Llama-4 scale is not 1;
    # mscale-ratio also has a yarn attention_factor != 1 on the rotated parts
    cfg = mistral4_config(case, q_lora_rank=q_lora_rank, rope_interleave=interleave)
    attn = m4.Mistral4Attention(cfg, 0).eval()
    randomize(attn, 3)
    rotary = m4.Mistral4RotaryEmbedding(cfg)
    L = 40
    x = np.random.default_rng(4).standard_normal((2, L, 32)).astype(np.float32)
    xt = torch.from_numpy(x)
    pos = torch.arange(L)[None]
    mask = torch.full((L, L), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        want = attn(xt, rotary(xt, pos), mask, pos)[0].numpy()

    ref = RefMLA(cfg)
    ref.load_weights([(k, mx.array(v.numpy())) for k, v in attn.state_dict().items()], strict=True)
    cache = KVCache()
    # chunked prefill then single-token decode: positions come from cache.offset
    outs = [ref(mx.array(x[:, a:b]), cache) for a, b in ((0, 13), (13, 38), (38, 39), (39, 40))]
    got = np.concatenate([np.array(o) for o in outs], axis=1)
    np.testing.assert_allclose(got, want, atol=ATOL)
    assert np.abs(want).mean() > 0.1
