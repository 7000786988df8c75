"""Tensor parallelism (issue 17): the generated ``Model.shard`` over two ranks of the ring
backend on localhost (``mlx.launch -n 2``), every spec's sharded logits against its unsharded
logits in one launched pair of processes (``tp_worker.py``): launch costs are paid once."""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent))
import checkpoints as ckpt
import test_server
from test_server import Server, free_port

from bench.tp_compare import launch_prefix
from mlxc.cli import main

ROOT = Path(__file__).resolve().parent.parent
LAUNCH = Path(sys.executable).with_name("mlx.launch")


def launch(*command: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """``mlx.launch -n 2 --backend ring`` on localhost, ports chosen free."""
    if not LAUNCH.exists():
        pytest.skip(f"mlx.launch is not installed next to {sys.executable}")
    args = launch_prefix(2, "ring")
    return subprocess.run(
        [*args, *command], check=False, cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def test_sharded_logits_equal_unsharded_for_every_spec():
    proc = launch(sys.executable, str(ROOT / "tests" / "tp_worker.py"), str(ROOT / "specs"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    lines = [line for line in proc.stdout.splitlines() if line[:4] in ("ok  ", "FAIL")]
    specs = sorted(p.stem for p in (ROOT / "specs").glob("*.yaml"))
    reported = [line.split()[1].rstrip(":") for line in lines]
    assert all(s in reported for s in specs), out
    assert not [line for line in lines if line.startswith("FAIL")], out
    cases = ("llama 8-bit", "qwen3_moe 8-bit", "llama sharded load", "sampling", "llama fused")
    for case in (*cases, "qwen3 fused 8-bit"):
        assert f"ok   {case}:" in proc.stdout, out


@pytest.fixture(scope="module")
def qwen3_checkpoint(tmp_path_factory):
    from mlxc.checkpoint import write_checkpoint

    out = tmp_path_factory.mktemp("tp") / "qwen3"
    write_checkpoint(str(ROOT / "specs" / "qwen3.yaml"), out)
    return out


def test_generate_on_two_ranks_prints_once_what_one_process_generates(qwen3_checkpoint):
    mlxc = str(Path(sys.executable).with_name("mlxc"))
    # A bounded cache trimmed after every small prefill chunk and decode step.
    flags = ["--model", str(qwen3_checkpoint), "--prompt", "hello there, tiny model"]
    flags += ["--max-tokens", "16", "--max-kv-size", "12", "--prefill-chunk-size", "5"]
    alone = CliRunner().invoke(main, ["generate", *flags])  # in this process: one rank
    assert alone.exit_code == 0, alone.output
    pair = launch(mlxc, "generate", *flags, timeout=120)
    assert pair.returncode == 0, pair.stdout + pair.stderr
    assert alone.stdout.strip()
    assert pair.stdout == alone.stdout  # rank 1 prints nothing
    assert pair.stderr.count("generated: 16 tokens") == 1, pair.stderr


class LaunchedServer(Server):
    """``mlx.launch -n 2 mlxc serve ARGS``: rank 0 on a free loopback port. Its own session, so
    that closing it reaches the launcher and both ranks."""

    def __init__(self, args: list[str], log_dir: Path) -> None:
        if not LAUNCH.exists():
            pytest.skip(f"mlx.launch is not installed next to {sys.executable}")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log_dir / f"launched-serve-{self.port}.log"
        mlxc = str(Path(sys.executable).with_name("mlxc"))
        launch = launch_prefix(2, "ring")
        serve = [mlxc, "serve", "--port", str(self.port), *map(str, args)]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [*launch, *serve],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "HF_HUB_OFFLINE": "1"},
                start_new_session=True,
            )
        if not self._wait_ready():
            self.close()
            raise AssertionError(f"launched server did not start\n{self.log_text()}")

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def _greedy_chat(pair: LaunchedServer, model: str, max_tokens: int, **client_options):
    """A function asking ``pair`` one greedy chat question (the openai client) for its answer."""
    from openai import OpenAI

    client = OpenAI(base_url=pair.url + "/v1", api_key="unused", max_retries=0, **client_options)

    def answer(ask: str) -> str:
        messages = [{"role": "user", "content": ask}]
        r = client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0
        )
        return r.choices[0].message.content

    return answer


def test_serve_on_two_ranks_answers_as_one_process(tmp_path):
    """Greedy chat answers of a two-rank server (the openai client), one at a time and then all
    at once (one decode batch on both ranks), equal `mlxc generate` in one process, under a
    bounded cache trimmed after every small prefill chunk and decode step on every rank."""

    path = test_server.make_qwen3_moe(tmp_path / "qwen3_moe")
    flags = ["--max-kv-size", "24", "--prefill-chunk-size", "8"]
    asks = ["hello there, tiny model", "count: one two three four five six", "and again"]
    expected = [test_server.mlxc_generate(path, ask, "--max-tokens", 20, *flags)[0] for ask in asks]

    pair = LaunchedServer(["--model", path, *flags], tmp_path)
    answer = _greedy_chat(pair, path.name, max_tokens=20)

    try:
        # A stream dropped mid-way: its cancellation reaches both ranks in the same tick.
        with pair.client() as c:
            body = {"messages": [{"role": "user", "content": "stream"}], "max_tokens": 200}
            with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
                assert r.status_code == 200
                next(r.iter_lines())
        assert [answer(ask) for ask in asks] == expected, pair.log_text()
        with concurrent.futures.ThreadPoolExecutor(len(asks)) as pool:
            assert list(pool.map(answer, asks)) == expected, pair.log_text()
        health = pair.wait_idle()
        assert health["requests"]["failed"] == 0 and health["pool"]["peak_batched"] >= 2
    finally:
        pair.close()
    assert "Traceback" not in pair.log_text(), pair.log_text()


def test_serve_on_two_ranks_quantises_the_kv_on_both(tmp_path):
    """`--kv-bits 4` reaches every rank (each holds its own heads' keys): the two-rank server's
    greedy answers equal `mlxc generate --kv-bits 4` in one process, not a mix of quantised and
    float heads."""
    path = ckpt.make_llama(tmp_path / "llama", head_dim=32)  # groups of 32 need a head dim 32
    flags = ["--kv-bits", "4", "--kv-group-size", "32"]
    asks = ["hello there, tiny model", "count: one two three four five six"]
    expected = [test_server.mlxc_generate(path, ask, "--max-tokens", 24, *flags)[0] for ask in asks]

    pair = LaunchedServer(["--model", path, *flags], tmp_path)
    try:
        answer = _greedy_chat(pair, path.name, max_tokens=24)
        assert [answer(ask) for ask in asks] == expected, pair.log_text()
    finally:
        pair.close()
    assert "Traceback" not in pair.log_text(), pair.log_text()


@pytest.mark.parametrize("drafter", ["--prompt-lookup", "--draft-model"])
def test_serve_on_two_ranks_speculates_as_one_process(tmp_path, drafter):
    """`mlx.launch -n 2 mlxc serve --prompt-lookup` (or `--draft-model`, the model itself,
    unsharded on each rank): every rank drafts the same tokens and accepts the same ones, so
    the sharded verification forwards pair up and the greedy answers are `mlxc generate`'s;
    concurrent requests speculate in one decode batch on both ranks."""

    path = test_server.make_qwen3_moe(tmp_path / "qwen3_moe")
    asks = ["abc abd abc abd abc abd abc", "count: one two one two one two one"]
    expected = [test_server.mlxc_generate(path, ask, "--max-tokens", 24)[0] for ask in asks]
    flags = [drafter] if drafter == "--prompt-lookup" else [drafter, path]
    pair = LaunchedServer(["--model", path, *flags, "--num-draft-tokens", 3], tmp_path)
    # Ranks that drafted or accepted differently would wait on each other's collectives: a
    # deadline turns that hang into a failure.
    answer = _greedy_chat(pair, path.name, max_tokens=24, timeout=120)

    try:
        assert [answer(ask) for ask in asks] == expected, pair.log_text()
        with concurrent.futures.ThreadPoolExecutor(len(asks)) as pool:
            assert list(pool.map(answer, asks)) == expected, pair.log_text()
        health = pair.wait_idle()
        assert health["requests"]["failed"] == 0, pair.log_text()
        assert health["speculation"]["steps"] > 0
    finally:
        pair.close()
    assert "Traceback" not in pair.log_text(), pair.log_text()


def test_lockstep_fails_a_request_it_cannot_hand_to_the_other_ranks():
    """Rank 0's side of the hook, on a group of one: a request whose inputs cannot be pickled
    ends with Failed and is dropped this tick, the others are handed on as they are."""
    import mlx.core as mx

    from mlxc.runtime.serving.admission import Request, SamplingParams
    from mlxc.runtime.serving.distributed import Lockstep, broadcast
    from mlxc.runtime.serving.scheduler import Failed

    group = mx.distributed.init()
    assert broadcast({"a": [1, 2]}, group) == {"a": [1, 2]}
    events = []
    good = Request("req-1", [1, 2], SamplingParams(4), events.append, lambda: None)
    bad = Request("req-2", [3], SamplingParams(4), events.append, lambda: None, {"f": lambda: 0})
    lockstep = Lockstep(group)
    assert lockstep.admit(lambda: [good, bad], []) == [good, bad]
    assert lockstep.cancelled == {"req-2"}
    assert len(events) == 1 and isinstance(events[0], Failed)
    assert lockstep.admit(lambda: None, []) is None and lockstep.cancelled == set()


def test_tp_compare_reports_sharded_logits_and_speed(tmp_path):
    """``bench.tp_compare`` on the CPU: a one-process run and a two-rank run of one checkpoint,
    the sharded logits within float32 rounding of the unsharded ones, and both runs timed."""
    if not LAUNCH.exists():
        pytest.skip(f"mlx.launch is not installed next to {sys.executable}")
    from bench import tp_compare

    out = tmp_path / "tp"
    tp_compare.main(
        ["--device", "cpu", "--size", "small", "--archs", "llama", "--prefill", "24"]
        + ["--decode-tokens", "4", "--logits-prompt", "12", "--repeats", "1"]
        + ["--work-dir", str(tmp_path), "--out", str(out)]
    )
    row = json.loads(out.with_suffix(".json").read_text())["rows"]["llama"]
    assert row["dtype"] == "float32" and row["bf16_floor"] is None
    assert 0 < row["logits_diff"] <= tp_compare.FLOAT32_TOL and row["logits_ok"]
    cell = row["levels"]["24"]
    assert cell["1"]["decode_tps"] > 0 and cell["2"]["decode_tps"] > 0
    assert cell["2"]["peak_bytes"] < cell["1"]["peak_bytes"]  # a rank holds a share
    assert "| llama | float32 | 24 |" in out.with_suffix(".md").read_text()


def test_serve_compare_measures_a_server_on_two_ranks(qwen3_checkpoint, tmp_path):
    """``bench.serve_compare --mlxc-ranks 2``'s server: ``mlx.launch`` starts both ranks, one
    level of streams is served and counted by rank 0's metrics, and stopping it ends the
    launcher and its ranks."""
    if not LAUNCH.exists():
        pytest.skip(f"mlx.launch is not installed next to {sys.executable}")
    from bench import serve_compare

    args = argparse.Namespace(
        port=free_port(), levels=[2], mlxc_args="", mlxc_ranks=2, mlxc_backend=None, gpu=False,
        out=str(tmp_path / "serve"), startup_timeout=120, max_tokens=6, max_tokens_spread=0,
        prompt_words=8, duration=60, timeout=60, requests_per_stream=2,
    )  # fmt: skip
    command = serve_compare.mlxc_command(str(qwen3_checkpoint), args)
    assert command[0] == str(LAUNCH) and command[1:5] == ["-n", "2", "--backend", "ring"]
    nccl = serve_compare.mlxc_command("m", argparse.Namespace(**{**vars(args), "gpu": True}))
    assert nccl[3:7] == ["--backend", "nccl", "--env", "NCCL_NVLS_ENABLE=0"]  # no multicast
    report = serve_compare.measure("mlxc", command, args.port, args, tmp_path, str(tmp_path), False)
    (level,) = report["levels"]
    assert level["errors"] == 0 and level["aggregate_tps"] > 0, level
    assert level["forwards"]["decode"] > 0  # counted by rank 0's /metrics
    assert "thread_cpu_s" not in level  # the launcher's threads are not the server's
    log = (tmp_path / "serve.mlxc.log").read_text()
    assert "Traceback" not in log, log
    for _ in range(100):  # the ranks had the signal with the launcher: they end within seconds
        ranks = subprocess.run(
            ["pgrep", "-f", f"--port {args.port}"], check=False, capture_output=True, text=True
        )
        if not ranks.stdout:
            break
        time.sleep(0.1)
    assert ranks.stdout == "", "a rank outlived its launcher"
