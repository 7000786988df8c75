"""`mlxc serve` with tools and structured output, end to end with the `openai` client.

One server: the tiny random llama under Qwen2.5-7B-Instruct's published chat template
(tests/fixtures/chat_templates, through --chat-template), so tool calls are written the Hermes
way (<tool_call>...</tool_call>).
"""

from __future__ import annotations

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
