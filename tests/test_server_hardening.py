"""`mlxc serve` against the review's probes, end to end (real server subprocesses on loopback):
clients that leave while tokens flow, unbounded `max_tokens`, a long prompt's preprocessing
beside running streams, cross-origin and DNS-rebinding requests, Ctrl-C during a stream, and
the start-up order (port first, then the model; a failed load exits 1).

No timing assertions: waits have deadlines only so that a hung server fails instead of hanging.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
import checkpoints as ckpt
from test_server import Server, free_port

LEAVE_DEADLINE = 30  # seconds for a departed client's request to be gone (it was never, before)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return ckpt.make_llama(tmp_path_factory.mktemp("hardening") / "llama")


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hardening-logs")


@pytest.fixture(scope="module")
def bounded(llama, logs):
    """A sliding window: the context no longer bounds a request's length."""
    server = Server(
        [
            "--model",
            llama,
            "--max-kv-size",
            64,
            "--max-tokens-limit",
            50000,
            "--allowed-hosts",
            "models.internal",
            "--allowed-origins",
            "http://localhost:3000",
        ],
        logs,
    )
    yield server
    server.close()


def wait_for(server: Server, done, what: str, deadline: float = LEAVE_DEADLINE) -> dict:
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        health = server.health()
        if done(health):
            return health
        time.sleep(0.02)
    raise AssertionError(f"{what}: never happened; /health says {server.health()}")


def post_raw(server: Server, path: str, body: dict) -> socket.socket:
    """Send a request on a raw socket and return it unread (the test hangs up on it)."""
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    s.sendall(
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return s


# --- 1. a client that leaves, max_tokens bounded ------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_client_leaving_while_tokens_flow_frees_its_slot(bounded, stream):
    """30000 tokens under a sliding window would run for minutes for nobody: the request ends
    once its client hangs up, while its tokens are flowing (the old 1 s idle poll never ran)."""
    before = bounded.wait_idle()["requests"]
    body = {"prompt": "hello", "max_tokens": 30000, "ignore_eos": True, "stream": stream}
    s = post_raw(bounded, "/v1/completions", body)
    wait_for(bounded, lambda h: h["pool"]["batched"] == 1, "the request decoding in the batch")
    s.close()
    after = wait_for(bounded, lambda h: h["running"] == 0, "the request cancelled")["requests"]
    assert after["cancelled"] == before["cancelled"] + 1
    assert after["completed"] == before["completed"]


def test_max_tokens_is_bounded_by_the_limit(bounded):
    with bounded.client() as c:
        for path, body in (
            ("/v1/completions", {"prompt": "hi", "max_tokens": 50001}),
            (
                "/v1/chat/completions",
                {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10**12},
            ),
        ):
            r = c.post(path, json=body)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == "max_tokens" and "--max-tokens-limit" in error["message"]
        ok = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


def test_the_default_max_tokens_must_fit_the_limit(llama):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlxc.cli",
            "serve",
            "--model",
            str(llama),
            "--port",
            str(free_port()),
            "--max-tokens",
            "600",
            "--max-tokens-limit",
            "500",
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: Invalid value for '--max-tokens': must be at most --max-tokens-limit (500)"
    ]


# --- 3. preprocessing runs beside the event loop ---------------------------------------------------


def test_a_long_prompt_does_not_stall_health_or_running_streams(llama, logs):
    """A 2 MB prompt takes seconds to tokenize. Meanwhile /health answers (and shows it
    preparing) and a running stream keeps receiving tokens; then it gets its 400."""
    server = Server(["--model", llama, "--max-body-bytes", 8 * 2**20], logs)
    try:
        received: list[str] = []

        def read_stream() -> None:
            body = {"prompt": "hi", "max_tokens": 400, "ignore_eos": True, "stream": True}
            with server.client() as c, c.stream("POST", "/v1/completions", json=body) as r:
                received.extend(r.iter_lines())

        streaming = threading.Thread(target=read_stream)
        streaming.start()
        wait_for(server, lambda h: h["pool"]["batched"] == 1, "the stream decoding")
        answers = []
        long_prompt = "the quick brown fox jumps over the lazy dog. " * 45000
        big = threading.Thread(
            target=lambda: answers.append(
                httpx.post(
                    server.url + "/v1/completions", json={"prompt": long_prompt}, timeout=300
                )
            )
        )
        big.start()
        seen = []  # lines the stream had received, at each /health that showed the prompt
        while big.is_alive():
            if server.health()["preparing"] == 1:
                seen.append(len(received))
            time.sleep(0.02)
        big.join()
        streaming.join()
        assert answers[0].status_code == 400 and "context" in answers[0].json()["error"]["message"]
        assert len(seen) >= 2, "/health never answered while the prompt was being tokenized"
        assert seen[-1] > seen[0] or received[-1] == "data: [DONE]", seen
    finally:
        server.close()


# --- 5. Host and Origin ---------------------------------------------------------------------------


