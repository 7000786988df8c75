"""``mlxc verify``: drive every spec's generated code through a fixed bounded-cache schedule.

For each spec: compile it (in memory), build the model from the spec's ``tiny_config`` with
random weights, and run the same token schedule three times, untrimmed and with a small
max-kv-size (without and with sink tokens): chunked prefill, a multi-token continuation, decode
steps, ``enforce_max_kv`` after each. It fails on any exception, on an array mask whose width is
not the live key count (every mask is materialised and checked), on any difference from the
untrimmed run before the first trim, and when the untrimmed chunked run disagrees with one full
forward pass or with the fast ``"causal"`` mask path. Layers whose cache holds state rather
than keys (a recurrent layer's, ``holds_keys`` false) must end the chunked run with the state
one forward pass leaves, and no trim may touch that state. The server's prefix cache: caches
resumed from the blocks snapshotted at each prefill boundary must continue with the very logits
of the run they were taken from. Then the server's batched decode: rows of different lengths
(one with the image), trimmed, joining and leaving a ``BatchCache``, must give each row the
logits it gets decoding alone. Where the model's head dims allow it, the chunked, trimmed and
batched runs are repeated on 4-bit quantised KV caches (``--kv-bits``): chunked must equal one
pass over the same quantised cache and batched must equal alone (each token is quantised on
its own, so both hold up to float rounding). Speculation: after a trimmed chunked prefill,
verification forwards of several tokens whose tails are rejected (rewound), with trims between
them, must give the logits of the plain one-token decode steps (a model whose caches cannot
rewind, a recurrent one, must be refused instead).
"""

from __future__ import annotations

import copy
import itertools
import types
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from mlxc.compiler import build
from mlxc.runtime.checkpoint.user_specs import load_source
from mlxc.runtime.model import layers, masks
from mlxc.runtime.model.batch import BatchCache
from mlxc.runtime.model.cache import (
    KVQuant,
    KVQuantError,
    RewindError,
    cache_arrays,
    check_kv_quant,
    enforce_max_kv,
    make_caches,
    prepare_rewind,
    rewind_caches,
    trimmable,
)
from mlxc.runtime.serving.generate import prefill_spans
from mlxc.runtime.serving.prefix_cache import cacheable
from mlxc.runtime.serving.speculative import decode_bound

PREFILL_CHUNK = 8
MAX_KV = 16
SINKS = (0, 4)
PROMPT_LEN = 44  # 6 chunks: trims happen inside prefill
CONTINUATION = 5  # a multi-token chunk after the trims
DECODE_STEPS = 4
ATOL = 1e-4  # float32 chunked vs full forward: accumulation order differs, ~1e-6 typical
KV_QUANT = KVQuant(bits=4, group_size=32)  # the smallest group: tiny heads are 32 wide at best


class VerifyError(AssertionError):
    pass


@dataclass
class Report:
    spec: str
    ok: bool
    detail: str
    masks_checked: int = 0
    notes: list[str] = field(default_factory=list)


def randomize(model, seed: int = 0) -> None:
    """Weights with real variance: matrices ~ N(0, 1/fan_in), norm scales ~ 1 + N(0, 0.1)."""
    rng = np.random.default_rng(seed)
    params = []
    for name, p in tree_flatten(model.parameters()):
        if name.endswith("norm.weight"):
            value = 1.0 + 0.1 * rng.standard_normal(p.shape)
        elif p.ndim >= 2:
            value = rng.standard_normal(p.shape) / np.sqrt(p.shape[-1])
        else:
            value = 0.1 * rng.standard_normal(p.shape)
        params.append((name, mx.array(value.astype(np.float32))))
    model.update(tree_unflatten(params))
    mx.eval(model.parameters())


IMAGE_AT = 5  # the image's tokens start here, so the first chunk boundary falls inside them


def vision_inputs(tower: str, config: dict, rng: np.random.Generator) -> tuple[dict, int]:
    """Random pixel inputs for one small image and its number of placeholder tokens."""
    vision = config["vision_config"]
    patch = vision.get("patch_size", 14)
    if tower == "gemma3_siglip":  # one image_size x image_size image, mm_tokens_per_image tokens
        size = vision.get("image_size", 224)
        pixels = rng.standard_normal((1, 3, size, size)).astype(np.float32)
        return {"pixel_values": mx.array(pixels)}, config.get("mm_tokens_per_image", 256)
    if tower == "pixtral":
        merge = config.get("spatial_merge_size", 2)
        h, w = 2 * patch * merge, 3 * patch * merge
        pixels = rng.standard_normal((1, 3, h, w)).astype(np.float32)
        return {"pixel_values": mx.array(pixels), "image_sizes": mx.array([[h, w]])}, 6
    merge = vision.get("spatial_merge_size", 2)
    t, h, w = 1, 2 * merge, 3 * merge
    channels = vision.get("in_channels", vision.get("in_chans", 3))
    width = channels * vision.get("temporal_patch_size", 2) * patch * patch
    pixels = rng.standard_normal((t * h * w, width)).astype(np.float32)
    return {"pixel_values": mx.array(pixels), "image_grid_thw": mx.array([[t, h, w]])}, 6


