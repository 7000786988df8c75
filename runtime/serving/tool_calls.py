"""Tool calls: the model's tool-call text in, OpenAI's ``message.tool_calls`` out.

A chat template that supports tools tells the model how to call one; each family writes calls
its own way. :class:`ToolFormat` is one such way: which text opens the calls (``opener``),
how to read them back (``parse``) and how to write one (``render``: the text a forced call is
constrained to, in ``runtime.serving.structured``). :func:`format_for_template` picks the format
from the markers the chat template contains:

=============  =========================================================  ====================
format         the model writes                                           template marker
=============  =========================================================  ====================
``hermes``     ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``  ``<tool_call>``
               (Qwen2.5, Qwen3, Hermes; the default)
``mistral``    ``[TOOL_CALLS]name[ARGS]{...}`` (v11+, Mistral Small 3.2)  ``[TOOL_CALLS]`` and
                                                                          ``[ARGS]``
``mistral_v3`` ``[TOOL_CALLS][{"name": ..., "arguments": {...}}]`` (v3,    ``[TOOL_CALLS]``
               Mistral Nemo); both Mistral formats read either form
``llama3``     ``{"name": ..., "parameters": {...}}`` as the whole reply   ``<|python_tag|>`` /
               (Llama 3.1-3.3 JSON tool calling)                          ``"parameters"``
``harmony``    ``to=functions.NAME<|channel|>commentary json<|message|>``  ``<|channel|>`` and
               ``{...}<|call|>`` (gpt-oss; the final channel is content)  ``<|call|>``
=============  =========================================================  ====================

:class:`ToolCallStream` turns the streamed text into content deltas and whole tool calls: text
that could begin the opener is held back until it is known not to; once the opener is seen,
the rest is held and parsed as calls (a Hermes call is emitted as soon as its closing tag
arrives, the others at the end; a harmony reply, channels and all, is read at the end). Text
that turns out not to parse as calls is content after all.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass
from typing import Any

_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text (OpenAI's shape)
    id: str

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return call if index is None else {"index": index, **call}


def _arguments_text(value: Any) -> str | None:
    """A call's arguments as JSON text: an object, or a string holding one; None otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None
    if not isinstance(value, dict):
        return None
    return json.dumps(value, ensure_ascii=False)


def _json_values(text: str) -> list[Any] | None:
    """The JSON values ``text`` holds one after another (separated by whitespace or ``;``), or
    None when anything else is in it."""
    values, i = [], 0
    while True:
        while i < len(text) and (text[i].isspace() or text[i] == ";"):
            i += 1
        if i == len(text):
            return values
        try:
            value, i = _DECODER.raw_decode(text, i)
        except json.JSONDecodeError:
            return None
        values.append(value)


class ToolFormat:
    """One family's way of writing tool calls (see the module docstring)."""

    name = ""
    opener = ""  # the text that begins the calls
    markers: tuple[str, ...] = ()  # text in a chat template that picks this format
    special: tuple[str, ...] = ()  # marker tokens the detokenizer must not skip
    whole_reply = False  # streaming holds the whole reply and parses it at the end

    def matches(self, template: str) -> bool:
        """Whether a chat template's text teaches this format."""
        return any(marker in template for marker in self.markers)

    def new_id(self) -> str:
        return "call_" + secrets.token_hex(12)

    def split(self, text: str) -> tuple[str, str] | None:
        """(content, the calls' text from the opener on), or None when no call begins."""
        i = text.find(self.opener)
        return None if i < 0 else (text[:i], text[i:])

    def calls(self, text: str, final: bool) -> list[ToolCall] | None:
        """The calls in ``text`` (which starts at the opener); before the end (``final``
        False) only those known to be complete. None: not calls after all (``final``)."""
        if not final:
            return []
        return self._parse(text) or None

    def _parse(self, text: str) -> list[ToolCall] | None:
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """A whole reply: (content, calls). No calls when the call text does not parse."""
        parts = self.split(text)
        if parts is not None:
            calls = self.calls(parts[1], final=True)
            if calls:
                return parts[0], calls
        return text, []

    def render(self, name: str, arguments: str) -> str:
        """The text of one call, as the model writes it (``arguments``: JSON text)."""
        raise NotImplementedError

    def _call(self, obj: Any, args_key: str = "arguments") -> ToolCall | None:
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        arguments = _arguments_text(obj.get(args_key, obj.get("arguments", {})))
        if arguments is None:
            return None
        return ToolCall(obj["name"], arguments, self.new_id())


