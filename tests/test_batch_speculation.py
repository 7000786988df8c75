"""Speculation in the server's decode batch (``mlxc serve --prompt-lookup``): the batch cache's
rewind, the shared acceptance rule, and the scheduler's output equal to plain greedy decoding
(``generate_tokens`` alone) with several rows, chunked prefill, trims and quantised KV."""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))  # the toy model and helpers live beside the tests
import _toy_model as toy
from test_scheduler import Collector, prompt, wait_idle
from test_speculative import kv, repeating_prompt, tiny

from mlxc.runtime.checkpoint.tokenizer import load_tokenizer
from mlxc.runtime.model.batch import BatchCache, BatchKVCache, BatchWindowedKVCache
from mlxc.runtime.model.cache import KVCache, KVQuant, RewindError
from mlxc.runtime.serving import metrics
from mlxc.runtime.serving.generate import generate_tokens
from mlxc.runtime.serving.scheduler import SamplingParams, Scheduler, _warm_tails
from mlxc.runtime.serving.speculative import (
    BatchSpeculation,
    PromptLookup,
    SpeculationError,
    rows_keep,
)

# --- the batch cache's rewind -----------------------------------------------------------------


def _joined(lengths: list[int]) -> BatchKVCache:
    """A decode batch whose rows are single caches of these lengths (keys name positions)."""
    caches = []
    for n in lengths:
        c = KVCache()
        c.update_and_fetch(*kv(n))
        caches.append(c)
    batch = BatchKVCache()
    batch.extend(caches)
    return batch


def _column(n: int, start: int) -> tuple[mx.array, mx.array]:
    k, v = kv(n, start)
    return mx.concatenate([k, k]), mx.concatenate([v, v])  # the same new columns for 2 rows


def test_batch_rewind_equals_never_having_written():
    spec, ref = _joined([5, 3]), _joined([5, 3])
    spec.update_and_fetch(*_column(4, 100))  # a verification: the input token and 3 drafts
    spec.rewind(3)  # every row kept the input token only
    ref.update_and_fetch(*_column(1, 100))
    assert spec.offsets.tolist() == ref.offsets.tolist() == [6, 4]
    assert spec.live_len == ref.live_len
    k_spec, _ = spec.update_and_fetch(*_column(2, 200))  # the next step overwrites the rest
    k_ref, _ = ref.update_and_fetch(*_column(2, 200))
    assert mx.array_equal(k_spec, k_ref)
    assert mx.array_equal(spec.key_valid(), ref.key_valid())


def test_batch_rewind_never_crosses_a_trim_or_a_join():
    batch = _joined([6, 4])
    batch.update_and_fetch(*_column(3, 50))
    with pytest.raises(RewindError):
        batch.rewind(4)  # more than were written since the rows joined
    batch.trim_front(np.array([2, 0]), keep=1)
    with pytest.raises(RewindError, match="since the rows last changed"):
        batch.rewind(1)
    batch.update_and_fetch(*_column(2, 60))
    batch.rewind(2)  # what was written after the trim may go
    other = KVCache()
    other.update_and_fetch(*kv(2))
    batch.update_and_fetch(*_column(1, 70))
    batch.extend([other])
    with pytest.raises(RewindError):
        batch.rewind(1)
    with pytest.raises(RewindError, match="sliding-window"):
        BatchWindowedKVCache(4).rewind(1)
    with pytest.raises(RewindError, match="sliding-window"):
        BatchWindowedKVCache(4).rewind_rows(np.array([0, 1]))


def test_batch_rows_rewind_their_own_counts():
    """Each row takes back its own rejected drafts (``tests/test_batch.py`` checks the keys)."""
    batch = _joined([5, 3])
    batch.update_and_fetch(*_column(4, 100))  # the input token and 3 drafts
    batch.rewind_rows(np.array([1, 3]))  # row 0 kept 2 drafts, row 1 none
    assert batch.offsets.tolist() == [8, 4] and batch.row_live_len.tolist() == [8, 4]
    assert batch.tail.tolist() == [0, 2] and batch.live_len == 8
    with pytest.raises(SpeculationError):
        BatchSpeculation(max_rows=0)


