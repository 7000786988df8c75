"""Per-sequence output of the scheduler: sampled token ids become a request's events.

A running sequence's text is its own business, apart from the step that samples its tokens
(``runtime.serving.scheduler``): :class:`SequenceOutput` feeds each token to a
``StreamingDetokenizer``, cuts the text at the first stop string (:class:`StopMatcher`), counts
completion tokens against ``max_tokens``, and turns each token into the :class:`Delta` and
:class:`Finished` events of ``runtime.serving.admission``. It holds no MLX state and runs on the
scheduler thread only (the detokenizer uses the scheduler's tokenizer).

A request without stop strings needs no text on the scheduler thread: with
``SamplingParams(detokenize=False)`` its events carry tokens alone, and :class:`EventText`
makes the same text where they are read (``mlxc serve``'s HTTP process, off the step).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

from mlxc.runtime.checkpoint.tokenizer import StreamingDetokenizer
from mlxc.runtime.serving.admission import Delta, Event, Finished, SamplingParams, TokenLogprob


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the character that stands for each byte in a token's
    piece (printable Latin-1 bytes stand for themselves, the others for 256 + n in order)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    kept += range(ord("®"), ord("ÿ") + 1)
    chars, extra = {}, 0
    for b in range(256):
        if b in kept:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_LEVEL = _byte_level_alphabet()
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


def token_piece(tokenizer: Any, token: int) -> tuple[str, list[int]]:
    """A token's text and UTF-8 bytes alone (logprobs). A token that is part of a character
    has no text of its own: its bytes come from its piece (byte-level BPE or SentencePiece byte
    fallback) and its text is ``bytes:\\xNN...``, as OpenAI writes it."""
    text = tokenizer.decode([token])
    if "\ufffd" not in text:
        return text, list(text.encode("utf-8"))
    piece = tokenizer.convert_ids_to_tokens(token)
    raw = None
    if isinstance(piece, str) and (m := _BYTE_PIECE.fullmatch(piece)):
        raw = [int(m.group(1), 16)]
    elif isinstance(piece, str) and piece and all(c in _BYTE_LEVEL for c in piece):
        raw = [_BYTE_LEVEL[c] for c in piece]
    if raw is None:
        return text, list(text.encode("utf-8"))
    return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw


class StopMatcher:
    """Cuts the text stream at the first stop string, holding back a possible partial match.

    ``feed`` returns the text safe to emit and whether a stop string was hit (the text then ends
    just before it). Text that could be the start of a stop string waits for the next delta.
    """

    def __init__(self, stops: Iterable[str]) -> None:
        self.stops = [s for s in stops if s]
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        if not self.stops:
            return text, False
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending = self.pending[: min(hits)], ""
            return out, True
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.pending)), hold, -1):
                if self.pending.endswith(s[:k]):
                    hold = k
                    break
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class SequenceOutput:
    """One sequence's detokenizer, stop strings and completion-token count.

    ``accept`` takes each sampled token in order and sends the events it makes: a Delta, and a
    Finished once the sequence ends (EOS unless ``ignore_eos``, a stop string, ``max_tokens``).
    """

    def __init__(
        self,
        tokenizer: Any,
        params: SamplingParams,
        prompt_tokens: int,
        eos_token_ids: frozenset[int],
    ) -> None:
        self.params = params
        self.prompt_tokens = prompt_tokens
        self.eos_token_ids = eos_token_ids
        self.generated = 0
        self.cached_tokens = 0  # prompt tokens resumed from the prefix cache (not prefilled)
        self.detok = (
            StreamingDetokenizer(tokenizer, params.keep_special) if params.detokenize else None
        )
        self.stops = StopMatcher(params.stop)

    def accept(
        self, token: int, send: Callable[[Event], None], logprob: TokenLogprob | None = None
    ) -> bool:
        """Send this token's events; True when it ended the sequence (Finished was sent)."""
        if token in self.eos_token_ids and not self.params.ignore_eos:
            send(self._finished("stop"))
            return True
        self.generated += 1
        text, hit = self.stops.feed(self.detok.add(token) if self.detok else "")
        if hit:
            send(self._finished("stop", final_text=text))
            return True
        send(Delta(text, token, logprob))
        if self.generated >= self.params.max_tokens:
            send(self._finished("length"))
            return True
        return False

    def _finished(self, reason: str, final_text: str | None = None) -> Finished:
        if self.detok is None:  # the reader detokenizes (EventText)
            final_text = ""
        elif final_text is None:
            # EOS or max_tokens: flush what the detokenizer and the stop matcher hold back.
            tail = self.detok.finalize()
            final_text, hit = self.stops.feed(tail)
            if hit:
                reason = "stop"
            else:
                final_text += self.stops.flush()
        return Finished(reason, final_text, self.prompt_tokens, self.generated, self.cached_tokens)


class EventText:
    """A request's text, made where its events are read: fills in ``Delta.text`` and
    ``Finished.text`` of events the scheduler sent without them (``SamplingParams(detokenize=
    False)``), as ``SequenceOutput`` would have (the same detokenizer; no stop strings).

    ``tokenizer`` must not be in use on another thread (Hugging Face tokenizers are not safe
    under concurrent use)."""

    def __init__(self, tokenizer: Any, keep_special: frozenset[int]) -> None:
        self.detok = StreamingDetokenizer(tokenizer, keep_special)

    def fill(self, event: Event) -> Event:
        """``event`` with its text (in place: the reader's own copy)."""
        if isinstance(event, Delta):
            event.text = self.detok.add(event.token)
        elif isinstance(event, Finished):
            event.text = self.detok.finalize()
        return event
