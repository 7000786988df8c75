"""Shared pieces of the MLA family tests (deepseek_v3, glm4_moe_lite, deepseek_v2, minicpm3):
tiny re-randomised transformers models saved in transformers-5 or hub (transformers-4) form,
and the checks every family runs against them (full forward, chunked prefill then decode, the
latent cache's size).

Every parameter is re-randomised with real variance (transformers' init hides bugs), and so is
the sigmoid router's ``e_score_correction_bias``, a buffer (zero at init: a wrong sign or a bias
added to the weights would pass unseen). float32, atol 1e-4.
"""

from __future__ import annotations

import json
from pathlib import Path

import checkpoints as ckpt
import mlx.core as mx
import numpy as np
import torch

import mlxc

ATOL = 1e-4


def rerandomise(model: torch.nn.Module, seed: int) -> None:
    """``checkpoints.rerandomise``, and the routers' correction biases (buffers) too."""
    g = ckpt.rerandomise(model, seed)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.2 * torch.randn(b.shape, generator=g))


def to_hub_config(path: Path, extra: dict | None = None) -> None:
    """config.json as the hub ships it (transformers 4): ``rope_theta`` + ``rope_scaling``
    (``type``, not ``rope_type``) at top level, ``torch_dtype``; ``extra`` keys added."""
    cfg_path = Path(path) / "config.json"
    cfg = json.loads(cfg_path.read_text())
    rope = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = rope.pop("rope_theta")
    kind = rope.pop("rope_type", "default")
    rope.pop("type", None)
    cfg["rope_scaling"] = None if kind == "default" else {"type": kind, **rope}
    cfg["torch_dtype"] = cfg.pop("dtype", "float32")
    cfg.update(extra or {})
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def reference(model: torch.nn.Module, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(ids)).logits.numpy()


def check_full_forward(hf, path, seed=0, length=40) -> None:
    ids = np.random.default_rng(seed).integers(0, hf.config.vocab_size, size=(2, length))
    model = mlxc.load_model(path)
    got = np.array(model(mx.array(ids), cache=model.make_cache()))
    np.testing.assert_allclose(got, reference(hf, ids), atol=ATOL, rtol=0)


def check_chunked_prefill_and_decode(hf, path, seed=1) -> None:
    """Chunks of a prefill, then single-token decode steps (the absorbed path) equal the full
    forward of transformers."""
    ids = np.random.default_rng(seed).integers(0, hf.config.vocab_size, size=(1, 36))
    model = mlxc.load_model(path)
    cache, parts = model.make_cache(), []
    for a, b in [(0, 13), (13, 30), (30, 33), (33, 34), (34, 35), (35, 36)]:
        parts.append(np.array(model(mx.array(ids[:, a:b]), cache=cache)))
    np.testing.assert_allclose(np.concatenate(parts, axis=1), reference(hf, ids), atol=ATOL, rtol=0)
    assert cache.offset == 36


def check_decode_in_cuda_layout(hf, path, monkeypatch) -> None:
    """Decode with kv_b_proj's halves as CUDA keeps them (transposed views of ``[H, out, in]``,
    ``latent.split_kv_b``) equals transformers too."""
    from mlxc.runtime.model import latent

    asked = []
    monkeypatch.setattr(latent, "_transposed_weights", lambda: asked.append(1) or True)
    check_chunked_prefill_and_decode(hf, path)
    assert asked  # decode took the split (once per layer)


def check_latent_cache(path, kv_lora_rank: int, qk_rope_head_dim: int) -> None:
    """Each layer caches one shared head per token: the latent (``kv_lora_rank``) as its keys
    and the rope key (``qk_rope_head_dim``) as its values: the latent's bytes, not per-head
    K/V."""
    model = mlxc.load_model(path)
    cache = model.make_cache()
    model(mx.array([[1, 2, 3, 4, 5]]), cache=cache)
    for layer in cache:
        assert layer.keys.shape[1] == 1 and layer.keys.shape[-1] == kv_lora_rank
        assert layer.values.shape[1] == 1 and layer.values.shape[-1] == qk_rope_head_dim
        assert layer.nbytes == 5 * (kv_lora_rank + qk_rope_head_dim) * 4
