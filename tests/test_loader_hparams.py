"""config.json values are checked against the checkpoint before the model is built (issue 10,
item 9): a bad value is a CheckpointError naming its config entry, never a traceback, and an
absurd layer count fails at once instead of building for a minute."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent))
import checkpoints as ck

from mlxc.cli import main
from mlxc.generated import llama
from mlxc.runtime.checkpoint.loading import CheckpointError, load_model


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A 2-layer llama (hidden 64, 4 heads of 16, vocab 384) with a tokenizer."""
    return ck.make_llama(tmp_path_factory.mktemp("llama") / "ckpt", num_hidden_layers=2)


def variant(base, tmp_path, **changes) -> Path:
    """A copy of ``base`` whose config.json has ``changes`` (a None value drops the key)."""
    path = tmp_path / "ckpt"
    shutil.copytree(base, path)
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    config = {k: v for k, v in config.items() if v is not None}
    (path / "config.json").write_text(json.dumps(config))
    return path


def load_error(path) -> str:
    with pytest.raises(CheckpointError) as info:
        load_model(path)
    msg = str(info.value)
    assert str(path) in msg and "\n" not in msg
    return msg


def test_the_base_checkpoint_loads(base):
    assert len(load_model(base).model.layers) == 2


def test_absurd_layer_count_fails_before_the_model_is_built(base, tmp_path, monkeypatch):
    # Building 1e5 layers took 52 s and 8.9 GB before the name check could fail.
    path = variant(base, tmp_path, num_hidden_layers=100_000)
    built = []
    monkeypatch.setattr(llama.Model, "__init__", lambda self, args: built.append(args))
    msg = load_error(path)
    assert "'num_hidden_layers' is 100000" in msg and "hold 2 layers" in msg
    assert built == []


@pytest.mark.parametrize(
    "changes, needles",
    [
        ({"hidden_size": 1e12}, ["'hidden_size' is 1000000000000"]),  # was OverflowError
        ({"vocab_size": -5}, ["'vocab_size' is -5"]),  # was ValueError
        ({"num_attention_heads": 0}, ["'num_attention_heads' = 0"]),  # was ZeroDivisionError
        ({"head_dim": 0}, ["'head_dim' = 0"]),  # was ZeroDivisionError, inside the build
        ({"rms_norm_eps": -1.0}, ["'rms_norm_eps' = -1.0"]),  # was ValueError from RMSNorm
        ({"hidden_size": 100}, ["'hidden_size' = 100", "wrong shape"]),
        ({"head_dim": 3}, ["'head_dim' = 3", "wrong shape"]),  # a factor of 4 heads x 3
        ({"num_hidden_layers": 0}, ["'num_hidden_layers' is 0"]),
        ({"intermediate_size": 2**31 - 1}, ["'intermediate_size' = 2147483647"]),
        ({"num_hidden_layers": "2"}, ["'num_hidden_layers' should be int"]),
    ],
)
def test_bad_values_name_their_config_entry(base, tmp_path, changes, needles):
    msg = load_error(variant(base, tmp_path, **changes))
    for needle in needles:
        assert needle in msg


def test_gqa_heads_must_divide_even_when_the_weights_fit(tmp_path):
    # 4 query heads over 3 key/value heads: every shape fits, but the attention cannot run.
    path = ck.make_llama(
        tmp_path / "ckpt", tokenizer=False, num_hidden_layers=1, num_key_value_heads=3
    )
    msg = load_error(path)
    assert "model.layers.0.self_attn" in msg and "'num_key_value_heads' = 3" in msg


def test_cli_prints_one_error_line(base, tmp_path):
    path = variant(base, tmp_path, num_hidden_layers=100_000)
    result = CliRunner().invoke(main, ["generate", "--model", str(path), "--prompt", "hi"])
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "num_hidden_layers" in lines[0] and "Traceback" not in result.output