def test_rows_keep_their_own_counts_where_that_buys_a_token_per_row():
    # Alone they emit 2, 4 and 1 tokens: 4 more than the fewest for 3 rows, so each keeps its own.
    own = [[5, 6], [5, 9, 1, 2], [4]]
    assert rows_keep(own) == own
    # 3, 2 and 3: 2 more than the fewest for 3 rows; every row is cut to 2, each token still
    # one its rule emitted (the tail a row would keep costs every later step).
    assert rows_keep([[5, 6, 7], [5, 9], [4, 4, 4]]) == [[5, 6], [5, 9], [4, 4]]


# --- the scheduler ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def toy_model():
    return toy.random_model()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("toy-tokenizer")
    toy.write_tokenizer(path)
    return load_tokenizer(path)


def _serve(model, tokenizer, jobs, **options) -> tuple[list[list[int]], dict]:
    """Each job's tokens from one scheduler running them together, and its stats after. The
    jobs are queued before the scheduler starts, so its first tick admits them all: which
    steps speculate (half the rows need a draft) does not depend on when each arrived."""
    s = Scheduler(model, tokenizer, max_concurrency=len(jobs), **options)
    try:
        outs = [Collector() for _ in jobs]
        for (ids, params), out in zip(jobs, outs):
            s.submit(ids, params, out)
        s.start()
        tokens = [out.result()[0] for out in outs]
        return tokens, wait_idle(s)
    finally:
        s.stop()


def _plain(model, ids, n, **options) -> list[int]:
    return list(generate_tokens(model, ids, max_tokens=n, **options))


CASES = [  # (model, cache options of the scheduler and of generate_tokens alone)
    ("toy", {}),
    ("toy", {"prefill_chunk_size": 8, "max_kv_size": 48, "kv_sink": 4}),  # 60 tokens: trims
    ("llama", {"prefill_chunk_size": 8}),
    ("llama", {"prefill_chunk_size": 8, "max_kv_size": 64, "kv_sink": 2}),  # 79 tokens
    ("llama", {"prefill_chunk_size": 8, "max_kv_size": 24, "kv_sink": 2}),  # at the bound
    ("qwen3", {"kv_quant": KVQuant(8, 32)}),
]


@pytest.mark.parametrize(("arch", "cache"), CASES)
def test_speculating_batch_equals_plain_greedy(toy_model, tokenizer, arch, cache):
    model = toy_model if arch == "toy" else tiny(arch)
    if arch == "toy":
        prompts = [prompt(20, start=s) for s in (1, 5, 9)]
    else:
        prompts = [repeating_prompt(model, seed) for seed in (3, 4, 5)]  # 39 tokens
    n = 40
    wants = [_plain(model, ids, n, **cache) for ids in prompts]
    jobs = [(ids, SamplingParams(max_tokens=n, ignore_eos=True)) for ids in prompts]
    before = metrics.SPEC_ACCEPTED_TOKENS._value.get()
    got, stats = _serve(model, tokenizer, jobs, speculation=BatchSpeculation(4, 3, 4), **cache)
    assert got == wants
    spec = stats["speculation"]
    assert spec["steps"] > 0 and spec["accepted"] > 0  # it did speculate and keep drafts
    assert metrics.SPEC_ACCEPTED_TOKENS._value.get() - before == spec["accepted"]