def _schedule(
    rng: np.random.Generator, vocab: int, image: tuple[int, int] | None = None, model=None
) -> list[np.ndarray]:
    """Token chunks: prefill chunks, one continuation chunk, then single-token decode steps.

    ``image``: (placeholder token id, count) placed at ``IMAGE_AT``; other tokens avoid the id.
    A prefill boundary inside one of the ``model``'s ``prefill_spans`` moves to its end, as
    ``runtime.serving.generate.prefill_chunks`` moves it (Gemma 3's images stay in one chunk).
    """
    tokens = rng.integers(0, vocab, size=PROMPT_LEN + CONTINUATION + DECODE_STEPS)
    if image is not None:
        token, count = image
        tokens[tokens == token] = (token + 1) % vocab
        tokens[IMAGE_AT : IMAGE_AT + count] = token
    spans = prefill_spans(model, tokens[:PROMPT_LEN].tolist()) if model is not None else []
    starts = range(0, PROMPT_LEN, PREFILL_CHUNK)
    cuts = {min(next((e for s, e in spans if s < c < e), c), PROMPT_LEN) for c in starts}
    bounds = sorted(cuts | {PROMPT_LEN})
    chunks = [tokens[a:b] for a, b in itertools.pairwise(bounds)]
    chunks.append(tokens[PROMPT_LEN : PROMPT_LEN + CONTINUATION])
    chunks += [tokens[i : i + 1] for i in range(PROMPT_LEN + CONTINUATION, len(tokens))]
    return chunks


def _states(cache) -> list[list[mx.array]]:
    """The arrays of every layer cache that holds state, not keys (recurrent layers)."""
    return [c.arrays() for c in cache if not c.holds_keys]


def _run(
    model,
    chunks,
    max_kv: int | None,
    keep: int,
    vision: dict | None = None,
    quant: KVQuant | None = None,
) -> tuple[list[mx.array], int | None, list]:
    """Logits per chunk, the index of the first chunk that ran after a trim, and the cache."""
    cache = make_caches(model, quant)
    outputs, first_trimmed, offset = [], None, 0
    for i, chunk in enumerate(chunks):
        extra = vision if (vision and i == 0) else {}  # vision inputs come with the first chunk
        logits = model(mx.array(chunk[None, :]), cache=cache, **extra)
        mx.eval(logits)
        outputs.append(logits)
        offset += len(chunk)
        for c in cache:
            if c.offset != offset:
                raise VerifyError(f"cache.offset is {c.offset} after {offset} tokens")
        states = _states(cache)
        if enforce_max_kv(cache, max_kv, keep) and first_trimmed is None:
            first_trimmed = i + 1
        after = _states(cache)
        if len(after) != len(states) or any(
            len(a) != len(b) or not all(x is y for x, y in zip(a, b)) for a, b in zip(states, after)
        ):
            raise VerifyError(f"a trim after chunk {i} changed a recurrent layer's state")
        if max_kv is not None and any(c.live_len > max_kv for c in cache if c.trimmable):
            raise VerifyError("a cache is still over max-kv-size after enforce_max_kv")
        for c in cache:
            if c.window is not None and (c.live_len >= c.window or c.held >= c.window + c.slack):
                raise VerifyError(f"a window-{c.window} cache holds {c.held} keys")
    return outputs, first_trimmed, cache


