"""bench.serve_load's client processes: every request of a level is made once, by one of the
processes, and their results come back merged (against a stand-in OpenAI stream server)."""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from bench import serve_compare, serve_load

TOKENS = 3  # content chunks per streamed answer

_SERVER = textwrap.dedent(
    f"""
    import json, sys
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with open(sys.argv[2], "a") as seen:  # one line per request: its prompt's first word
                seen.write(body["prompt"].split()[0] + "\\n")
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            events = [{{"choices": [{{"text": "x"}}]}} for _ in range({TOKENS})]
            events.append({{"choices": [], "usage": {{"completion_tokens": {TOKENS}}}}})
            for event in events:
                self.wfile.write(f"data: {{json.dumps(event)}}\\n\\n".encode())
            self.wfile.write(b"data: [DONE]\\n\\n")

        def do_GET(self):  # /metrics as mlxc serves it (prometheus text); anything else 404
            body = (
                b'# TYPE mlxc_forwards_total counter\\n'
                b'mlxc_forwards_total{{kind="decode"}} 12.0\\n'
                b'mlxc_forwards_total{{kind="prefill"}} 3.0\\n'
                b'mlxc_scheduler_seconds_total{{phase="build"}} 0.25\\n'
                b'mlxc_scheduler_seconds_total{{phase="tick"}} 1.5e-05\\n'
            )
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def stream_server(tmp_path):
    port, seen = _free_port(), tmp_path / "seen.txt"
    proc = subprocess.Popen([sys.executable, "-c", _SERVER, str(port), str(seen)])
    try:
        for _ in range(200):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
                break
            except OSError:
                time.sleep(0.05)
        yield ("127.0.0.1", port, ""), seen
    finally:
        proc.kill()
        proc.wait()


def _args(clients: int) -> argparse.Namespace:
    return argparse.Namespace(
        requests=12,
        max_tokens=TOKENS,
        max_tokens_spread=0,
        prompt_words=4,
        endpoint="completions",
        duration=60.0,
        timeout=30.0,
        clients=clients,
    )


@pytest.mark.parametrize("clients", [1, 3])
def test_every_request_once_across_client_processes(stream_server, clients):
    target, seen = stream_server
    level = serve_load.run_level(target, "m", 5, _args(clients))
    assert level["requests"] == 12 and level["errors"] == 0
    assert level["completion_tokens"] == 12 * TOKENS
    # Each request id's prompt was sent exactly once, whichever process sent it.
    want = sorted(serve_load.prompt_text(5 * 100_000 + i, 4).split()[0] for i in range(12))
    assert sorted(seen.read_text().split()) == want
    assert level["wall_s"] > 0 and level["aggregate_tps"] > 0
    # Every content chunk of every process lands in the level's timeline, once.
    assert sum(level["tps_by_second"]) == 12 * TOKENS
    # The full-load window ends when the first stream found no request left, within the level.
    assert 0 < level["full_load_s"] <= level["wall_s"] and level["full_load_tps"] > 0
    assert all("times" not in r for r in level["results"])  # the JSON keeps per-second counts


def test_full_load_counts_the_tokens_before_the_first_stream_stopped():
    """Two answers of 4 chunks, 4 and 8 tokens (the second's text held back, 2 tokens a
    chunk): 6 of the 8 chunks came by t=3, weighed to tokens 6 x 12 / 8 = 9 in 3 s; a window
    that does not open has no rate."""
    a = serve_load.Result(True, 0.0, 4.0, 0.5, 4, times=[0.5, 1.0, 1.5, 2.0])
    b = serve_load.Result(True, 0.0, 5.0, 1.0, 8, times=[1.0, 2.5, 3.5, 4.0])
    assert serve_load.full_load_tps([a, b], 0.0, 3.0) == pytest.approx(6 * 12 / 8 / 3)
    assert serve_load.full_load_tps([a, b], 3.0, 3.0) is None
    assert serve_load.full_load_tps([], 0.0, 3.0) is None


def test_the_timeline_counts_chunks_by_second_across_requests():
    """A level's tokens/s second by second, the seconds between its first chunk's and its
    last's included (a stall: no chunk at all), and the median and lowest of its whole seconds
    (the first and last are partly outside it)."""
    a = serve_load.Result(True, 0.0, 0.0, 0.0, 5, times=[100.1, 100.7, 103.0, 103.2, 103.9])
    b = serve_load.Result(True, 0.0, 0.0, 0.0, 4, times=[101.0, 101.1, 101.5, 101.6, 105.3])
    assert serve_load.by_second([a, b]) == [2, 4, 0, 3, 0, 1]
    assert serve_load.by_second([serve_load.Result(False, 0.0, 0.0, None, 0)]) == []


def test_serve_compare_counts_the_kernel_modules_mlx_compiled(tmp_path, monkeypatch):
    """``ptx_modules``: the ``.ptx`` files under MLX's CUDA compile cache (long module names
    are split into folders), None where there is none; ``_compiled`` their growth."""
    cache = tmp_path / "ptx"
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(cache))
    assert serve_compare.ptx_modules() is None
    (cache / "long_name_part").mkdir(parents=True)
    for path in ("gather_i32.ptx", "gather_i32.txt", "long_name_part/rest.ptx"):
        (cache / path).write_text("x")
    assert serve_compare.ptx_modules() == 2
    assert serve_compare._compiled(2, 5) == 3 and serve_compare._compiled(None, 5) is None


def test_serve_compare_reports_each_levels_seconds():
    ours = {"levels": [{"concurrency": 16, "second_tps_median": 1234.4, "second_tps_min": 87.0}]}
    peer = {"levels": [{"concurrency": 16, "second_tps_median": None, "second_tps_min": None}]}
    assert serve_compare._by_second(ours, peer) == (
        "Tokens/s by whole second, median / lowest, mlxc and mlx-lm: 16 streams: 1,234 / 87 and —."
    )


def test_a_warm_up_wave_sends_prompts_the_level_does_not(stream_server):
    """serve_compare's unmeasured wave before each level (``first_id``) asks other prompts than
    the level's, so no prompt cache answers the measured requests from it."""
    target, seen = stream_server
    serve_load.run_level(target, "m", 5, _args(1), first_id=5 * 100_000 + 50_000)
    warm = set(seen.read_text().split())
    serve_load.run_level(target, "m", 5, _args(1))
    level = set(seen.read_text().split()) - warm
    assert len(warm) == len(level) == 12  # every prompt distinct, none in both