@pytest.mark.parametrize(
    ("arch", "draft_seed", "cache"),
    [
        ("llama", 0, {}),
        ("llama", 1, {}),
        ("llama", 1, {"prefill_chunk_size": 8, "max_kv_size": 64, "kv_sink": 2}),
        ("qwen3", 0, {"kv_quant": KVQuant(8, 32)}),  # the draft's batch quantised too
    ],
)
def test_draft_model_batch_equals_plain_greedy(tokenizer, arch, draft_seed, cache):
    """`mlxc serve --draft-model`: the draft model drafts for all rows at once on its own batch,
    the batch verifies them in one forward, and the greedy answers are the plain ones (79
    tokens under --max-kv-size 64: trims too). Seed 0: the draft is the model itself, so
    nearly every draft is kept (a near-tie of a random model's logits can fall the other way
    between the draft's batch and the verification, and a row that rejects may cut the others,
    ``rows_keep``); seed 1: another random model, whose drafts are mostly rejected."""
    model, draft = tiny(arch), tiny(arch, draft_seed)
    prompts = [repeating_prompt(model, seed) for seed in (3, 4, 5)]  # 39 tokens
    wants = [_plain(model, ids, 40, **cache) for ids in prompts]
    jobs = [(ids, SamplingParams(max_tokens=40, ignore_eos=True)) for ids in prompts]
    spec = BatchSpeculation(4, 3, 4, draft_model=draft)
    got, stats = _serve(model, tokenizer, jobs, speculation=spec, **cache)
    assert got == wants
    spec = stats["speculation"]
    assert spec["drafter"] == "draft-model" and spec["steps"] > 0
    if draft_seed == 0:
        assert spec["accepted"] >= 0.9 * spec["proposed"]
    else:
        assert spec["accepted"] < spec["proposed"]


def test_rows_keep_their_own_drafts_and_rows_without_drafts_verify(tokenizer, monkeypatch):
    """Rows accept different counts and each keeps its own (prompt lookup finds n-grams in two
    prompts and none in the third, which takes its one token from the verification); the
    answers are still the plain ones."""
    events = []  # ("drafts", count) per row drafted, ("kept", rewinds) per verification
    rewind_rows, propose = BatchCache.rewind_rows, PromptLookup.propose
    monkeypatch.setattr(
        BatchCache,
        "rewind_rows",
        lambda self, n: events.append(("kept", list(n))) or rewind_rows(self, n),
    )

    def proposing(self, *args):
        drafts = propose(self, *args)
        events.append(("drafts", len(drafts[0])))
        return drafts

    monkeypatch.setattr(PromptLookup, "propose", proposing)
    model = tiny("llama")
    prompts = [repeating_prompt(model, 3), repeating_prompt(model, 4), list(range(3, 42))]
    wants = [_plain(model, ids, 30) for ids in prompts]
    jobs = [(ids, SamplingParams(max_tokens=30, ignore_eos=True)) for ids in prompts]
    got, stats = _serve(model, tokenizer, jobs, speculation=BatchSpeculation(4, 3, 4))
    assert got == wants
    verified = [(i, n) for i, (kind, n) in enumerate(events) if kind == "kept"]
    assert any(len(set(n)) > 1 for _, n in verified)  # rows kept different counts
    drafted = [[n for _, n in events[i - 3 : i]] for i, _ in verified]
    assert any(0 in counts and max(counts) > 0 for counts in drafted)  # one had no draft
    # The model as its own draft keeps (nearly) every draft, but a row near its max_tokens
    # takes fewer: then the rows of the draft's batch rewind different counts too.
    events.clear()
    lengths = (30, 27, 25)
    wants = [_plain(model, ids, n) for ids, n in zip(prompts, lengths)]
    jobs = [
        (ids, SamplingParams(max_tokens=n, ignore_eos=True)) for ids, n in zip(prompts, lengths)
    ]
    spec = BatchSpeculation(4, 3, 4, draft_model=model)
    got, stats = _serve(model, tokenizer, jobs, speculation=spec)
    assert got == wants
    assert stats["speculation"]["accepted"] >= 0.9 * stats["speculation"]["proposed"] > 0
    assert any(len(set(n)) > 1 for kind, n in events if kind == "kept")


