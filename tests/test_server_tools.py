"""`mlxc serve` with tools and structured output, end to end with the `openai` client.

One server: the tiny random llama under Qwen2.5-7B-Instruct's published chat template
(tests/fixtures/chat_templates, through --chat-template), so tool calls are written the Hermes
way (<tool_call>...</tool_call>).
"""

from __future__ import annotations

import concurrent.futures
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import checkpoints as ckpt
from test_server import Server

openai = pytest.importorskip("openai")

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather now in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL_ID = "call_0"
TURNS = ASK + [
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": CALL_ID,
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": CALL_ID, "content": '{"temp_c": 21}'},
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("tools")
    model = ckpt.make_llama(root / "llama", num_hidden_layers=2, max_position_embeddings=4096)
    server = Server(
        [
            "--model",
            model,
            "--chat-template",
            TEMPLATES / "qwen2_5_7b_instruct.jinja",
            "--model-id",
            "tiny",
        ],
        root,
    )
    yield server
    server.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def test_tools_and_tool_turns_reach_the_template(client):
    plain = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=2)
    tools = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER], max_tokens=2
    )
    none = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=2
    )
    turns = client.chat.completions.create(
        model="tiny", messages=TURNS, tools=[WEATHER], max_tokens=2
    )
    # The tool definitions are in the prompt (not with tool_choice "none"), and so are the
    # earlier call and its result.
    assert plain.usage.prompt_tokens == none.usage.prompt_tokens < tools.usage.prompt_tokens
    assert tools.usage.prompt_tokens < turns.usage.prompt_tokens


@pytest.mark.parametrize(
    "body,param",
    [
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ],
)
def test_bad_tool_requests_are_400(server, body, param):
    with server.client() as c:
        r = c.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_bad_call_arguments_are_400(server):
    turns = json.loads(json.dumps(TURNS))
    turns[1]["tool_calls"][0]["function"]["arguments"] = "{not json"
    with server.client() as c:
        r = c.post("/v1/chat/completions", json={"messages": turns, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text


# --- structured output and forced tool calls (runtime.serving.structured) ------------------------

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog"]},
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}
SCHEMA_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "person", "schema": PERSON, "strict": True},
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"tz": {"enum": ["UTC", "CET"]}},
            "required": ["tz"],
            "additionalProperties": False,
        },
    },
}


def check_person(value):
    """PERSON's constraints, checked by hand (no schema library in the test environment)."""
    assert set(value) == {"name", "age", "pet"}
    assert isinstance(value["name"], str) and len(value["name"]) <= 6
    assert type(value["age"]) is int and 0 <= value["age"] <= 120
    assert value["pet"] in ("cat", "dog")


def streamed(client, **kw):
    """(content, tool calls merged from their deltas, finish_reason) of a streamed chat."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model="tiny", stream=True, **kw):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = delta.id or call["id"]
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_reply_validates(client, temperature):
    r = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        response_format=SCHEMA_FORMAT,
        max_tokens=48,
        temperature=temperature,
        seed=3,
    )
    assert r.choices[0].finish_reason == "stop"
    check_person(json.loads(r.choices[0].message.content))
    content, calls, finish = streamed(
        client, messages=ASK, response_format=SCHEMA_FORMAT, max_tokens=48, temperature=0.0
    )
    assert finish == "stop" and calls == []
    check_person(json.loads(content))


def test_json_object_reply_is_an_object(client):
    r = client.chat.completions.create(
        model="tiny", messages=ASK, response_format={"type": "json_object"}, max_tokens=48
    )
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_unusable_schema_is_400(server):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"if": {}}}}
    with server.client() as c:
        r = c.post(
            "/v1/chat/completions",
            json={"messages": ASK, "max_tokens": 2, "response_format": bad},
        )
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text


def check_weather_call(name, arguments):
    assert name == "get_weather"
    args = json.loads(arguments)
    assert set(args) == {"city"} and isinstance(args["city"], str) and len(args["city"]) <= 8


def test_named_tool_choice_forces_a_valid_call(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[CLOCK, WEATHER], tool_choice=choice, max_tokens=128
    )
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and not message.content
    (call,) = message.tool_calls
    assert call.type == "function" and call.id
    check_weather_call(call.function.name, call.function.arguments)

    content, calls, finish = streamed(
        client, messages=ASK, tools=[CLOCK, WEATHER], tool_choice=choice, max_tokens=128
    )
    assert finish == "tool_calls" and not content and len(calls) == 1
    check_weather_call(calls[0]["name"], calls[0]["arguments"])
    assert calls[0]["id"]

    # The call and its result go back to the model as the next turn's history.
    follow = ASK + [
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 21}'},
    ]
    r = client.chat.completions.create(model="tiny", messages=follow, tools=[WEATHER], max_tokens=4)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_required_tool_choice_calls_one_of_the_tools(client):
    r = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[CLOCK, WEATHER], tool_choice="required", max_tokens=128
    )
    (call,) = r.choices[0].message.tool_calls
    if call.function.name == "get_time":
        assert json.loads(call.function.arguments) in ({"tz": "UTC"}, {"tz": "CET"})
    else:
        check_weather_call(call.function.name, call.function.arguments)


def test_constrained_rows_leave_the_others_alone(server, client):
    """A greedy reply is the same alone and decoded in one batch beside constrained rows."""
    alone = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=24)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        constrained = [
            pool.submit(
                client.chat.completions.create,
                model="tiny",
                messages=ASK,
                response_format=SCHEMA_FORMAT,
                max_tokens=48,
            )
            for _ in range(2)
        ]
        free = pool.submit(
            client.chat.completions.create, model="tiny", messages=ASK, max_tokens=24
        )
        for f in constrained:
            check_person(json.loads(f.result().choices[0].message.content))
        assert free.result().choices[0].message.content == alone.choices[0].message.content
    assert server.health()["pool"]["peak_batched"] >= 2


def test_response_format_with_tools_is_the_format_or_a_call(client):
    r = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=[CLOCK],
        response_format=SCHEMA_FORMAT,
        max_tokens=96,
    )
    choice = r.choices[0]
    if choice.message.tool_calls:
        (call,) = choice.message.tool_calls
        assert choice.finish_reason == "tool_calls" and call.function.name == "get_time"
        assert json.loads(call.function.arguments) in ({"tz": "UTC"}, {"tz": "CET"})
    else:
        assert choice.finish_reason == "stop"
        check_person(json.loads(choice.message.content))