def test_clients_scale_with_streams_and_cpus(monkeypatch):
    monkeypatch.setattr(serve_load.os, "cpu_count", lambda: 16)
    assert [serve_load.clients(n) for n in (1, 8, 9, 16, 64)] == [1, 1, 2, 2, 4]
    monkeypatch.setattr(serve_load.os, "cpu_count", lambda: 2)
    assert serve_load.clients(64) == 1


def test_serve_compare_reads_the_server_counters(stream_server):
    (host, port, _), _ = stream_server
    url = f"http://{host}:{port}"
    assert serve_compare.counters(url) == {
        "forwards": {"decode": 12.0, "prefill": 3.0},
        "scheduler_s": {"build": 0.25, "tick": 1.5e-05},
    }
    assert serve_compare.counters(url + "/nothing") is None  # a server without them: None


def test_serve_compare_reports_phases_per_decode_forward():
    level = {
        "forwards": {"decode": 10.0},
        "scheduler_s": {"build": 0.01, "read": 0.02, "tick": 0.05},
    }
    assert serve_compare._per_forward(level) == "build 1.00, read 2.00, other 2.00"


def test_answer_lengths_spread_evenly_around_the_mean():
    args = argparse.Namespace(max_tokens=64, max_tokens_spread=32)
    lengths = [serve_load.max_tokens(i, args) for i in range(65 * 4)]
    assert min(lengths) == 32 and max(lengths) == 96
    assert sum(lengths) / len(lengths) == 64  # every length of 32..96 equally often
    assert serve_load.max_tokens(7, argparse.Namespace(max_tokens=64, max_tokens_spread=0)) == 64


@pytest.mark.skipif(sys.platform != "linux", reason="reads Linux's /proc")
def test_thread_cpu_names_each_thread():
    """serve_compare's CPU time per thread: a thread named for the OS the way the scheduler
    names its own (``_name_os_thread``) is counted under that name, the first thread as
    ``main``; a level's line gives microseconds per token."""
    import os
    import threading

    from mlxc.runtime.serving.scheduler import _name_os_thread

    burnt, release = threading.Event(), threading.Event()

    def burn():
        _name_os_thread("mlxc-burn-test")
        while time.thread_time() < 0.3:
            pass
        burnt.set()
        release.wait(30)

    thread = threading.Thread(target=burn)
    thread.start()
    try:
        assert burnt.wait(30)
        used = serve_compare.thread_cpu(os.getpid())
    finally:
        release.set()
        thread.join()
    assert used["mlxc-burn-test"] >= 0.25 and "main" in used
    level = {"thread_cpu_s": {"main": 0.069, "mlxc-scheduler": 0.114, "a": 0.5, "b": 0.33}}
    level["completion_tokens"] = 1000
    assert serve_compare._per_token(level) == "main 69, mlxc-scheduler 114, other 830"
    level["thread_cpu_s"]["child"] = 0.045  # mlxc serve's HTTP process
    assert serve_compare._per_token(level) == "main 69, mlxc-scheduler 114, child 45, other 830"


@pytest.mark.skipif(sys.platform != "linux", reason="reads Linux's /proc")
def test_thread_cpu_counts_the_processes_a_server_started():
    """``mlxc serve``'s HTTP process is a child of the process serve_compare started: its
    threads count as ``child``."""
    import os
    import subprocess

    script = (
        "import time\nwhile time.process_time() < 0.3: pass\nprint('burnt', flush=True)\ninput()"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "burnt"
        used = serve_compare.thread_cpu(os.getpid())
    finally:
        child.communicate("\n", timeout=30)
    assert used["child"] >= 0.25


def test_rows_per_decode_forward():
    level = {"completion_tokens": 1000, "requests": 10, "errors": 0, "forwards": {"decode": 99}}
    assert serve_compare._rows(level) == " (10.0 rows)"  # 990 tokens after the first ones
    assert serve_compare._rows({**level, "forwards": {"prefill": 3}}) == ""
