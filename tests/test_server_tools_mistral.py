"""Tool calls in Mistral's format, served in process: the `openai` client over FastAPI's
TestClient, the tiny random llama under Mistral-Small-3.2-24B-Instruct-2506's published chat
template, its tokenizer given [TOOL_CALLS], [ARGS] and [CALL_ID] as special tokens (as
Mistral's tokenizers have them). A forced call is sampled as those tokens, the detokenizer keeps
them, the reply parses back, and the call goes back to the template as the next turn's history
(Mistral's templates take only 9-character call ids)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import checkpoints as ckpt

openai = pytest.importorskip("openai")

TEMPLATE = (
    Path(__file__).parent / "fixtures/chat_templates/mistral_small_3_2_24b_instruct_2506.jinja"
)
MARKERS = ["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather now in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 6}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
# A short system prompt: the template's default one is ~2,500 characters.
ASK = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
]
FORCED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    from fastapi.testclient import TestClient
    from transformers import PreTrainedTokenizerFast

    from mlxc.runtime.serving.engine import Engine
    from mlxc.runtime.serving.server import create_app

    path = ckpt.make_llama(
        tmp_path_factory.mktemp("mistral") / "llama",
        num_hidden_layers=2,
        max_position_embeddings=2048,
    )
    tok = PreTrainedTokenizerFast.from_pretrained(path)
    tok.add_special_tokens({"additional_special_tokens": MARKERS})
    tok.save_pretrained(path)
    engine = Engine.from_path(path, model_id="tiny", chat_template=TEMPLATE.read_text())
    assert engine.tool_format.name == "mistral" and set(engine.tool_markers) == set(MARKERS)
    app = create_app(engine, allowed_hosts=("testserver",))
    with TestClient(app) as http:
        yield openai.OpenAI(
            base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0
        )


def check_call(call_id, name, arguments):
    assert len(call_id) == 9 and call_id.isalnum()
    assert name == "get_weather"
    args = json.loads(arguments)
    assert set(args) == {"city"} and len(args["city"]) <= 6


def test_forced_call_in_mistral_format(client):
    r = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER], tool_choice=FORCED, max_tokens=48
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    check_call(call.id, call.function.name, call.function.arguments)

    deltas = []
    for chunk in client.chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER], tool_choice=FORCED, max_tokens=48, stream=True
    ):
        if chunk.choices:
            deltas += chunk.choices[0].delta.tool_calls or []
            assert not chunk.choices[0].delta.content
    (delta,) = deltas
    check_call(delta.id, delta.function.name, delta.function.arguments)

    follow = ASK + [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 21}'},
    ]
    r = client.chat.completions.create(model="tiny", messages=follow, tools=[WEATHER], max_tokens=4)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