def test_draft_rows_catch_up_after_plain_steps(tokenizer):
    """A row drafts alone (one row allowed), then a second row's arrival makes the steps plain
    until it ends, then the first drafts again: its draft caches catch up on the plain steps'
    tokens in one forward. With the model as its own draft, every draft must still be kept:
    a draft cache that missed or repeated a token would propose something else."""
    model = tiny("llama")
    first, second = repeating_prompt(model, 3), repeating_prompt(model, 4) * 2  # 39, 78
    jobs = [
        (first, SamplingParams(max_tokens=120, ignore_eos=True)),
        (second, SamplingParams(max_tokens=6, ignore_eos=True)),
    ]
    wants = [_plain(model, ids, p.max_tokens, prefill_chunk_size=8) for ids, p in jobs]
    spec = BatchSpeculation(4, 3, 1, draft_model=model)
    got, stats = _serve(model, tokenizer, jobs, speculation=spec, prefill_chunk_size=8)
    assert got == wants
    spec = stats["speculation"]
    assert spec["steps"] > 0 and spec["accepted"] == spec["proposed"]


def test_draft_model_sampled_rows(tokenizer):
    """Rows sampled at a temperature verify the draft model's drafts by the accept/reject rule
    with the draft's own distributions: near temperature 0 that keeps exactly the drafts equal
    to the target's argmax (the greedy tokens), and a seeded run repeats."""
    model, draft = tiny("llama"), tiny("llama", 1)
    spec = BatchSpeculation(4, 3, 4, draft_model=draft)
    prompts = [repeating_prompt(model, seed) for seed in (3, 4)]
    greedy = [_plain(model, ids, 20) for ids in prompts]
    cold = SamplingParams(max_tokens=20, ignore_eos=True, temperature=1e-4, seed=1)
    jobs = [(prompts[0], cold), (prompts[1], SamplingParams(max_tokens=20, ignore_eos=True))]
    got, stats = _serve(model, tokenizer, jobs, speculation=spec)
    assert got == greedy and stats["speculation"]["steps"] > 0
    warm = SamplingParams(max_tokens=20, ignore_eos=True, temperature=1.0, seed=5)
    runs = [_serve(model, tokenizer, [(prompts[0], warm)], speculation=spec) for _ in range(2)]
    assert runs[0][0] == runs[1][0] and runs[0][1]["speculation"]["steps"] > 0


def test_a_draft_model_that_cannot_rewind_is_refused(toy_model, tokenizer):
    with pytest.raises(RewindError):
        Scheduler(toy_model, tokenizer, speculation=BatchSpeculation(draft_model=tiny("jamba")))


def test_sampled_rows_speculate_by_the_accept_rule(toy_model, tokenizer):
    """Rows sampled at a temperature alone speculate with the greedy ones: near temperature 0
    the rule keeps exactly the greedy drafts (so the tokens are the greedy ones), and a seed
    makes a run repeat; top-p makes the step plain."""
    model = tiny("llama")
    prompts = [repeating_prompt(model, seed) for seed in (3, 4)]
    greedy = [_plain(model, ids, 30) for ids in prompts]
    cold = SamplingParams(max_tokens=30, ignore_eos=True, temperature=1e-4, seed=1)
    jobs = [(prompts[0], cold), (prompts[1], SamplingParams(max_tokens=30, ignore_eos=True))]
    got, stats = _serve(model, tokenizer, jobs, speculation=BatchSpeculation(4, 3, 4))
    assert got == greedy
    assert stats["speculation"]["steps"] > 0 and stats["speculation"]["accepted"] > 0
    warm = SamplingParams(max_tokens=30, ignore_eos=True, temperature=1.0, seed=5)
    runs = [
        _serve(model, tokenizer, [(prompts[0], warm)], speculation=BatchSpeculation(4, 3, 4))
        for _ in range(2)
    ]
    assert runs[0][0] == runs[1][0] and runs[0][1]["speculation"]["steps"] > 0
    top_p = SamplingParams(max_tokens=30, ignore_eos=True, temperature=1.0, top_p=0.9, seed=5)
    _, stats = _serve(model, tokenizer, [(prompts[0], top_p)], speculation=BatchSpeculation())
    assert stats["speculation"]["steps"] == 0


