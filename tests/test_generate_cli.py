"""generate_tokens (chunked prefill, bounded cache, EOS) and the `mlxc generate` command."""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent))  # the toy model lives beside the tests
import _toy_model as toy

from mlxc.cli import main
from mlxc.runtime.checkpoint import loading
from mlxc.runtime.checkpoint.loading import CheckpointError, load_model
from mlxc.runtime.checkpoint.tokenizer import (
    StreamingDetokenizer,
    encode_prompt,
    eos_token_ids,
    load_tokenizer,
)
from mlxc.runtime.model.cache import KVCache, buffer_tokens
from mlxc.runtime.serving.generate import generate_tokens, prefill_chunks
from mlxc.runtime.serving.sample import make_sampler

PROMPT = list(range(10, 47))  # 37 tokens


@pytest.fixture
def use_toy(monkeypatch):
    monkeypatch.setattr(loading, "model_types", lambda: {"toy": toy.__name__})


@pytest.fixture(scope="module")
def model():
    m = toy.Model(toy.ModelArgs.from_config(toy.CONFIG))
    m.load_weights(list(toy.random_weights().items()))
    return m


def greedy_reference(model, prompt, n):
    """Greedy tokens by recomputing the whole sequence each step (no cache reuse)."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(mx.argmax(model(mx.array([ids]))[0, -1])))
    return ids[len(prompt) :]


# --- generate_tokens ------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 5, 37, 512])
def test_chunked_prefill_matches_full_recompute(model, chunk):
    expected = greedy_reference(model, PROMPT, 8)
    got = list(generate_tokens(model, PROMPT, max_tokens=8, prefill_chunk_size=chunk))
    assert got == expected


def test_roomy_kv_limit_changes_nothing(model):
    expected = list(generate_tokens(model, PROMPT, max_tokens=8))
    got = list(generate_tokens(model, PROMPT, max_tokens=8, max_kv_size=45, prefill_chunk_size=8))
    assert got == expected


class Recorder:
    """Wraps a model; records each cache's live length when a forward pass starts."""

    def __init__(self, model):
        self.model, self.seen = model, []

    def __call__(self, ids, cache=None, **kwargs):
        self.seen.append(max(c.live_len for c in cache))
        return self.model(ids, cache=cache, **kwargs)

    def make_cache(self):
        return self.model.make_cache()


def test_kv_limit_enforced_after_every_chunk_and_step(model):
    rec = Recorder(model)
    cache = model.make_cache()
    out = list(
        generate_tokens(
            rec, PROMPT, max_tokens=20, max_kv_size=12, kv_sink=4, prefill_chunk_size=5, cache=cache
        )
    )
    assert len(out) == 20
    # Every forward pass starts from a trimmed cache, and the end state is trimmed too.
    assert rec.seen[0] == 0 and max(rec.seen) == 12
    assert all(c.live_len <= 12 for c in cache)
    assert cache[0].offset == len(PROMPT) + 19  # positions keep counting past the trims


def test_resident_kv_stays_flat_ten_times_past_the_limit(model):
    """A generation 10x past max_kv_size: once the window is full, the buffers neither grow
    nor are reallocated (same capacity), and the live bytes stay at the limit."""
    cache = model.make_cache()
    capacities, live_bytes = [], []
    for _ in generate_tokens(model, PROMPT, max_tokens=300, max_kv_size=24, cache=cache):
        capacities.append(max(c.keys.shape[2] for c in cache))
        live_bytes.append(sum(c.nbytes for c in cache))
    full = live_bytes.index(max(live_bytes))
    assert len(capacities) == 300 and cache[0].offset > 10 * 24
    # One allocation (a step and the token buffer_tokens adds), never grown.
    assert set(capacities[full:]) == {buffer_tokens(24, KVCache.step)} == {KVCache.step + 1}
    assert set(live_bytes[full:]) == {live_bytes[full]}  # 24 tokens (+0 between steps)


