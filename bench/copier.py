"""A llama checkpoint of the benchmark's shape whose greedy output copies its prompt, so that
prompt-lookup decoding can be measured on a model that accepts drafts::

    python -m bench.copier --size small --out /tmp/copier-small

Random weights do not copy (``bench.speculative``'s random-model runs accepted 3-11% of the
drafts), and no trained checkpoint can be downloaded here. Training a narrow llama to copy on
this project's 2-core CPU stayed on its loss plateau for 800+ steps (induction heads form late),
so the copier is built by hand instead: the induction circuit that trained models learn (Olsson
et al., 2022, "In-context learning and induction heads"), written into the weights of a narrow
llama (hidden 256, two layers, head dim 64, four query heads per KV head and the RoPE of the
bench llama):

- the embedding of every token the copier knows holds a constant channel (dim 0) and a random
  content vector (64 dims); the stream has two more 64-dim slots, for the previous token's
  content and the one before's;
- layer 0: the query and key come from the constant channel only, the key turned back by one
  position in the fastest RoPE pairs, so head 0's score ``sum cos(theta_f (i - j - 1))`` peaks
  at ``j = i - 1``; head 1's query is turned back once more and peaks at ``j = i - 2``. Each
  writes the content it attends to into its slot;
- layer 1, head 0 is the induction head: its query is (this token, the previous token), its key
  (the previous token, the one before), in the RoPE pairs that turn least (under 0.45 rad over
  1,000 positions), so it attends to the positions that followed an earlier occurrence of the
  same two tokens, and writes their content into the content slot, ~13 times the current
  token's own;
- the tied output scores each token's content against the stream's: the copied one wins.

Every other head, MLP and weight is zero. The result is a real forward of the bench llama's
architecture; only the weights are chosen rather than learned. Where the two tokens before
occur twice with different continuations (the task's one change), it takes one of them.

The narrow model is then written into the bench llama's shape (``bench.models``, ``small`` or
``medium``) with zeros around it, so that each forward costs what the bench model's costs while
its logits are the narrow model's:

- its hidden dims, heads and MLP rows fill the first rows and columns of the wide tensors; the
  other entries are zero, so the residual stream stays zero outside the narrow model's dims;
- RMSNorm divides by the root mean square over all dims, which the zeros would shrink by
  ``sqrt(d / D)``, and so move ``eps`` relative to it. So the residual stream is carried
  ``c = sqrt(D / d)`` times larger (the embedding and the writes into the stream, ``o_proj``
  and ``down_proj``, times ``c``): each norm then sees the narrow model's mean square, and
  its output is ``c`` times the narrow one's, which its weight divided by ``c`` cancels. The
  final norm's weight is divided by ``c`` once more, as the tied output matrix is the
  embedding, times ``c``;
- the layers past the narrow model's have every matrix zero: attention and MLP add nothing;
- the vocabulary rows past the narrow model's (ids it never sees) are zero, logit 0, below the
  constant channel's share of every known token's logit.

The checkpoint directory holds ``copier.json``: the token ids the copier knows (the task must
draw from them) and how often its greedy prediction copies on sample episodes.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

from bench import models

NARROW = {"hidden_size": 256, "num_hidden_layers": 2, "intermediate_size": 256}
FIRST_ID = 3  # ids 0-2 are left to special tokens, as in bench.speculative.task
SPAN = 8192  # token ids the copier knows: FIRST_ID .. FIRST_ID + SPAN - 1
HEAD_DIM = 64
# The residual stream of the narrow model: a constant channel, then three slots of WIDTH dims:
# the token's content, the previous token's, the one before that's.
WIDTH = 64  # a KV head's value carries 64 dims: one slot
CONTENT, PREVIOUS, BEFORE = (1 + WIDTH * i for i in range(3))

# The circuit's constants:
CONSTANT = 1.0  # dim 0 of every known token's embedding
CONTENT_STD = 0.05  # its content entries: the constant dominates the norm's scale
LOOKBACK_PAIRS = 12  # fastest RoPE pairs, which locate the tokens 1 and 2 back
LOOKBACK_SHARPNESS = 30.0  # score gap grows with it: the token looked for takes ~all the weight
LOOKBACK_GAIN = 0.1  # the slots hold those contents at about the stream's own scale
MATCH_PAIRS = 16  # slowest RoPE pairs, where the content match barely turns with distance
MATCH_SHARPNESS = 60.0  # two matching tokens outscore one by far more than the noise
COPY_GAIN = 1.0  # the copied content (layer 1's normed input) is ~13x the current token's
OUTPUT_SCALE = 5.0  # final norm weight: many logits between the copied token and the rest


def narrow_config(size: str) -> dict:
    """The bench llama's config at ``size``, narrowed: the same rope, head dim and GQA group."""
    wide = models.config("llama", size)
    group = wide["num_attention_heads"] // wide["num_key_value_heads"]
    assert wide["head_dim"] == HEAD_DIM
    cfg = {**wide, **NARROW, "num_attention_heads": group, "num_key_value_heads": 1}
    cfg["vocab_size"] = FIRST_ID + SPAN
    return cfg


