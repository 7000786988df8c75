"""Scheduler and cache pool, in process on the toy model: equality with generate_tokens
(chunked prefill, trims), interleaving, cancellation, failure isolation, admission control."""

from __future__ import annotations

import queue
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))  # the toy model lives beside the tests
import _toy_model as toy

from mlxc.runtime.checkpoint.tokenizer import StreamingDetokenizer, load_tokenizer
from mlxc.runtime.model.batch import BatchCache, BatchKVCache
from mlxc.runtime.model.cache import KVCache, cache_policy
from mlxc.runtime.serving import metrics
from mlxc.runtime.serving.admission import AdmissionQueue, Request
from mlxc.runtime.serving.generate import generate_tokens, prefill_chunks
from mlxc.runtime.serving.output import EventText, SequenceOutput
from mlxc.runtime.serving.sample import make_sampler
from mlxc.runtime.serving.scheduler import (
    Delta,
    Failed,
    Finished,
    QueueFull,
    SamplingParams,
    Scheduler,
    StopMatcher,
)
from mlxc.runtime.serving.speculative import BatchSpeculation

POISON = 7  # a prompt holding this id makes FaultyModel raise inside its forward


@pytest.fixture(scope="module")
def model():
    return toy.random_model()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("toy-tokenizer")
    toy.write_tokenizer(path)
    return load_tokenizer(path)


def prompt(n: int, start: int = 10) -> list[int]:
    return [(start + 3 * i) % 240 + 10 for i in range(n)]  # never POISON


class Collector:
    """An emit callback that records events (the scheduler calls it from its thread)."""

    def __init__(self) -> None:
        self.events: queue.Queue = queue.Queue()

    def __call__(self, event) -> None:
        self.events.put(event)

    def result(self, timeout: float = 60.0):
        tokens, text = [], []
        while True:
            event = self.events.get(timeout=timeout)
            if isinstance(event, Delta):
                tokens.append(event.token)
                text.append(event.text)
            else:
                if isinstance(event, Finished):
                    text.append(event.text)
                return tokens, "".join(text), event


@pytest.fixture
def make_scheduler(model, tokenizer):
    made = []

    def make(m=None, start=True, **options) -> Scheduler:
        s = Scheduler(m or model, tokenizer, **options)
        if start:
            s.start()
        made.append(s)
        return s

    yield make
    for s in made:
        s.stop()


def expected(model, ids, n, **options) -> list[int]:
    # Runs on the test thread while no scheduler works: MLX never sees two threads at once.
    return list(generate_tokens(model, ids, max_tokens=n, **options))


def wait_idle(s: Scheduler) -> dict:
    """Stats once nothing runs or waits (the last publish follows the last event)."""
    for _ in range(6000):  # a deadline for a hung test, not a timing assertion
        stats = s.stats()
        if stats["running"] == 0 and stats["waiting"] == 0 and stats["pool"]["sequences"] == 0:
            return stats
        time.sleep(0.01)
    raise AssertionError(f"scheduler never went idle: {s.stats()}")


# --- equality with generate_tokens -------------------------------------------------------------


@pytest.mark.parametrize(
    "chunk, max_kv, sink",
    [(512, None, 4), (5, None, 4), (8, 24, 4), (16, 20, 0), (7, 30, 2)],
)
def test_greedy_matches_generate_tokens(model, make_scheduler, chunk, max_kv, sink):
    ids = prompt(53)
    want = expected(model, ids, 20, prefill_chunk_size=chunk, max_kv_size=max_kv, kv_sink=sink)
    s = make_scheduler(prefill_chunk_size=chunk, max_kv_size=max_kv, kv_sink=sink)
    out = Collector()
    s.submit(ids, SamplingParams(max_tokens=20), out)
    tokens, _, done = out.result()
    assert tokens == want
    assert (done.reason, done.prompt_tokens, done.completion_tokens) == ("length", 53, 20)


