"""`mlxc serve` end to end: real server subprocesses on loopback, tiny checkpoints.

Per text architecture with a spec (one server each, `--max-kv-size 64 --prefill-chunk-size 32`):
the scaled-down lablup/mlxcel #421 crash scenario, equality with `mlxc generate`, and
byte-identical output with and without `--max-kv-size` when nothing is trimmed. On one llama
server without a bounded cache: the bad-input suite, 8 concurrent clients with a disconnect, the
`openai` client. And the built-in demo checkpoint behind a bare `mlxc serve`.

No timing assertions: waits have deadlines only so that a hung server fails instead of hanging.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent))
import checkpoints as ckpt

from mlxc.cli import main


def make_mistral4(path: Path, seed: int = 0) -> Path:
    """mistral4 (MLA with a latent cache, MoE, yarn, Llama-4 query scale) from test_mistral4,
    with the factory tokenizer (its vocab and special ids)."""
    from test_mistral4 import ROPE, make_checkpoint

    make_checkpoint(
        str(path),
        seed=seed,
        rope=dict(ROPE, factor=8.0, original_max_position_embeddings=64),
        vocab_size=ckpt.VOCAB_SIZE,
        max_position_embeddings=512,
        bos_token_id=ckpt.BOS_ID,
        eos_token_id=ckpt.EOS_ID,
        pad_token_id=ckpt.PAD_ID,
    )
    ckpt.write_tokenizer(path)
    return path


KEY = "sekrit-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def make_gemma3_text(path: Path, seed: int = 0) -> Path:
    from test_gemma3 import make_gemma3_text

    return make_gemma3_text(path, seed)


def make_qwen3_moe(path: Path, seed: int = 0) -> Path:
    from test_qwen3_moe import make_qwen3_moe

    return make_qwen3_moe(path, seed)


def make_ministral3(path: Path, seed: int = 0) -> Path:
    from test_ministral3 import make_ministral3

    return make_ministral3(path, seed)


ARCHS = {
    "llama": ckpt.make_llama,
    "gemma3_text": make_gemma3_text,
    "qwen3_moe": make_qwen3_moe,
    "ministral3": make_ministral3,
    "gpt_oss": ckpt.make_gpt_oss,
    "qwen2": ckpt.make_qwen2,
    "qwen3": ckpt.make_qwen3,
    "nemotron_nas": ckpt.make_nemotron_nas,
    "mistral4": make_mistral4,
    "nemotron_h": ckpt.make_nemotron_h,
    "jamba": ckpt.make_jamba,
    "granitemoehybrid": ckpt.make_granitemoehybrid,
    "deepseek_v3": lambda path: __import__("test_deepseek_v3").make_server_checkpoint(path),
    "glm4_moe_lite": lambda path: __import__("test_glm4_moe_lite").make_server_checkpoint(path),
    "deepseek_v2": lambda path: __import__("test_deepseek_v2").make_server_checkpoint(path),
    "minicpm3": lambda path: __import__("test_minicpm3").make_server_checkpoint(path),
}
SHORT = "hello world"  # 25 tokens under the chat template: one chunk, nothing trimmed
LONG = " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog." for i in range(12))
CUSTOM_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}[ASSISTANT] {% endif %}"
)


# --- harness ---------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`mlxc serve ARGS` in a subprocess on a free loopback port; ready once /health answers."""

    def __init__(self, args: list[str], log_dir: Path, env: dict | None = None) -> None:
        self.args = [str(a) for a in args]
        for _ in range(3):  # another process may take the port between probe and bind
            self.port = free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            self.log = log_dir / f"serve-{self.port}.log"
            with open(self.log, "wb") as out:
                self.proc = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "mlxc.cli",
                        "serve",
                        "--port",
                        str(self.port),
                        "--log-level",
                        "info",
                        *self.args,
                    ],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
                )
            if self._wait_ready():
                return
            if "address already in use" not in self.log_text().lower():
                break
        raise AssertionError(f"server did not start: {self.args}\n{self.log_text()}")

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return True
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.close()
        return False

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")[-5000:]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=120, **kw)

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=30).json()

    def wait_idle(self) -> dict:
        """/health once no sequence runs or waits and the pool is empty."""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            h = self.health()
            if h["running"] == 0 and h["waiting"] == 0 and h["pool"]["sequences"] == 0:
                return h
            time.sleep(0.05)
        raise AssertionError(f"server never went idle: {self.health()}")


