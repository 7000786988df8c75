"""Speculative decoding: the cache contract's ``rewind``, prompt-lookup and draft-model drafts
(greedy output identical to plain decoding, trims and sinks included), the accept/reject rule
(the target's distribution, checked statistically), and what is refused."""

from __future__ import annotations

import contextlib
import functools
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent))  # the toy model lives beside the tests
import _toy_model as toy
from checkpoints import write_tokenizer

from mlxc.cli import main
from mlxc.compiler import build, lint
from mlxc.runtime.checkpoint import loading
from mlxc.runtime.checkpoint.user_specs import load_source
from mlxc.runtime.model.batch import BatchKVCache
from mlxc.runtime.model.cache import (
    KVCache,
    KVQuant,
    QuantizedKVCache,
    RewindError,
    WindowedKVCache,
    decode_steps_valid,
    make_caches,
    prepare_rewind,
)
from mlxc.runtime.serving import speculative
from mlxc.runtime.serving.generate import generate_tokens
from mlxc.runtime.serving.speculative import (
    DraftModel,
    PromptLookup,
    SpecStats,
    accept_drafts,
    speculative_tokens,
)
from mlxc.verify import randomize


@functools.cache
def tiny(name: str, seed: int = 0):
    """The spec's tiny_config model with random weights (as ``mlxc verify`` builds it)."""
    path = f"specs/{name}.yaml"
    module = load_source(name, build.render([path]).files[f"{name}.py"])
    config = lint.check_all([path])[0].spec.tiny_config
    model = module.Model(module.ModelArgs.from_config(config))
    randomize(model, seed)
    return model


def kv(n: int, start: int = 0) -> tuple[mx.array, mx.array]:
    """Keys and values ``[1, 2, n, 4]`` whose entries name their position."""
    x = mx.arange(start, start + n, dtype=mx.float32)[None, None, :, None] * mx.ones((1, 2, 1, 4))
    return x, -x


# --- the cache contract: rewind -------------------------------------------------------------------


@pytest.mark.parametrize("make", [KVCache, lambda: QuantizedKVCache(KVQuant(8, 32))])
def test_rewind_takes_back_the_last_tokens(make):
    fresh, spec = make(), make()
    k32 = mx.ones((1, 2, 1, 32))
    for i in range(5):
        fresh.update_and_fetch(k32 * i, -k32 * i)
    for i in [0, 1, 2, 9, 9]:
        spec.update_and_fetch(k32 * i, -k32 * i)
    spec.rewind(2)
    assert (spec.offset, spec.live_len) == (3, 3)
    for i in [3, 4]:
        spec.update_and_fetch(k32 * i, -k32 * i)
    got, want = spec.live(), fresh.live()
    for a, b in zip(got, want):
        a, b = (x.dequantize() if hasattr(x, "dequantize") else x for x in (a, b))
        assert mx.array_equal(a, b)


def test_rewind_never_undoes_a_trim():
    cache = KVCache()
    cache.update_and_fetch(*kv(6))
    cache.trim_front(2, keep=1)
    with pytest.raises(RewindError, match="since the last trim"):
        cache.rewind(1)
    cache.update_and_fetch(*kv(3, 6))
    cache.rewind(3)
    assert (cache.offset, cache.live_len) == (6, 4)
    with pytest.raises(RewindError):
        cache.rewind(1)


def test_windowed_rewind_keeps_what_the_window_sees():
    # Window 4, drops in runs of 4: after 10 tokens it holds the last 3 only.
    plain = WindowedKVCache(4)
    plain.update_and_fetch(*kv(10))
    assert plain.held == 3
    with pytest.raises(RewindError, match="rewind_reserve"):
        plain.rewind(2)
    # With a reserve of 2 it keeps 2 more keys, so a rewind of 2 still leaves the window whole.
    spec, ref = WindowedKVCache(4), WindowedKVCache(4)
    spec.rewind_reserve = 2
    spec.update_and_fetch(*kv(10))
    spec.rewind(2)
    ref.update_and_fetch(*kv(8))
    assert (spec.offset, spec.live_len) == (8, 3)
    k_spec, _ = spec.update_and_fetch(*kv(1, 8))
    k_ref, _ = ref.update_and_fetch(*kv(1, 8))
    assert mx.array_equal(k_spec, k_ref)


def test_recurrent_caches_refuse_to_rewind():
    # (a decode batch rewinds all its rows at once: tests/test_batch_speculation.py)
    with pytest.raises(RewindError):
        BatchKVCache().rewind(1)  # nothing written since its rows joined
    model = tiny("nemotron_h")
    with pytest.raises(RewindError, match="RecurrentCache cannot"):
        prepare_rewind(model, make_caches(model), 3)
    with pytest.raises(RewindError, match="RecurrentCache"):
        speculative_tokens(model, [1, 2, 3], PromptLookup(), max_tokens=4)