class HermesFormat(ToolFormat):
    name = "hermes"
    opener = "<tool_call>"
    markers = ("<tool_call>",)
    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def calls(self, text: str, final: bool) -> list[ToolCall] | None:
        calls, end = [], 0
        for m in self._CALL.finditer(text):
            if text[end : m.start()].strip():
                break  # text between calls: the calls end here
            try:
                call = self._call(json.loads(m.group(1)))
            except json.JSONDecodeError:
                call = None
            if call is None:
                return None if final else calls
            calls.append(call)
            end = m.end()
        if final:
            rest = text[end:].strip()
            if rest.startswith(self.opener):  # an unclosed last call (max_tokens, a stop)
                try:
                    call = self._call(json.loads(rest[len(self.opener) :]))
                except json.JSONDecodeError:
                    call = None
                if call is not None:
                    calls.append(call)
            return calls or None
        return calls

    def render(self, name: str, arguments: str) -> str:
        return (
            f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": {arguments}}}\n</tool_call>'
        )


class MistralFormat(ToolFormat):
    """Mistral's v11+ tokenizers (``[TOOL_CALLS]name[ARGS]{...}``); either form is read."""

    name = "mistral"
    opener = "[TOOL_CALLS]"
    markers = ("[TOOL_CALLS]", "[ARGS]")
    special = ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")
    _ALNUM = string.ascii_letters + string.digits

    def new_id(self) -> str:
        # Mistral's templates take back only 9-character alphanumeric call ids.
        return "".join(secrets.choice(self._ALNUM) for _ in range(9))

    def _parse(self, text: str) -> list[ToolCall] | None:
        body = text[len(self.opener) :].lstrip()
        if body.startswith(("[", "{")):  # v3: a JSON list of {"name", "arguments"(, "id")}
            values = _json_values(body)
            if not values or len(values) != 1:
                return None
            items = values[0] if isinstance(values[0], list) else [values[0]]
            calls = [self._call(item) for item in items]
            return None if not calls or None in calls else calls
        calls = []  # v11+: [TOOL_CALLS]name[ARGS]{...}, once per call
        for piece in text.split(self.opener)[1:]:
            head, sep, args = piece.partition("[ARGS]")
            name = head.split("[CALL_ID]")[0].strip()
            values = _json_values(args) if sep else None
            if not name or not values or len(values) != 1:
                return None
            arguments = _arguments_text(values[0])
            if arguments is None:
                return None
            calls.append(ToolCall(name, arguments, self.new_id()))
        return calls or None

    def matches(self, template: str) -> bool:
        return all(marker in template for marker in self.markers)

    def render(self, name: str, arguments: str) -> str:
        return f"[TOOL_CALLS]{name}[ARGS]{arguments}"


class MistralV3Format(MistralFormat):
    """Mistral's v3 tokenizers (Mistral Nemo): ``[TOOL_CALLS][{"name", "arguments"}]``."""

    name = "mistral_v3"
    markers = ("[TOOL_CALLS]",)

    def render(self, name: str, arguments: str) -> str:
        return f'[TOOL_CALLS][{{"name": {json.dumps(name)}, "arguments": {arguments}}}]'


class Llama3JsonFormat(ToolFormat):
    name = "llama3"
    opener = "{"
    markers = ("<|python_tag|>", '"parameters"')
    special = ("<|python_tag|>",)

    def split(self, text: str) -> tuple[str, str] | None:
        # A call is the whole reply: JSON from its first character (after <|python_tag|>).
        body = text.lstrip()
        if body.startswith("<|python_tag|>"):
            body = body[len("<|python_tag|>") :].lstrip()
        return ("", body) if body.startswith("{") else None

    def _parse(self, text: str) -> list[ToolCall] | None:
        values = _json_values(text)
        if not values:
            return None
        calls = [self._call(v, "parameters") for v in values]
        return None if None in calls else calls

    def render(self, name: str, arguments: str) -> str:
        return f'{{"name": {json.dumps(name)}, "parameters": {arguments}}}'


class HarmonyFormat(ToolFormat):
    """gpt-oss's harmony messages: ``<|channel|>analysis<|message|>...<|end|><|start|>assistant
    to=functions.NAME<|channel|>commentary json<|message|>{...}<|call|>``. A message to
    ``functions.NAME`` is a call; the final channel (and commentary to nobody) is the content;
    the analysis channel is reasoning, not content."""

    name = "harmony"
    opener = "<|start|>"  # unused: the whole reply is read at the end (whole_reply)
    markers = ("<|channel|>", "<|call|>")
    special = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>")
    special += ("<|call|>", "<|return|>")
    whole_reply = True

    def matches(self, template: str) -> bool:
        return all(marker in template for marker in self.markers)

    _ENDS = re.compile(r"<\|(?:end|call|return)\|>")
    _TO = re.compile(r"to=functions\.([^\s<]+)")
    _CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        if "<|message|>" not in text:
            return text, []
        content, calls = [], []
        for segment in text.split("<|start|>"):
            header, sep, body = segment.partition("<|message|>")
            if not sep:
                continue
            body = self._ENDS.split(body, maxsplit=1)[0]
            to, channel = self._TO.search(header), self._CHANNEL.search(header)
            if to is not None:
                arguments = _arguments_text(body)
                if arguments is None:
                    return text, []
                calls.append(ToolCall(to.group(1), arguments, self.new_id()))
            elif channel is None or channel.group(1) != "analysis":
                content.append(body)
        return "".join(content), calls

    def render(self, name: str, arguments: str) -> str:
        # After the prompt's <|start|>assistant, as the template writes an earlier call.
        return f" to=functions.{name}<|channel|>commentary json<|message|>{arguments}<|call|>"


