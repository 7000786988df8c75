"""`mlxc serve`'s OpenAI request fields end to end (one tiny llama server for the module):
sampling controls (min_p, penalties, logit_bias), logprobs in chat and legacy completions
(streamed too, through the `openai` client), 400 on fields that would change the output and are
not supported, the harmless ones ignored, chat template kwargs (`--chat-template-args` and
`chat_template_kwargs`), `--reasoning-parser`, and `GET /metrics`.

The server's chat template is a thinking one shaped like Qwen3's: with `enable_thinking` the
generation prompt ends inside `<think>`, without it the think block is closed in the prompt.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import checkpoints as ckpt
from test_server import Server, chat, sse_events

from mlxc.runtime.serving.reasoning import ReasoningSplitter, starts_in_reasoning

THINKING_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)
PROMPT = "hello world"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("server-api")
    model = ckpt.make_llama(root / "llama")
    template = root / "thinking.jinja"
    template.write_text(THINKING_TEMPLATE)
    logs = root / "logs"
    logs.mkdir()
    s = Server(
        [
            "--model",
            model,
            "--chat-template",
            template,
            "--chat-template-args",
            json.dumps({"enable_thinking": False}),
            "--reasoning-parser",
            "qwen3",
            "--max-concurrency",
            4,
            "--model-id",
            "tiny",
        ],
        logs,
    )
    yield s
    s.close()


@pytest.fixture(scope="module")
def tokenizer(server):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(server.args[1]))


def content(reply) -> str:
    return reply.json()["choices"][0]["message"]["content"]


# --- sampling controls ------------------------------------------------------------------------


def test_logit_bias_and_min_p(server, tokenizer):
    (a,) = tokenizer.encode("a", add_special_tokens=False)
    with server.client() as c:
        forced = chat(c, PROMPT, max_tokens=6, ignore_eos=True, logit_bias={str(a): 100})
        assert forced.status_code == 200, forced.text
        assert content(forced) == "a" * 6
        # min_p 1 keeps only the most likely token: a seeded draw is then the greedy text.
        greedy = content(chat(c, PROMPT, max_tokens=12, ignore_eos=True))
        drawn = chat(c, PROMPT, max_tokens=12, ignore_eos=True, temperature=1.5, seed=3, min_p=1.0)
        assert content(drawn) == greedy
        loose = chat(c, PROMPT, max_tokens=12, ignore_eos=True, temperature=1.5, seed=3)
        assert content(loose) != greedy


def test_presence_and_frequency_penalties_follow_openai_formula(server, tokenizer):
    """Greedy with penalties: each step's token is the argmax of the model's logprobs minus
    the penalties of what came before (checked on the 20 most likely tokens). The ids past the
    tokenizer's (the model's vocab is padded) have no text: a logit bias rules them out."""
    banned = {str(i): -100 for i in range(len(tokenizer), ckpt.VOCAB_SIZE)}
    with server.client() as c:
        plain = chat(c, PROMPT, max_tokens=16, ignore_eos=True).json()
        body = chat(
            c,
            PROMPT,
            max_tokens=16,
            ignore_eos=True,
            presence_penalty=1.5,
            frequency_penalty=1.0,
            logprobs=True,
            top_logprobs=20,
            logit_bias=banned,
        ).json()
    steps = body["choices"][0]["logprobs"]["content"]
    assert len(steps) == 16
    counts: Counter = Counter()
    for step in steps:
        top = {t["token"]: t["logprob"] for t in step["top_logprobs"]}
        score = {
            t: lp - 1.0 * counts[t] - 1.5 * (counts[t] > 0) - 100 * (t == "")
            for t, lp in top.items()
        }
        assert step["token"] == max(score, key=score.get)
        counts[step["token"]] += 1
    assert body["choices"][0]["message"]["content"] != plain["choices"][0]["message"]["content"]


def test_repetition_penalty_changes_greedy_output_deterministically(server):
    with server.client() as c:
        plain = content(chat(c, PROMPT, max_tokens=16, ignore_eos=True))
        a, b = (
            content(chat(c, PROMPT, max_tokens=16, ignore_eos=True, repetition_penalty=1.8))
            for _ in range(2)
        )
    assert a == b and a != plain


BAD = [
    ({"min_p": 1.5}, "min_p"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"100000": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),  # needs logprobs: true
    ({"logprobs": 1}, "logprobs"),  # chat takes a bool
]


@pytest.mark.parametrize("fields, param", BAD, ids=[json.dumps(b[0]) for b in BAD])
def test_bad_sampling_values_are_400(server, fields, param):
    with server.client() as c:
        r = chat(c, PROMPT, max_tokens=2, **fields)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


# --- logprobs ---------------------------------------------------------------------------------


def test_chat_logprobs_with_the_openai_client(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    args = {
        "model": "tiny",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 10,
        "logprobs": True,
        "top_logprobs": 4,
        "extra_body": {"ignore_eos": True},
    }
    whole = client.chat.completions.create(**args)
    entries = whole.choices[0].logprobs.content
    assert len(entries) == whole.usage.completion_tokens == 10
    for e in entries:
        assert len(e.top_logprobs) == 4
        values = [t.logprob for t in e.top_logprobs]
        assert values == sorted(values, reverse=True) and values[0] <= 0
        # Greedy: the chosen token is the most likely one.
        assert (e.token, e.logprob) == (e.top_logprobs[0].token, values[0])
        if not e.token.startswith("bytes:"):  # part of a character: its bytes alone
            assert e.bytes == list(e.token.encode("utf-8"))
    streamed = []
    for chunk in client.chat.completions.create(**args, stream=True):
        for choice in chunk.choices:
            if choice.logprobs is not None:
                streamed += choice.logprobs.content
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]
    plain = client.chat.completions.create(**{**args, "logprobs": None, "top_logprobs": None})
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == whole.choices[0].message.content


def test_completions_legacy_logprobs(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    args = {
        "model": "tiny",
        "prompt": "hello",
        "max_tokens": 8,
        "logprobs": 2,
        "extra_body": {"ignore_eos": True},
    }
    whole = client.completions.create(**args)
    lp = whole.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 2 and top[token] == value == max(top.values())
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert lp.text_offset[-1] <= len(whole.choices[0].text)
    tokens, offsets = [], []
    for chunk in client.completions.create(**args, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            tokens += chunk.choices[0].logprobs.tokens
            offsets += chunk.choices[0].logprobs.text_offset
    assert (tokens, offsets) == (lp.tokens, lp.text_offset)


# --- nothing silently ignored ------------------------------------------------------------------


REFUSED = [
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    ("tool_choice", "required"),
    ("response_format", {"type": "json_object"}),
    ("n", 2),
    ("audio", {"voice": "alloy", "format": "wav"}),
    ("prediction", {"type": "content", "content": "x"}),
    ("modalities", ["text", "audio"]),
    ("guided_json", {"type": "object"}),
    ("frobnicate", 1),  # unknown: refused, not dropped
]


# Chat makes these (tool calls, structured output: tests/test_server_tools.py); completions
# refuse them.
CHAT_ONLY = {"tools", "tool_choice", "response_format"}


@pytest.mark.parametrize("name, value", REFUSED, ids=[r[0] for r in REFUSED])
def test_unsupported_fields_are_400_naming_them(server, name, value):
    before = server.health()["requests"]
    with server.client() as c:
        if name not in CHAT_ONLY:
            r = chat(c, PROMPT, max_tokens=2, **{name: value})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == name and name in error["message"]
        t = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, name: value})
        assert t.status_code == 400 and t.json()["error"]["param"] == name
    assert server.health()["requests"] == before


def test_harmless_fields_are_ignored(server):
    harmless = {
        "user": "u-1",
        "metadata": {"k": "v"},
        "store": False,
        "service_tier": "auto",
        "parallel_tool_calls": True,
        "safety_identifier": "x",
        "n": 1,
        "tools": [],
        "tool_choice": "none",
        "response_format": {"type": "text"},
        "modalities": ["text"],
        "stream_options": {"include_usage": False},
    }
    with server.client() as c:
        plain = content(chat(c, PROMPT, max_tokens=8))
        r = chat(c, PROMPT, max_tokens=8, **harmless)
        assert r.status_code == 200, r.text
        assert content(r) == plain
        t = c.post(
            "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "user": "u", "echo": False}
        )
        assert t.status_code == 200, t.text


# --- chat template kwargs and the reasoning parser ---------------------------------------------


def test_template_kwargs_and_reasoning_content(server, tokenizer):
    with server.client() as c:
        # The server default (--chat-template-args) closes the think block: all content.
        off = chat(c, PROMPT, max_tokens=12, ignore_eos=True).json()
        message = off["choices"][0]["message"]
        assert message["reasoning_content"] is None and message["content"]
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": PROMPT}],
            add_generation_prompt=True,
            tokenize=False,
            chat_template=THINKING_TEMPLATE,
            enable_thinking=False,
        )
        assert off["usage"]["prompt_tokens"] == len(
            tokenizer.encode(rendered, add_special_tokens=False)
        )
        # The request's chat_template_kwargs win: the prompt opens <think>, the reply is reasoning
        # (no </think> from a random model within 12 tokens).
        on = chat(
            c,
            PROMPT,
            max_tokens=12,
            ignore_eos=True,
            chat_template_kwargs={"enable_thinking": True},
        )
        on = on.json()
        assert on["usage"]["prompt_tokens"] != off["usage"]["prompt_tokens"]
        reasoning = on["choices"][0]["message"]["reasoning_content"]
        assert reasoning and on["choices"][0]["message"]["content"] == ""
        stream = c.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": PROMPT}],
                "max_tokens": 12,
                "ignore_eos": True,
                "chat_template_kwargs": {"enable_thinking": True},
                "stream": True,
            },
        )
        deltas = [
            e["choices"][0]["delta"]
            for e in sse_events(stream)
            if isinstance(e, dict) and e["choices"]
        ]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == reasoning.lstrip()
    assert not "".join(d.get("content") or "" for d in deltas)


def test_reasoning_splitter_whole_and_streamed():
    text = "<think>\nfirst, 2+2</think>\n\nIt is 4. <think> stays"
    for in_reasoning in (False, True):
        assert ReasoningSplitter(in_reasoning).split(text) == (
            "first, 2+2",
            "It is 4. <think> stays",
        )
        for size in (1, 2, 3, 5):
            s, parts = ReasoningSplitter(in_reasoning), {"reasoning": "", "content": ""}
            for i in range(0, len(text), size):
                for kind, piece in s.feed(text[i : i + size]):
                    parts[kind] += piece
            for kind, piece in s.flush():
                parts[kind] += piece
            assert (parts["reasoning"], parts["content"]) == (
                "first, 2+2",
                "It is 4. <think> stays",
            )
    assert ReasoningSplitter(True).split("cut short") == ("cut short", "")
    assert ReasoningSplitter(False).split("plain") == ("", "plain")
    assert ReasoningSplitter(True).split("reason</think>") == ("reason", "")
    assert starts_in_reasoning("deepseek_r1", "anything")
    assert starts_in_reasoning("qwen3", "<|assistant|><think>\n")
    assert not starts_in_reasoning("qwen3", "<think>\n\n</think>\n\n")


# --- metrics ------------------------------------------------------------------------------------


def scrape(server) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    with server.client() as c:
        r = c.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def test_metrics(server):
    server.wait_idle()
    before = scrape(server)
    runs = [5, 7]
    with server.client() as c:
        usages = [chat(c, PROMPT, max_tokens=n, ignore_eos=True).json()["usage"] for n in runs]
        chat(c, PROMPT, max_tokens=3, ignore_eos=True, stream=True)
        assert chat(c, PROMPT, n=3).status_code == 400
    server.wait_idle()
    after = scrape(server)

    def grew(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    assert grew("mlxc_requests_total", endpoint="chat", status="200") == 3
    assert grew("mlxc_requests_total", endpoint="chat", status="400") == 1
    assert grew("mlxc_prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages) * 3 / 2
    assert grew("mlxc_generation_tokens_total") == sum(runs) + 3
    assert grew("mlxc_request_finished_total", reason="length") == 3
    assert grew("mlxc_time_to_first_token_seconds_count") == 3
    assert grew("mlxc_inter_token_latency_seconds_count") == sum(n - 1 for n in runs) + 2
    assert grew("mlxc_request_latency_seconds_count") == 3
    for gauge in ("mlxc_queue_depth", "mlxc_running_sequences", "mlxc_kv_cache_bytes"):
        assert after[(gauge, ())] == 0
    assert ("mlxc_prefix_cache_hits_total", ()) in after