def test_seeded_sampling_matches_generate_tokens(model, make_scheduler):
    ids = prompt(30)
    sampling = {"temp": 0.8, "top_p": 0.9, "top_k": 20, "seed": 11}
    want = expected(model, ids, 12, sampler=make_sampler(**sampling))
    s = make_scheduler()
    out = Collector()
    params = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, top_k=20, seed=11)
    s.submit(ids, params, out)
    assert out.result()[0] == want


def test_greedy_and_sampled_rows_in_one_batch_match_alone(model, make_scheduler):
    """Rows of one decode batch keep their own samplers (and seeded random streams)."""
    ids = [prompt(30), prompt(17, start=3), prompt(24, start=5)]
    sampled = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, top_k=20, seed=11)
    wants = [
        expected(model, ids[0], 12),
        expected(model, ids[1], 12, sampler=make_sampler(temp=0.8, top_p=0.9, top_k=20, seed=11)),
        expected(model, ids[2], 12),
    ]
    s = make_scheduler(max_concurrency=3)
    outs = [Collector() for _ in ids]
    for prompt_ids, params, out in zip(
        ids, [SamplingParams(max_tokens=12), sampled, SamplingParams(max_tokens=12)], outs
    ):
        s.submit(prompt_ids, params, out)
    for want, out in zip(wants, outs):
        assert out.result()[0] == want


def test_eos_stops_and_is_not_emitted(model, make_scheduler):
    ids = prompt(20)
    free = expected(model, ids, 10)
    eos = free[4]
    s = make_scheduler(eos_token_ids={eos})
    out = Collector()
    s.submit(ids, SamplingParams(max_tokens=10), out)
    tokens, _, done = out.result()
    assert tokens == free[: free.index(eos)]
    assert done.reason == "stop" and done.completion_tokens == len(tokens)
    # ignore_eos generates through it
    out = Collector()
    s.submit(ids, SamplingParams(max_tokens=10, ignore_eos=True), out)
    assert out.result()[0] == free


# --- many sequences ------------------------------------------------------------------------------


def test_concurrent_sequences_match_alone_and_pool_empties(model, make_scheduler):
    jobs = [(prompt(n, start=n), k) for n, k in [(5, 9), (61, 14), (17, 3), (90, 11), (33, 20)]]
    wants = [expected(model, ids, k, prefill_chunk_size=8, max_kv_size=40) for ids, k in jobs]
    s = make_scheduler(prefill_chunk_size=8, max_kv_size=40, max_concurrency=3)
    outs = [Collector() for _ in jobs]
    for (ids, k), out in zip(jobs, outs):
        s.submit(ids, SamplingParams(max_tokens=k), out)
    for want, out in zip(wants, outs):
        assert out.result()[0] == want
    stats = wait_idle(s)
    assert stats["pool"]["bytes"] == 0
    assert stats["requests"]["completed"] == len(jobs)
    # Toy caches: 2 layers x (K + V) x 32 floats per token. The pool never held more than
    # max_kv_size (+1 token in flight before a trim) tokens per running sequence.
    per_token = 2 * 2 * 32 * 4
    assert 0 < stats["pool"]["peak_bytes"] <= 3 * 40 * per_token


