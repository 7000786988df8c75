"""Speculative decoding for one sequence: a drafter proposes up to K tokens, the target model
verifies all of them in one forward of K + 1 positions, and the caches take back what it rejects.

Two drafters: ``PromptLookup`` (n-gram matches in the prompt and the output so far; no second
model) and ``DraftModel`` (a smaller model decoding K tokens on its own cache). Greedy, the
output is the target's own greedy output, token for token: a draft is kept only while it equals
the target's argmax, and the target's next token follows the kept ones. Sampling, the standard
rule keeps the target's distribution (``accept_drafts``).

The cache contract (``LayerCache.rewind``): rejected tokens leave the caches by ``rewind``,
which moves ``offset`` back to the next real position. ``enforce_max_kv`` runs only once the
accepted tokens are known, on the accepted state, so a rewind never crosses a trim. Under
``--max-kv-size`` the verification forward's queries see exactly what one-token decode steps
would have seen, each followed by its trim (``KVCache.decode_bound``): the trimmed speculative
run equals the trimmed plain run. Windowed layers keep K keys past their window
(``rewind_reserve``) so a rewind leaves them what the window sees. Recurrent layers cannot
rewind; such models are refused (``RewindError``).

In the server (``BatchSpeculation``) the rows of the decode batch speculate together: one
verification forward of ``k + 1`` tokens per row (a row with fewer drafts is padded and takes
back the padding), each row's own acceptance (greedy, or the rule above at its temperature),
and each row keeps what it accepted where that buys the batch a token per row, else every row
is cut to the fewest (``rows_keep``; ``BatchCache.rewind_rows``). Their drafts come from
prompt lookup, or from ``BatchDrafter``: the draft model on a decode batch of its own, one
forward per draft token for every row.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
from mlx import nn

from mlxc.runtime.model import cuda_attention, cuda_matmul
from mlxc.runtime.model.batch import BatchCache
from mlxc.runtime.model.cache import (
    KVQuant,
    RewindError,
    cache_arrays,
    check_kv_limits,
    enforce_max_kv,
    make_caches,
    prepare_rewind,
    rewind_caches,
)
from mlxc.runtime.model.cache import trimmable as caches_to_trim
from mlxc.runtime.serving.generate import DEFAULT_KV_SINK, check_prompt, prefill_prompt


class SpeculationError(ValueError):
    """Speculative decoding asked of a pair or a setting it cannot serve (named)."""


@dataclass
class SpecStats:
    """What a speculative run did: verification steps, drafts proposed and accepted."""

    steps: int = 0
    proposed: int = 0
    accepted: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


# --- the accept/reject rule ---------------------------------------------------------------------


def _draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    cdf = np.cumsum(probs, dtype=np.float64)
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), len(cdf) - 1))


def accept_drafts(
    p: np.ndarray, q: np.ndarray | None, drafts: list[int], rng: np.random.Generator
) -> list[int]:
    """The tokens a verification step emits: the accepted drafts, then one more.

    ``p`` ``[k + 1, V]``: the target's distributions at each draft position and after the last;
    ``q`` ``[k, V']``: the draft's (None: deterministic drafts, q one-hot), over its own logit
    width (``_vocab_like`` brings it to ``V``). Draft ``i`` is kept
    with probability ``min(1, p_i(d) / q_i(d))``; at the first rejection the token is drawn
    from ``norm(max(0, p_i - q_i))`` and the step ends; if all are kept the last comes from
    ``p_k``. Each emitted token is then distributed as the target alone would sample it
    (Leviathan et al. 2023; Chen et al. 2023).
    """
    if q is not None and q.shape[1] != p.shape[1]:
        q = _vocab_like(q, p.shape[1])
    out = []
    for i, d in enumerate(drafts):
        q_i = np.zeros_like(p[i]) if q is None else q[i]
        if q is None:
            q_i[d] = 1.0
        if rng.random() * q_i[d] < p[i, d]:  # u < p/q, without dividing by a tiny q
            out.append(d)
            continue
        residual = np.maximum(p[i] - q_i, 0.0)
        out.append(_draw(residual if residual.sum() > 0 else p[i], rng))
        return out
    out.append(_draw(p[len(drafts)], rng))
    return out


def greedy_accept(targets: list[int], drafts: list[int]) -> list[int]:
    """Greedy: the drafts that equal the target's argmax, then the target's next token."""
    n = 0
    while n < len(drafts) and drafts[n] == targets[n]:
        n += 1
    return [*drafts[:n], targets[n]]


def rows_keep(emitted: list[list[int]]) -> list[list[int]]:
    """The tokens each row of one batched verification keeps, of what its rule emitted
    (``greedy_accept`` or ``accept_drafts``): its own count where that buys the batch at least
    one token per row over cutting every row to the fewest any row emits, else that cut.

    A row that keeps fewer than the others leaves columns in the batch cache that are not its
    own (``BatchKVCache.rewind_rows``' tail), which cost every later step until a compaction:
    on a GPU a scatter per layer and a masked attention where rows of equal length had none
    (on the H200 a batch of copy tasks speculated about a quarter slower keeping every row's
    count, ``docs/performance.md``). A cut row emits only tokens its rule accepted: greedy,
    each equals its argmax; sampled, whether the row goes on to a position depends on its
    earlier positions and on the other rows, never on that position's own draw, so each
    emitted token still follows the target's distribution given the ones before."""
    fewest = min(len(tokens) for tokens in emitted)
    if sum(len(tokens) - fewest for tokens in emitted) >= len(emitted):
        return emitted
    return [tokens[:fewest] for tokens in emitted]


@dataclass(frozen=True)
class BatchSpeculation:
    """Speculation in the server's decode batch (``mlxc serve --prompt-lookup`` or
    ``--draft-model``): up to ``num_draft_tokens`` drafts per row, from n-grams of up to
    ``ngram_size`` tokens or from ``draft_model`` (``BatchDrafter``: all rows at once), in
    the steps where the batch holds at most ``max_rows`` rows, each greedy or sampled at a
    temperature alone (no top-p, top-k or min-p), with nothing that adjusts or reports its
    logits (penalties, biases, logprobs, grammars)."""

    num_draft_tokens: int = 3
    ngram_size: int = 3
    max_rows: int = 4
    draft_model: nn.Module | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        for name in ("num_draft_tokens", "ngram_size", "max_rows"):
            if getattr(self, name) < 1:
                raise SpeculationError(f"{name} must be >= 1, got {getattr(self, name)}")


def probs(logits: mx.array, temp: float) -> np.ndarray:
    """Softmax of ``logits / temp`` on the host, float64 ``[L, V]``."""
    return np.asarray(mx.softmax(logits.astype(mx.float32) / temp, axis=-1), np.float64)


def _vocab_like(q: np.ndarray, vocab: int) -> np.ndarray:
    """A draft's distributions over the target's logit width: a shorter head (less embedding
    padding) pads with zeros; a draft that can propose ids the target has not is refused."""
    if q.shape[1] > vocab and q[:, vocab:].any():
        raise SpeculationError(
            f"the draft model's vocabulary ({q.shape[1]}) is larger than the target's ({vocab})"
        )
    return np.pad(q, ((0, 0), (0, max(vocab - q.shape[1], 0))))[:, :vocab]


# --- drafters -----------------------------------------------------------------------------------


class PromptLookup:
    """Drafts from the sequence itself: the tokens that followed the latest earlier occurrence
    of its last ``n`` tokens (``n`` from ``ngram_size`` down to 1, the longest match wins)."""

    def __init__(self, ngram_size: int = 3) -> None:
        if ngram_size < 1:
            raise SpeculationError(f"the n-gram size must be >= 1, got {ngram_size}")
        self.ngram_size = ngram_size

    def prefill(self, prompt_ids: list[int], chunk_size: int) -> None:
        pass

    def propose(self, history: list[int], k: int, temp: float, rng) -> tuple[list[int], None]:
        if k == 0:
            return [], None
        h = np.asarray(history)
        for n in range(min(self.ngram_size, len(h) - 1), 0, -1):
            windows = np.lib.stride_tricks.sliding_window_view(h[:-1], n)
            hits = np.flatnonzero((windows == h[-n:]).all(axis=1))
            if len(hits):
                start = hits[-1] + n  # the latest match: the most recent context
                return h[start : start + k].tolist(), None
        return [], None

    def accepted(self, n_accepted: int, n_proposed: int) -> None:
        pass


class DraftModel:
    """A smaller model proposing ``k`` tokens autoregressively on its own caches, which are
    rewound over what the target rejects and trimmed (``max_kv_size``) only after acceptance."""

    def __init__(
        self,
        model: nn.Module,
        reserve: int,
        *,
        max_kv_size: int | None = None,
        kv_sink: int = DEFAULT_KV_SINK,
        kv_quant: KVQuant | None = None,
    ) -> None:
        self.model = model
        self.cache = make_caches(model, kv_quant)
        prepare_rewind(model, self.cache, reserve)
        self.trimmable = caches_to_trim(model, self.cache)
        self.max_kv_size, self.kv_sink = max_kv_size, kv_sink
        self.seen = 0  # tokens of the sequence in the draft's caches
        self.unverified = 0  # drafts in its caches the target has not yet judged

    def prefill(self, prompt_ids: list[int], chunk_size: int) -> None:
        prefill_prompt(self.model, self.cache, prompt_ids, chunk_size, self._trim)
        mx.eval(cache_arrays(self.cache))
        self.seen = len(prompt_ids)

    def _trim(self) -> None:
        enforce_max_kv(self.trimmable, self.max_kv_size, self.kv_sink)

    def propose(
        self, history: list[int], k: int, temp: float, rng: np.random.Generator
    ) -> tuple[list[int], np.ndarray | None]:
        if k == 0:
            return [], None
        ids, drafts, qs = history[self.seen :], [], []
        for _ in range(k):
            # Untrimmed until acceptance, yet seeing what trimmed decode steps would see.
            with decode_bound(self.trimmable, self.max_kv_size, self.kv_sink):
                logits = self.model(mx.array([ids], dtype=mx.int32), cache=self.cache)
            logits = logits[0, -1:]
            if temp == 0:
                token = int(mx.argmax(logits, axis=-1).item())
            else:
                q = probs(logits, temp)[0]
                token = _draw(q, rng)
                qs.append(q)
            drafts.append(token)
            ids = [token]
        # Its caches hold the history and every draft but the last.
        self.seen = len(history)
        self.unverified = k - 1
        return drafts, (np.stack(qs) if qs else None)

    def accepted(self, n_accepted: int, n_proposed: int) -> None:
        if n_proposed == 0:
            return
        kept = min(n_accepted, self.unverified)
        rewind_caches(self.cache, self.unverified - kept)
        self.seen += kept
        self.unverified = 0
        enforce_max_kv(self.trimmable, self.max_kv_size, self.kv_sink)


class BatchDrafter:
    """A draft model drafting for every row of the server's decode batch at once
    (``mlxc serve --draft-model``): one forward of the draft per draft token, whatever the
    number of rows.

    Its own ``BatchCache`` holds, per row (a request id), that row's history but the last
    token, which leads the next drafting. Rows that took plain steps since they last drafted,
    or kept all their drafts, catch up in the first draft forward (they all lag by the same
    count: they were in the decode batch for the same steps), or in a forward of their own when
    a row joins or they are more than a chunk behind; a row new to the drafts is prefilled alone
    and joins. Under ``--max-kv-size`` the draft's rows are trimmed after each catch-up and
    acceptance, so a draft may differ from what an exact one-token run of the draft would
    propose: drafts are proposals, and the model's verification decides every token.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        max_kv_size: int | None = None,
        kv_sink: int = DEFAULT_KV_SINK,
        kv_quant: KVQuant | None = None,
        prefill_chunk_size: int = 512,
    ) -> None:
        probe = make_caches(model, kv_quant)
        if not BatchCache.accepts(probe) or not BatchCache.like(probe).rewindable:
            raise RewindError(
                "the draft model's caches cannot rewind in a decode batch (sliding-window, "
                "recurrent or model-owned layers)"
            )
        self.model = model
        self.max_kv_size, self.kv_sink, self.kv_quant = max_kv_size, kv_sink, kv_quant
        self.prefill_chunk_size = prefill_chunk_size
        self.batch: BatchCache | None = None
        self.keys: list[str] = []  # the request id of each row, in row order
        self.seen: dict[str, int] = {}  # tokens of each row's history in its draft caches
        self.unverified = 0  # drafts in every row's caches the model has not judged yet

    def propose(
        self,
        keys: list[str],
        histories: list[list[int]],
        k: int,
        temps: list[float],
        rngs: list,
    ) -> list[tuple[list[int], np.ndarray | None]]:
        """Each row's ``k`` drafts (greedy at temperature 0, else drawn at its temperature
        from its generator) and, for sampled rows, their distributions ``[k, V]``."""
        behind = self._sync(keys, histories)
        # The first forward also takes the tokens the rows are behind by (all rows equally).
        ids = mx.array([b + [h[-1]] for b, h in zip(behind, histories)], dtype=mx.int32)
        # Every row's caches will hold its history and every draft but the last.
        for key, history in zip(keys, histories):
            self.seen[key] = len(history)
        self.unverified = k - 1
        if not any(temp > 0 for temp in temps):  # all greedy: k forwards, one host read
            steps = []
            for _ in range(k):
                ids = mx.argmax(self.model(ids, cache=self.batch)[:, -1, :], axis=-1)[:, None]
                steps.append(ids)
            return [(d, None) for d in mx.concatenate(steps, axis=1).tolist()]
        drafts: list[list[int]] = [[] for _ in keys]
        dists: list[list[np.ndarray]] = [[] for _ in keys]
        for _ in range(k):
            logits = self.model(ids, cache=self.batch)[:, -1, :]
            tokens = mx.argmax(logits, axis=-1).tolist()
            for b, temp in enumerate(temps):
                if temp > 0:
                    q = probs(logits[b : b + 1], temp)[0]
                    dists[b].append(q)
                    tokens[b] = _draw(q, rngs[b])
                drafts[b].append(tokens[b])
            ids = mx.array(tokens, dtype=mx.int32)[:, None]
        return [(d, np.stack(q) if q else None) for d, q in zip(drafts, dists)]

    def accepted(self, n_accepted: list[int]) -> None:
        """The verification kept ``n_accepted[b]`` drafts of row ``b``: take back the rest. A
        row that kept every draft lags its history by one token (its last draft was never fed
        back); every other row then takes back one token more, fed again with the next
        drafting, so that all rows lag equally and the first draft forward takes as many
        tokens of each (``_sync``)."""
        kept = np.minimum(np.asarray(n_accepted, np.int64), self.unverified)
        lag = np.asarray(n_accepted) - kept
        again = lag.max(initial=0) - lag
        self.batch.rewind_rows(self.unverified - kept + again)
        for key, n in zip(self.keys, kept - again):
            self.seen[key] += int(n)
        self.unverified = 0
        self._trim(self.batch)

    def drop(self, key: str) -> None:
        """Forget a row (its request ended)."""
        if key not in self.seen:
            return
        del self.seen[key]
        row = self.keys.index(key)
        del self.keys[row]
        if not self.keys:
            self.batch = None
        else:
            self.batch.keep_rows([b for b in range(len(self.keys) + 1) if b != row])

    def _trim(self, caches) -> None:
        enforce_max_kv(caches_to_trim(self.model, caches), self.max_kv_size, self.kv_sink)

    def _sync(self, keys: list[str], histories: list[list[int]]) -> list[list[int]]:
        """Make the rows ``keys``, in that order, each holding its history but the last token,
        but for the tokens returned per row (the same count for every row), which the first
        draft forward takes: the tokens of plain steps (or of a verification whose drafts were
        all kept) since the rows last drafted, when no row joins and they fit one chunk."""
        wanted = dict(zip(keys, histories))
        for key in [key for key in self.keys if key not in wanted]:
            self.drop(key)
        lags = {len(wanted[key]) - 1 - self.seen[key] for key in self.keys}
        if len(lags) > 1 or min(lags, default=0) < 0:  # not expected: start the rows afresh
            for key in list(self.keys):
                self.drop(key)
        elif lags and (lag := lags.pop()) > 0:  # plain steps since the last drafting
            behind = [wanted[key][self.seen[key] : self.seen[key] + lag] for key in self.keys]
            for key in self.keys:
                self.seen[key] += lag
            if self.keys == keys and lag <= self.prefill_chunk_size:  # no row joins or goes
                return behind  # the first draft forward takes them
            for start in range(0, lag, self.prefill_chunk_size):
                chunk = [tokens[start : start + self.prefill_chunk_size] for tokens in behind]
                self.model(mx.array(chunk, dtype=mx.int32), cache=self.batch)
                self._trim(self.batch)
                mx.eval(cache_arrays(self.batch))
        new = [key for key in keys if key not in self.seen]
        rows = []
        for key in new:  # prefilled alone, as generate_tokens would, then joined
            caches = make_caches(self.model, self.kv_quant)
            prompt = wanted[key][:-1]
            prefill_prompt(
                self.model, caches, prompt, self.prefill_chunk_size, lambda c=caches: self._trim(c)
            )
            mx.eval(cache_arrays(caches))
            rows.append(caches)
            self.seen[key] = len(prompt)
        if rows:
            if self.batch is None:
                self.batch = BatchCache.like(rows[0])
            self.batch.extend(rows)
            self.keys += new
        if self.keys != keys:
            self.batch.keep_rows([self.keys.index(key) for key in keys])
            self.keys = list(keys)
        return [[] for _ in keys]


def load_draft(path, tokenizer, specs=None) -> nn.Module:
    """The draft checkpoint at ``path``, built; ``CheckpointError`` when it cannot draft for a
    model of ``tokenizer`` (another vocabulary: its token ids would mean other tokens)."""
    from mlxc.runtime.checkpoint.loading import CheckpointError, load_checkpoint

    draft = load_checkpoint(path, specs=specs)
    if draft.tokenizer.get_vocab() != tokenizer.get_vocab():
        raise CheckpointError(
            f"the draft model at {path} has another tokenizer vocabulary than the model: "
            "its token ids would mean other tokens"
        )
    return draft.load_model()


# --- the loop -----------------------------------------------------------------------------------


@contextlib.contextmanager
def decode_bound(caches: list, max_kv_size: int | None, keep: int):
    """Within it, the trimmable caches mask a multi-token forward as one-token steps."""
    bound = None if max_kv_size is None else (max_kv_size, keep)
    for c in caches:
        c.decode_bound = bound
    try:
        yield
    finally:
        for c in caches:
            c.decode_bound = None


def speculative_tokens(
    model: nn.Module,
    prompt_ids: list[int],
    drafter: PromptLookup | DraftModel,
    *,
    max_tokens: int,
    num_draft_tokens: int = 3,
    temp: float = 0.0,
    seed: int | None = None,
    prefill_chunk_size: int = 2048,
    max_kv_size: int | None = None,
    kv_sink: int = DEFAULT_KV_SINK,
    kv_quant: KVQuant | None = None,
    eos_token_ids: Iterable[int] = (),
    stats: SpecStats | None = None,
) -> Iterator[int]:
    """Yield generated token ids (EOS not yielded), as ``generate_tokens`` would with the same
    arguments: greedy (``temp`` 0) the very same tokens; sampling, tokens from the same
    distribution (``temp`` only: top-p/top-k are not combined with speculation). Each step
    drafts up to ``num_draft_tokens`` and verifies them in one target forward. ``seed``: the
    host generator of the sampling draws (numpy). ``stats``: filled as the run goes.

    Raises ``RewindError`` (a ``ValueError``) at the call, before any forward, for a model
    whose caches cannot rewind.
    """
    check_prompt(prompt_ids, model, *([drafter.model] if isinstance(drafter, DraftModel) else []))
    if num_draft_tokens < 1:
        raise SpeculationError(f"--num-draft-tokens must be >= 1, got {num_draft_tokens}")
    check_kv_limits(max_kv_size, kv_sink)
    stats = SpecStats() if stats is None else stats
    cache = make_caches(model, kv_quant)
    prepare_rewind(model, cache, num_draft_tokens)
    # The kernels of verifications of up to K drafts (fewer when the drafter finds fewer).
    cuda_attention.warm(model, tuple(range(1, num_draft_tokens + 2)), kv_quant)
    cuda_matmul.warm(model)  # their products of K + 1 rows
    trimmable = caches_to_trim(model, cache)
    rng = np.random.default_rng(seed)
    eos = set(eos_token_ids)

    def _run() -> Iterator[int]:
        # Prefill exactly as generate_tokens does (the same chunks, a trim after each).
        def trim() -> None:
            enforce_max_kv(trimmable, max_kv_size, kv_sink)

        logits = prefill_prompt(model, cache, prompt_ids, prefill_chunk_size, trim)[0, -1:]
        drafter.prefill(prompt_ids, prefill_chunk_size)
        new = (
            [int(mx.argmax(logits, -1).item())]
            if temp == 0
            else [_draw(probs(logits, temp)[0], rng)]
        )

        history, emitted = list(prompt_ids), 0
        while True:
            for token in new:
                if token in eos:
                    return
                yield token
                history.append(token)
                emitted += 1
                if emitted == max_tokens:
                    return
            # The last token is not in the caches yet: it leads the verification forward.
            k = min(num_draft_tokens, max_tokens - emitted - 1)
            drafts, q = drafter.propose(history, k, temp, rng)
            with decode_bound(trimmable, max_kv_size, kv_sink):
                ids = mx.array([[history[-1], *drafts]], dtype=mx.int32)
                logits = model(ids, cache=cache)[0]
            if temp == 0:
                new = greedy_accept(mx.argmax(logits, -1).tolist(), drafts)
            else:
                new = accept_drafts(probs(logits, temp), q, drafts, rng)
            n_accepted = len(new) - 1
            rewind_caches(cache, len(drafts) - n_accepted)
            trim()  # on the accepted state only
            drafter.accepted(n_accepted, len(drafts))
            stats.steps += 1
            stats.proposed += len(drafts)
            stats.accepted += n_accepted

    return _run() if max_tokens > 0 else iter(())
