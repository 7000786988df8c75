"""Tool calls (runtime.serving.tool_calls) on real chat templates, rendered by the tiny factory
tokenizer: the format each template teaches, tools and earlier calls reaching the template, and
the model text of each format parsed back (whole and streamed).

The templates in tests/fixtures/chat_templates are the published ones (see README there).
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import checkpoints as ckpt

from mlxc.runtime.checkpoint.tokenizer import StreamingDetokenizer, render_chat_template
from mlxc.runtime.serving.api_schemas import ChatMessage
from mlxc.runtime.serving.tool_calls import (
    FORMATS,
    ToolCallStream,
    format_for_template,
    template_message,
)

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
FAMILY = {  # template file -> the format it teaches
    "qwen2_5_7b_instruct": "hermes",
    "qwen3_0_6b": "hermes",
    "llama_3_3_70b_instruct": "llama3",
    "mistral_nemo_instruct_2407": "mistral_v3",
    "mistral_small_3_2_24b_instruct_2506": "mistral",
    "gpt_oss_120b": "harmony",
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather now in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
CALL_ID = "a1b2c3d4e"  # Mistral's templates take 9 alphanumeric characters only
# What every end-of-turn marker of these templates looks like (the model's EOS, not text).
END_MARKERS = ("<|im_end|>", "<|eot_id|>", "</s>")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return ckpt.write_tokenizer(tmp_path_factory.mktemp("tok"))


def template(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text()


def render(tok, name, messages, tools=None, **kw):
    kwargs = {"tools": tools} if tools else {}
    return render_chat_template(
        tok, messages, chat_template=template(name), template_kwargs=kwargs, **kw
    )


def message(**fields) -> dict:
    """A request message as the server hands it to the template."""
    m = ChatMessage.model_validate(fields)
    return {"role": m.role, "content": m.content or "", **template_message(m)}


ASK = {"role": "user", "content": "What is the weather in Paris?"}
CALLED = message(
    role="assistant",
    content=None,
    tool_calls=[
        {
            "id": CALL_ID,
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        }
    ],
)
ANSWERED = message(role="tool", content='{"temp_c": 21}', tool_call_id=CALL_ID, name="get_weather")


@pytest.mark.parametrize("name", sorted(FAMILY))
def test_format_is_picked_from_the_template(name):
    assert format_for_template(template(name)).name == FAMILY[name]


def test_default_format_and_named_templates():
    assert format_for_template(ckpt.CHAT_TEMPLATE).name == "hermes"
    assert format_for_template(None).name == "hermes"
    named = {"default": ckpt.CHAT_TEMPLATE, "tool_use": template("mistral_nemo_instruct_2407")}
    assert format_for_template(named).name == "mistral_v3"


@pytest.mark.parametrize("name", sorted(FAMILY))
def test_tools_and_tool_turns_reach_the_template(tokenizer, name):
    without = render(tokenizer, name, [ASK])
    with_tools = render(tokenizer, name, [ASK], tools=[WEATHER])
    assert "get_weather" not in without
    assert "get_weather" in with_tools and "The weather now in a city" in with_tools
    turns = render(tokenizer, name, [ASK, CALLED, ANSWERED], tools=[WEATHER])
    assert "temp_c" in turns and "21" in turns  # Llama's template writes it through tojson
    assert with_tools.count("get_weather") < turns.count("get_weather")


@pytest.mark.parametrize("name", sorted(FAMILY))
def test_the_templates_own_call_text_parses_back(tokenizer, name):
    """What the template writes for an assistant's call is what the model learnt to write:
    the format parses it back to the same call."""
    before = render(tokenizer, name, [ASK], tools=[WEATHER])
    after = render(tokenizer, name, [ASK, CALLED], tools=[WEATHER], add_generation_prompt=False)
    assert after.startswith(before[: len(before) // 2])
    reply = after[len(os.path.commonprefix([before, after])) :]
    for end in END_MARKERS:
        reply = reply.replace(end, "")
    fmt = format_for_template(template(name))
    content, calls = fmt.parse(reply)
    # Qwen3 writes an (empty) thinking block first: reasoning text, not a call.
    assert content.replace("<think>\n\n</think>", "").strip() == ""
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]


MODEL_TEXT = {
    "hermes": (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": "{\\"tz\\": \\"CET\\"}"}\n'
        "</tool_call>"
    ),
    "mistral": (
        'Let me check.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
        '[TOOL_CALLS]get_time[ARGS]{"tz": "CET"}'
    ),
    "llama3": '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
    '{"name": "get_time", "parameters": {"tz": "CET"}}',
    "harmony": (  # analysis, a preamble, then two calls in the two header orders harmony allows
        "<|channel|>analysis<|message|>They want weather.<|end|><|start|>assistant"
        "<|channel|>commentary<|message|>Let me check.<|end|><|start|>assistant"
        ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
        "<|start|>assistant<|channel|>commentary to=functions.get_time <|constrain|>json"
        '<|message|>{"tz": "CET"}<|call|>'
    ),
}
EXPECTED = [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]


@pytest.mark.parametrize("fmt", sorted(MODEL_TEXT))
def test_model_text_parses_whole_and_streamed(fmt):
    text = MODEL_TEXT[fmt]
    content, calls = FORMATS[fmt].parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == EXPECTED
    assert len({c.id for c in calls}) == 2
    assert content == {"hermes": "Let me check.\n", "llama3": ""}.get(fmt, "Let me check.")
    rng = random.Random(0)
    for _ in range(20):
        stream, got, streamed = ToolCallStream(FORMATS[fmt]), [], ""
        i = 0
        while i < len(text):
            n = rng.randint(1, 6)
            piece, more = stream.feed(text[i : i + n])
            streamed += piece
            got += more
            i += n
        piece, more = stream.finish()
        streamed, got = streamed + piece, got + more
        assert streamed == content
        assert [(c.name, json.loads(c.arguments)) for c in got] == EXPECTED


def test_stream_limit_emits_the_first_call_only():
    stream = ToolCallStream(FORMATS["hermes"], limit=1)
    got = stream.feed(MODEL_TEXT["hermes"])[1] + stream.finish()[1]
    assert [c.name for c in got] == ["get_weather"]
    stream = ToolCallStream(FORMATS["harmony"], limit=1)
    got = stream.feed(MODEL_TEXT["harmony"])[1] + stream.finish()[1]
    assert [c.name for c in got] == ["get_weather"]


def test_mistral_v3_json_list_and_ids():
    fmt = FORMATS["mistral"]
    text = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "x"}]'
    content, calls = fmt.parse(text)
    assert content == "" and [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city": "Paris"}')
    ]
    assert len(calls[0].id) == 9 and calls[0].id.isalnum()


@pytest.mark.parametrize(
    "fmt,text",
    [
        ("hermes", "<tool_call>\nnot json\n</tool_call>"),
        ("hermes", '<tool_call>{"arguments": {}}</tool_call>'),  # no name
        ("mistral", "[TOOL_CALLS]get_weather[ARGS]{oops"),
        ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"}} and more'),
        ("llama3", 'The answer is {"name": "x", "parameters": {}}'),  # a call is the whole reply
    ],
)
def test_text_that_is_not_a_call_stays_content(fmt, text):
    assert FORMATS[fmt].parse(text) == (text, [])
    stream = ToolCallStream(FORMATS[fmt])
    out = "".join(stream.feed(ch)[0] for ch in text)
    rest, calls = stream.finish()
    assert out + rest == text and calls == []


def test_harmony_content_is_the_final_channel():
    fmt = FORMATS["harmony"]
    text = "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Hi!"
    assert fmt.parse(text) == ("Hi!", [])
    assert fmt.parse("no channels") == ("no channels", [])
    bad = " to=functions.f<|channel|>commentary json<|message|>{oops<|call|>"
    assert fmt.parse(bad) == (bad, [])


def test_opener_prefix_is_held_back_until_known():
    stream = ToolCallStream(FORMATS["hermes"])
    assert stream.feed("Hi <tool") == ("Hi ", [])
    assert stream.feed("box>") == ("<toolbox>", [])


def test_bad_call_arguments_are_refused():
    with pytest.raises(ValueError, match="not a JSON object"):
        message(
            role="assistant",
            tool_calls=[{"id": "x", "function": {"name": "f", "arguments": "[1, 2]"}}],
        )


def test_marker_tokens_survive_detokenizing(tokenizer, tmp_path):
    """A format's marker that is a special token (Mistral's [TOOL_CALLS]) is written out when
    asked, and skipped like any special token otherwise."""
    tok = ckpt.write_tokenizer(tmp_path)
    tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]", "[ARGS]"]})
    marker, args = tok.convert_tokens_to_ids(["[TOOL_CALLS]", "[ARGS]"])
    ids = tok.encode("hello", add_special_tokens=False) + [marker]
    ids += tok.encode("get_weather", add_special_tokens=False) + [args]
    ids += tok.encode('{"city": "Paris"}', add_special_tokens=False)

    def detok(keep):
        d = StreamingDetokenizer(tok, keep)
        return "".join(d.add(t) for t in ids) + d.finalize()

    assert detok(frozenset()) == 'helloget_weather{"city": "Paris"}'
    kept = detok(frozenset({marker, args}))
    assert kept == 'hello[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
    assert FORMATS["mistral"].parse(kept)[1][0].name == "get_weather"