def episode(rng, block: int) -> list[int]:
    """A block of known ids, the block with one change, the block again."""
    code = rng.integers(FIRST_ID, FIRST_ID + SPAN, block)
    changed = code.copy()
    at = int(rng.integers(0, block))
    changed[at] = FIRST_ID + (changed[at] - FIRST_ID + 1) % SPAN
    return [*code.tolist(), *changed.tolist(), *code.tolist()]


def _rope_angles(cfg: dict) -> np.ndarray:
    """Each RoPE pair's angle per position, read off the model's own rope (llama3 scaling)."""
    from mlx_lm.models import llama

    rope = llama.Attention(llama.ModelArgs.from_dict(cfg)).rope
    half = HEAD_DIM // 2
    probe = mx.zeros((1, 1, 1, HEAD_DIM))
    probe[..., :half] = 1.0
    turned = np.array(rope(probe, offset=1)[0, 0, 0])
    return np.arctan2(turned[half:], turned[:half])


def circuit(cfg: dict, seed: int = 0, match: int = 2) -> dict[str, mx.array]:
    """The narrow copier's weights (hub names) for the narrow config ``cfg``. ``match``: the
    tokens its induction head matches, 2 (this one and the previous one) or 1 (this one only:
    where a token occurs twice in the block, it may continue from the wrong occurrence)."""
    d, inter, half = cfg["hidden_size"], cfg["intermediate_size"], HEAD_DIM // 2
    heads, slot = cfg["num_attention_heads"], np.arange(WIDTH)
    angles = _rope_angles(cfg)
    rng = np.random.default_rng(seed)
    w: dict[str, np.ndarray] = {}
    embed = np.zeros((cfg["vocab_size"], d), np.float32)
    embed[FIRST_ID:, 0] = CONSTANT
    embed[FIRST_ID:, CONTENT + slot] = CONTENT_STD * rng.standard_normal((SPAN, WIDTH))
    w["model.embed_tokens.weight"] = embed
    # Layer 0's norm turns the constant channel into about this value.
    constant = CONSTANT / math.sqrt((CONSTANT**2 + CONTENT_STD**2 * WIDTH) / d)
    for layer in range(2):
        p = f"model.layers.{layer}."
        w[p + "input_layernorm.weight"] = np.ones(d, np.float32)
        w[p + "post_attention_layernorm.weight"] = np.ones(d, np.float32)
        w[p + "mlp.gate_proj.weight"] = np.zeros((inter, d), np.float32)
        w[p + "mlp.up_proj.weight"] = np.zeros((inter, d), np.float32)
        w[p + "mlp.down_proj.weight"] = np.zeros((d, inter), np.float32)
        q = np.zeros((heads * HEAD_DIM, d), np.float32)
        k = np.zeros((HEAD_DIM, d), np.float32)
        v = np.zeros((HEAD_DIM, d), np.float32)
        o = np.zeros((d, heads * HEAD_DIM), np.float32)
        v[slot, CONTENT + slot] = 1.0  # every head's value: the attended token's content
        if layer == 0:
            # The key: the constant channel, turned back by one position in each fast pair.
            # Head h's query turned back by h more: its score sum_f cos(theta_f (i - j - 1 - h))
            # peaks at j = i - 1 - h. Head 0 fills the previous-token slot, head 1 the one
            # before.
            for f in range(LOOKBACK_PAIRS):
                k[f, 0], k[f + half, 0] = math.cos(angles[f]), math.sin(angles[f])
                for h, into in enumerate((PREVIOUS, BEFORE)):
                    row = h * HEAD_DIM
                    q[row + f, 0] = math.cos(h * angles[f])
                    q[row + f + half, 0] = -math.sin(h * angles[f])
                    o[into + slot, row + slot] = LOOKBACK_GAIN
            q *= LOOKBACK_SHARPNESS / constant
            k /= constant
        else:
            # Head 0 matches (this token, the previous one) against (the previous, the one
            # before) at each earlier position, in the slow pairs, and copies the content of
            # the best match: the token that followed the same two tokens.
            pairs = np.arange(half - MATCH_PAIRS, half)
            dims = np.concatenate([pairs, pairs + half])
            n = len(dims) // match  # the dims each matched token gets
            q[dims[:n], CONTENT + np.arange(n)] = MATCH_SHARPNESS
            k[dims[:n], PREVIOUS + np.arange(n)] = 1.0
            if match == 2:
                q[dims[n:], PREVIOUS + np.arange(n)] = MATCH_SHARPNESS
                k[dims[n:], BEFORE + np.arange(n)] = 1.0
            o[CONTENT + slot, slot] = COPY_GAIN
        attn = p + "self_attn."
        w |= {attn + "q_proj.weight": q, attn + "k_proj.weight": k}
        w |= {attn + "v_proj.weight": v, attn + "o_proj.weight": o}
    w["model.norm.weight"] = np.full(d, OUTPUT_SCALE, np.float32)
    return {name: mx.array(value) for name, value in w.items()}