@pytest.mark.parametrize(
    "options",
    [{}, {"max_kv_size": 12, "kv_sink": 2}],
    ids=["plain", "trimmed"],
)
def test_rows_that_leave_are_taken_over_in_place(model, make_scheduler, monkeypatch, options):
    """Requests of different lengths through 3 rows: a finished row stays in the batch, dead,
    and a joining request is written over it (BatchCache.place) rather than the batch copied;
    every answer still equals generate_tokens alone."""
    # A small step: buffers grow, and rows placed at the growing column index soon waste a
    # step's worth of columns, so the pool compacts within this short schedule too.
    monkeypatch.setattr(KVCache, "step", 8)
    monkeypatch.setattr(BatchKVCache, "step", 8)
    kept = []
    keep_rows = BatchCache.keep_rows
    monkeypatch.setattr(
        BatchCache, "keep_rows", lambda b, rows: kept.append(rows) or keep_rows(b, rows)
    )
    placed = []
    place = BatchCache.place

    def recorded(batch, slots, other):
        placed.append(place(batch, slots, other))
        return placed[-1]

    monkeypatch.setattr(BatchCache, "place", recorded)
    lengths = [(5, 9), (7, 30), (6, 4), (9, 25), (4, 12), (8, 6), (5, 20), (6, 3), (3, 14)]
    jobs = [(prompt(n, start=7 * i), k) for i, (n, k) in enumerate(lengths)]
    wants = [expected(model, ids, k, **options) for ids, k in jobs]
    s = make_scheduler(max_concurrency=3, **options)
    outs = [Collector() for _ in jobs]
    for (ids, k), out in zip(jobs, outs):
        s.submit(ids, SamplingParams(max_tokens=k, ignore_eos=True), out)
    for want, out in zip(wants, outs):
        assert out.result()[0] == want
    assert any(placed), "no joining request took a dead row's place"
    assert kept, "dead rows were never dropped"
    stats = wait_idle(s)
    assert stats["pool"]["batched"] == 0 and stats["pool"]["bytes"] == 0


def test_forwards_are_counted_by_kind(model, make_scheduler):
    """``mlxc_forwards_total{kind}``: one prefill forward per prompt chunk, one decode forward
    per batched step after the first token (which the last chunk gives)."""

    def count(kind: str) -> float:
        return metrics.forward_counts()[kind]

    before = metrics.forward_counts()
    s = make_scheduler(prefill_chunk_size=8)
    out = Collector()
    s.submit(prompt(20), SamplingParams(max_tokens=5, ignore_eos=True), out)
    assert len(out.result()[0]) == 5
    wait_idle(s)
    assert count("prefill") - before["prefill"] == len(prefill_chunks(20, 8))
    # 4 steps; a step queued before the answer's end was read may run once more, unread.
    assert count("decode") - before["decode"] in (4, 5)


def test_scheduler_time_is_counted_by_phase(model, make_scheduler):
    """``mlxc_scheduler_seconds_total{phase}``: each phase a served request passes through
    takes time, no speculation ran, and the phases fit inside the ticks that hold them."""
    before = metrics.scheduler_seconds()
    s = make_scheduler(prefill_chunk_size=8)
    outs = [Collector() for _ in range(3)]
    for i, out in enumerate(outs):
        s.submit(prompt(12 + i), SamplingParams(max_tokens=6, ignore_eos=True), out)
    assert all(len(out.result()[0]) == 6 for out in outs)
    wait_idle(s)
    spent = {k: v - before[k] for k, v in metrics.scheduler_seconds().items()}
    for phase in ("build", "dispatch", "read", "hand_out", "prefill", "tick"):
        assert spent[phase] > 0, phase
    assert spent["verify"] == 0
    assert sum(v for k, v in spent.items() if k != "tick") <= spent["tick"]


class Recorder:
    """Wraps a model; records (cache list id, number of input tokens) of every forward."""

    def __init__(self, model):
        self.model, self.calls = model, []

    def __call__(self, ids, cache=None, **kwargs):
        self.calls.append((id(cache), ids.shape[1]))
        return self.model(ids, cache=cache, **kwargs)

    def make_cache(self):
        return self.model.make_cache()


class BatchRecorder(Recorder):
    """Records the batch size of every forward."""

    def __call__(self, ids, cache=None, **kwargs):
        self.calls.append(ids.shape[0])
        return self.model(ids, cache=cache, **kwargs)