def verify_module(
    name: str, module: types.ModuleType, config: dict, image_token: str | None = None
) -> Report:
    """``image_token``: for a vision spec, the param holding the placeholder id; the schedule
    then carries one image in its first chunk, cut by the first chunk boundary."""
    args = module.ModelArgs.from_config(config)
    model = module.Model(args)
    randomize(model)
    layers.fuse(model)  # as loading does: the schedule runs the model that is served
    vocab = model(mx.array([[0]])).shape[-1]
    rng = np.random.default_rng(1)
    vision, image = None, None
    if image_token is not None:
        vision, count = vision_inputs(model.vision_tower, config, rng)
        image = (getattr(args, image_token), count)
    chunks = _schedule(rng, vocab, image, model)
    notes = [] if vision is None else ["one image in the first chunks"]
    with masks.array_masks() as audit:
        reference, _, chunked_cache = _run(model, chunks, None, 0, vision)
        full_cache = model.make_cache()
        tokens = mx.array(np.concatenate(chunks)[None, :])
        full = model(tokens, cache=full_cache, **(vision or {}))
        for keep in SINKS:
            trimmed, first, _ = _run(model, chunks, MAX_KV, keep, vision)
            if first is None:
                raise VerifyError(f"no trim happened with max-kv-size {MAX_KV}")
            for i in range(first):
                if not mx.array_equal(trimmed[i], reference[i]):
                    raise VerifyError(
                        f"keep={keep}: chunk {i} differs from the untrimmed run before any trim"
                    )
            for i, out in enumerate(trimmed[first:], first):
                if not mx.all(mx.isfinite(out)).item():
                    raise VerifyError(f"keep={keep}: non-finite logits at chunk {i} after trim")
            notes.append(f"keep={keep}: first trim after chunk {first - 1}")
    if audit.checked == 0:
        raise VerifyError("no attention mask was checked: the schedule never reached attention")
    chunked = mx.concatenate(reference, axis=1)
    err = mx.abs(chunked - full).max().item()
    if err > ATOL:
        raise VerifyError(f"chunked prefill + decode differs from one forward pass by {err:.2e}")
    # State layers: the chunks (prefill, continuation, decode steps) carry the state through
    # as one pass does. Relative to the state's scale: an SSM state sums many tokens' inputs
    # (tens here), where the logits' absolute tolerance would measure float32 rounding.
    state_err = 0.0
    full_states = _states(full_cache)
    for a, b in zip(_states(chunked_cache), full_states, strict=True):
        if len(a) != len(b):
            raise VerifyError("a recurrent layer holds other state chunked than in one pass")
        for x, y in zip(a, b):
            scale = max(1.0, mx.abs(y).max().item())
            state_err = max(state_err, mx.abs(x - y).max().item() / scale)
    if state_err > ATOL:
        raise VerifyError(f"recurrent state chunked differs from one pass by {state_err:.2e}")
    if full_states:
        notes.append(
            f"{len(full_states)} state layers continuous across chunks "
            f"({state_err:.1e} relative), untouched by trims"
        )
    fast, _, _ = _run(model, chunks, None, 0, vision)  # string "causal" masks, as in production
    fast_err = max(mx.abs(a - b).max().item() for a, b in zip(fast, reference))
    if fast_err > ATOL:
        raise VerifyError(f'"causal" fast path differs from array masks by {fast_err:.2e}')
    notes.append(_check_prefix_resume(model, chunks, vision, fast))
    batch_err = _batched_decode_error(model, rng, vocab, vision, image)
    if batch_err > ATOL:
        raise VerifyError(f"batched decode differs from decoding alone by {batch_err:.2e}")
    notes.append(_verify_quantized(model, chunks, vision, rng, vocab, image))
    notes.append(_verify_speculation(model, chunks[: -1 - DECODE_STEPS], vision, rng, vocab))
    detail = (
        f"{len(chunks)} chunks x {1 + len(SINKS)} runs, {audit.checked} masks checked, "
        f"chunked vs full {err:.1e}, batched vs alone {batch_err:.1e}, {'; '.join(notes)}"
    )
    return Report(name, True, detail, audit.checked, notes)


def _verify_quantized(model, chunks, vision, rng, vocab, image) -> str:
    """The schedule on quantised KV caches (``KV_QUANT``); a note saying what ran."""
    try:
        check_kv_quant(model, KV_QUANT)
    except KVQuantError:
        return f"{KV_QUANT.bits}-bit KV skipped: a head is not a multiple of {KV_QUANT.group_size}"
    chunked, _, _ = _run(model, chunks, None, 0, vision, KV_QUANT)
    ids = mx.array(np.concatenate(chunks)[None, :])
    full = model(ids, cache=make_caches(model, KV_QUANT), **(vision or {}))
    err = mx.abs(mx.concatenate(chunked, axis=1) - full).max().item()
    if err > ATOL:
        raise VerifyError(f"quantised KV: chunked differs from one forward pass by {err:.2e}")
    trimmed, first, _ = _run(model, chunks, MAX_KV, SINKS[-1], vision, KV_QUANT)
    if first is None or not all(mx.all(mx.isfinite(out)).item() for out in trimmed):
        raise VerifyError("quantised KV: no trim happened, or non-finite logits after one")
    batch_err = _batched_decode_error(model, rng, vocab, vision, image, KV_QUANT)
    if batch_err > ATOL:
        raise VerifyError(f"quantised KV: batched decode differs from alone by {batch_err:.2e}")
    return f"{KV_QUANT.bits}-bit KV: chunked vs full {err:.1e}, batched vs alone {batch_err:.1e}"


