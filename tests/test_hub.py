"""`--model org/name`: hub model ids resolved through huggingface_hub's cache, offline, against
a cache directory the test builds (HF_HUB_CACHE layout: models--org--name/snapshots/<rev>/...,
refs/main), for `mlxc generate` and `mlxc serve`; a clear error when the cache lacks the model."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent))
import checkpoints as ckpt
from test_server import Server

from mlxc.cli import main
from mlxc.runtime.checkpoint.hub import ModelNotFound, is_hub_id, resolve_model

REPO = "tiny-org/tiny-llama"
REVISION = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> tuple[Path, Path]:
    """(the checkpoint directory, a hub cache holding it as REPO at REVISION)."""
    root = tmp_path_factory.mktemp("hub")
    model = ckpt.make_llama(root / "llama")
    cache = root / "cache"
    repo = cache / ("models--" + REPO.replace("/", "--"))
    shutil.copytree(model, repo / "snapshots" / REVISION)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    return model, cache


@pytest.fixture
def offline(hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(hub[1]))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hub


def generate(model: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(
        main, ["generate", "--model", model, "--prompt", "hello", "--max-tokens", "6"]
    )
    return result.exit_code, result.stdout, result.stderr


def test_resolve_model(offline):
    model, cache = offline
    assert resolve_model(str(model)) == (model, None)  # a directory is used as is
    path, hub_id = resolve_model(REPO)
    assert hub_id == REPO
    assert path == cache / "models--tiny-org--tiny-llama" / "snapshots" / REVISION
    assert is_hub_id("Qwen/Qwen3-0.6B") and not is_hub_id("./x/y") and not is_hub_id("a/../b")
    with pytest.raises(ModelNotFound, match="no such directory"):
        resolve_model("/no/such/dir")
    with pytest.raises(ModelNotFound, match="not a directory"):
        resolve_model(str(model / "config.json"))


def test_generate_from_a_hub_id_matches_the_directory(offline):
    model, _ = offline
    by_id = generate(REPO)
    assert by_id[0] == 0, by_id
    assert by_id[1] == generate(str(model))[1] and by_id[1].strip()


def test_missing_model_is_a_clear_error(offline):
    code, _, err = generate("tiny-org/not-there")
    assert code == 2
    assert "tiny-org/not-there is not in" in err and "HF_HUB_OFFLINE" in err
    assert str(offline[1]) in err
    assert "Traceback" not in err


def test_serve_a_hub_id(hub, tmp_path):
    _, cache = hub
    server = Server(["--model", REPO], tmp_path, env={"HF_HUB_CACHE": str(cache)})
    try:
        models = httpx.get(server.url + "/v1/models", timeout=30).json()
        assert [m["id"] for m in models["data"]] == [REPO]
        reply = httpx.post(
            server.url + "/v1/chat/completions",
            json={"model": REPO, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
    finally:
        server.close()
