"""The server under injected faults, in process (uvicorn in a thread, real HTTP on loopback):
an MLX exception in one request's forward, a full queue, a scheduler that is gone.

The toy model is wrapped so a test can make a forward raise, or hold the scheduler inside a
forward until it says so; that is what a subprocess cannot offer.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import httpx
import mlx.core as mx
import pytest
import uvicorn

sys.path.insert(0, str(Path(__file__).parent))
import _toy_model as toy

from mlxc.runtime.checkpoint.tokenizer import load_tokenizer
from mlxc.runtime.serving.server import Engine, create_app

POISON = "\x07"  # byte 7: a prompt holding it fails inside the forward


class Controlled:
    """The toy model, with a poison byte that raises an MLX error mid-forward and a gate that
    holds the forward (on the scheduler thread) until the test opens it."""

    def __init__(self, model):
        self.model = model
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    def __call__(self, ids, cache=None, **kwargs):
        self.entered.set()
        self.gate.wait()
        if 7 in ids.tolist()[0]:
            return mx.zeros((1, 4, 8)) + mx.zeros((1, 6, 8))  # ValueError: broadcast_shapes
        return self.model(ids, cache=cache, **kwargs)

    def make_cache(self):
        return self.model.make_cache()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tmp_path_factory.mktemp("toy-tok")
    toy.write_tokenizer(path)
    model = toy.random_model()
    controlled = Controlled(model)
    engine = Engine(
        controlled,
        load_tokenizer(path),
        model_id="toy",
        eos_token_ids={257},
        context_length=1024,
        vocab_size=260,
        max_concurrency=1,
        max_queue=1,
    )
    app = create_app(engine, default_max_tokens=8)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}", controlled, engine
    controlled.gate.set()
    server.should_exit = True
    thread.join(30)


def completion(url: str, prompt: str, **body) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"prompt": prompt, **body}, timeout=60)


def test_a_failing_forward_is_a_500_and_the_server_keeps_serving(served):
    url, _, engine = served
    r = completion(url, "abc" + POISON + "def")
    assert r.status_code == 500
    error = r.json()["error"]
    assert error["type"] == "server_error" and "broadcast" in error["message"]

    r = completion(url, "abc" + POISON, stream=True)
    assert r.status_code == 200  # the status left before the failure
    lines = [ln[len("data: ") :] for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    assert "broadcast" in json.loads(lines[-2])["error"]["message"]

    ok = completion(url, "hello", max_tokens=5, ignore_eos=True)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 5
    # The scheduler publishes its stats after each tick: the reply can come first.
    deadline = time.monotonic() + 30
    while engine.scheduler.stats()["pool"]["sequences"] and time.monotonic() < deadline:
        time.sleep(0.02)
    stats = engine.scheduler.stats()
    assert stats["requests"]["failed"] == 2 and stats["pool"]["sequences"] == 0


def test_past_max_queue_the_answer_is_429_at_once(served):
    url, controlled, engine = served
    controlled.gate.clear()
    controlled.entered.clear()
    results = {}

    def run(name):
        results[name] = completion(url, "hello", max_tokens=3, ignore_eos=True)

    first = threading.Thread(target=run, args=("first",))
    first.start()
    assert controlled.entered.wait(60)  # the first holds the only slot (--max-concurrency 1)
    second = threading.Thread(target=run, args=("second",))
    second.start()
    deadline = time.monotonic() + 60
    while engine.scheduler.stats()["waiting"] != 1:  # the second fills the queue (--max-queue 1)
        assert time.monotonic() < deadline
        time.sleep(0.02)

    r = completion(url, "hello")
    assert r.status_code == 429
    assert r.json()["error"]["code"] == "queue_full"

    controlled.gate.set()
    first.join(60)
    second.join(60)
    assert results["first"].status_code == 200 and results["second"].status_code == 200
    assert results["second"].json()["usage"]["completion_tokens"] == 3


def test_health_reports_a_dead_scheduler(tmp_path):
    path = tmp_path / "tok"
    toy.write_tokenizer(path)

    def broken_load():
        raise RuntimeError("no weights here")

    engine = Engine(None, load_tokenizer(path), model_id="x", load=broken_load)
    with pytest.raises(RuntimeError, match="no weights"):
        engine.start()
    from fastapi.testclient import TestClient

    app = create_app(engine)
    with TestClient(app, base_url="http://127.0.0.1", raise_server_exceptions=False) as client:
        r = client.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "error"
        r = client.post("/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 503 and "error" in r.json()


def test_a_client_leaving_a_plain_request_frees_its_slot(served):
    """No stream: the handler notices the disconnect while it waits, and cancels."""
    url, controlled, engine = served
    before = engine.scheduler.stats()["requests"]["cancelled"]
    completed_before = engine.scheduler.stats()["requests"]["completed"]
    controlled.gate.clear()
    controlled.entered.clear()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            url + "/v1/completions",
            json={"prompt": "hello", "max_tokens": 900, "ignore_eos": True},
            timeout=httpx.Timeout(60, read=0.5),  # gives up while the forward is held
        )
    assert controlled.entered.wait(60)
    # The scheduler is held inside the forward: wait for the server to flag the request, then
    # let it go; the next tick drops it instead of generating 900 tokens.
    deadline = time.monotonic() + 60
    while not any(s.request.cancelled for s in list(engine.scheduler._running)):
        assert time.monotonic() < deadline, "the disconnect was never noticed"
        time.sleep(0.05)
    controlled.gate.set()
    while engine.scheduler.stats()["requests"]["cancelled"] == before:
        assert time.monotonic() < deadline, "the request was never cancelled"
        time.sleep(0.05)
    while engine.scheduler.stats()["pool"]["sequences"]:  # published after the tick
        assert time.monotonic() < deadline
        time.sleep(0.05)
    stats = engine.scheduler.stats()
    assert stats["requests"]["cancelled"] == before + 1
    assert stats["requests"]["completed"] == completed_before  # it did not run to the end
