"""``loading.load_checkpoint``: what generate and the server read before the weights; and the
``cache_policy`` / ``vision_tower`` class attributes every generated ``Model`` carries."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # the toy model lives beside the tests
import _toy_model as toy

from mlxc.runtime.checkpoint import loading
from mlxc.runtime.checkpoint.loading import CheckpointError, load_checkpoint


@pytest.fixture
def use_toy(monkeypatch):
    monkeypatch.setattr(loading, "model_types", lambda: {"toy": toy.__name__})


def test_reads_everything_but_the_weights(tmp_path, use_toy, monkeypatch):
    path = toy.write_tokenizer(toy.write_checkpoint(tmp_path))
    loads = []
    real = loading.load_model
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: loads.append(a) or real(*a, **k))
    checkpoint = load_checkpoint(str(path))
    assert loads == []  # the model loads apart
    assert checkpoint.path == path and checkpoint.module is toy
    assert checkpoint.config["model_type"] == "toy"
    assert checkpoint.tokenizer.eos_token_id == 257 and 257 in checkpoint.eos_token_ids
    assert checkpoint.prompt_tokenizer is checkpoint.tokenizer
    assert checkpoint.processor is None and checkpoint.vision_tower is None
    assert checkpoint.vocab_size == toy.CONFIG["vocab_size"]
    assert checkpoint.context_length == toy.CONFIG.get("max_position_embeddings")
    assert isinstance(checkpoint.load_model(), toy.Model) and len(loads) == 1

    copied = load_checkpoint(path, copy_tokenizer=True)
    assert copied.prompt_tokenizer is not copied.tokenizer


def test_errors_in_order(tmp_path, use_toy):
    path = toy.write_checkpoint(tmp_path)  # no tokenizer
    with pytest.raises(CheckpointError, match="no tokenizer .*: copy the tokenizer files"):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match="no tokenizer .*: read prompts"):
        load_checkpoint(path, tokenizer_hint="read prompts")
    seen = []

    def refuse(config, tower):
        seen.append((config["model_type"], tower))
        raise RuntimeError("refused")

    with pytest.raises(RuntimeError, match="refused"):  # the hook runs before the tokenizer
        load_checkpoint(path, before_tokenizer=refuse)
    assert seen == [("toy", None)]  # a text model: no vision tower
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):  # before the hook
        load_checkpoint(tmp_path / "empty", before_tokenizer=refuse)
    assert len(seen) == 1


def test_generated_models_carry_their_policy_and_tower():
    from mlxc.generated.registry import MODEL_TYPES

    for name in sorted(set(MODEL_TYPES.values())):
        module = importlib.import_module(f"mlxc.generated.{name}")
        assert module.Model.cache_policy == module.CACHE_POLICY, name
        assert module.Model.vision_tower == module.VISION_TOWER, name
