"""Fresh prompts prefilled together as the rows of one batch (``Scheduler._prefill_together``,
``BatchCache.start_rows``): left-padded to the longest, each row's positions start at 0, its
padding is never attended to, and every answer equals the one ``generate_tokens`` gives the
prompt alone; caches that cannot take padding (recurrent state) prefill one by one."""

from __future__ import annotations

import functools
import logging
import queue

import checkpoints as ckpt
import mlx.core as mx
import pytest
from test_server import ARCHS

from mlxc.runtime.checkpoint.loading import load_checkpoint
from mlxc.runtime.model.batch import BatchCache, BatchKVCache
from mlxc.runtime.model.cache import KVQuant
from mlxc.runtime.serving import metrics
from mlxc.runtime.serving import scheduler as scheduler_module
from mlxc.runtime.serving.generate import generate_tokens
from mlxc.runtime.serving.scheduler import Delta, Finished, SamplingParams, Scheduler
from mlxc.runtime.serving.structured import apply_masks

# Prompt lengths (one of a single token); a bound that trims the longest prompt inside its
# prefill and the others while they decode.
LENGTHS = (1, 9, 20, 33)
MAX_KV, SINK = 24, 2
# Answers of 6 tokens; minicpm3's run past its LongRoPE's 64-token original context, so a row
# whose positions did not start at 0 would switch to the long factors at the wrong token (plain
# RoPE cannot tell: attention sees only position differences).
ANSWER = {"minicpm3": 60}


def setup(tmp_path, arch: str, kv_bits: int | None):
    """A checkpoint of ``arch`` (where KV is quantised, a llama of head dim 32, for the groups),
    its model, the prompts, and the options the scheduler and ``generate_tokens`` both take."""
    make = ARCHS[arch] if kv_bits is None else functools.partial(ckpt.make_llama, head_dim=32)
    checkpoint = load_checkpoint(make(tmp_path / arch))
    model = checkpoint.load_model()
    quant = None if kv_bits is None else KVQuant(kv_bits, 32)
    options = {"prefill_chunk_size": 64, "max_kv_size": MAX_KV, "kv_sink": SINK, "kv_quant": quant}
    return checkpoint, model, prompts(model.args.vocab_size), options


def recording_groups(patch: pytest.MonkeyPatch) -> list[int]:
    """The size of each prompt batch ``Scheduler._prefill_together`` prefills, from now on."""
    groups: list[int] = []
    real = Scheduler._prefill_together

    def recording(self, group):
        groups.append(len(group))
        return real(self, group)

    patch.setattr(Scheduler, "_prefill_together", recording)
    return groups


def prompts(vocab: int) -> list[list[int]]:
    return [[(7 + 5 * i + n) % (vocab - 3) + 3 for i in range(n)] for n in LENGTHS]


def answers(scheduler: Scheduler, jobs: list[list[int]], n: int) -> list[list[int]]:
    """Every job submitted before the scheduler starts, so its first tick admits them all."""
    outs = [queue.Queue() for _ in jobs]
    for ids, out in zip(jobs, outs):
        scheduler.submit(ids, SamplingParams(max_tokens=n, ignore_eos=True), out.put)
    return run(scheduler, outs)


def run(scheduler: Scheduler, outs: list[queue.Queue]) -> list[list[int]]:
    """Start ``scheduler``; each queue's tokens once its request finishes; stop it."""
    scheduler.start()
    try:
        return collect(outs)
    finally:
        scheduler.stop()


def collect(outs: list[queue.Queue]) -> list[list[int]]:
    """Each queue's tokens once its request finishes."""
    results = []
    for out in outs:
        tokens = []
        while not isinstance(event := out.get(timeout=120), Finished):
            assert isinstance(event, Delta), event
            tokens.append(event.token)
        results.append(tokens)
    return results


@pytest.mark.parametrize(
    "arch, kv_bits, together",
    [
        ("llama", None, True),
        ("llama", 8, True),  # quantised rows take padding too (head_dim 32 for the groups)
        ("gemma3_text", None, True),  # sliding-window layers
        ("deepseek_v3", None, True),  # MLA latent cache
        ("minicpm3", None, True),  # longrope: each row switches by its own positions
        ("nemotron_h", None, False),  # recurrent state: padding would run through it
    ],
)
def test_prompts_prefilled_together_answer_as_alone(tmp_path, monkeypatch, arch, kv_bits, together):
    checkpoint, model, jobs, options = setup(tmp_path, arch, kv_bits)
    n = ANSWER.get(arch, 6)
    alone = [list(generate_tokens(model, ids, max_tokens=n, **options)) for ids in jobs]
    mx.clear_cache()

    groups = recording_groups(monkeypatch)
    scheduler = Scheduler(
        model, checkpoint.tokenizer, max_concurrency=len(jobs), prefix_cache_bytes=0, **options
    )
    assert answers(scheduler, jobs, n) == alone
    if together:
        # 4 rows x 33 padded tokens exceed the 64-token budget: the first rows go together.
        assert groups and max(groups) >= 2 and sum(groups) <= len(jobs)
    else:
        assert groups == []