def test_scheduler_decodes_its_sequences_in_one_forward(model, make_scheduler):
    jobs = [(prompt(n, start=n), k) for n, k in [(5, 30), (40, 25), (17, 20), (9, 28)]]
    wants = [expected(model, ids, k, prefill_chunk_size=8, max_kv_size=24) for ids, k in jobs]
    rec = BatchRecorder(model)
    s = make_scheduler(rec, prefill_chunk_size=8, max_kv_size=24, max_concurrency=4)
    outs = [Collector() for _ in jobs]
    for (ids, k), out in zip(jobs, outs):
        s.submit(ids, SamplingParams(max_tokens=k, ignore_eos=True), out)
    seen_batched, deadline = 0, time.monotonic() + 60  # a deadline, not a timing assertion
    while seen_batched < 2 and time.monotonic() < deadline:
        seen_batched = max(seen_batched, s.stats()["pool"]["batched"])
        time.sleep(0.001)
    for want, out in zip(wants, outs):
        assert out.result()[0] == want
    assert seen_batched >= 2  # /health shows the rows decoding in the batch
    assert wait_idle(s)["pool"]["batched"] == 0
    assert max(rec.calls) == len(jobs)  # all four decoded together
    decode_tokens = sum(k for _, k in jobs) - len(jobs)  # the first token comes from prefill
    assert sum(b for b in rec.calls if b > 1) >= decode_tokens // 2


def test_long_prefill_interleaves_with_decode(model, make_scheduler):
    rec = Recorder(model)
    s = make_scheduler(rec, prefill_chunk_size=10)
    short, long = Collector(), Collector()
    s.submit(prompt(4), SamplingParams(max_tokens=60, ignore_eos=True), short)
    assert isinstance(short.events.get(timeout=60), Delta)  # the short one is decoding
    s.submit(prompt(95), SamplingParams(max_tokens=2), long)
    long.result()
    short.result()
    long_cache = next(c for c, n in rec.calls if n == 10)
    chunks = [i for i, (c, n) in enumerate(rec.calls) if c == long_cache]
    between = [rec.calls[i] for i in range(chunks[0], chunks[9])]
    # Between the long prompt's first and last chunk, the short one kept decoding.
    assert sum(1 for c, n in between if c != long_cache and n == 1) >= 8


def test_cancel_frees_the_slot(model, make_scheduler):
    s = make_scheduler(max_concurrency=1)
    first, second = Collector(), Collector()
    handle = s.submit(prompt(10), SamplingParams(max_tokens=10_000, ignore_eos=True), first)
    assert isinstance(first.events.get(timeout=60), Delta)
    s.submit(prompt(12), SamplingParams(max_tokens=5), second)  # waits for the only slot
    handle.cancel()
    tokens, _, done = second.result()
    assert isinstance(done, Finished) and len(tokens) == 5
    stats = wait_idle(s)
    assert stats["requests"]["cancelled"] == 1
    assert stats["pool"]["bytes"] == 0


def test_cancel_inside_emit(model, make_scheduler):
    """A listener may cancel from its callback (the server does so when a client leaves)."""
    s = make_scheduler()
    seen = []

    def emit(event):
        seen.append(event)
        if len(seen) == 3:
            handle.cancel()

    handle = s.submit(prompt(8), SamplingParams(max_tokens=500, ignore_eos=True), emit)
    stats = wait_idle(s)
    assert stats["requests"]["cancelled"] == 1
    assert len(seen) < 10


# --- failures -------------------------------------------------------------------------------------


class FaultyModel:
    """The toy model, except a forward whose input holds POISON fails the way #421 did: an MLX
    broadcast error raised in the middle of the forward."""

    def __init__(self, model):
        self.model = model

    def __call__(self, ids, cache=None, **kwargs):
        if POISON in ids.tolist()[0]:
            return mx.zeros((1, 4, 8)) + mx.zeros((1, 6, 8))  # ValueError: broadcast_shapes
        return self.model(ids, cache=cache, **kwargs)

    def make_cache(self):
        return self.model.make_cache()