def test_a_negative_seed_speculates(tokenizer):
    """OpenAI's seeds are any int64; the accept/reject generator takes the seed modulo 2**64
    (numpy refuses a negative one, which once failed the request at admission)."""
    model = tiny("llama")
    ids = repeating_prompt(model, 3)
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0, seed=-5)
    runs = [_serve(model, tokenizer, [(ids, params)], speculation=BatchSpeculation()) for _ in "ab"]
    assert len(runs[0][0][0]) == 12 and runs[0][0] == runs[1][0]
    assert runs[0][1]["requests"]["failed"] == 0 and runs[0][1]["speculation"]["steps"] > 0


def test_rows_that_report_or_adjust_take_plain_steps(toy_model, tokenizer):
    """A batch with a row that asks for logprobs (or has penalties, biases or a grammar) never
    speculates; a lone greedy request does, once the others are done."""
    ids = prompt(40, start=1)
    wants = [_plain(toy_model, ids, 20)] * 2
    jobs = [
        (ids, SamplingParams(max_tokens=20, ignore_eos=True, logprobs=True)),
        (ids, SamplingParams(max_tokens=20, ignore_eos=True)),
    ]
    got, stats = _serve(toy_model, tokenizer, jobs, speculation=BatchSpeculation(4, 3, 1))
    assert got == wants
    got, stats = _serve(toy_model, tokenizer, jobs[:1], speculation=BatchSpeculation(4, 3, 4))
    assert got == wants[:1] and stats["speculation"]["steps"] == 0
    got, stats = _serve(toy_model, tokenizer, jobs[1:], speculation=BatchSpeculation(4, 3, 4))
    assert got == wants[1:] and stats["speculation"]["steps"] > 0


def test_recurrent_batches_take_plain_steps(tokenizer):
    model = tiny("nemotron_h")
    prompts = [repeating_prompt(model, seed) for seed in (0, 1)]
    wants = [_plain(model, ids, 12) for ids in prompts]
    jobs = [(ids, SamplingParams(max_tokens=12, ignore_eos=True)) for ids in prompts]
    got, stats = _serve(model, tokenizer, jobs, speculation=BatchSpeculation(4, 3, 4))
    assert got == wants and stats["speculation"]["steps"] == 0


def test_warm_up_runs_a_verification_that_leaves_a_tail(toy_model, monkeypatch):
    """``scheduler._warm_tails`` (CUDA's warm-up with speculation; run here on the CPU): two
    throwaway rows verify, keep different counts, and the steps after write over the tail
    (the scatter MLX compiles at first use) and mask around it."""
    tails = []
    real = BatchKVCache.update_and_fetch

    def spy(self, keys, values=None):
        tails.append(self.tail.copy())
        return real(self, keys, values)

    monkeypatch.setattr(BatchKVCache, "update_and_fetch", spy)
    _warm_tails(toy_model, None, 4)
    # Row 0 kept its input token of 5 columns: the steps after write over a tail of 4.
    assert [t.tolist() for t in tails].count([4, 0]) >= 2


def test_speculation_warm_up_takes_both_models_and_only_logs_a_failure(
    toy_model, tokenizer, monkeypatch, caplog
):
    """The warm-up runs ``_warm_tails`` for the target and the draft model; if it fails, the
    server still starts (a warning), since only the requests of such a verification would."""
    from mlxc.runtime.serving import scheduler as sched

    draft = toy.random_model(seed=1)
    spec = BatchSpeculation(num_draft_tokens=2, draft_model=draft)
    s = Scheduler(toy_model, tokenizer, max_concurrency=2, speculation=spec)
    warmed = []
    monkeypatch.setattr(sched, "_warm_tails", lambda model, quant, k: warmed.append((model, k)))
    s._warm_speculation()
    assert warmed == [(toy_model, 2), (draft, 2)]

    def fails(*_):
        raise RuntimeError("no scatter here")

    monkeypatch.setattr(sched, "_warm_tails", fails)
    s._warm_speculation()  # does not raise
    assert "warming up speculation failed: RuntimeError: no scatter here" in caplog.text