# Verification steps (accepted drafts, rejected drafts): the first runs before any decode trim,
# every later one after one; the rejections are forced (random tokens rewound).
SPEC_STEPS = ((2, 1), (0, 3), (3, 0), (1, 2), (2, 2), (0, 0))


def _verify_speculation(model, prompt_chunks, vision, rng, vocab) -> str:
    """Speculative steps across trims (``SPEC_STEPS``, ``MAX_KV`` with sinks) against the plain
    one-token steps over the same tokens: the logits of each accepted position, and the caches'
    offsets and live lengths after every step. A note saying what ran."""
    keep, reserve = SINKS[-1], max(a + r for a, r in SPEC_STEPS)
    cache = make_caches(model)
    try:
        prepare_rewind(model, cache, reserve)
    except RewindError as e:
        try:  # refused at the cache, and by the loop
            rewind_caches(cache, 1)
        except RewindError:
            return f"speculation refused ({e})"
        raise VerifyError("a cache that is not rewindable rewound") from e
    plain = make_caches(model)
    tokens = rng.integers(0, vocab, size=sum(a + 1 for a, _ in SPEC_STEPS)).tolist()
    for c in (cache, plain):
        for i, chunk in enumerate(prompt_chunks):
            extra = vision if (vision and i == 0) else {}
            model(mx.array(chunk[None, :]), cache=c, **extra)
            enforce_max_kv(c, MAX_KV, keep)
    trimmable = [c for c in cache if c.trimmable]
    err, at = 0.0, 0
    for accepted, rejected in SPEC_STEPS:
        real = tokens[at : at + accepted + 1]
        drafts = rng.integers(0, vocab, size=rejected).tolist()
        with decode_bound(trimmable, MAX_KV, keep):
            spec = model(mx.array([real + drafts]), cache=cache)[0, : accepted + 1]
        rewind_caches(cache, rejected)
        enforce_max_kv(cache, MAX_KV, keep)
        for j, token in enumerate(real):
            one = model(mx.array([[token]]), cache=plain)[0, -1]
            enforce_max_kv(plain, MAX_KV, keep)
            err = max(err, mx.abs(spec[j] - one).max().item())
        if [(c.offset, c.live_len) for c in cache] != [(c.offset, c.live_len) for c in plain]:
            raise VerifyError("speculation: caches differ from the plain run's after a rewind")
        at += accepted + 1
    if err > ATOL:
        raise VerifyError(f"speculation across trims differs from one-token steps by {err:.2e}")
    return f"speculation across trims vs one-token steps {err:.1e}"


def _check_prefix_resume(model, chunks, vision, straight: list[mx.array]) -> str:
    """The prompt prefilled with a snapshot (``prefix_block``) at every boundary, then a fresh
    cache resumed from them at the last one (with the prompt state there: every image seen)
    continues with the logits of the ``straight`` run, bit for bit, as the server's prefix
    cache needs (``runtime.serving.prefix_cache``)."""
    cache = model.make_cache()
    if not cacheable(cache):
        return "no prefix resume (a cache kind lacks prefix_block / resume)"
    blocks, start, n = [], 0, 0
    while start < PROMPT_LEN:
        extra = vision if (vision and n == 0) else {}
        model(mx.array(chunks[n][None, :]), cache=cache, **extra)
        blocks.append([c.prefix_block(start) for c in cache])
        mx.eval(blocks[-1])
        start, n = cache.offset, n + 1
    resumed = model.make_cache()
    for layer, c in enumerate(resumed):
        c.resume([b[layer] for b in blocks], start)
    if getattr(cache, "rope_state", None) is not None:
        resumed.rope_state = copy.deepcopy(cache.rope_state)
    for i in range(n, len(chunks)):
        logits = model(mx.array(chunks[i][None, :]), cache=resumed)
        if not mx.array_equal(logits, straight[i]).item():
            raise VerifyError(f"resumed from the prefix blocks, chunk {i} differs")
    return f"resumed after {n} prefill chunks: equal"


BATCH_PROMPTS = (44, 9, 23, 12)  # prompt lengths of the batch's rows; the first has the image
# Decode steps: row 2 joins after 2 of them, row 0 leaves after 4 (the batch copied), row 1
# ends after 6 leaving its row dead, and row 3 is written over that row after 7. Steps 5 and 8
# (where every layer can rewind) are speculative verifications of VERIFY_TOKENS per row where
# each row keeps its own count, so row 2 enters step 8 with a tail (BatchKVCache.rewind_rows).
BATCH_STEPS = 10
VERIFY_STEPS = (5, 8)
VERIFY_TOKENS = 3


