"""Tiny random Hugging Face checkpoints and independent reference logits.

Every factory writes a float32 checkpoint directory (``config.json`` + safetensors weights, and
by default a small byte-level BPE tokenizer with a chat template) and returns the directory as a
``pathlib.Path``.  Every parameter is re-randomised with real variance after construction:
transformers' own initialisation (std 0.02, norms at exactly 1, biases at 0) is close enough to
zero that a wrong RoPE, a missing bias, a swapped norm or a GQA mix-up barely moves the logits.

Scales, for hidden 64 (all deterministic in ``seed``):
  * Linear weights  N(0, 1.5 / sqrt(fan_in))   -> pre-activations ~ O(1.5), attention scores
                                                   with real spread (softmax is not uniform)
  * biases          N(0, 0.2)
  * embeddings      N(0, 1.0); N(0, 2/sqrt(hidden)) when tied to lm_head, so that tied logits
                    stay O(2) instead of O(sqrt(hidden))
  * norm weights    1 + 0.1 * N(0, 1)            (input/post-attention norms, q/k norms, final)
Resulting logits have a standard deviation of a few units.

Reference logits:
  * llama / qwen2 / qwen3: transformers (PyTorch, CPU, eager attention), loaded with
    ``output_loading_info=True`` and asserted to have no missing/unexpected/mismatched keys.
  * nemotron-nas: mlx-lm's ``nemotron-nas`` model (weights renamed from hub names, loaded
    ``strict=True``); ``nemotron_torch_reference`` is a second, independent oracle assembled from
    transformers' Llama blocks, used to check the first.

torch / transformers / mlx-lm are imported lazily inside functions.
"""

from __future__ import annotations

import copy
import importlib
import json
from pathlib import Path

import numpy as np