@pytest.mark.parametrize(
    "arch, kv_bits",
    [("llama", None), ("llama", 8), ("gemma3_text", None), ("deepseek_v3", None)],
)
def test_prompts_prefilled_together_fill_the_prefix_cache(tmp_path, monkeypatch, arch, kv_bits):
    """With a prefix cache, a prompt batch's rows are snapshotted as their prompts prefilled
    alone are: on a CPU a prompt is its first chunk, then its last token alone, and each row's
    first chunk (its keys cut from the batch's buffers) goes into the trie. The 1-token prompt
    has no first chunk and the 33-token one is trimmed inside its prefill (no longer a whole
    prefix): neither is stored. The blocks equal those of the prompts prefilled one by one, the
    same prompts again resume from them, and every answer equals ``generate_tokens``'s."""
    checkpoint, model, jobs, options = setup(tmp_path, arch, kv_bits)
    alone = [list(generate_tokens(model, ids, max_tokens=6, **options)) for ids in jobs]
    params = SamplingParams(max_tokens=6, ignore_eos=True)

    def serve() -> tuple[list[list[list[int]]], dict, list[int]]:
        """Two waves of ``jobs`` (the first submitted before the scheduler starts, so its
        first tick admits them all; the second after the first has finished): their answers,
        the trie's blocks by prompt length after the first, and the prompt batches' sizes."""

        def submit() -> list[queue.Queue]:
            outs = [queue.Queue() for _ in jobs]
            for ids, out in zip(jobs, outs):
                scheduler.submit(ids, params, out.put)
            return outs

        with monkeypatch.context() as patch:
            groups = recording_groups(patch)
            scheduler = Scheduler(
                model,
                checkpoint.tokenizer,
                max_concurrency=4,
                prefix_cache_bytes=1 << 30,
                **options,
            )
            first = submit()
            scheduler.start()
            try:
                waves = [collect(first)]
                nodes = scheduler.prefix.root.children.values()
                blocks = {node.end + 1: node.blocks for node in nodes}
                waves.append(collect(submit()))
                hits = scheduler.prefix.hits
            finally:
                scheduler.stop()
        assert hits == len(blocks)  # the second wave's stored prompts resumed
        return waves, blocks, groups

    waves, blocks, groups = serve()
    assert waves == [alone, alone]
    assert sorted(blocks) == [9, 20]  # the prompts of 9 and 20 tokens, first chunks stored
    # The 9- and 20-token prompts together (the 1-token one is a single chunk, the 33-token one
    # past the 64-token budget); the second wave's resumed prompts are past their first chunk.
    assert groups == [2], groups

    monkeypatch.setattr(Scheduler, "_prefills_together", lambda self, seq: False)
    waves, one_by_one, groups = serve()
    assert waves == [alone, alone] and groups == []
    assert sorted(one_by_one) == [9, 20]
    for n, layers in blocks.items():
        for ours, theirs in zip(layers, one_by_one[n], strict=True):
            for a, b in zip(ours, theirs, strict=True):
                assert a.shape == b.shape and a.dtype == b.dtype
                if mx.issubdtype(a.dtype, mx.floating):
                    # Float32 keys of one forward of 2 rows against one of 1: the same sums in
                    # other groupings, a few ulps apart.
                    assert mx.allclose(a, b, rtol=1e-5, atol=1e-5), (n, float(abs(a - b).max()))
                else:  # packed 8-bit codes: keys a few ulps apart may round one code over
                    codes = [x.view(mx.uint8).astype(mx.int32) for x in (a, b)]
                    assert int(abs(codes[0] - codes[1]).max()) <= 1, n