def copy_rate(weights: dict[str, mx.array], cfg: dict, block: int, n: int = 4) -> float:
    """How often the greedy prediction is the block's next token in the third copy."""
    from mlx_lm.models import llama

    model = llama.Model(llama.ModelArgs.from_dict(cfg))
    model.load_weights(list(weights.items()))
    rng = np.random.default_rng(1)
    hits = total = 0
    for _ in range(n):
        seq = episode(rng, block)
        predicted = np.array(model(mx.array([seq[:-1]])).argmax(-1)[0])
        third = slice(2 * block, 3 * block - 1)
        hits += int((predicted[third] == np.array(seq[1:])[third]).sum())
        total += block - 1
    return hits / total


def widen(
    narrow: dict[str, mx.array], narrow_cfg: dict, wide_cfg: dict, dtype=mx.bfloat16
) -> dict[str, mx.array]:
    """The narrow weights inside zero tensors of the wide checkpoint's every name and shape."""
    c = math.sqrt(wide_cfg["hidden_size"] / narrow_cfg["hidden_size"])
    scale = {"embed_tokens.weight": c, "o_proj.weight": c, "down_proj.weight": c}
    scale |= {"model.norm.weight": 1 / c**2, "layernorm.weight": 1 / c}
    out = {}
    for name, shape in models.shapes(wide_cfg):
        small = narrow.get(name)
        if small is None:  # a layer past the narrow model's, or a tensor it lacks
            out[name] = (mx.ones if len(shape) == 1 else mx.zeros)(shape, dtype=dtype)
            continue
        wide = mx.zeros(shape, dtype=mx.float32)
        factor = next((f for suffix, f in scale.items() if name.endswith(suffix)), 1.0)
        wide[tuple(slice(0, n) for n in small.shape)] = small.astype(mx.float32) * factor
        out[name] = wide.astype(dtype)
    return out


def write_checkpoint(path: Path, size: str) -> Path:
    """Write the copier in the bench llama's ``size`` shape to ``path``; returns it."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    narrow_cfg, wide_cfg = narrow_config(size), models.config("llama", size)
    narrow = circuit(narrow_cfg)
    weights = widen(narrow, narrow_cfg, wide_cfg)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(wide_cfg, indent=2) + "\n")
    record = {
        "first_id": FIRST_ID,
        "span": SPAN,
        "narrow": {k: narrow_cfg[k] for k in (*NARROW, "num_attention_heads", "vocab_size")},
        "copy_rate": {b: copy_rate(narrow, narrow_cfg, b) for b in (64, 256)},
    }
    (path / "copier.json").write_text(json.dumps(record, indent=2) + "\n")
    return path


def write_draft(path: Path, size: str) -> Path:
    """Write a draft model for the wide copier to ``path``: the narrow copier alone (no
    padding, a fraction of the cost) whose induction head matches one token instead of two,
    so it is another function and its drafts are sometimes wrong (at a token that occurs twice
    in the block it may copy from the wrong occurrence), as a real draft's are. Its vocabulary
    is the narrow one (the ids it knows); a draft only needs the ids it proposes to mean the
    same tokens."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = narrow_config(size)
    weights = {k: v.astype(mx.bfloat16) for k, v in circuit(cfg, match=1).items()}
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.copier", description=__doc__)
    p.add_argument("--size", default="small", choices=models.SIZES)
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    args = p.parse_args(argv)
    path = write_checkpoint(Path(args.out), args.size)
    print((path / "copier.json").read_text(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