def test_decode_steps_valid_hides_what_each_step_trimmed():
    # 6 live keys (max 6, sink 2), 3 new queries: query j no longer sees columns 2 .. 2 + j.
    valid = np.asarray(decode_steps_valid(6, 3, 6, 2))[0, 0]
    assert valid.shape == (3, 9)
    assert valid[0].all()
    assert not valid[1, 2] and valid[1, 3:].all() and valid[1, :2].all()
    assert not valid[2, 2:4].any() and valid[2, 4:].all()


# --- greedy: identical to plain decoding ----------------------------------------------------------


def repeating_prompt(model, seed: int = 0) -> list[int]:
    vocab = model(mx.array([[0]])).shape[-1]
    return np.random.default_rng(seed).integers(3, vocab, 13).tolist() * 3


CASES = [  # (arch, max_kv_size, kv_sink, kv_quant)
    ("llama", None, 0, None),
    ("llama", 20, 4, None),
    ("qwen3", 20, 0, None),
    ("gemma3_text", None, 0, None),  # window 6: rewinds cross the window's drops
    ("gemma3_text", 22, 4, None),
    ("qwen3", 20, 4, KVQuant(8, 32)),
]


@pytest.mark.parametrize(("arch", "max_kv", "sink", "quant"), CASES)
def test_prompt_lookup_greedy_equals_plain(arch, max_kv, sink, quant):
    model = tiny(arch)
    prompt = repeating_prompt(model)
    kw = {"max_kv_size": max_kv, "kv_sink": sink, "kv_quant": quant, "prefill_chunk_size": 8}
    plain = list(generate_tokens(model, prompt, max_tokens=40, **kw))
    stats = SpecStats()
    drafter = PromptLookup(3)
    got = list(
        speculative_tokens(
            model, prompt, drafter, max_tokens=40, num_draft_tokens=4, stats=stats, **kw
        )
    )
    assert got == plain
    assert stats.proposed > 0 and stats.steps < 40  # it did speculate, some drafts accepted
    assert stats.accepted > 0


def test_trimmed_verification_needs_thedecode_bound(monkeypatch):
    """Without the per-query mask, a K+1 forward under --max-kv-size sees keys that one-token
    steps had trimmed: the output drifts from the plain run (what the bound prevents)."""
    model = tiny("llama")
    prompt = repeating_prompt(model)
    kw = {"max_kv_size": 20, "kv_sink": 4, "prefill_chunk_size": 8}
    plain = list(generate_tokens(model, prompt, max_tokens=40, **kw))
    monkeypatch.setattr(speculative, "decode_bound", lambda *a: contextlib.nullcontext())
    got = list(speculative_tokens(model, prompt, PromptLookup(3), max_tokens=40, **kw))
    assert got != plain


def test_windowed_model_without_reserve_cannot_rewind(monkeypatch):
    model = tiny("gemma3_text")
    real = speculative.prepare_rewind
    monkeypatch.setattr(speculative, "prepare_rewind", lambda m, c, r: real(m, c, 0))
    with pytest.raises(RewindError, match="window"):
        list(speculative_tokens(model, repeating_prompt(model), PromptLookup(3), max_tokens=40))


@pytest.mark.parametrize(("arch", "max_kv", "draft_seed"), [("llama", 20, 0), ("llama", None, 1)])
def test_draft_model_greedy_equals_plain(arch, max_kv, draft_seed):
    model, draft = tiny(arch), tiny(arch, draft_seed)  # seed 0: the draft is the model itself
    prompt = repeating_prompt(model, 1)
    kw = {"max_kv_size": max_kv, "kv_sink": 4}
    plain = list(generate_tokens(model, prompt, max_tokens=30, prefill_chunk_size=8, **kw))
    stats = SpecStats()
    drafter = DraftModel(draft, 3, **kw)
    got = list(
        speculative_tokens(
            model, prompt, drafter, max_tokens=30, stats=stats, prefill_chunk_size=8, **kw
        )
    )
    assert got == plain
    if draft_seed == 0:
        assert stats.accepted == stats.proposed  # a draft that is the target is always right
    else:
        assert stats.accepted < stats.proposed  # rejections (and rewinds) happened


@pytest.mark.parametrize("draft", ["lookup", "model"])
def test_sampling_near_zero_temperature_is_greedy(draft):
    """The sampling path (accept/reject against p and q, residual draws) lined up position by
    position: at temperature 1e-4 p is one-hot on the argmax, so the output is plain greedy."""
    model = tiny("llama")
    prompt = repeating_prompt(model)
    plain = list(generate_tokens(model, prompt, max_tokens=30))
    # The model drafting for itself: q = p, so every draft is kept.
    drafter = PromptLookup(3) if draft == "lookup" else DraftModel(model, 3)
    stats = SpecStats()
    got = list(
        speculative_tokens(model, prompt, drafter, max_tokens=30, temp=1e-4, seed=0, stats=stats)
    )
    assert got == plain
    if draft == "lookup":
        assert 0 < stats.accepted < stats.proposed
    else:
        assert stats.accepted == stats.proposed > 0