@pytest.mark.parametrize("wait_steps", [0, 3])
def test_fresh_prompts_wait_while_the_batch_decodes(tmp_path, monkeypatch, wait_steps):
    """While 12 rows decode, prompts arrive (submitted on the first row's tokens): three at
    once (a quarter of the rows: prefilled at once), then one, then one more a tick later:
    these wait until the oldest has waited ``prefill_wait_steps`` ticks and prefill as one
    forward (with 0, each at once). Every answer is still the one ``generate_tokens`` gives
    the prompt alone."""
    checkpoint = load_checkpoint(ckpt.make_llama(tmp_path / "llama"))
    model = checkpoint.load_model()
    vocab = model.args.vocab_size
    rows = [[(3 * i + 5 * r) % (vocab - 3) + 3 for i in range(5 + r)] for r in range(12)]
    arriving = [[(7 * i + 11 * a) % (vocab - 3) + 3 for i in range(4 + a)] for a in range(5)]
    due = {2: [0, 1, 2], 6: [3], 7: [4]}  # the first row's token count -> arrivals
    long_n, short_n = 24, 5
    want = [list(generate_tokens(model, ids, max_tokens=long_n)) for ids in rows]
    want += [list(generate_tokens(model, ids, max_tokens=short_n)) for ids in arriving]

    groups: list[tuple[int, int]] = []  # fresh prompts prefilled in one go, ticks the oldest waited
    prompt_group = Scheduler._prompt_group

    def recording(self, first):
        fresh = first.prefilled == 0  # not a later chunk (on a CPU the last token goes alone)
        group = prompt_group(self, first)
        if fresh:
            groups.append((len(group), self._ticks - min(s.admitted_tick for s in group)))
        return group

    monkeypatch.setattr(Scheduler, "_prompt_group", recording)
    scheduler = Scheduler(
        model,
        checkpoint.tokenizer,
        max_concurrency=len(rows) + len(arriving),
        prefix_cache_bytes=0,
        prefill_wait_steps=wait_steps,
    )
    outs = [queue.Queue() for _ in rows + arriving]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (long_n, short_n)]
    seen = [0]

    def first_row(event) -> None:  # the scheduler thread, one token per tick while it decodes
        outs[0].put(event)
        seen[0] += 1
        for a in due.get(seen[0], []):
            scheduler.submit(arriving[a], params[1], outs[len(rows) + a].put)

    for r, ids in enumerate(rows):
        scheduler.submit(ids, params[0], first_row if r == 0 else outs[r].put)
    assert run(scheduler, outs) == want
    if wait_steps == 0:
        # (on a CPU the second single prompt waits a tick behind the first one's last token)
        assert [n for n, _ in groups] == [12, 3, 1, 1] and max(w for _, w in groups) <= 2
    else:
        assert groups == [(12, 1), (3, 1), (2, wait_steps)]


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "deepseek_v3", "nemotron_h"])
def test_warm_serving_takes_the_churn_and_leaves_no_trace(tmp_path, monkeypatch, arch):
    """The throwaway requests a CUDA server serves before the real ones
    (``Scheduler._warm_serving``, called here directly on the CPU) take the paths the first
    real waves take: several prompts prefilled as one batch (not for recurrent caches, which
    take no padding), a dead row decoded through and a new row written over it, the dead rows
    dropped, sampled and logprob rows, and a constrained row's masked prefill and decode steps.
    They leave the server as they found it: an empty pool, no request counted, an empty prefix
    cache; and answers after them equal ``generate_tokens``'s."""
    checkpoint = load_checkpoint(ARCHS[arch](tmp_path / arch))
    model = checkpoint.load_model()
    seen: list[str] = []
    masked: list[tuple[int, int]] = []  # (rows masked, rows in the step) per masked step

    def recording_masks(logits, rows, masks):
        assert all(m.shape == masks[0].shape and (m == -1).all() for m in masks)  # AnyToken
        if rows:  # every step asks; most have no constrained row
            masked.append((len(rows), logits.shape[0]))
        return apply_masks(logits, rows, masks)

    monkeypatch.setattr(scheduler_module, "apply_masks", recording_masks)
    for name in ("place", "keep_rows", "start_rows"):
        real = getattr(BatchCache, name)

        def recording(self, *args, _real=real, _name=name, **kwargs):
            seen.append(_name)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(BatchCache, name, recording)
    options = {"max_kv_size": MAX_KV, "kv_sink": SINK}
    scheduler = Scheduler(model, checkpoint.tokenizer, max_concurrency=4, **options)
    counted = metrics.forward_counts()
    scheduler._warm_serving()
    assert metrics.forward_counts() == counted  # the server's metrics count what it served
    prompt_batches = arch != "nemotron_h"  # recurrent state takes no padding
    assert ("start_rows" in seen) == prompt_batches
    # The constrained row's prefill (in a prompt batch of four where they take padding), then
    # its decode steps beside other rows; its 10 tokens: the prefill's and 9 steps'.
    assert masked[0] == ((1, 4) if prompt_batches else (1, 1))
    assert len(masked) == 10 and any(batch > 1 for _, batch in masked[1:])
    assert "place" in seen and "keep_rows" in seen
    stats = scheduler.stats()
    assert len(scheduler.pool) == 0 and stats["pool"]["peak_batched"] == 0
    assert stats["running"] == stats["waiting"] == 0
    assert not any(stats["requests"].values()), stats["requests"]
    assert scheduler.prefix.nbytes == 0 and scheduler.prefix.hits == 0

    jobs = prompts(model.args.vocab_size)
    alone = [list(generate_tokens(model, ids, max_tokens=6, **options)) for ids in jobs]
    assert answers(scheduler, jobs, 6) == alone


