"""The built-in demo checkpoint: what ``mlxc serve`` and ``mlxc generate`` run on when no
``--model`` is given.

A small llama-spec model (hidden 256, 4 layers) with RANDOM weights, so the server runs on a
fresh machine with no download. Its output is meaningless text; the log and ``/v1/models``
say so. Everything is deterministic: a byte-level tokenizer built without training (the 256
bytes plus a few special tokens), weights from a seeded numpy generator. It is written once
into ``$MLXC_HOME/demo-v1`` (default ``~/.cache/mlxc/demo-v1``) through a temporary directory
renamed into place, so a crash or a concurrent first run never leaves a half-written one.
"""

from __future__ import annotations

import json
import os
import shutil
import string
import tempfile
from pathlib import Path

import numpy as np

from mlxc.runtime.home import mlxc_home

DEMO_NAME = "demo-v1"  # bump when the recipe changes, so old caches are not reused
DEMO_MODEL_ID = "mlxc-demo"
DEMO_DESCRIPTION = (
    "mlxc built-in demo checkpoint: RANDOM weights (no download, no training); "
    "the output is meaningless text. Serve a real model with `mlxc serve --model DIR`."
)
SEED = 20240501

SPECIALS = ["<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]
BOS_ID, EOS_ID, PAD_ID = 256, 257, 258  # the specials follow the 256 byte tokens

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 264,  # 256 bytes + 6 specials, rounded up to a multiple of 8
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": True,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "pad_token_id": PAD_ID,
    "torch_dtype": "float32",
    "mlxc_demo": DEMO_DESCRIPTION,
}


def no_model_warning(doing: str, path: Path) -> str:
    """What a command says when, given no --model, it runs on the demo (``doing``: "serving")."""
    return (
        f"no --model: {doing} the built-in demo checkpoint {path}. Its weights are RANDOM: the "
        "output is meaningless text. Pass --model DIR to use a real model."
    )


def demo_dir() -> Path:
    """Where the demo checkpoint lives: ``$MLXC_HOME/demo-v1``, else the user cache dir."""
    return Path(mlxc_home()) / DEMO_NAME


def ensure_demo(path: Path | None = None) -> Path:
    """The demo checkpoint directory, written on first use (atomically)."""
    path = demo_dir() if path is None else Path(path)
    if (path / "config.json").is_file():
        return path
    if path.exists():
        raise RuntimeError(f"{path} exists but holds no demo checkpoint; delete it and retry")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the checkpoint is not a secret
    try:
        write_demo(tmp)
        try:
            os.rename(tmp, path)
        except OSError:
            if not (path / "config.json").is_file():  # not a concurrent first run: a real error
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone after a successful rename
    return path


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what the ByteLevel pre-tokenizer emits)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\u00a1"), ord("\u00ac") + 1),
        *range(ord("\u00ae"), ord("\u00ff") + 1),
    ]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


# Which bytes a vocabulary too small for all 256 keeps, most useful first; the rest are <unk>.
_BYTE_PRIORITY = ("\n \t\r" + string.ascii_letters + string.digits + string.punctuation).encode()


def write_tokenizer(path: Path, vocab_size: int = 256 + len(SPECIALS)) -> dict[str, int]:
    """Byte-level tokenizer of exactly ``vocab_size`` ids, no merges, no training; returns the
    ``bos/eos/pad_token_id`` entries of config.json.

    Ids: the bytes (token id = byte value when all 256 fit; else the most useful bytes, in byte
    order, then ``<unk>`` for the others), then ``SPECIALS``, then reserved ``<|extra_N|>``
    specials up to ``vocab_size``: every id of the model's vocabulary decodes, and no text
    encodes to an id past it. The default is the demo's: the 256 bytes and the specials.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    n_bytes = min(256, vocab_size - len(SPECIALS))
    unk = n_bytes < 256
    if unk:
        n_bytes -= 1  # room for <unk>
    if n_bytes < 1:
        raise ValueError(
            f"vocab_size {vocab_size} is too small for a tokenizer: it needs at least "
            f"{len(SPECIALS) + 2} ids"
        )
    rest = [b for b in range(256) if b not in _BYTE_PRIORITY]
    kept = sorted([*_BYTE_PRIORITY, *rest][:n_bytes])
    chars = _bytes_to_unicode()
    vocab = {chars[b]: i for i, b in enumerate(kept)}
    if unk:
        vocab["<unk>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>" if unk else None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    extras = [f"<|extra_{i}|>" for i in range(vocab_size - len(vocab) - len(SPECIALS))]
    tok.add_special_tokens(["<unk>"] * unk + SPECIALS + extras)
    assert tok.get_vocab_size() == vocab_size, (tok.get_vocab_size(), vocab_size)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        **({"unk_token": "<unk>"} if unk else {}),
        chat_template=CHAT_TEMPLATE,
    )
    fast.save_pretrained(str(path))
    ids = {"bos": "<s>", "eos": "</s>", "pad": "<pad>"}
    return {f"{k}_token_id": tok.token_to_id(t) for k, t in ids.items()}


def _weight_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    h, inter, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c["vocab_size"], h)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        }
    shapes["model.norm.weight"] = (h,)
    return shapes  # tied embeddings: no lm_head


def write_demo(path: Path) -> None:
    """Write the demo checkpoint (config, float32 safetensors, tokenizer) into ``path``."""
    from safetensors.numpy import save_file

    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(SEED)
    weights = {}
    for name, shape in _weight_shapes(CONFIG).items():
        if "norm" in name:
            w = np.ones(shape)
        elif "embed_tokens" in name:
            # Tied to the output head: keep logits O(2), not O(sqrt(hidden)).
            w = rng.standard_normal(shape) * (2.0 / CONFIG["hidden_size"] ** 0.5)
        else:
            w = rng.standard_normal(shape) / shape[1] ** 0.5
        weights[name] = np.ascontiguousarray(w, dtype=np.float32)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    ids = write_tokenizer(path)
    assert all(CONFIG[k] == v for k, v in ids.items()), ids
    (path / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