def test_cross_origin_and_rebinding_requests_are_refused(bounded):
    completion = {"prompt": "hi", "max_tokens": 2}
    before = bounded.wait_idle()["requests"]
    refused = [
        # A page on another site POSTs a text/plain body (no CORS preflight needed).
        ({"Origin": "http://evil.example", "Content-Type": "text/plain"}, "origin_not_allowed"),
        ({"Origin": "null"}, "origin_not_allowed"),
        # DNS rebinding: evil.example now resolves to 127.0.0.1; the page is "same origin".
        ({"Host": "evil.example:8000", "Origin": "http://evil.example:8000"}, "host_not_allowed"),
        ({"Host": "evil.example"}, "host_not_allowed"),
    ]
    with bounded.client() as c:
        for headers, code in refused:
            r = c.post("/v1/completions", content=json.dumps(completion), headers=headers)
            assert r.status_code == 403, (headers, r.text)
            assert r.json()["error"]["code"] == code
        assert c.get("/health", headers={"Host": "evil.example"}).status_code == 403
        assert bounded.health()["requests"] == before  # nothing reached the scheduler

        host = f"127.0.0.1:{bounded.port}"
        allowed = [
            {},  # no Origin: curl, SDKs
            {"Origin": f"http://{host}"},  # same origin
            {"Origin": "http://localhost:3000"},  # --allowed-origins
            {"Host": f"localhost:{bounded.port}"},
            {"Host": "models.internal"},  # --allowed-hosts
        ]
        for headers in allowed:
            r = c.post("/v1/completions", json=completion, headers=headers)
            assert r.status_code == 200, (headers, r.text)
        r = c.post("/v1/completions", json=completion, headers={"Origin": "http://localhost:3000"})
        assert r.headers["access-control-allow-origin"] == "http://localhost:3000"
        preflight = c.options(
            "/v1/chat/completions",
            headers={
                "Origin": "http://localhost:3000",
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type",
            },
        )
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "http://localhost:3000"


# --- 6. Ctrl-C during a stream ----------------------------------------------------------------------


def test_ctrl_c_ends_streams_with_a_final_event_and_exits_0(llama, logs):
    server = Server(["--model", llama, "--max-kv-size", 64], logs)
    try:
        body = {"prompt": "hi", "max_tokens": 30000, "ignore_eos": True, "stream": True}
        lines = []
        with server.client() as c, c.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                lines.append(line)
                if len(lines) == 6:  # a few tokens in
                    server.proc.send_signal(signal.SIGINT)
        rc = server.proc.wait(60)
        log = server.log.read_text()
    finally:
        server.close()
    events = [line[len("data: ") :] for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    final = json.loads(events[-2])
    assert final["error"]["code"] == "server_shutting_down", final
    assert rc == 0, log
    assert "Traceback" not in log and "graceful shutdown exceeded" not in log, log


# --- 7. start-up order ---------------------------------------------------------------------------


def serve_once(*args, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mlxc.cli", "serve", *map(str, args)],
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_a_port_in_use_is_reported_before_the_model_loads(llama, tmp_path):
    # A checkpoint whose load would fail: were the model loaded first, that error would show.
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in llama.iterdir():
        if f.suffix != ".safetensors":
            (broken / f.name).write_bytes(f.read_bytes())
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = serve_once("--model", broken, "--port", port)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith(f"error: cannot listen on 127.0.0.1:{port}: "), result.stderr
    assert "address already in use" in lines[-1].lower()
    assert "safetensors" not in result.stderr


def test_a_failed_load_exits_1_with_one_error_line(llama, tmp_path):
    """Weights that do not match config.json fail after the model is built (MLX has run on
    the scheduler thread): the exit was sometimes an abort (134, "terminate called")."""
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    for f in llama.iterdir():
        (wrong / f.name).write_bytes(f.read_bytes())
    config = json.loads((wrong / "config.json").read_text())
    config["intermediate_size"] *= 2
    (wrong / "config.json").write_text(json.dumps(config))
    for _ in range(3):
        result = serve_once("--model", wrong, "--port", free_port())
        assert result.returncode == 1, result.stderr
        errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
        assert len(errors) == 1 and errors[0].startswith("error: weights in "), result.stderr
        assert "terminate called" not in result.stderr and "Traceback" not in result.stderr


def test_the_scheduler_thread_outlives_a_failed_load(tmp_path):
    """Why the abort is gone: the thread that ran MLX never ends while the process lives (its
    C++ thread-local teardown raced the interpreter's exit); it parks, holding nothing."""
    import gc
    import weakref

    from mlxc.runtime.serving.scheduler import Scheduler

    def broken_load():
        import mlx.core as mx

        mx.eval(mx.ones(3) * 2)  # MLX state on this thread, as a real load leaves
        raise RuntimeError("no weights here")

    scheduler = Scheduler(None, None, load=broken_load)
    with pytest.raises(RuntimeError, match="no weights"):
        scheduler.start()
    assert not scheduler.alive
    assert scheduler._thread.is_alive()  # parked
    ref = weakref.ref(scheduler)
    del scheduler
    gc.collect()
    assert ref() is None  # the parked thread keeps no reference to the scheduler