@pytest.mark.parametrize("flag, warm", [([], True), (["--no-warmup"], False)])
def test_warmup_flag_reaches_the_scheduler(tmp_path, monkeypatch, flag, warm):
    """``mlxc serve --no-warmup`` turns the throwaway requests off (the settings every rank
    shares: under mlx.launch all ranks warm up or none); with them on, a scheduler on CUDA
    serves them before ``start`` returns. CUDA is stood in for: ``available`` says yes and the
    attention kernel's own warm-up is skipped; ``_warm_serving`` runs as it would."""
    from click.testing import CliRunner

    from mlxc.cli import main
    from mlxc.runtime.model import cuda_attention
    from mlxc.runtime.serving.engine import Engine

    path = ARCHS["llama"](tmp_path / "llama")
    seen = {}

    def loading(*args, **kwargs):
        seen.update(kwargs)
        raise KeyboardInterrupt  # stop before serving: the CLI reports it and exits 130

    monkeypatch.setattr(Engine, "from_path", staticmethod(loading))
    result = CliRunner().invoke(main, ["serve", "--model", str(path), "--port", "0", *flag])
    assert result.exit_code == 130, result.output
    assert seen["warm_up"] is warm

    warmed = []
    real = Scheduler._warm_serving
    monkeypatch.setattr(Scheduler, "_warm_serving", lambda self: warmed.append(real(self)))
    monkeypatch.setattr(cuda_attention, "available", lambda: True)
    monkeypatch.setattr(cuda_attention, "warm", lambda *args, **kwargs: None)
    checkpoint = load_checkpoint(path)
    scheduler = Scheduler(checkpoint.load_model(), checkpoint.tokenizer, warm_up=warm)
    scheduler.start()
    scheduler.stop()
    assert len(warmed) == warm and len(scheduler.pool) == 0


@pytest.mark.parametrize("arch", ["llama", "nemotron_h"])
@pytest.mark.parametrize("max_kv_size", [None, 1024])
def test_warm_serving_compacts_the_batch(tmp_path, monkeypatch, arch, max_kv_size):
    """The warm-up's last wave makes the batch compact its rows (``BatchKVCache._compact``, a
    gather along the columns: on CUDA a module of its own, compiled where a loaded server would
    otherwise first meet it, once its first answers end). Unless ``--max-kv-size`` trims the
    long prompt below a buffer step: then the rows' gaps, not padding, make the compactions."""
    compactions = []
    real = BatchKVCache._compact

    def recording(self):
        compactions.append(self.width)
        return real(self)

    monkeypatch.setattr(BatchKVCache, "_compact", recording)
    checkpoint = load_checkpoint(ARCHS[arch](tmp_path / arch))
    options = {"max_kv_size": max_kv_size, "kv_sink": SINK}
    scheduler = Scheduler(checkpoint.load_model(), checkpoint.tokenizer, **options)
    scheduler._warm_serving()
    assert compactions and len(scheduler.pool) == 0


def test_warm_serving_goes_on_when_the_image_prompt_fails(tmp_path, caplog):
    """A VL server whose warm-up image cannot be made into a prompt warms up without it (the
    first real image request will say what fails), rather than refusing to start."""

    def broken():
        raise ValueError("the template takes no image here")

    checkpoint = load_checkpoint(ARCHS["llama"](tmp_path / "llama"))
    scheduler = Scheduler(checkpoint.load_model(), checkpoint.tokenizer, warm_image=broken)
    with caplog.at_level(logging.WARNING):
        scheduler._warm_serving()
    assert "warming up without an image: ValueError: the template takes no image" in caplog.text
    assert len(scheduler.pool) == 0 and scheduler.stats()["running"] == 0