@pytest.mark.parametrize("n, chunk", [(1, 4), (2, 4), (4, 4), (5, 4), (9, 4), (12, 4), (7, 100)])
def test_prefill_chunks_cover_the_prompt_with_the_last_token_alone_on_a_cpu(n, chunk):
    bounds = prefill_chunks(n, chunk)
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(a < b <= a + chunk for a, b in bounds)
    assert all(b == c for (_, b), (c, _) in itertools.pairwise(bounds))  # contiguous
    assert bounds[-1] == (n - 1, n)  # the CPU plan: the last token alone


def test_eos_and_max_tokens(model):
    first_two = list(generate_tokens(model, PROMPT, max_tokens=2))
    assert list(generate_tokens(model, PROMPT, max_tokens=0)) == []
    assert list(generate_tokens(model, PROMPT, max_tokens=5, eos_token_ids=[first_two[0]])) == []
    if first_two[1] != first_two[0]:
        stop = [first_two[1]]
        assert list(generate_tokens(model, PROMPT, max_tokens=5, eos_token_ids=stop)) == [
            first_two[0]
        ]


def test_seeded_sampling_repeats(model):
    def run():
        sampler = make_sampler(temp=1.0, top_p=0.9, seed=11)
        return list(generate_tokens(model, PROMPT, max_tokens=10, sampler=sampler))

    assert run() == run()


def test_bad_generate_arguments(model):
    bad = [
        {"prompt_ids": []},
        {"max_tokens": -1},
        {"prefill_chunk_size": 0},
        {"max_kv_size": 4, "kv_sink": 4},
        {"kv_sink": -1},
    ]
    for kwargs in bad:
        args = {"prompt_ids": PROMPT, "max_tokens": 3, **kwargs}
        with pytest.raises(ValueError):
            list(generate_tokens(model, **args))


# --- detokenizer ----------------------------------------------------------------------------


def test_streaming_detokenizer_never_splits_a_character(tmp_path):
    tokenizer = load_tokenizer(toy.write_tokenizer(tmp_path))
    text = "héllo, 日本語 🙂 ok"
    ids = tokenizer.encode(text)
    detok = StreamingDetokenizer(tokenizer)
    deltas = [detok.add(i) for i in ids]
    deltas.append(detok.finalize())
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)
    assert len([d for d in deltas if d]) > 5  # it streams, not one lump at the end