def _one_of_three_fails(model, scheduler, bad_prompt: list[int], error: str) -> list[int]:
    """Two good requests and ``bad_prompt`` between them: the good ones answer as alone, the
    bad one fails with ``error``, nothing is left held. Returns the first good answer."""
    good = [prompt(30, start=1), prompt(45, start=2)]
    wants = [expected(model, ids, 15, prefill_chunk_size=8) for ids in good]
    outs = [Collector() for _ in range(3)]
    for ids, out in zip([good[0], bad_prompt, good[1]], outs):
        scheduler.submit(ids, SamplingParams(max_tokens=15), out)
    assert [outs[0].result()[0], outs[2].result()[0]] == wants
    _, _, failed = outs[1].result()
    assert isinstance(failed, Failed) and error in failed.message
    stats = wait_idle(scheduler)
    assert stats["requests"]["failed"] == 1 and stats["pool"]["bytes"] == 0
    return wants[0]


def test_a_failing_forward_ends_only_its_request(model, make_scheduler):
    s = make_scheduler(FaultyModel(model), prefill_chunk_size=8)
    bad_prompt = prompt(20) + [POISON] + prompt(20)  # fails on its third chunk
    want = _one_of_three_fails(model, s, bad_prompt, "broadcast")
    # ... and the scheduler still serves.
    out = Collector()
    s.submit(prompt(30, start=1), SamplingParams(max_tokens=15), out)
    assert out.result()[0] == want


class FailsWhenEvaluated(FaultyModel):
    """A forward whose input holds POISON builds, and fails only once evaluated (as a kernel's
    failure would): a singular matrix's inverse is part of its logits."""

    def __call__(self, ids, cache=None, **kwargs):
        logits = self.model(ids, cache=cache, **kwargs)
        if POISON in ids.tolist()[0]:
            singular = mx.linalg.inv(mx.zeros((2, 2)), stream=mx.cpu)  # raises in evaluation
            logits = logits + singular.sum().astype(logits.dtype) * 0
        return logits


def test_a_forward_failing_in_evaluation_ends_only_its_request(model, make_scheduler):
    s = make_scheduler(FailsWhenEvaluated(model), prefill_chunk_size=8)
    # In its last chunk: the one whose logits are evaluated (the others' caches are).
    _one_of_three_fails(model, s, prompt(36) + [POISON], "LU factorization")


def test_bad_sampling_params_fail_the_request_not_the_loop(model, make_scheduler):
    s = make_scheduler()
    out = Collector()
    s.submit(prompt(5), SamplingParams(max_tokens=3, top_p=0.0, temperature=1.0), out)
    assert isinstance(out.result()[2], Failed)
    out = Collector()
    s.submit(prompt(5), SamplingParams(max_tokens=3), out)
    assert len(out.result()[0]) == 3


# --- admission ------------------------------------------------------------------------------------


def test_queue_full_and_cancelled_waiters_give_their_place_back(make_scheduler):
    # Not started: nothing is admitted. One free slot plus two queue places take three.
    s = make_scheduler(start=False, max_concurrency=1, max_queue=2)
    waiters = [s.submit(prompt(5), SamplingParams(max_tokens=1), Collector()) for _ in range(3)]
    with pytest.raises(QueueFull):
        s.submit(prompt(5), SamplingParams(max_tokens=1), Collector())
    waiters[0].cancel()
    s.submit(prompt(5), SamplingParams(max_tokens=1), Collector())
    stats = s.stats()
    assert stats["waiting"] == 3
    assert stats["requests"]["rejected"] == 1 and stats["requests"]["cancelled"] == 1


