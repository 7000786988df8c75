"""`mlxc serve`'s HTTP side in a process of its own (`runtime.serving.frontend`), end to end:
the same answers as one process (`--no-http-process`), and either process ending the other.
The rest of the server suites run against the default (two processes) too."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
import checkpoints as ckpt
from test_server import Server

pytestmark = pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc (Linux)")


def http_processes(pid: int) -> list[int]:
    """The multiprocessing children of ``pid`` (the HTTP process; not its resource tracker)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [
        int(c)
        for c in children
        if b"multiprocessing.spawn" in Path(f"/proc/{c}/cmdline").read_bytes()
    ]


def ended(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie child counts: its code is waiting to be read)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_until(condition, what: str, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return ckpt.make_llama(tmp_path_factory.mktemp("process") / "llama", num_hidden_layers=2)


BODY = {"prompt": "hello world", "max_tokens": 12, "ignore_eos": True, "logprobs": 2}


def test_http_runs_in_its_own_process_and_answers_as_one_process(model, tmp_path):
    answers = {}
    for flag in ("--http-process", "--no-http-process"):
        server = Server(["--model", model, flag], tmp_path)
        try:
            children = http_processes(server.proc.pid)
            assert len(children) == (1 if flag == "--http-process" else 0)
            with server.client() as c:
                reply = c.post("/v1/completions", json=BODY).json()
                streamed = c.post("/v1/completions", json={**BODY, "stream": True}).text
                # Text made by the engine (stop strings), not by the HTTP process.
                stop = reply["choices"][0]["text"][4:6]
                stopped = c.post("/v1/completions", json={**BODY, "stop": [stop]}).json()
                metrics = c.get("/metrics").text
            answers[flag] = reply["choices"][0], reply["usage"], stopped["choices"][0]
            assert streamed.endswith("data: [DONE]\n\n")
            chunks = [
                json.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: {")
            ]
            assert "".join(c["choices"][0]["text"] for c in chunks) == reply["choices"][0]["text"]
            assert stopped["choices"][0]["finish_reason"] == "stop"
            # The scheduler's families come from the engine process, the requests from HTTP.
            assert 'mlxc_forwards_total{kind="decode"}' in metrics
            assert 'mlxc_requests_total{endpoint="completions",status="200"} 3.0' in metrics
        finally:
            server.close()
        assert server.proc.returncode == 0, server.log_text()
    assert answers["--http-process"] == answers["--no-http-process"]


def test_a_signal_to_the_engine_process_ends_both(model, tmp_path):
    server = Server(["--model", model, "--max-kv-size", "64"], tmp_path)  # no context limit
    (http,) = http_processes(server.proc.pid)
    with (
        server.client() as c,
        c.stream(
            "POST", "/v1/completions", json={**BODY, "max_tokens": 30000, "stream": True}
        ) as stream,
    ):
        lines = stream.iter_lines()
        assert next(lines).startswith("data: ")  # decoding
        server.proc.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line]
    assert server.proc.wait(30) == 0, server.log_text()
    assert "server_shutting_down" in "".join(rest) and rest[-1] == "data: [DONE]"
    wait_until(lambda: ended(http), "the HTTP process outlived the engine process")


def test_the_engine_process_dying_ends_the_http_process(model, tmp_path):
    server = Server(["--model", model], tmp_path)
    (http,) = http_processes(server.proc.pid)
    server.proc.kill()
    server.proc.wait(30)
    wait_until(lambda: ended(http), "the HTTP process outlived the engine process")
    with pytest.raises(httpx.TransportError):
        httpx.get(server.url + "/health", timeout=5)


def test_the_http_process_dying_ends_the_engine_process(model, tmp_path):
    server = Server(["--model", model], tmp_path)
    (http,) = http_processes(server.proc.pid)
    os.kill(http, signal.SIGKILL)
    assert server.proc.wait(30) == 128 + signal.SIGKILL, server.log_text()