def chat(client: httpx.Client, content: str, **body) -> httpx.Response:
    payload = {"messages": [{"role": "user", "content": content}], **body}
    return client.post("/v1/chat/completions", json=payload)


def sse_events(response: httpx.Response) -> list:
    """The JSON events of an SSE body, then the final "[DONE]" marker."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def stream_text(events: list) -> str:
    return "".join(
        (e["choices"][0]["delta"].get("content") or "")
        for e in events
        if isinstance(e, dict) and e.get("choices")
    )


def mlxc_generate(model_dir: Path, prompt: str, *flags) -> tuple[str, int]:
    """(text, generated token count) of `mlxc generate` (greedy)."""
    args = ["generate", "--model", str(model_dir), "--prompt", prompt, *map(str, flags)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert result.stdout.endswith("\n")
    count = re.search(r"generated: (\d+) tokens", result.stderr)
    return result.stdout[:-1], int(count.group(1))


# --- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("serve-ckpts")
    return {name: make(root / name) for name, make in ARCHS.items()}


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("serve-logs")


@pytest.fixture(scope="module", params=list(ARCHS))
def arch(request, checkpoints, logs):
    """(name, checkpoint, server with a bounded cache) for each architecture with a spec."""
    name = request.param
    server = Server(
        ["--model", checkpoints[name], "--max-kv-size", 64, "--prefill-chunk-size", 32], logs
    )
    yield name, checkpoints[name], server
    server.close()


@pytest.fixture(scope="module")
def api(checkpoints, logs, tmp_path_factory):
    """llama without a bounded cache; API key, custom chat template, small body limit (under
    uvicorn's 64 KiB read buffer, so an oversize body is read whole: a clean 413, no reset)."""
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(CUSTOM_TEMPLATE)
    server = Server(
        [
            "--model",
            checkpoints["llama"],
            "--api-key",
            KEY,
            "--chat-template",
            template,
            "--prefill-chunk-size",
            16,
            "--max-concurrency",
            4,
            "--max-body-bytes",
            16384,
            "--model-id",
            "tiny-llama",
        ],
        logs,
    )
    yield server
    server.close()


# --- every architecture ---------------------------------------------------------------------------


def test_crash_scenario_421(arch):
    """Prompt several times longer than --max-kv-size, prefilled in chunks that each trigger a
    trim, then a multi-token continuation: 200, all tokens, and the server keeps serving."""
    _, _, server = arch
    with server.client() as c:
        r = chat(c, LONG, max_tokens=24, ignore_eos=True)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["prompt_tokens"] > 4 * 64
        assert body["usage"]["completion_tokens"] == 24
        assert body["choices"][0]["finish_reason"] == "length"

        # The same through a stream, with usage in the last chunk.
        with c.stream(
            "POST",
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": LONG}],
                "max_tokens": 24,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        ) as s:
            assert s.status_code == 200
            events = sse_events(s)
        assert events[-1] == "[DONE]"
        assert events[-2]["usage"]["completion_tokens"] == 24
        assert stream_text(events) == body["choices"][0]["message"]["content"]

        # Still serving.
        assert chat(c, SHORT, max_tokens=4).status_code == 200
    h = server.wait_idle()
    assert h["status"] == "ok" and h["requests"]["failed"] == 0 and h["pool"]["bytes"] == 0


def test_greedy_matches_mlxc_generate_with_trims(arch):
    _, model_dir, server = arch
    want, n = mlxc_generate(
        model_dir, LONG, "--max-tokens", 16, "--max-kv-size", 64, "--prefill-chunk-size", 32
    )
    with server.client() as c:
        body = chat(c, LONG, max_tokens=16).json()
    assert body["choices"][0]["message"]["content"] == want
    assert body["usage"]["completion_tokens"] == n


def test_concurrent_requests_decode_batched_as_alone(arch):
    """Three prompts of different lengths at once (one long enough to be trimmed, and to run
    past any sliding window): they decode as rows of one batch, and each answer equals the one
    it gets alone."""
    _, _, server = arch
    prompts = [LONG, SHORT, " ".join(LONG.split()[:40])]
    with server.client() as c:
        # 32 tokens: the prompts' prefixes hit the prefix cache the second time, so their
        # prefills are short and fewer decode steps might never overlap.
        alone = [chat(c, p, max_tokens=32, ignore_eos=True).json() for p in prompts]
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            together = list(pool.map(lambda p: chat(c, p, max_tokens=32, ignore_eos=True), prompts))
    for a, t in zip(alone, together):
        assert t.status_code == 200, t.text
        assert t.json()["choices"][0]["message"]["content"] == a["choices"][0]["message"]["content"]
    health = server.wait_idle()
    assert health["requests"]["failed"] == 0
    assert health["pool"]["peak_batched"] >= 2  # the rows did decode together


@pytest.mark.parametrize("drafter", ["--prompt-lookup", "--draft-model"])
def test_speculation_serves_the_plain_greedy_text(checkpoints, logs, drafter):
    """`mlxc serve --prompt-lookup` or `--draft-model` (here the model itself, from its own
    directory): a request speculates in the decode batch (the metrics count its verifications)
    and its answer is `mlxc generate`'s greedy text; two at once answer as alone. (Which steps
    of two concurrent rows speculate depends on when each arrives; that the rows of one batch
    speculate together is tests/test_batch_speculation.py's.)"""
    path = checkpoints["llama"]
    flags = [drafter] if drafter == "--prompt-lookup" else [drafter, path]
    server = Server(["--model", path, *flags, "--num-draft-tokens", 4], logs)
    try:
        prompts = [LONG, SHORT + " " + SHORT]
        wants = [mlxc_generate(path, p, "--max-tokens", 24)[0] for p in prompts]
        with server.client() as c:
            alone = chat(c, LONG, max_tokens=24).json()["choices"][0]["message"]["content"]
            spec = server.wait_idle()["speculation"]
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                got = list(pool.map(lambda p: chat(c, p, max_tokens=24), prompts))
            scrape = c.get("/metrics").text
        assert alone == wants[0]
        assert spec["steps"] > 0 and spec["proposed"] > 0
        assert [g.json()["choices"][0]["message"]["content"] for g in got] == wants
        spec = server.wait_idle()["speculation"]
        assert f"mlxc_spec_decode_steps_total {float(spec['steps'])}" in scrape
    finally:
        server.close()


def test_no_trim_is_byte_identical_without_max_kv_size(arch, api):
    """25 prompt + 30 generated tokens stay under --max-kv-size 64: nothing is trimmed, and the
    output is byte-identical to generation with no bound at all."""
    name, model_dir, server = arch
    want, n = mlxc_generate(model_dir, SHORT, "--max-tokens", 30)  # no --max-kv-size
    with server.client() as c:
        body = chat(c, SHORT, max_tokens=30).json()
    assert body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"] <= 64
    assert body["choices"][0]["message"]["content"].encode() == want.encode()
    assert body["usage"]["completion_tokens"] == n
    if name == "llama":
        # Server against server: the unbounded one serves the same checkpoint (its custom
        # template is the same prompt in a different dress: use raw completions).
        with server.client() as a, api.client(headers=AUTH) as b:
            bounded = a.post("/v1/completions", json={"prompt": SHORT * 2, "max_tokens": 30})
            free = b.post("/v1/completions", json={"prompt": SHORT * 2, "max_tokens": 30})
        assert bounded.json()["usage"]["prompt_tokens"] <= 16  # one prefill chunk in both
        assert (
            bounded.json()["choices"][0]["text"].encode()
            == free.json()["choices"][0]["text"].encode()
        )


# --- bad input ------------------------------------------------------------------------------------


def raw_http(server: Server, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as s:
        s.sendall(request)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def user(content, **extra) -> dict:
    return {"messages": [{"role": "user", "content": content}], **extra}


NO_KEY, WRONG_KEY = {}, {"Authorization": "Bearer nope"}
IMAGE_MESSAGE = [
    {"type": "text", "text": "what is this?"},
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
]
BAD_REQUESTS = [
    # (name, JSON body (bytes: sent as is), expected status, words in the message, headers)
    ("no key", user("hi"), 401, "api key", NO_KEY),
    ("wrong key", user("hi"), 401, "api key", WRONG_KEY),
    ("invalid json", b'{"messages": [', 400, "not valid json", AUTH),
    ("not an object", [1, 2], 400, "json object", AUTH),
    ("missing messages", {"max_tokens": 3}, 400, "messages", AUTH),
    ("messages not a list", {"messages": "hi"}, 400, "messages", AUTH),
    ("empty messages", {"messages": []}, 400, "at least one", AUTH),
    ("unknown role", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "role", AUTH),
    ("max_tokens as string", user("hi", max_tokens="5"), 400, "max_tokens", AUTH),
    ("negative temperature", user("hi", temperature=-1), 400, "temperature", AUTH),
    ("top_p zero", user("hi", top_p=0), 400, "top_p", AUTH),
    ("n=2", user("hi", n=2), 400, "n=2", AUTH),
    ("unknown model", user("hi", model="gpt-9"), 404, "does not exist", AUTH),
    ("image to a text model", user(IMAGE_MESSAGE), 400, "takes no images", AUTH),
    ("prompt longer than the context", user(LONG * 3), 400, "context", AUTH),
    ("max_tokens past the context", user("hi", max_tokens=600), 400, "context", AUTH),
    ("oversize body", user("x" * 20000), 413, "limit", AUTH),
    ("max_tokens over the limit", user("hi", max_tokens=40000), 400, "--max-tokens-limit", AUTH),
    ("seed past int64", user("hi", seed=2**63, temperature=1), 400, "seed", AUTH),
    ("seed before int64", user("hi", seed=-(2**63) - 1, temperature=1), 400, "seed", AUTH),
    (
        "lone surrogate",
        b'{"messages": [{"role": "user", "content": "a\\ud800"}]}',
        400,
        "surrogate",
        AUTH,
    ),
    (
        "nested 5k deep (under the body limit)",
        b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}",
        400,
        "nested too deeply",
        AUTH,
    ),
]


@pytest.mark.parametrize(
    "name, payload, status, words, headers", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS]
)
def test_bad_input_is_rejected_and_changes_nothing(api, name, payload, status, words, headers):
    before = api.health()
    if isinstance(payload, bytes):
        kwargs = {"content": payload, "headers": {**headers, "content-type": "application/json"}}
    else:
        kwargs = {"json": payload, "headers": headers}
    with api.client() as c:
        r = c.post("/v1/chat/completions", **kwargs)
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert words.lower() in error["message"].lower()
        after = api.health()
        assert after["requests"] == before["requests"]
        assert after["waiting"] == 0 and after["pool"]["sequences"] == 0
        # ... and the next good request is served.
        good = c.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
            headers=AUTH,
        )
        assert good.status_code == 200, good.text