FORMATS: dict[str, ToolFormat] = {
    f.name: f
    for f in (
        HermesFormat(),
        MistralFormat(),
        MistralV3Format(),
        Llama3JsonFormat(),
        HarmonyFormat(),
    )
}
DEFAULT_FORMAT = "hermes"


def template_text(template: Any) -> str:
    """A chat template's source: a string, or a tokenizer's named templates (a dict or a list
    of {"name", "template"}), joined."""
    if isinstance(template, str):
        return template
    if isinstance(template, dict):
        return "\n".join(str(t) for t in template.values())
    if isinstance(template, list):
        return "\n".join(str(t.get("template", "")) for t in template if isinstance(t, dict))
    return ""


def format_for_template(template: Any) -> ToolFormat:
    """The tool-call format a chat template teaches its model: the first format (harmony,
    Mistral v11, Mistral v3, Hermes, Llama 3) whose markers the template contains; Hermes when
    none does."""
    text = template_text(template)
    for name in ("harmony", "mistral", "mistral_v3", "hermes", "llama3"):
        if FORMATS[name].matches(text):
            return FORMATS[name]
    return FORMATS[DEFAULT_FORMAT]


class ToolCallStream:
    """Streamed text -> (content delta, tool calls completed) per ``feed``; ``finish`` at the end."""

    def __init__(self, fmt: ToolFormat, limit: int | None = None) -> None:
        self.fmt = fmt
        self.limit = limit  # the most calls to emit (parallel_tool_calls false: 1)
        self.pending = ""  # text not emitted yet
        self.in_calls = False
        self.sent = 0  # calls emitted so far
        self.started = False  # content seen: a Llama 3 call (the whole reply) can no longer come

    def _hold(self) -> int:
        """How much of the end of ``pending`` could still become the opener."""
        if isinstance(self.fmt, Llama3JsonFormat):
            stripped = self.pending.lstrip()
            if not stripped or "<|python_tag|>".startswith(stripped):
                return len(self.pending)
            self.started = True
            return 0
        opener = self.fmt.opener
        for k in range(min(len(opener) - 1, len(self.pending)), 0, -1):
            if self.pending.endswith(opener[:k]):
                return k
        return 0

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self.pending += text
        if self.fmt.whole_reply:
            return "", []
        content = ""
        if not self.in_calls:
            parts = None if self.started else self.fmt.split(self.pending)
            if parts is None:
                cut = len(self.pending) - (0 if self.started else self._hold())
                content, self.pending = self.pending[:cut], self.pending[cut:]
                return content, []
            content, self.pending = parts
            self.in_calls = True
        calls = self.fmt.calls(self.pending, final=False)[self.sent : self.limit]
        self.sent += len(calls)
        return content, calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        if self.fmt.whole_reply:
            content, calls = self.fmt.parse(self.pending)
            calls = calls[: self.limit]
            self.pending, self.sent = "", len(calls)
            return content, calls
        if self.in_calls:
            found = self.fmt.calls(self.pending, final=True)
            if found is not None:
                calls = found[self.sent : self.limit]
                self.sent += len(calls)
                return "", calls
            if self.sent:  # calls already sent: the unreadable rest is dropped
                return "", []
        out, self.pending = self.pending, ""  # not calls after all: it was content
        return out, []


# --- the request side ---------------------------------------------------------------------------


def template_message(message: Any) -> dict[str, Any]:
    """A chat message's tool fields as chat templates read them: an assistant's ``tool_calls``
    with their arguments as objects (templates write them with ``tojson``), a tool message's
    ``tool_call_id`` and ``name``. ValueError when a call's arguments are not a JSON object."""
    fields: dict[str, Any] = {}
    if message.tool_calls:
        calls = []
        for call in message.tool_calls:
            text = _arguments_text(call.function.arguments)
            if text is None:
                raise ValueError(f"the arguments of tool call {call.id!r} are not a JSON object")
            arguments = json.loads(text)
            function = {"name": call.function.name, "arguments": arguments}
            calls.append({"id": call.id, "type": "function", "function": function})
        fields["tool_calls"] = calls
    if message.tool_call_id is not None:
        fields["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        fields["name"] = message.name
    return fields