def test_a_tick_asks_the_waiting_requests_only_after_a_cancel(monkeypatch):
    """Admission looks for cancelled waiting requests only when one was cancelled since it
    last looked: a long queue (an overloaded server) costs a tick nothing per waiting request."""
    asked = []
    real = Request.cancelled
    monkeypatch.setattr(
        Request, "cancelled", property(lambda r: asked.append(r.id) or real.fget(r))
    )
    q = AdmissionQueue(max_concurrency=1, max_queue=100)
    waiting = [
        q.submit(prompt(5), SamplingParams(max_tokens=1), Collector(), None, lambda: False)
        for _ in range(50)
    ]
    assert [r.id for r in q.admit(busy=True)] == [waiting[0].id]
    for _ in range(3):
        assert q.admit(busy=True) == []  # no free slot
    assert asked == []
    waiting[7].cancel()
    q.admit(busy=True)
    assert len(asked) == 49  # each waiting request once, the cancelled one dropped
    q.admit(busy=True)
    assert len(asked) == 49
    assert q.read_stats()[1] == 48 and q.read_stats()[3]["cancelled"] == 1


def test_max_queue_zero_still_admits_into_free_slots(make_scheduler):
    s = make_scheduler(max_concurrency=2, max_queue=0)
    outs = [Collector(), Collector()]
    for out in outs:
        s.submit(prompt(5), SamplingParams(max_tokens=2), out)
    assert all(len(out.result()[0]) == 2 for out in outs)


def test_submit_validates(make_scheduler, model):
    s = make_scheduler(start=False)
    with pytest.raises(ValueError, match="empty"):
        s.submit([], SamplingParams(max_tokens=1), Collector())
    # An id past the embedding would be read out of bounds by MLX's gather (a crash), not
    # refused: the scheduler refuses it, as generate_tokens does.
    vocab = model.args.vocab_size
    for bad in (vocab, -1):
        with pytest.raises(ValueError, match=f"token id {bad} is out of range"):
            s.submit([5, bad, 6], SamplingParams(max_tokens=1), Collector())
        with pytest.raises(ValueError, match=f"token id {bad} is out of range"):
            next(generate_tokens(model, [5, bad, 6], max_tokens=1))
    s.submit([vocab - 1], SamplingParams(max_tokens=1), Collector())
    # With a draft model of a smaller embedding, its rows bound the ids too.
    draft = toy.random_model({**toy.CONFIG, "vocab_size": vocab - 10}, seed=1)
    spec = make_scheduler(start=False, speculation=BatchSpeculation(4, 3, 4, draft_model=draft))
    with pytest.raises(ValueError, match=f"token id {vocab - 5} is out of range"):
        spec.submit([5, vocab - 5], SamplingParams(max_tokens=1), Collector())
    with pytest.raises(ValueError, match="max_tokens"):
        s.submit([1], SamplingParams(max_tokens=0), Collector())
    with pytest.raises(ValueError, match="kv_sink"):
        make_scheduler(start=False, max_kv_size=4, kv_sink=4)


# --- model-owned caches --------------------------------------------------------------------------


def test_model_owned_caches_are_never_trimmed(model, make_scheduler):
    Owned = type("Owned", (toy.Model,), {"cache_policy": "model-owned"})
    owned = Owned(model.args)
    owned.update(model.parameters())
    assert cache_policy(owned) == "model-owned" and cache_policy(model) == "pooled-kv"

    ids = prompt(40)
    want = expected(model, ids, 10, prefill_chunk_size=8)  # the untrimmed result
    s = make_scheduler(owned, prefill_chunk_size=8, max_kv_size=16)
    assert not s.pool.trims
    out = Collector()
    s.submit(ids, SamplingParams(max_tokens=10), out)
    assert out.result()[0] == want


# --- stop strings --------------------------------------------------------------------------------


def test_stop_matcher():
    m = StopMatcher(["END", "xy"])
    assert m.feed("abc E") == ("abc ", False)  # "E" may start "END": held back
    assert m.feed("N") == ("", False)
    assert m.feed("D and more") == ("", True)

    m = StopMatcher(["xy", "bx"])
    assert m.feed("aaxbxy") == ("aax", True)  # the earliest hit wins
    m = StopMatcher(["##"])
    assert m.feed("a#") == ("a", False)
    assert m.feed("b") == ("#b", False)  # a false start is released
    assert m.flush() == ""
    assert StopMatcher([]).feed("x") == ("x", False)


