"""Constrained decoding (runtime.serving.structured) on the tiny factory tokenizer: the bitmask
applied to the logits rows it belongs to, and random logits decoded under a grammar always
giving output that its schema (or the tool-call format's parser) accepts."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
import checkpoints as ckpt

from mlxc.runtime.serving.structured import (
    GrammarError,
    Grammars,
    apply_masks,
    call_items,
    grammar,
    response_grammar,
    response_item,
    tool_call_grammar,
)
from mlxc.runtime.serving.tool_calls import FORMATS

ITEM = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "tag": {"type": "string", "maxLength": 4},
        "ok": {"type": "boolean"},
    },
    "required": ["id", "tag", "ok"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "lookup", "parameters": ITEM}},
    {
        "type": "function",
        "function": {
            "name": "pick",
            "parameters": {
                "type": "object",
                "properties": {"which": {"enum": ["a", "b"]}},
                "required": ["which"],
                "additionalProperties": False,
            },
        },
    },
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return ckpt.write_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return Grammars(tokenizer, ckpt.VOCAB_SIZE, {ckpt.EOS_ID})


def unpacked(mask: np.ndarray, vocab: int) -> np.ndarray:
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little").astype(bool)
    return np.concatenate([bits, np.zeros(max(0, vocab - bits.size), bool)])[:vocab]


def test_apply_masks_touches_only_the_masked_rows():
    rng = np.random.default_rng(0)
    vocab = 77  # not a multiple of 32; the second mask is one word short: its tail is forbidden
    logits = rng.normal(size=(4, vocab)).astype(np.float32)
    masks = [rng.integers(-(2**31), 2**31, size=3, dtype=np.int64).astype(np.int32)]
    masks.append(masks[0][:2].copy())
    out = np.array(apply_masks(mx.array(logits), [1, 3], masks))
    for row, mask in zip([1, 3], masks):
        allowed = unpacked(mask, vocab)
        assert np.array_equal(out[row][allowed], logits[row][allowed])
        assert np.all(np.isneginf(out[row][~allowed]))
    assert np.isneginf(out[3][64:]).all()
    assert np.array_equal(out[[0, 2]], logits[[0, 2]])


def decode(grammars, grammar: str, seed: int, steps: int = 200):
    """Random logits each step, masked, sampled; the tokens until EOS."""
    rng = np.random.default_rng(seed)
    constraint = grammars.constraint(grammar)
    tokens = []
    for _ in range(steps):
        logits = mx.array(rng.normal(scale=3.0, size=(1, ckpt.VOCAB_SIZE)).astype(np.float32))
        logits = apply_masks(logits, [0], [constraint.bitmask()])
        token = int(mx.random.categorical(logits, key=mx.random.key(int(rng.integers(1 << 30)))))
        constraint.accept(token)
        if token == ckpt.EOS_ID:
            assert constraint.done
            return tokens
        tokens.append(token)
    raise AssertionError("the grammar never ended")


def check_item(value):
    assert set(value) == {"id", "tag", "ok"}
    assert type(value["id"]) is int and 0 <= value["id"] <= 999
    assert isinstance(value["tag"], str) and len(value["tag"]) <= 4
    assert isinstance(value["ok"], bool)


@pytest.mark.parametrize("seed", range(4))
def test_random_logits_under_a_schema_give_valid_json(tokenizer, grammars, seed):
    text = tokenizer.decode(decode(grammars, response_grammar("json_schema", ITEM), seed))
    check_item(json.loads(text))
    outside_strings = re.sub(r'"(\\.|[^"\\])*"', '""', text)
    assert not re.search(r"\s", outside_strings)  # compact JSON


def test_json_object_grammar_gives_an_object(tokenizer, grammars):
    text = tokenizer.decode(decode(grammars, response_grammar("json_object"), 0, steps=400))
    assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("seed", range(3))
def test_forced_calls_parse_back_in_every_format(tokenizer, grammars, fmt, seed):
    text = tokenizer.decode(decode(grammars, tool_call_grammar(FORMATS[fmt], TOOLS), seed))
    content, calls = FORMATS[fmt].parse(text)
    assert content.strip() == "" and len(calls) == 1
    args = json.loads(calls[0].arguments)
    if calls[0].name == "lookup":
        check_item(args)
    else:
        assert calls[0].name == "pick" and args in ({"which": "a"}, {"which": "b"})


def test_a_finished_grammar_allows_only_eos(grammars):
    constraint = grammars.constraint('start: "ok"')
    assert unpacked(constraint.bitmask(), ckpt.VOCAB_SIZE)[ckpt.EOS_ID] == 0
    for token in grammars._tokenizer_info().tokenize_str("ok"):
        constraint.accept(token)
    allowed = np.flatnonzero(unpacked(constraint.bitmask(), ckpt.VOCAB_SIZE))
    assert allowed.tolist() == [ckpt.EOS_ID]
    with pytest.raises(RuntimeError, match="rejects"):
        grammars.constraint('start: "ok"').accept(ckpt.EOS_ID)


def test_unusable_schema_is_a_grammar_error(grammars):
    with pytest.raises(GrammarError):
        grammars.constraint(response_grammar("json_schema", {"type": "object", "if": {}}))


def test_marker_tokens_are_sampled_as_the_special_tokens(tmp_path):
    """With a tokenizer whose [TOOL_CALLS] and [ARGS] are special tokens (as Mistral's are),
    a forced call samples those tokens, and the detokenizer that keeps them reads it back."""
    from mlxc.runtime.checkpoint.tokenizer import StreamingDetokenizer

    tok = ckpt.write_tokenizer(tmp_path)
    tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]", "[ARGS]"]})
    markers = dict(
        zip(["[TOOL_CALLS]", "[ARGS]"], tok.convert_tokens_to_ids(["[TOOL_CALLS]", "[ARGS]"]))
    )
    grammar = tool_call_grammar(FORMATS["mistral"], TOOLS[1:], markers)
    tokens = decode(Grammars(tok, ckpt.VOCAB_SIZE, {ckpt.EOS_ID}), grammar, 0)
    assert tokens[0] == markers["[TOOL_CALLS]"] and markers["[ARGS]"] in tokens
    detok = StreamingDetokenizer(tok, frozenset(markers.values()))
    text = "".join(detok.add(t) for t in tokens) + detok.finalize()
    (call,) = FORMATS["mistral"].parse(text)[1]
    assert call.name == "pick" and json.loads(call.arguments) in ({"which": "a"}, {"which": "b"})


@pytest.mark.parametrize("seed", range(6))
def test_response_format_or_a_call(tokenizer, grammars, seed):
    """tool_choice "auto" with a response_format: the schema's JSON, or a call of a tool."""
    fmt = FORMATS["hermes"]
    alternatives = [response_item("json_schema", ITEM), *call_items(fmt, TOOLS)]
    text = tokenizer.decode(decode(grammars, grammar(alternatives), seed))
    content, calls = fmt.parse(text)
    if calls:
        assert content == "" and calls[0].name in ("lookup", "pick")
    else:
        check_item(json.loads(text))