def test_bad_completions_input(api):
    with api.client(headers=AUTH) as c:
        cases = [
            ({"prompt": ["a", "b"]}, 400, "one prompt"),
            ({"prompt": [1, 2, 100000]}, 400, "out of range"),
            ({"prompt": list(range(3, 303)) * 2}, 400, "context"),
            ({"prompt": 5}, 400, "prompt"),
            ({"prompt": "hi", "echo": True}, 400, "echo"),
            (b'{"prompt": "a\\ud800b"}', 400, "surrogate"),  # JSON may spell one; not text
            ({"prompt": "hi", "seed": 2**64, "temperature": 1.0}, 400, "seed"),
        ]
        for body, status, words in cases:
            if isinstance(body, bytes):
                headers = {"content-type": "application/json"}
                r = c.post("/v1/completions", content=body, headers=headers)
            else:
                r = c.post("/v1/completions", json=body)
            assert r.status_code == status, (body, r.text)
            assert words in r.json()["error"]["message"]
        ok = c.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2})
        assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] == 3
        # Any int64 seeds a sampler (a negative one was a 500); the same seed, the same text.
        seeded = {"prompt": "hi", "max_tokens": 4, "temperature": 1.0, "seed": -(2**63)}
        first, again = (c.post("/v1/completions", json=seeded) for _ in range(2))
        assert first.status_code == 200, first.text
        assert first.json()["choices"][0]["text"] == again.json()["choices"][0]["text"]