def _batched_decode_error(model, rng, vocab, vision, image, quant=None) -> float:
    """Largest logit difference between rows decoded in one ``BatchCache`` and alone.

    Each row is prefilled twice on its own (chunked, trimmed to ``MAX_KV`` with sinks): one
    copy decodes alone, the other joins the batch. Rows differ in length, so the batch has
    padding; the first is trimmed before it joins and every row is trimmed while decoding. A
    row leaves by a copy of the batch (``keep_rows``), another stays dead (decoded, unread) until
    a new row takes its place (``BatchCache.place``), as in the server. One step verifies
    several tokens per row and each row keeps a different count (``BatchCache.rewind_rows``),
    as the server's speculation does (under ``decode_bound``, so each query sees what its
    one-token step would have, trims between them included); alone, a row takes the tokens it
    kept one step each.
    """
    keep = SINKS[-1]
    rows = []
    for r, n in enumerate(BATCH_PROMPTS):
        tokens = rng.integers(0, vocab, size=n + BATCH_STEPS + len(VERIFY_STEPS) * VERIFY_TOKENS)
        has_image = r == 0 and image is not None
        if image is not None:
            token, count = image
            tokens[tokens == token] = (token + 1) % vocab
            if has_image:
                tokens[IMAGE_AT : IMAGE_AT + count] = token
        pair = []
        for _ in range(2):
            cache = make_caches(model, quant)
            for i in range(0, n, PREFILL_CHUNK):
                extra = vision if (has_image and i == 0) else {}
                model(mx.array(tokens[None, i : min(i + PREFILL_CHUNK, n)]), cache=cache, **extra)
                enforce_max_kv(cache, MAX_KV, keep)
            mx.eval(cache_arrays(cache))
            pair.append(cache)
        rows.append((tokens[n:], *pair))
    batch = BatchCache.like(rows[0][1])
    members: list[int | None] = [0, 1]  # None: a dead row
    batch.extend([rows[r][2] for r in members])
    err = 0.0
    at = [0] * len(rows)  # each row's next token
    rewinds = batch.rewindable
    for step in range(BATCH_STEPS):
        if step == 2:
            members.append(2)
            batch.extend([rows[2][2]])
        if step == 4:
            batch.keep_rows([1, 2])
            members.remove(0)
        if step == 6:
            members[members.index(1)] = None
        if step == 7:
            joining = BatchCache.like(rows[3][2])
            joining.extend([rows[3][2]])
            slot = members.index(None)
            if not batch.place([slot], joining):
                raise VerifyError("a joining row could not take a dead row's place")
            members[slot] = 3
        width = VERIFY_TOKENS if step in VERIFY_STEPS and rewinds else 1
        ids = mx.array(
            [
                [0] * width if r is None else rows[r][0][at[r] : at[r] + width].tolist()
                for r in members
            ]
        )
        kept = [width - b % width for b in range(len(members))]  # tokens each row keeps
        with decode_bound(trimmable(model, batch), MAX_KV, keep):
            batched = model(ids, cache=batch)
        if width > 1:
            batch.rewind_rows(np.array([width - n for n in kept]))
        enforce_max_kv(batch, MAX_KV, keep)
        for b, r in enumerate(members):
            if r is None:
                continue
            for i in range(kept[b]):  # alone, the kept tokens one step each, each trimmed
                alone = model(ids[b : b + 1, i : i + 1], cache=rows[r][1])
                enforce_max_kv(rows[r][1], MAX_KV, keep)
                err = max(err, mx.abs(batched[b, i] - alone[0, 0]).max().item())
            at[r] += kept[b]
    return err


def verify(paths: list[str]) -> list[Report]:
    result = build.render(paths)
    if result.findings:
        raise VerifyError("specs have lint findings; run `mlxc lint` first")
    from mlxc.compiler import lint

    reports = []
    for checked in lint.check_all(paths):
        name = checked.spec.name
        try:
            module = load_source(name, result.files[f"{name}.py"])
            vision = checked.spec.vision
            image_token = vision.image_token if vision is not None else None
            reports.append(verify_module(name, module, checked.spec.tiny_config, image_token))
        except Exception as err:  # noqa: BLE001 - any failure of one spec is reported, the others still run
            reports.append(Report(name, False, f"{type(err).__name__}: {err}"))
    return reports