def _sentencepiece_tokenizer(path: Path):
    """A Llama-2 / Mistral style tokenizer (what their tokenizer.json holds): BPE over
    ``\u2581``-joined words with byte fallback (``<0x..>`` tokens for characters outside the
    vocabulary) and a decoder that strips the leading space: the window's left context matters
    to it, unlike the byte-level tokenizer's."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    normalizer = normalizers.Sequence(
        [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
    )
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.normalizer = normalizer
    trainer = trainers.BpeTrainer(
        vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    trained.train_from_iterator(["hello world, the lazy dog jumps over the quick fox"] * 8, trainer)
    vocab = trained.get_vocab()
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = json.loads(trained.to_str())["model"]["merges"]
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=[tuple(m) for m in merges],
            unk_token="<unk>",
            byte_fallback=True,
            fuse_unk=True,
        )
    )
    tok.normalizer = normalizer
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("\u2581", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.save_pretrained(str(path))
    return load_tokenizer(path)


@pytest.mark.parametrize("kind", ["byte-level", "sentencepiece"])
def test_streaming_detokenizer_paths_agree(tmp_path, kind):
    """Where the transformers class adds nothing to the Rust decode, the detokenizer streams
    through ``tokenizers``' ``DecodeStream`` (the Rust tokenizer's own decode where a marker is
    written out, and at the end): on random token streams (special tokens, multi-byte
    characters split across tokens, byte-fallback pieces) every delta equals what the plain
    window over transformers' own decode gives. (Their join can differ from one decode of the
    whole stream where random bytes make invalid UTF-8: U+FFFD counts depend on the cuts.)"""
    if kind == "byte-level":
        tokenizer = load_tokenizer(toy.write_tokenizer(tmp_path))
    else:
        tokenizer = _sentencepiece_tokenizer(tmp_path)
        assert len(tokenizer.encode("日本", add_special_tokens=False)) == 7  # \u2581, 6 bytes
    assert StreamingDetokenizer(tokenizer)._stream is not None  # a plain TokenizersBackend
    rng = np.random.default_rng(0)
    for _ in range(20):
        ids = [int(i) for i in rng.integers(0, len(tokenizer), 40)]
        stream, rust, slow = (StreamingDetokenizer(tokenizer) for _ in range(3))
        rust._stream = None
        slow._stream = slow._rust = None
        deltas = [stream.add(i) for i in ids] + [stream.finalize()]
        assert deltas == [rust.add(i) for i in ids] + [rust.finalize()]
        assert deltas == [slow.add(i) for i in ids] + [slow.finalize()]
    # Real text joins to itself, streams a delta per token or so, never splits a character.
    text = "hello world, 日本語 the lazy dog 🙂 jumps"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = StreamingDetokenizer(tokenizer)
    deltas = [detok.add(i) for i in ids] + [detok.finalize()]
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)
    assert sum(bool(d) for d in deltas) > len(ids) // 2
    assert detok._stream is not None  # DecodeStream served it all (random bytes may not)


def test_no_tokenizer_files(tmp_path):
    assert load_tokenizer(tmp_path) is None


def test_tokenizer_beside_a_remote_code_config(tmp_path):
    # A config.json with auto_map (nemotron-nas) must neither prompt nor run code.
    path = toy.write_tokenizer(tmp_path)
    config = dict(toy.CONFIG, auto_map={"AutoConfig": "configuration_toy.ToyConfig"})
    (path / "config.json").write_text(json.dumps(config))
    assert load_tokenizer(path).eos_token_id == 257


def test_broken_tokenizer_is_a_checkpoint_error(tmp_path):
    path = toy.write_tokenizer(tmp_path)
    (path / "tokenizer.json").write_text("{broken")
    with pytest.raises(CheckpointError, match="cannot load the tokenizer"):
        load_tokenizer(path)


def test_eos_ids_from_tokenizer_and_configs(tmp_path):
    path = toy.write_tokenizer(tmp_path)
    (path / "config.json").write_text(json.dumps({"eos_token_id": [7, 8]}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 9}))
    assert eos_token_ids(load_tokenizer(path), path) == {7, 8, 9, 257}


def test_encode_prompt_modes(tmp_path):
    tokenizer = load_tokenizer(toy.write_tokenizer(tmp_path))
    assert tokenizer.decode(encode_prompt(tokenizer, "hi")) == "<s>user: hi\nassistant:"
    assert encode_prompt(tokenizer, "hi", chat_template=False) == [ord("h"), ord("i")]
    plain = load_tokenizer(toy.write_tokenizer(tmp_path / "plain", chat_template=False))
    assert encode_prompt(plain, "hi") == [ord("h"), ord("i")]
    with pytest.raises(ValueError, match="no chat template"):
        encode_prompt(plain, "hi", chat_template=True)


# --- CLI ------------------------------------------------------------------------------------


@pytest.fixture
def checkpoint(tmp_path, use_toy):
    path = toy.write_checkpoint(tmp_path / "ckpt")
    toy.write_tokenizer(path)
    return path


def run_cli(*args):
    return CliRunner().invoke(main, ["generate", *map(str, args)])


def test_cli_generates(checkpoint):
    result = run_cli("--model", checkpoint, "--prompt", "hello", "--max-tokens", 6)
    assert result.exit_code == 0, result.output
    # Same text as generating directly with the same greedy settings.
    tokenizer = load_tokenizer(checkpoint)
    ids = tokenizer.encode(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "hello"}], add_generation_prompt=True, tokenize=False
        ),
        add_special_tokens=False,
    )
    tokens = list(generate_tokens(load_model(checkpoint), ids, max_tokens=6, eos_token_ids=[257]))
    expected = tokenizer.decode(tokens, skip_special_tokens=True)
    assert result.stdout == expected + "\n"
    stats = result.stderr.strip().splitlines()
    assert len(stats) == 1
    assert f"prompt: {len(ids)} tokens" in stats[0]
    assert f"generated: {len(tokens)} tokens" in stats[0]


def test_cli_sampling_and_bounded_cache_flags(checkpoint):
    args = [
        "--model",
        checkpoint,
        "--prompt",
        "x" * 40,
        "--max-tokens",
        8,
        "--temp",
        0.8,
        "--top-p",
        0.9,
        "--top-k",
        20,
        "--seed",
        3,
        "--max-kv-size",
        16,
        "--kv-sink",
        2,
        "--prefill-chunk-size",
        7,
        "--no-chat-template",
    ]
    first, second = run_cli(*args), run_cli(*args)
    assert first.exit_code == 0, first.output
    assert "prompt: 40 tokens" in first.stderr
    assert first.stdout == second.stdout


def assert_one_error_line(result, code, *needles):
    assert result.exit_code == code, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in lines[0]


def test_cli_flag_errors(checkpoint, tmp_path):
    base = ["--model", checkpoint, "--prompt", "hi"]
    assert_one_error_line(run_cli(*base, "--max-tokens", -1), 2, "--max-tokens")
    assert_one_error_line(run_cli(*base, "--max-kv-size", 4, "--kv-sink", 4), 2, "--max-kv-size")
    assert_one_error_line(run_cli(*base, "--max-kv-size", 3), 2, "--kv-sink (4)")
    assert_one_error_line(run_cli(*base, "--top-p", 0), 2, "--top-p")
    assert_one_error_line(run_cli("--model", tmp_path / "missing", "--prompt", "hi"), 2, "missing")


def test_cli_checkpoint_errors(checkpoint, tmp_path):
    def gen(path):
        return run_cli("--model", path, "--prompt", "hi", "--max-tokens", 2)

    empty = tmp_path / "empty"
    empty.mkdir()
    assert_one_error_line(gen(empty), 1, "no config.json")

    no_tok = toy.write_checkpoint(tmp_path / "no_tok")
    assert_one_error_line(gen(no_tok), 1, "no tokenizer")

    weights = toy.random_weights()
    del weights["model.layers.1.down_proj.weight"]
    missing = toy.write_tokenizer(toy.write_checkpoint(tmp_path / "missing", weights))
    assert_one_error_line(gen(missing), 1, "model.layers.1.down_proj.weight")

    unknown = toy.write_tokenizer(tmp_path / "unknown")
    toy.write_checkpoint(unknown, config=dict(toy.CONFIG, model_type="gpt9"))
    assert_one_error_line(gen(unknown), 1, "'gpt9'", "toy")

    corrupt = toy.write_tokenizer(toy.write_checkpoint(tmp_path / "corrupt"))
    data = (corrupt / "model.safetensors").read_bytes()
    (corrupt / "model.safetensors").write_bytes(data[:1000])
    assert_one_error_line(gen(corrupt), 1, "model.safetensors")


@pytest.fixture
def short_context(tmp_path, use_toy):
    """A toy checkpoint whose context (max_position_embeddings) is 32 tokens."""
    config = dict(toy.CONFIG, max_position_embeddings=32)
    return toy.write_tokenizer(toy.write_checkpoint(tmp_path / "short", config=config))


def generated(result) -> int:
    assert result.exit_code == 0, result.output
    return int(result.stderr.split("generated: ")[1].split()[0])


def test_cli_keeps_to_the_context(short_context):
    # The server's rule: prompt + max_tokens fit the context, unless --max-kv-size slides.
    raw = ["--model", short_context, "--no-chat-template", "--prompt"]
    over = run_cli(*raw, "x" * 20, "--max-tokens", 13)
    assert_one_error_line(over, 2, "--max-tokens", "context of 32 tokens", "at most 12")
    assert_one_error_line(run_cli(*raw, "x" * 32), 2, "--prompt", "32 tokens")
    assert generated(run_cli(*raw, "x" * 20, "--max-tokens", 12)) <= 12
    assert generated(run_cli(*raw, "x" * 20)) <= 12  # the default 256, capped by the context
    sliding = run_cli(*raw, "x" * 40, "--max-tokens", 30, "--max-kv-size", 16)
    assert generated(sliding) <= 30 and "prompt: 40 tokens" in sliding.stderr


def test_cli_max_tokens_zero_is_a_usage_error(checkpoint):
    result = run_cli("--model", checkpoint, "--prompt", "hi", "--max-tokens", 0)
    assert_one_error_line(result, 2, "--max-tokens")


def test_cli_without_model_generates_with_the_demo(tmp_path, monkeypatch):
    # What `pip install .` users (and the CI packaging step) run: no checkpoint at hand.
    monkeypatch.setenv("MLXC_HOME", str(tmp_path))
    result = run_cli("--prompt", "hello", "--max-tokens", 4)
    assert generated(result) <= 4
    demo = tmp_path / "demo-v1"
    assert (demo / "config.json").is_file()
    warning = result.stderr.splitlines()[0]
    assert warning.startswith("warning: ") and "RANDOM" in warning and str(demo) in warning


# --- a real generated module, when the build has produced one --------------------------------


@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("llama")
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=260,
        max_position_embeddings=512,
        bos_token_id=256,
        eos_token_id=257,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # transformers' init is near zero: re-randomise
        for p in model.parameters():
            p.normal_(0, 0.3)
    model.save_pretrained(path, safe_serialization=True)
    toy.write_tokenizer(path)
    return path


def test_llama_end_to_end_streams(llama_checkpoint):
    result = run_cli("--model", llama_checkpoint, "--prompt", "hello", "--max-tokens", 12)
    assert result.exit_code == 0, result.output
    assert "generated:" in result.stderr


def test_llama_long_prompt_under_small_kv_limit(llama_checkpoint):
    model = load_model(llama_checkpoint)
    prompt = [int(i) for i in np.random.default_rng(0).integers(0, 256, size=150)]
    cache = model.make_cache()
    out = list(
        generate_tokens(
            model,
            prompt,
            max_tokens=20,
            max_kv_size=24,
            kv_sink=4,
            prefill_chunk_size=16,
            cache=cache,
        )
    )
    assert 0 < len(out) <= 20
    assert all(c.live_len <= 24 for c in cache)
    # Unbounded greedy over a short prompt agrees with a full recompute.
    short = prompt[:20]
    assert list(generate_tokens(model, short, max_tokens=5)) == greedy_reference(model, short, 5)


def test_cli_a_failing_chat_template_is_one_error_line_naming_it(checkpoint):
    # A template's raise_exception (or one that cannot take the messages) was a traceback.
    config_file = checkpoint / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = "{{ raise_exception('system messages only') }}"
    config_file.write_text(json.dumps(config))
    (checkpoint / "chat_template.jinja").unlink(missing_ok=True)
    result = run_cli("--model", checkpoint, "--prompt", "hi", "--max-tokens", 2)
    assert_one_error_line(
        result, 1, "the chat template from tokenizer_config.json failed", "system messages only"
    )
    raw = run_cli("--model", checkpoint, "--prompt", "hi", "--max-tokens", 2, "--no-chat-template")
    assert raw.exit_code == 0, raw.output
