"""Shard names in model.safetensors.index.json stay inside the checkpoint directory (issue 10,
item 10): an absolute name or one that climbs out with ``..`` is refused, not loaded."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent))
import _toy_model as toy

from mlxc.cli import main
from mlxc.runtime.checkpoint import loading
from mlxc.runtime.checkpoint.loading import CheckpointError, load_model

SHARD = "model-00002-of-00002.safetensors"


@pytest.fixture(autouse=True)
def use_toy(monkeypatch):
    monkeypatch.setattr(loading, "model_types", lambda: {"toy": toy.__name__})


def point_shard_at(path: Path, name: str) -> None:
    """Rewrite the index so that the tensors of the second shard are read from ``name``."""
    index_file = path / loading.INDEX_FILE
    index = json.loads(index_file.read_text())
    index["weight_map"] = {k: name if v == SHARD else v for k, v in index["weight_map"].items()}
    index_file.write_text(json.dumps(index))


@pytest.fixture
def checkpoint(tmp_path):
    path = toy.write_tokenizer(toy.write_checkpoint(tmp_path / "ckpt", shards=2))
    # The shard moves out of the directory: only a name that escapes can still reach it.
    shutil.move(path / SHARD, tmp_path / "outside.safetensors")
    return path


@pytest.mark.parametrize("kind", ["absolute", "dotdot", "nested dotdot"])
def test_a_shard_outside_the_directory_is_refused(checkpoint, tmp_path, kind):
    name = {
        "absolute": str(tmp_path / "outside.safetensors"),
        "dotdot": "../outside.safetensors",
        "nested dotdot": "sub/../../outside.safetensors",
    }[kind]
    (checkpoint / "sub").mkdir()
    point_shard_at(checkpoint, name)
    with pytest.raises(CheckpointError) as info:
        load_model(checkpoint)
    assert repr(name) in str(info.value) and "outside" in str(info.value)

    result = CliRunner().invoke(main, ["generate", "--model", str(checkpoint), "--prompt", "hi"])
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and repr(name) in lines[0]


@pytest.mark.parametrize("name", [7, "", "a\0b.safetensors"])
def test_a_shard_name_that_is_no_file_name_is_refused(checkpoint, name):
    point_shard_at(checkpoint, name)
    with pytest.raises(CheckpointError, match="shard"):
        load_model(checkpoint)


def test_shards_linked_from_outside_still_load(checkpoint, tmp_path):
    # The Hugging Face cache links every file of a snapshot to ../../blobs/<hash>: allowed.
    (checkpoint / SHARD).symlink_to(tmp_path / "outside.safetensors")
    nested = checkpoint / "sub"
    nested.mkdir()
    shutil.copy(checkpoint / "model-00001-of-00002.safetensors", nested / "first.safetensors")
    index_file = checkpoint / loading.INDEX_FILE
    index = json.loads(index_file.read_text())
    first = "model-00001-of-00002.safetensors"
    index["weight_map"] = {
        k: "sub/first.safetensors" if v == first else v for k, v in index["weight_map"].items()
    }
    index_file.write_text(json.dumps(index))
    assert len(load_model(checkpoint).model.layers) == 2
