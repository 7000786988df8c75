"""bench.copier writes a narrow model into a wide checkpoint: the wide model's logits must be the
narrow model's (and 0 for the ids the narrow model lacks), or the prompt-lookup benchmark would
time one model and report another's acceptance. Checked through mlx-lm's llama on both."""

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models import llama

from bench import copier, models

WIDE = {
    **models.config("llama", "small"),
    "hidden_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 160,
    "vocab_size": 300,
}
NARROW = {
    **WIDE,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "intermediate_size": 48,
    "vocab_size": 200,
}


def _model(cfg, weights=None):
    model = llama.Model(llama.ModelArgs.from_dict(cfg))
    if weights is None:  # real variance everywhere, norms included
        mx.random.seed(1)
        weights = {
            k: (1.0 + 0.3 * mx.random.normal(v.shape))
            if v.ndim == 1
            else mx.random.normal(v.shape) * 0.3
            for k, v in tree_flatten(model.parameters())
        }
    model.load_weights(list(weights.items()))
    return model, weights


def test_wide_checkpoint_computes_the_narrow_models_logits():
    narrow, weights = _model(NARROW)
    wide, _ = _model(WIDE, copier.widen(weights, NARROW, WIDE, dtype=mx.float32))
    ids = mx.array([np.random.default_rng(0).integers(0, NARROW["vocab_size"], 40).tolist()])
    small, big = narrow(ids), wide(ids)
    assert float(mx.abs(small).max()) > 1.0  # logits with real spread, not all near zero
    # float32 through three layers, in matmuls of other widths (other summation orders).
    np.testing.assert_allclose(np.array(big[..., :200]), np.array(small), atol=1e-4, rtol=1e-4)
    assert not mx.any(big[..., 200:]).item()  # ids the narrow model lacks: logit exactly 0


def test_episode_is_block_changed_block_block():
    rng = np.random.default_rng(0)
    seq = copier.episode(rng, 10)
    a, b, c = seq[:10], seq[10:20], seq[20:]
    assert a == c and sum(x != y for x, y in zip(a, b)) == 1
    assert all(copier.FIRST_ID <= t < copier.FIRST_ID + copier.SPAN for t in seq)


def test_circuit_copies_the_block():
    """The premise of `bench.speculative --copier`: greedy predictions repeat the block. The
    misses are the unpredictable positions: a copy's first prediction (the two tokens before it
    never occurred together) and the changed token (both continuations occurred)."""
    cfg = copier.narrow_config("small")
    assert copier.copy_rate(copier.circuit(cfg), cfg, block=64, n=2) > 0.95
