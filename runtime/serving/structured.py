"""Structured output: decoding constrained to a grammar, through llguidance.

A request's ``response_format`` (``json_object``, ``json_schema``) or forcing ``tool_choice``
(a named function, or ``"required"``) becomes a grammar (:func:`response_grammar`,
:func:`tool_call_grammar`: Lark text with inline ``%json`` schemas, which llguidance compiles);
with tools the model may call (``tool_choice`` "auto"), a ``response_format`` grammar also
allows a call of any of them.
:class:`Grammars` holds the engine's llguidance tokenizer (built once, from the Hugging Face
tokenizer) and makes each request's :class:`Constraint`: a matcher that gives the bitmask of the
tokens allowed next and consumes each sampled token. The scheduler applies the bitmask to a
constrained row's logits before sampling (:func:`apply_masks`); unconstrained rows are never
touched. EOS is allowed once the grammar accepts, and is the only token left when it is done.

JSON is generated compact (llguidance's ``whitespace_flexible`` off unless a schema's
``x-guidance`` says otherwise): a weak model cannot fill its budget with whitespace.

llguidance was picked over xgrammar by measurement (the README's serving section has the
numbers) and because xgrammar's package requires torch, which the runtime does not depend on.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import mlx.core as mx
import numpy as np

from mlxc.runtime.serving.tool_calls import ToolFormat

# Compact JSON by default; a schema's own "x-guidance" options win.
JSON_OPTIONS = {"whitespace_flexible": False}
ANY_OBJECT = {"type": "object"}


class GrammarError(ValueError):
    """A grammar (a schema) the engine cannot use (answered 400)."""


def _json(schema: dict[str, Any]) -> str:
    """A Lark ``%json`` item for ``schema`` (compact unless it asks otherwise)."""
    options = {**JSON_OPTIONS, **(schema.get("x-guidance") or {})}
    return "%json " + json.dumps({**schema, "x-guidance": options})


def grammar(alternatives: list[str]) -> str:
    """A Lark grammar whose output is any one of ``alternatives`` (Lark items)."""
    rules = [f"alt{i}: {item}" for i, item in enumerate(alternatives)]
    return "\n".join(["start: " + " | ".join(f"alt{i}" for i in range(len(rules))), *rules])


def response_item(kind: str, schema: dict[str, Any] | None = None) -> str | None:
    """A ``response_format``'s output: any JSON object (``json_object``), JSON valid against
    ``schema`` (``json_schema``); None for ``text``."""
    if kind == "json_object":
        return _json(ANY_OBJECT)
    if kind == "json_schema":
        return _json(schema or ANY_OBJECT)
    return None


def response_grammar(kind: str, schema: dict[str, Any] | None = None) -> str | None:
    """The grammar of a ``response_format`` (None for ``text``)."""
    item = response_item(kind, schema)
    return None if item is None else grammar([item])


def _literal(text: str, markers: dict[str, int]) -> str:
    """Lark items for ``text``: quoted strings, and the marker tokens in it as the special
    tokens themselves (``<[id]>``: a real tokenizer's [TOOL_CALLS] is one token, not text)."""
    if not text:
        return ""
    for marker, token in markers.items():
        if marker in text:
            head, _, tail = text.partition(marker)
            items = [_literal(head, markers), f"<[{token}]>", _literal(tail, markers)]
            return " ".join(i for i in items if i)
    return json.dumps(text)


def call_items(
    fmt: ToolFormat, tools: list[dict[str, Any]], markers: dict[str, int] | None = None
) -> list[str]:
    """For each of ``tools`` (OpenAI tool definitions), one call as ``fmt`` writes it, its
    arguments valid against the function's ``parameters`` schema. ``markers``: the format's
    marker texts that are special tokens of the tokenizer, and their ids."""
    items = []
    for tool in tools:
        function = tool["function"]
        before, after = fmt.render(function["name"], "\0").split("\0")
        schema = function.get("parameters") or ANY_OBJECT
        parts = [_literal(before, markers or {}), _json(schema), _literal(after, markers or {})]
        items.append(" ".join(p for p in parts if p))
    return items


def tool_call_grammar(
    fmt: ToolFormat, tools: list[dict[str, Any]], markers: dict[str, int] | None = None
) -> str:
    """One call of one of ``tools`` (see :func:`call_items`)."""
    return grammar(call_items(fmt, tools, markers))


class Constraint:
    """One request's matcher: the allowed-token bitmask for the next step, and its tokens.
    ``grammar``: the Lark text it was made from (a matcher does not pickle: another process
    makes its own from this, ``runtime.serving.frontend``)."""

    def __init__(self, matcher: Any, words: int, grammar: str = "") -> None:
        self.matcher = matcher
        self.words = words  # int32 words of the bitmask
        self.grammar = grammar

    def bitmask(self) -> np.ndarray:
        """The tokens allowed next, one bit per token id (int32 words, little-endian bits)."""
        from llguidance.numpy import fill_next_token_bitmask

        mask = np.zeros((1, self.words), dtype=np.int32)
        fill_next_token_bitmask(self.matcher, mask, 0)
        return mask[0]

    def accept(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"the grammar rejects token {token}: {self.matcher.get_error()}")

    @property
    def done(self) -> bool:
        return self.matcher.is_stopped()


class AnyToken:
    """A constraint every token satisfies: ``Constraint``'s interface with no grammar behind it.
    The scheduler's CUDA warm-up gives it to one throwaway request, so the steps of a
    constrained row (masked logits, sampled once the masks are known) compile their kernels
    before the first real grammar meets them."""

    def __init__(self, vocab_size: int) -> None:
        self._mask = np.full((vocab_size + 31) // 32, -1, dtype=np.int32)

    def bitmask(self) -> np.ndarray:
        return self._mask

    def accept(self, token: int) -> None:
        pass


class Grammars:
    """Makes constraints for one tokenizer (the llguidance tokenizer is built on first use)."""

    def __init__(self, tokenizer: Any, vocab_size: int | None, eos_token_ids) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._info = None
        self._lock = threading.Lock()  # the prompt workers build it once (~1 s, large vocabs)

    def _tokenizer_info(self):
        with self._lock:
            return self._build_info()

    def _build_info(self):
        if self._info is None:
            import llguidance.hf

            n_vocab = self.vocab_size
            if n_vocab is not None and n_vocab < len(self.tokenizer):
                n_vocab = None  # the tokenizer's own size
            eos = self.eos_token_ids or None
            self._info = llguidance.hf.from_tokenizer(
                self.tokenizer, n_vocab=n_vocab, eos_token=eos
            )
        return self._info

    def constraint(self, grammar: str) -> Constraint:
        """A fresh matcher for ``grammar`` (Lark text); GrammarError when it cannot compile."""
        import llguidance

        info = self._tokenizer_info()
        matcher = llguidance.LLMatcher(
            info, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0
        )
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return Constraint(matcher, (info.vocab_size + 31) // 32, grammar)


def apply_masks(logits: mx.array, rows: list[int], masks: list[np.ndarray]) -> mx.array:
    """``logits [B, V]`` with the tokens each mask forbids set to -inf in its row (``rows[i]``
    takes ``masks[i]``); other rows are returned as they are."""
    if not rows:
        return logits
    vocab = logits.shape[-1]
    words = (vocab + 31) // 32
    packed = np.zeros((len(rows), words), dtype=np.int32)  # tokens past the mask: forbidden
    for i, mask in enumerate(masks):
        n = min(words, mask.shape[0])
        packed[i, :n] = mask[:n]
    ids = mx.arange(vocab, dtype=mx.int32)
    bits = mx.array(packed)[:, ids // 32]
    allowed = mx.bitwise_and(mx.right_shift(bits, ids % 32), 1).astype(mx.bool_)
    index = mx.array(rows, dtype=mx.int32)
    logits = mx.array(logits)  # a copy: the caller's logits stay the model's
    logits[index] = mx.where(allowed, logits[index], mx.array(-mx.inf, logits.dtype))
    return logits