def test_body_over_the_limit_is_refused_before_it_is_read(api):
    # Declares 1 GB and sends none of it: the answer comes from the header alone.
    reply = raw_http(
        api,
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
        + KEY.encode()
        + b"\r\nContent-Type: application/json\r\nContent-Length: 1000000000\r\n"
        + b"Connection: close\r\n\r\n",
    )
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert b'"error"' in reply
    with api.client(headers=AUTH) as c:
        assert c.get("/v1/models").status_code == 200


def test_unknown_route_and_method_are_openai_shaped(api):
    with api.client(headers=AUTH) as c:
        r = c.get("/v1/nothing")
        assert r.status_code == 404 and "error" in r.json()
        r = c.get("/v1/chat/completions")
        assert r.status_code == 405 and "error" in r.json()


# --- the API --------------------------------------------------------------------------------------


def test_models_health_and_chat_template(api):
    with api.client(headers=AUTH) as c:
        models = c.get("/v1/models").json()
        assert models["object"] == "list"
        assert [m["id"] for m in models["data"]] == ["tiny-llama"]
        assert c.get("/v1/models/tiny-llama").json()["id"] == "tiny-llama"
        assert c.get("/v1/models/other").status_code == 404
        body = chat(c, SHORT, max_tokens=2, model="tiny-llama").json()
    assert body["model"] == "tiny-llama" and body["object"] == "chat.completion"
    # --chat-template replaced the tokenizer's template.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(api.args[1]))
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": SHORT}],
        chat_template=CUSTOM_TEMPLATE,
        add_generation_prompt=True,
        tokenize=False,
    )
    assert rendered.startswith("<s>[USER] hello world")
    assert body["usage"]["prompt_tokens"] == len(tok.encode(rendered, add_special_tokens=False))
    h = api.health()
    assert h["status"] == "ok" and h["model"] == "tiny-llama"
    assert h["pool"]["max_kv_size"] is None