def test_stop_string_ends_generation(model, tokenizer, make_scheduler):
    ids = prompt(25)
    free = expected(model, ids, 30)
    detok = StreamingDetokenizer(tokenizer)
    text = "".join(detok.add(t) for t in free) + detok.finalize()
    stop = text[10:13]
    assert len(stop) == 3
    s = make_scheduler()
    out = Collector()
    s.submit(ids, SamplingParams(max_tokens=30, stop=(stop,)), out)
    tokens, got, done = out.result()
    assert got == text[: text.index(stop)]
    assert done.reason == "stop" and len(tokens) < 30


@pytest.mark.parametrize("ending", ["eos", "length"])
def test_text_made_by_the_reader_equals_the_schedulers(tokenizer, ending):
    """``mlxc serve``'s HTTP process makes the text of requests without stop strings
    (``SamplingParams(detokenize=False)``, ``output.EventText``): on random token streams
    (multi-byte characters split across tokens, a special token kept), every event's text
    equals what the scheduler's own ``SequenceOutput`` sends, and the scheduler's events
    carry none."""
    eos = 257
    keep = frozenset({256})
    rng = np.random.default_rng(1)
    for _ in range(10):
        ids = [int(i) for i in rng.integers(0, 256, 30)] + [256, 72, 105]
        if ending == "eos":
            ids.append(eos)
        made = {}
        for detokenize in (True, False):
            params = SamplingParams(max_tokens=len(ids), keep_special=keep, detokenize=detokenize)
            output = SequenceOutput(tokenizer, params, 4, frozenset({eos}))
            events: list = []
            for token in ids:
                if output.accept(token, events.append):
                    break
            made[detokenize] = events
        sent, filled = made[True], made[False]
        assert [type(e) for e in sent] == [type(e) for e in filled]
        assert isinstance(sent[-1], Finished) and sent[-1].reason == (
            "stop" if ending == "eos" else "length"
        )
        assert all(e.text == "" for e in filled)  # nothing detokenized on the scheduler's side
        reader = EventText(tokenizer, keep)
        assert [reader.fill(e) for e in filled] == sent
        assert "".join(e.text for e in sent).endswith("Hi")
    with pytest.raises(ValueError, match="stop strings"):
        SamplingParams(max_tokens=4, stop=("x",), detokenize=False)


class KwargsRecorder:
    """Records the keyword inputs of every forward (what a VL model gets with its images)."""

    def __init__(self, model):
        self.model, self.calls = model, []

    def __call__(self, ids, cache=None, last_only=False, **inputs):
        self.calls.append((ids.shape[1], inputs))
        return self.model(ids, cache=cache, last_only=last_only)

    def make_cache(self):
        return self.model.make_cache()


def test_model_inputs_go_to_the_first_prefill_chunk_only(model, make_scheduler):
    rec = KwargsRecorder(model)
    s = make_scheduler(rec, prefill_chunk_size=8)
    out = Collector()
    pixels = np.arange(6, dtype=np.float32).reshape(2, 3)
    s.submit(prompt(20), SamplingParams(max_tokens=3), out, model_inputs={"pixel_values": pixels})
    out.result()
    (n_first, first), *rest = rec.calls
    assert n_first == 8 and isinstance(first["pixel_values"], mx.array)
    assert np.array_equal(np.array(first["pixel_values"]), pixels)
    # The other prefill chunks, then two decode steps (the batched step runs one ahead of the
    # tokens read, so a third may run past the end), none with the model inputs.
    chunks = [b - a for a, b in prefill_chunks(20, 8)]
    want = chunks[1:] + [1, 1]
    assert [n for n, _ in rest[: len(want)]] == want and len(rest) <= len(want) + 1
    assert all(inputs == {} for _, inputs in rest)