def test_sampling_runs_are_seeded():
    model, draft = tiny("llama"), tiny("llama", 1)
    prompt = repeating_prompt(model)

    def run(seed):
        drafter = DraftModel(draft, 3)
        return list(speculative_tokens(model, prompt, drafter, max_tokens=12, temp=1.0, seed=seed))

    assert run(3) == run(3) and len(run(3)) == 12


# --- the accept/reject rule keeps the target's distribution ---------------------------------------


def _tv(counts: np.ndarray, p: np.ndarray) -> float:
    return 0.5 * np.abs(counts / counts.sum() - p).sum()


@pytest.mark.parametrize("deterministic_drafts", [False, True])
def test_accept_rule_samples_the_target_distribution(deterministic_drafts):
    rng = np.random.default_rng(0)
    V, K, N = 5, 2, 20000
    p = rng.dirichlet(np.ones(V), K + 1)
    q = rng.dirichlet(np.ones(V) * 0.5, K)
    assert _tv(q[0], p[0]) > 0.15  # keeping every draft would give q, far from p
    first, second = np.zeros(V), np.zeros(V)
    for _ in range(N):
        if deterministic_drafts:  # prompt lookup: q is one-hot on a fixed draft
            out = accept_drafts(p, None, [int(np.argmax(p[0])), int(np.argmax(p[1]))], rng)
        else:
            drafts = [int(rng.choice(V, p=q[i])) for i in range(K)]
            out = accept_drafts(p, q, drafts, rng)
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
    # Sampling error of N draws over 5 outcomes: TV ~ 0.01; a wrong rule is off by > 0.1.
    assert _tv(first, p[0]) < 0.02
    assert second.sum() > 3000 and _tv(second, p[1]) < 0.04


# --- mlxc generate --------------------------------------------------------------------------------


@pytest.fixture
def toy_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setattr(loading, "model_types", lambda: {"toy": toy.__name__})
    path = toy.write_checkpoint(tmp_path / "ckpt")
    toy.write_tokenizer(path)
    return path


def generate_cli(*args):
    return CliRunner().invoke(main, ["generate", *map(str, args)])


PROMPT = "abc abd abc abd abc abd abc"


@pytest.mark.parametrize("flags", [["--prompt-lookup", "--ngram-size", 2], ["--draft-model", None]])
def test_cli_speculative_greedy_prints_the_plain_text(toy_checkpoint, flags):
    flags = [toy_checkpoint if f is None else f for f in flags]
    common = ["--model", toy_checkpoint, "--prompt", PROMPT, "--max-tokens", 12]
    common += ["--max-kv-size", 24]
    plain = generate_cli(*common)
    spec = generate_cli(*common, *flags, "--num-draft-tokens", 3)
    assert plain.exit_code == 0 and spec.exit_code == 0, spec.output
    assert spec.stdout == plain.stdout
    assert "drafts accepted" in spec.stderr


def test_cli_refuses_what_speculation_cannot_do(toy_checkpoint, tmp_path):
    base = ["--model", toy_checkpoint, "--prompt", PROMPT, "--max-tokens", 4]
    both = generate_cli(*base, "--prompt-lookup", "--draft-model", toy_checkpoint)
    assert both.exit_code != 0 and "not both" in both.output
    top_p = generate_cli(*base, "--prompt-lookup", "--temp", 1, "--top-p", 0.5)
    assert top_p.exit_code != 0 and "--top-p" in top_p.output
    other = toy.write_checkpoint(tmp_path / "other")
    write_tokenizer(other)
    mismatch = generate_cli(*base, "--draft-model", other)
    assert mismatch.exit_code == 1 and "another tokenizer vocabulary" in mismatch.output
    serve = ["serve", "--model", toy_checkpoint, "--port", "0"]
    both = CliRunner().invoke(main, [*serve, "--prompt-lookup", "--draft-model", toy_checkpoint])
    assert both.exit_code != 0 and "not both" in both.output
    mismatch = CliRunner().invoke(main, [*serve, "--draft-model", other])
    assert mismatch.exit_code == 1 and "another tokenizer vocabulary" in mismatch.output


def test_verify_catches_a_verification_forward_that_ignores_trims(monkeypatch):
    from mlxc import verify

    path = "specs/llama.yaml"
    module = load_source("llama", build.render([path]).files["llama.py"])
    config = lint.check_all([path])[0].spec.tiny_config
    monkeypatch.setattr(verify, "decode_bound", lambda *a: contextlib.nullcontext())
    # Both checks see it: the batch schedule's verifications (which come first) and one
    # sequence speculating across trims.
    with pytest.raises(verify.VerifyError, match="batched decode differs"):
        verify.verify_module("llama", module, config)
    monkeypatch.setattr(verify, "_batched_decode_error", lambda *a, **k: 0.0)
    with pytest.raises(verify.VerifyError, match="speculation across trims"):
        verify.verify_module("llama", module, config)