VOCAB_SIZE = 384  # >= tokenizer size (~313): byte alphabet + 3 specials + a few merges
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2  # ids of <s>, </s>, <pad> in the factory tokenizer

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}{{ eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

_TOKENIZER_CORPUS = [
    "hello world, this is a tiny model used by the mlxc test-suite.",
    "The quick brown fox jumps over the lazy dog.",
    "user: what is the capital of France? assistant: Paris is the capital.",
    "def main():\n    return 42\n",
    "numbers 0 1 2 3 4 5 6 7 8 9 and punctuation !?.,;:",
]

# llama3 rope scaling with a small original context so that all three branches of the llama3
# rule are exercised at head_dim 16, theta 500000 (the llama default below): wavelengths
# 2*pi*theta^(2i/16) are 6.3 (< 16: high-frequency, unchanged), 32.5 (between 16 and 64:
# smoothed), 168 ... 1.9e5 (> 64: divided by `factor`). No wavelength sits on a boundary, where
# mlx-lm (strict inequalities) and transformers (inclusive) would disagree.
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


# --------------------------------------------------------------------------------------------
# tokenizer
# --------------------------------------------------------------------------------------------


def write_tokenizer(path, vocab_size: int = 320):
    """Train a byte-level BPE tokenizer offline and save it as a HF fast tokenizer in ``path``.

    Specials: ``<s>`` (id 0, bos), ``</s>`` (id 1, eos), ``<pad>`` (id 2). Files written by
    transformers 5: tokenizer.json, tokenizer_config.json, chat_template.jinja.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_TOKENIZER_CORPUS * 4, trainer)
    assert tok.token_to_id("<s>") == BOS_ID and tok.token_to_id("</s>") == EOS_ID
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        chat_template=CHAT_TEMPLATE,
    )
    assert len(fast) <= VOCAB_SIZE
    fast.save_pretrained(str(path))
    return fast


# --------------------------------------------------------------------------------------------
# re-randomisation
# --------------------------------------------------------------------------------------------


def rerandomise(model, seed: int):
    """transformers' init is near zero and hides bugs: every parameter of the torch ``model``
    redrawn with real variance (matrices ~ 1.2 / sqrt(fan_in), norm weights ~ 1 + 0.2 N, other
    vectors ~ 0.2 N). Returns the generator, for the caller's architecture-specific draws."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                base = 1.0 if "norm" in name else 0.0
                p.copy_(base + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 1.2 / p.shape[-1] ** 0.5)
    return g


def _randomise_torch(model, seed: int):
    import torch

    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    embed_std = 2.0 / model.config.hidden_size**0.5 if tied else 1.0

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        # named_parameters() de-duplicates tied weights, so a tied lm_head is drawn once.
        for name, p in model.named_parameters():
            if "norm" in name:  # input/post_attention_layernorm, q_norm, k_norm, model.norm
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith((".bias", "_bias")):  # _bias: gpt-oss's fused expert biases
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith(".sinks"):  # gpt-oss: one logit per head, around the scores'
                p.copy_(torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(embed_std * torch.randn(p.shape, generator=g))
            elif p.ndim == 2 or p.ndim == 3:  # nn.Linear weight [out, in]
                p.copy_(torch.randn(p.shape, generator=g) * (1.5 / p.shape[1] ** 0.5))
            else:
                raise AssertionError(f"unexpected parameter {name} {tuple(p.shape)}")


def _to_legacy_config(path: Path):
    """Rewrite a transformers-5 config.json into the pre-5 form hub checkpoints use:
    ``rope_theta`` + ``rope_scaling`` at top level (no ``rope_parameters``), ``torch_dtype``."""
    cfg_path = Path(path) / "config.json"
    cfg = json.loads(cfg_path.read_text())
    rope = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = rope.pop("rope_theta")
    if rope.get("rope_type", "default") == "default":
        cfg["rope_scaling"] = None
    else:
        cfg["rope_scaling"] = rope
    if "dtype" in cfg:
        cfg["torch_dtype"] = cfg.pop("dtype")
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _make_hf(
    config_cls,
    model_cls,
    path,
    defaults: dict,
    overrides: dict,
    *,
    seed: int,
    tokenizer: bool,
    legacy_config: bool,
    max_shard_size=None,
):
    import torch

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    kwargs = {**defaults, **overrides}
    rope_theta = kwargs.pop("rope_theta", 10000.0)
    rope_scaling = kwargs.pop("rope_scaling", None)
    if "rope_parameters" not in kwargs:
        kwargs["rope_parameters"] = {"rope_type": "default", **(rope_scaling or {})}
        kwargs["rope_parameters"]["rope_theta"] = rope_theta
    config = config_cls(**kwargs)
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    _randomise_torch(model, seed)
    save_kwargs = {"safe_serialization": True}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(str(path), **save_kwargs)
    if legacy_config:
        _to_legacy_config(path)
    if tokenizer:
        write_tokenizer(path)
    return path


_COMMON = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 3,
    "intermediate_size": 160,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "pad_token_id": PAD_ID,
}


def make_llama(
    path, *, seed=0, tokenizer=True, legacy_config=False, max_shard_size=None, **overrides
):
    """LlamaForCausalLM. Overrides are LlamaConfig kwargs, plus ``rope_theta`` and
    ``rope_scaling`` (e.g. ``LLAMA3_ROPE``) which are folded into ``rope_parameters``.

    Weights: model.embed_tokens.weight, model.layers.N.{input_layernorm,post_attention_layernorm}
    .weight, model.layers.N.self_attn.{q,k,v,o}_proj.weight (+ .bias if attention_bias),
    model.layers.N.mlp.{gate,up,down}_proj.weight (+ .bias if mlp_bias), model.norm.weight,
    lm_head.weight.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    defaults = dict(
        _COMMON, head_dim=16, attention_bias=False, mlp_bias=False, rope_theta=500_000.0
    )
    return _make_hf(
        LlamaConfig,
        LlamaForCausalLM,
        path,
        defaults,
        overrides,
        seed=seed,
        tokenizer=tokenizer,
        legacy_config=legacy_config,
        max_shard_size=max_shard_size,
    )


def make_qwen2(
    path, *, seed=0, tokenizer=True, legacy_config=False, max_shard_size=None, **overrides
):
    """Qwen2ForCausalLM: always q/k/v biases (no o_proj bias, no MLP bias), head_dim is
    hidden/heads (Qwen2Config has no head_dim key). Default GQA 4 heads / 2 kv heads."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    defaults = dict(_COMMON, num_key_value_heads=2, rope_theta=1_000_000.0)
    return _make_hf(
        Qwen2Config,
        Qwen2ForCausalLM,
        path,
        defaults,
        overrides,
        seed=seed,
        tokenizer=tokenizer,
        legacy_config=legacy_config,
        max_shard_size=max_shard_size,
    )


def make_qwen3(
    path, *, seed=0, tokenizer=True, legacy_config=False, max_shard_size=None, **overrides
):
    """Qwen3ForCausalLM: per-head RMSNorm on q and k (self_attn.{q,k}_norm.weight, shape
    [head_dim]) before RoPE, no biases by default, explicit head_dim (may differ from
    hidden/heads). Default GQA 4 heads / 2 kv heads."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    defaults = dict(
        _COMMON, num_key_value_heads=2, head_dim=16, rope_theta=1_000_000.0, attention_bias=False
    )
    return _make_hf(
        Qwen3Config,
        Qwen3ForCausalLM,
        path,
        defaults,
        overrides,
        seed=seed,
        tokenizer=tokenizer,
        legacy_config=legacy_config,
        max_shard_size=max_shard_size,
    )


# Keys the gpt-oss hub config.json has and transformers 5 does not write (read by nothing).
GPT_OSS_HUB_ONLY = {"experts_per_token": 2, "initial_context_length": 16}
# yarn with a small original context, so that short prompts reach the interpolated dims.
GPT_OSS_ROPE = {
    "rope_type": "yarn",
    "factor": 4.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "original_max_position_embeddings": 16,
    "truncate": False,
}


def make_gpt_oss(
    path, *, seed=0, tokenizer=True, legacy_config=False, max_shard_size=None, **overrides
):
    """GptOssForCausalLM: GQA with q/k/v/o biases and per-head sinks, sliding (window 8) and
    full layers alternating, yarn RoPE, routed experts (4, top-2) with a biased router and
    clamped SwiGLU experts. ``swiglu_limit`` is 2.0 (the hub's is 7.0) so that the clamps act
    at these weights' scale. Weights as the bf16 hub checkpoints and transformers 5 name them:
    model.layers.N.mlp.router.{weight,bias}, mlp.experts.gate_up_proj [E, H, 2I] (gate and up
    interleaved), gate_up_proj_bias, down_proj [E, I, H], down_proj_bias, self_attn.sinks.
    ``legacy_config``: the hub's config form (rope_theta + rope_scaling, no swiglu_alpha, and
    its extra keys); otherwise transformers 5's."""
    from transformers import GptOssConfig, GptOssForCausalLM

    defaults = dict(
        _COMMON,
        num_hidden_layers=2,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=64,
        max_position_embeddings=64,  # factor x original: transformers warns otherwise
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        swiglu_limit=2.0,
        attention_bias=True,
        rope_theta=150_000.0,
        rope_scaling=GPT_OSS_ROPE,
        router_aux_loss_coef=0.9,
    )
    path = _make_hf(
        GptOssConfig,
        GptOssForCausalLM,
        path,
        defaults,
        overrides,
        seed=seed,
        tokenizer=tokenizer,
        legacy_config=legacy_config,
        max_shard_size=max_shard_size,
    )
    if legacy_config:
        cfg_path = path / "config.json"
        cfg = json.loads(cfg_path.read_text())
        if cfg.pop("swiglu_alpha") != 1.702:
            raise ValueError("the hub config has no swiglu_alpha: it is 1.702 there")
        cfg_path.write_text(json.dumps(cfg | GPT_OSS_HUB_ONLY, indent=2, sort_keys=True) + "\n")
    return path


# --------------------------------------------------------------------------------------------
# nemotron-nas (DeciLM): not in transformers, written by hand in hub format
# --------------------------------------------------------------------------------------------


def _attn(no_op=False, linear=False, group=None):
    return {
        "n_heads_in_group": None if (no_op or linear) else group,
        "no_op": no_op,
        "num_sink_tokens": None,
        "replace_with_linear": linear,
        "sparsify": None,
        "unshifted_sink": False,
        "use_prefill_window_in_sink_attention": False,
        "window_length": None,
    }


def _ffn(no_op=False, linear=False, mult=None):
    return {
        "ffn_mult": None if (no_op or linear) else mult,
        "no_op": no_op,
        "replace_with_linear": linear,
        "sparsify": None,
    }


# Mixed default: two GQA group sizes (2 -> 2 kv heads, 4 -> 1 kv head), a no-op attention,
# a linear-replacement attention, a linear FFN, a no-op FFN, and two FFN widths
# (ffn_mult 1.0 -> 256, 7.5 -> 512 at hidden 64; every mult <= 6 rounds to 256 there).
NEMOTRON_MIXED_BLOCKS = [
    {"attention": _attn(group=2), "ffn": _ffn(mult=1.0)},
    {"attention": _attn(no_op=True), "ffn": _ffn(mult=7.5)},
    {"attention": _attn(group=4), "ffn": _ffn(linear=True)},
    {"attention": _attn(linear=True), "ffn": _ffn(mult=1.0)},
    {"attention": _attn(group=2), "ffn": _ffn(no_op=True)},
    {"attention": _attn(group=4), "ffn": _ffn(mult=7.5)},
]


def nemotron_intermediate_size(ffn_mult: float, hidden_size: int) -> int:
    """mlx-lm / DeciLM rule: int(2 * ffn_mult * hidden / 3) rounded up to a multiple of 256."""
    n = int(2 * round(ffn_mult, 6) * hidden_size / 3)
    return n if n % 256 == 0 else n + 256 - n % 256


def nemotron_hub_weight_shapes(config: dict) -> dict:
    """Hub weight names and shapes for a nemotron-nas config."""
    h = config["hidden_size"]
    nh = config["num_attention_heads"]
    hd = h // nh
    v = config["vocab_size"]
    shapes = {"model.embed_tokens.weight": (v, h)}
    for i, blk in enumerate(config["block_configs"]):
        a, f = blk["attention"], blk["ffn"]
        p = f"model.layers.{i}."
        if not a["no_op"]:
            shapes[p + "input_layernorm.weight"] = (h,)
            if a["replace_with_linear"]:
                shapes[p + "self_attn.linear_attn.weight"] = (h, h)
            else:
                kv = nh // a["n_heads_in_group"]
                shapes[p + "self_attn.q_proj.weight"] = (nh * hd, h)
                shapes[p + "self_attn.k_proj.weight"] = (kv * hd, h)
                shapes[p + "self_attn.v_proj.weight"] = (kv * hd, h)
                shapes[p + "self_attn.o_proj.weight"] = (h, nh * hd)
        if not f["no_op"]:
            shapes[p + "post_attention_layernorm.weight"] = (h,)
            if f["replace_with_linear"]:
                shapes[p + "mlp.linear_mlp.weight"] = (h, h)
            else:
                inter = nemotron_intermediate_size(f["ffn_mult"], h)
                shapes[p + "mlp.gate_proj.weight"] = (inter, h)
                shapes[p + "mlp.up_proj.weight"] = (inter, h)
                shapes[p + "mlp.down_proj.weight"] = (h, inter)
    shapes["model.norm.weight"] = (h,)
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (v, h)
    return shapes


def make_nemotron_nas(
    path, *, seed=0, tokenizer=True, block_configs=None, shards: int = 1, **overrides
):
    """Hub-format nemotron-nas (DeciLMForCausalLM) checkpoint: hand-written config.json in the
    pre-transformers-5 form (``rope_theta`` + ``rope_scaling``, ``torch_dtype``) and float32
    safetensors with hub names (``self_attn.linear_attn`` / ``mlp.linear_mlp`` for the linear
    replacements; no norm for a no-op sub-block). ``shards > 1`` writes
    model-0000k-of-0000n.safetensors + model.safetensors.index.json."""
    from safetensors.numpy import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    blocks = copy.deepcopy(block_configs if block_configs is not None else NEMOTRON_MIXED_BLOCKS)
    config = {
        "architectures": ["DeciLMForCausalLM"],
        "attention_bias": False,
        "auto_map": {
            "AutoConfig": "configuration_decilm.DeciLMConfig",
            "AutoModelForCausalLM": "modeling_decilm.DeciLMForCausalLM",
        },
        "block_configs": blocks,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": None,
        "max_position_embeddings": 512,
        "mlp_bias": False,
        "model_type": "nemotron-nas",
        "num_attention_heads": 4,
        "num_hidden_layers": len(blocks),
        "num_key_value_heads": None,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-5,
        "rope_scaling": dict(LLAMA3_ROPE),
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "transformers_version": "4.48.3",
        "use_cache": True,
        "vocab_size": VOCAB_SIZE,
    }
    config.update(overrides)
    config["num_hidden_layers"] = len(config["block_configs"])
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in nemotron_hub_weight_shapes(config).items():
        if "norm" in name:
            w = 1.0 + 0.1 * rng.standard_normal(shape)
        elif "embed_tokens" in name:
            w = rng.standard_normal(shape)
        else:
            w = rng.standard_normal(shape) * (1.5 / shape[1] ** 0.5)
        weights[name] = np.ascontiguousarray(w, dtype=np.float32)

    names = list(weights)
    if shards <= 1:
        save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    else:
        parts = np.array_split(np.arange(len(names)), shards)
        weight_map = {}
        for k, idx in enumerate(parts, start=1):
            fname = f"model-{k:05d}-of-{shards:05d}.safetensors"
            part = {names[j]: weights[names[j]] for j in idx}
            save_file(part, str(path / fname), metadata={"format": "pt"})
            weight_map.update({n: fname for n in part})
        total = sum(w.nbytes for w in weights.values())
        (path / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        )
    if tokenizer:
        write_tokenizer(path)
    return path


# --------------------------------------------------------------------------------------------
# reference logits
# --------------------------------------------------------------------------------------------


def read_config(path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


def _load_safetensors_numpy(path) -> dict:
    from safetensors.numpy import load_file

    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def reference_logits(path, input_ids) -> np.ndarray:
    """Logits [B, L, V] (float32 numpy) from an independent implementation, full causal forward
    from position 0 with no padding."""
    input_ids = np.asarray(input_ids, dtype=np.int64)
    assert input_ids.ndim == 2
    model_type = read_config(path)["model_type"]
    if model_type in ("nemotron-nas", "nemotron_nas"):
        return _mlx_lm_nemotron_logits(path, input_ids)
    return _transformers_logits(path, input_ids)


def _transformers_logits(path, input_ids):
    import torch
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        str(path), output_loading_info=True, dtype=torch.float32, attn_implementation="eager"
    )
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info.get(key), f"{key} while loading reference model: {info.get(key)}"
    model.eval()
    with torch.no_grad():
        out = model(torch.from_numpy(input_ids), use_cache=False)
    return out.logits.to(torch.float32).numpy()


def _mlx_lm_nemotron_model(path):
    import mlx.core as mx

    mod = importlib.import_module("mlx_lm.models.nemotron-nas")
    args = mod.ModelArgs.from_dict(read_config(path))
    model = mod.Model(args)
    weights = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        weights.update(mx.load(str(f)))
    renamed = []
    for name, w in weights.items():
        name = name.replace("self_attn.linear_attn.", "self_attn.linear.")
        name = name.replace("mlp.linear_mlp.", "mlp.linear.")
        renamed.append((name, w))
    renamed = list(model.sanitize(dict(renamed)).items())
    model.load_weights(renamed, strict=True)
    mx.eval(model.parameters())
    return model


def _mlx_lm_nemotron_logits(path, input_ids):
    import mlx.core as mx

    model = _mlx_lm_nemotron_model(path)
    logits = model(mx.array(input_ids.astype(np.int32)))
    mx.eval(logits)
    return np.array(logits.astype(mx.float32))


def nemotron_torch_reference(path, input_ids) -> np.ndarray:
    """Second nemotron-nas oracle, independent of mlx: transformers' Llama RMSNorm / attention /
    MLP / rotary modules assembled per the block configs (PyTorch, CPU, eager, explicit causal
    mask). No-op sub-blocks skip norm + residual entirely; linear replacements are a bias-free
    Linear applied to the normed input."""
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama import modeling_llama as ml

    cfg = read_config(path)
    sd = {k: torch.from_numpy(v) for k, v in _load_safetensors_numpy(path).items()}
    h, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    rope = {"rope_type": "default", **(cfg.get("rope_scaling") or {})}
    rope["rope_theta"] = cfg["rope_theta"]

    def llama_cfg(kv_heads=nh, inter=4 * h):
        c = LlamaConfig(
            vocab_size=cfg["vocab_size"],
            hidden_size=h,
            num_attention_heads=nh,
            num_key_value_heads=kv_heads,
            intermediate_size=inter,
            head_dim=h // nh,
            rms_norm_eps=cfg["rms_norm_eps"],
            rope_parameters=rope,
            max_position_embeddings=cfg["max_position_embeddings"],
            hidden_act=cfg["hidden_act"],
            attention_bias=False,
            mlp_bias=False,
        )
        c._attn_implementation = "eager"
        return c

    def load(module, prefix):
        own = {k[len(prefix) :]: v for k, v in sd.items() if k.startswith(prefix)}
        module.load_state_dict(own, strict=True)  # raises on any missing / unexpected key
        return module.eval()

    def linear(prefix):
        lin = torch.nn.Linear(h, h, bias=False)
        lin.weight.data.copy_(sd[prefix + "weight"])
        return lin

    B, L = input_ids.shape
    ids = torch.from_numpy(np.asarray(input_ids, dtype=np.int64))
    with torch.no_grad():
        x = sd["model.embed_tokens.weight"][ids]
        pos = torch.arange(L)[None].expand(B, L)
        cos_sin = ml.LlamaRotaryEmbedding(llama_cfg())(x, pos)
        mask = torch.full((L, L), torch.finfo(torch.float32).min).triu(1)[None, None]
        for i, blk in enumerate(cfg["block_configs"]):
            a, f = blk["attention"], blk["ffn"]
            p = f"model.layers.{i}."
            if not a["no_op"]:
                norm = load(ml.LlamaRMSNorm(h, eps=cfg["rms_norm_eps"]), p + "input_layernorm.")
                hn = norm(x)
                if a["replace_with_linear"]:
                    x = x + linear(p + "self_attn.linear_attn.")(hn)
                else:
                    attn = load(
                        ml.LlamaAttention(
                            llama_cfg(kv_heads=nh // a["n_heads_in_group"]), layer_idx=i
                        ),
                        p + "self_attn.",
                    )
                    x = x + attn(hn, position_embeddings=cos_sin, attention_mask=mask)[0]
            if not f["no_op"]:
                norm = load(
                    ml.LlamaRMSNorm(h, eps=cfg["rms_norm_eps"]), p + "post_attention_layernorm."
                )
                hn = norm(x)
                if f["replace_with_linear"]:
                    x = x + linear(p + "mlp.linear_mlp.")(hn)
                else:
                    inter = nemotron_intermediate_size(f["ffn_mult"], h)
                    mlp = load(ml.LlamaMLP(llama_cfg(inter=inter)), p + "mlp.")
                    x = x + mlp(hn)
        x = load(ml.LlamaRMSNorm(h, eps=cfg["rms_norm_eps"]), "model.norm.")(x)
        w = (
            sd["model.embed_tokens.weight"]
            if cfg.get("tie_word_embeddings")
            else sd["lm_head.weight"]
        )
        return (x @ w.T).numpy()


def make_nemotron_h(path, seed: int = 0) -> Path:
    """A hub-format nemotron_h checkpoint (Mamba2, attention and MLP layers) with the factory
    tokenizer: tests/test_nemotron_h.py's."""
    from test_nemotron_h import make_nemotron_h

    return make_nemotron_h(path, seed)[1]


def make_jamba(path, seed: int = 0) -> Path:
    """A hub-format jamba checkpoint (Mamba and attention layers, SwiGLU and routed-expert
    MLPs) with the factory tokenizer: tests/test_jamba.py's."""
    from test_jamba import make_jamba

    return make_jamba(path, seed)[1]


def make_granitemoehybrid(path, seed: int = 0) -> Path:
    """A hub-format granitemoehybrid checkpoint (Mamba2 and attention layers, routed experts
    plus a shared MLP) with the factory tokenizer: tests/test_granitemoehybrid.py's."""
    from test_granitemoehybrid import make_granite

    return make_granite(path, seed)[1]


SPECS_DIR = Path(__file__).resolve().parents[1] / "specs"
SPEC_NAMES = sorted(p.stem for p in SPECS_DIR.glob("*.yaml"))


def spec_model(name: str, seed: int = 0):
    """The generated model of ``specs/NAME.yaml`` (``mlxc.generated``) built from the spec's
    ``tiny_config``, its weights randomised as ``mlxc verify`` does."""
    import yaml

    from mlxc.verify import randomize

    module = importlib.import_module(f"mlxc.generated.{name}")
    config = yaml.safe_load((SPECS_DIR / f"{name}.yaml").read_text())["tiny_config"]
    model = module.Model(module.ModelArgs.from_config(config))
    randomize(model, seed)
    return model