def test_stop_and_seeded_sampling(api):
    with api.client(headers=AUTH) as c:
        free = chat(c, SHORT, max_tokens=40, ignore_eos=True).json()
        text = free["choices"][0]["message"]["content"]
        stop = text[8:11]
        stopped = chat(c, SHORT, max_tokens=40, ignore_eos=True, stop=[stop]).json()
        assert stopped["choices"][0]["message"]["content"] == text[: text.index(stop)]
        assert stopped["choices"][0]["finish_reason"] == "stop"

        sampled = [
            chat(c, SHORT, max_tokens=20, temperature=1.0, top_p=0.9, top_k=50, seed=s).json()
            for s in (1, 1, 2)
        ]
        texts = [s["choices"][0]["message"]["content"] for s in sampled]
        assert texts[0] == texts[1]  # the seed fixes the draws


def test_eight_concurrent_clients_one_disconnecting(api):
    """Mixed long/short prompts, streams and not; one stream is dropped mid-way. Everyone
    else gets exactly what they get alone, and the pool returns to empty."""
    jobs = [
        (LONG, 12, False),
        (LONG[:400], 20, True),
        (SHORT, 25, False),
        ("tell me", 30, True),
        (LONG[200:], 8, True),
        ("why?", 15, False),
        (LONG[:300], 10, False),
    ]

    def run(client: httpx.Client, content: str, n: int, stream: bool) -> str:
        if not stream:
            r = chat(client, content, max_tokens=n, ignore_eos=True)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["message"]["content"]
        body = {
            "messages": [{"role": "user", "content": content}],
            "max_tokens": n,
            "ignore_eos": True,
            "stream": True,
        }
        with client.stream("POST", "/v1/chat/completions", json=body) as s:
            assert s.status_code == 200
            events = sse_events(s)
        assert events[-1] == "[DONE]"
        return stream_text(events)

    with api.client(headers=AUTH) as c:
        alone = [run(c, *job) for job in jobs]
    cancelled_before = api.health()["requests"]["cancelled"]

    start = threading.Barrier(len(jobs) + 1)
    got_chunks = threading.Event()

    def job(i):
        with api.client(headers=AUTH) as c:
            start.wait()
            return run(c, *jobs[i])

    def leaver():
        body = {
            "messages": [{"role": "user", "content": "go on"}],
            "max_tokens": 450,
            "ignore_eos": True,
            "stream": True,
        }
        with api.client(headers=AUTH) as c:
            start.wait()
            with c.stream("POST", "/v1/chat/completions", json=body) as s:
                seen = 0
                for line in s.iter_lines():
                    if line.startswith("data: "):
                        seen += 1
                    if seen == 4:
                        got_chunks.set()
                        break  # leaving the block closes the connection mid-stream

    with concurrent.futures.ThreadPoolExecutor(len(jobs) + 1) as pool:
        futures = [pool.submit(job, i) for i in range(len(jobs))]
        left = pool.submit(leaver)
        results = [f.result(timeout=300) for f in futures]
        left.result(timeout=300)
    assert got_chunks.is_set()
    assert results == alone
    h = api.wait_idle()
    assert h["pool"]["bytes"] == 0
    assert h["requests"]["cancelled"] == cancelled_before + 1
    assert h["requests"]["failed"] == 0


