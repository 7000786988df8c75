"""A tiny stand-in for a generated module (same interface), plus checkpoint/tokenizer writers.

Loading and generation tests run against this instead of a real generated module, so they do
not depend on the compiler; tests point the loader's registry at it with ``use_toy``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_flatten

from mlxc.runtime.model import masks
from mlxc.runtime.model.cache import KVCache
from mlxc.runtime.model.multimodal import SequenceCache

CONFIG = {
    "model_type": "toy",
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "vocab_size": 260,
    "tie_word_embeddings": False,
    "eos_token_id": 257,
}


@dataclass
class ModelArgs:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False

    @classmethod
    def from_config(cls, config: dict) -> ModelArgs:
        try:
            args = cls(**{k: config[k] for k in cls.__dataclass_fields__ if k in config})
        except TypeError as e:
            raise ValueError(f"bad toy config: {e}") from e
        if args.hidden_size % args.num_attention_heads:
            raise ValueError("hidden_size must be a multiple of num_attention_heads")
        return args


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        h = args.hidden_size
        self.n_heads = args.num_attention_heads
        self.head_dim = h // self.n_heads
        self.q_proj = nn.Linear(h, h, bias=False)
        self.k_proj = nn.Linear(h, h, bias=False)
        self.v_proj = nn.Linear(h, h, bias=False)
        self.o_proj = nn.Linear(h, h, bias=False)

    def __call__(self, x: mx.array, cache: KVCache, offset, mask) -> mx.array:
        B, L, _ = x.shape

        def heads(t):
            return t.reshape(B, L, self.n_heads, self.head_dim).transpose(0, 2, 1, 3)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        q = mx.fast.rope(
            q, self.head_dim, traditional=False, base=10000.0, scale=1.0, offset=offset
        )
        k = mx.fast.rope(
            k, self.head_dim, traditional=False, base=10000.0, scale=1.0, offset=offset
        )
        k, v = cache.update_and_fetch(k, v)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.head_dim**-0.5, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class Block(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(args.hidden_size)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def __call__(self, x: mx.array, cache: KVCache, offset, mask) -> mx.array:
        x = x + self.self_attn(self.input_layernorm(x), cache, offset, mask)
        return x + self.down_proj(nn.gelu(self.up_proj(self.post_attention_layernorm(x))))


class Inner(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [Block(args) for _ in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size)


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = Inner(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(
        self, input_ids: mx.array, cache: list | None = None, last_only: bool = False
    ) -> mx.array:
        cache = cache or self.make_cache()
        x = self.model.embed_tokens(input_ids)
        # Read once for every layer, as generated code does: monotonic-position for RoPE,
        # live-window for the mask (sized to the keys once this chunk is appended).
        L = input_ids.shape[1]
        offset = cache.offset
        kv = cache.windows()[None]  # full attention only
        mask = masks.causal(L, kv.live_len + L, kv.key_valid(L))
        for layer, c in zip(self.model.layers, cache):
            x = layer(x, c, offset, mask)
        x = self.model.norm(x)
        if last_only:
            x = x[:, -1:, :]
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(x)
        return self.lm_head(x)

    def make_cache(self) -> SequenceCache:
        return SequenceCache([KVCache() for _ in self.model.layers])

    def sanitize(self, weights: dict) -> dict:
        # The same kind of rules a spec declares: drop HF buffers, honour tied embeddings.
        weights = {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
        if self.args.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        return weights


# --- checkpoint writers ---------------------------------------------------------------------


def random_weights(config: dict = CONFIG, seed: int = 0) -> dict[str, mx.array]:
    """Random float32 weights of the toy model, by checkpoint name."""
    mx.random.seed(seed)
    model = Model(ModelArgs.from_config(config))
    return {k: mx.random.normal(v.shape) * 0.2 for k, v in tree_flatten(model.parameters())}


def random_model(config: dict = CONFIG, seed: int = 0) -> Model:
    """The toy model holding ``random_weights``, evaluated."""
    model = Model(ModelArgs.from_config(config))
    model.load_weights(list(random_weights(config, seed).items()))
    mx.eval(model.parameters())
    return model


def write_checkpoint(
    path: Path, weights: dict | None = None, config: dict | None = None, shards: int = 1
) -> Path:
    """Write config.json and the weights (sharded with an index when ``shards`` > 1)."""
    path.mkdir(parents=True, exist_ok=True)
    config = dict(CONFIG if config is None else config)
    weights = random_weights(config) if weights is None else weights
    (path / "config.json").write_text(json.dumps(config))
    if shards == 1:
        mx.save_safetensors(str(path / "model.safetensors"), weights)
        return path
    names = sorted(weights)
    weight_map = {}
    for i in range(shards):
        shard = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i::shards]
        mx.save_safetensors(str(path / shard), {k: weights[k] for k in part})
        weight_map.update(dict.fromkeys(part, shard))
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    return path


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what the ByteLevel pre-tokenizer uses)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def write_tokenizer(path: Path, chat_template: bool = True) -> Path:
    """A byte-level tokenizer: ids 0-255 are bytes, 256 <s>, 257 </s> (fits vocab 260)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    table = _bytes_to_unicode()
    assert set(table.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    vocab = {table[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.add_special_tokens({"bos_token": "<s>", "eos_token": "</s>"})
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE
    path.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(path))
    return path