def test_openai_client_streams_a_chat_completion(api):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=api.url + "/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list()] == ["tiny-llama"]
    whole = client.chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": SHORT}], max_tokens=20
    )
    stream = client.chat.completions.create(
        model="tiny-llama",
        messages=[{"role": "user", "content": SHORT}],
        max_tokens=20,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts, usage, finish = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(parts) == whole.choices[0].message.content
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert finish == whole.choices[0].finish_reason
    text = client.completions.create(model="tiny-llama", prompt="hello", max_tokens=5)
    assert text.usage.completion_tokens <= 5 and text.object == "text_completion"
    streamed = client.completions.create(
        model="tiny-llama", prompt="hello", max_tokens=5, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == text.choices[0].text
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=api.url + "/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny-llama", messages=[], max_tokens=2)


# --- the built-in demo ----------------------------------------------------------------------------


def test_bare_serve_runs_the_demo_checkpoint(tmp_path, logs):
    server = Server([], logs, env={"MLXC_HOME": str(tmp_path)})
    try:
        assert (tmp_path / "demo-v1" / "config.json").is_file()
        assert "RANDOM" in server.log_text()
        with server.client() as c:
            card = c.get("/v1/models").json()["data"][0]
            assert card["id"] == "mlxc-demo" and "RANDOM weights" in card["description"]
            r = chat(c, "Say something.", max_tokens=8, ignore_eos=True)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    finally:
        server.close()


def test_demo_checkpoint_is_deterministic(tmp_path):
    from mlxc.runtime.checkpoint import demo

    a = demo.ensure_demo(tmp_path / "a" / "demo-v1")
    b = demo.ensure_demo(tmp_path / "b" / "demo-v1")
    assert demo.ensure_demo(a) == a  # made once, then reused
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    assert "model.safetensors" in names and "tokenizer.json" in names
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert not [p for p in a.parent.iterdir() if p.name.startswith(".")]  # no temp dirs left
