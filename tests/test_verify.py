"""`mlxc verify` passes on the shipped specs and catches a mask sized from the offset."""

import os
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from mlxc.cli import main
from mlxc.compiler import build, lint
from mlxc.runtime.model import mrope
from mlxc.runtime.model.batch import BatchKVCache, BatchPositions
from mlxc.runtime.model.masks import MaskWidthError
from mlxc.verify import VerifyError, load_source, verify_module

ROOT = Path(__file__).resolve().parents[1]


def test_verify_passes_on_every_spec():
    result = CliRunner().invoke(main, ["verify", str(ROOT / "specs")])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    specs = sorted(p.stem for p in (ROOT / "specs").glob("*.yaml"))
    assert [line.split()[1].rstrip(":") for line in lines] == specs
    assert all(line.startswith("ok ") for line in lines)


@pytest.mark.parametrize("given", [None, "1"])
def test_verify_runs_without_tf32_unless_told(monkeypatch, given):
    """`mlxc verify` compares float32 runs to 1e-4: it asks MLX for full float32 matmuls (a
    GPU's TF32 rounds each product to ~1e-3, which failed every spec on the H200), unless the
    variable is already set."""
    if given is None:
        monkeypatch.delenv("MLX_ENABLE_TF32", raising=False)
    else:
        monkeypatch.setenv("MLX_ENABLE_TF32", given)
    result = CliRunner().invoke(main, ["verify", str(ROOT / "specs" / "llama.yaml")])
    assert result.exit_code == 0, result.output
    assert os.environ["MLX_ENABLE_TF32"] == (given or "0")


def _spec(name):
    [checked] = lint.check_all([str(ROOT / "specs" / f"{name}.yaml")])
    source = build.render([str(ROOT / "specs" / f"{name}.yaml")]).files[f"{name}.py"]
    return checked.spec, source


@pytest.mark.parametrize("name", ["llama", "nemotron_nas"])
def test_verify_catches_mask_sized_from_offset(name):
    spec, source = _spec(name)
    broken = source.replace("kv.live_len + L", "kv.offset + L")
    assert broken != source
    with pytest.raises(MaskWidthError):
        verify_module(name, load_source(name + "_broken", broken), spec.tiny_config)


def test_verify_catches_positions_that_ignore_the_cache():
    spec, source = _spec("qwen3")
    broken = source.replace("offset = cache.offset", "offset = 0")
    with pytest.raises(VerifyError, match="differs from one forward pass"):
        verify_module("qwen3", load_source("qwen3_broken", broken), spec.tiny_config)


def test_verify_catches_a_cache_that_loses_keys_before_any_trim():
    spec, source = _spec("qwen2")
    broken = source.replace(
        "keys, values = cache.update_and_fetch(keys, values)",
        "keys, values = cache.update_and_fetch(keys, values)\n"
        "        keys, values = keys[..., -8:, :], values[..., -8:, :]",
    )
    with pytest.raises((VerifyError, MaskWidthError)):
        verify_module("qwen2", load_source("qwen2_broken", broken), spec.tiny_config)


def test_verify_catches_a_batch_row_that_sees_other_rows_pads_or_trimmed_keys(monkeypatch):
    """The batched-decode check fails when rows attend to every column of the shared buffer."""
    spec, source = _spec("qwen3")

    def every_column(self, columns=None):
        return np.ones((len(self.pad), self.width if columns is None else columns), bool)

    monkeypatch.setattr(BatchKVCache, "_valid", every_column)
    with pytest.raises(VerifyError, match="batched decode differs"):
        verify_module("qwen3", load_source("qwen3_batch", source), spec.tiny_config)


def test_verify_catches_batch_positions_without_the_rows_mrope_deltas(monkeypatch):
    """An image row's MRoPE positions run behind its offset by its rope delta; forget it and
    the batched row no longer matches the row decoded alone."""
    spec, source = _spec("qwen2_vl")

    def no_deltas(self, input_ids, offset):
        return mrope.TextPositions(offset, input_ids.shape[1])

    monkeypatch.setattr(BatchPositions, "__call__", no_deltas)
    module = load_source("qwen2_vl_batch", source)
    with pytest.raises(VerifyError, match="batched decode differs"):
        verify_module("qwen2_vl", module, spec.tiny_config, spec.vision.image_token)


def test_verify_catches_a_trim_that_resets_recurrent_state(monkeypatch):
    """A hybrid's state layers: a trim that resets the Mamba2 state fails verify."""
    from mlxc.runtime.model.ssm import RecurrentCache

    spec, source = _spec("nemotron_h")

    def reset(self, n, keep=0):
        self.conv = self.ssm = None
        return n

    # A kind that counted its tokens as live and let --max-kv-size trim them would do this.
    monkeypatch.setattr(RecurrentCache, "trimmable", True)
    monkeypatch.setattr(RecurrentCache, "row_live_len", property(lambda self: self.offset))
    monkeypatch.setattr(RecurrentCache, "trim_front", reset)
    with pytest.raises(VerifyError, match="changed a recurrent layer's state"):
        verify_module("nemotron_h", load_source("nemotron_h_reset", source), spec.tiny_config)


def test_verify_catches_recurrent_state_that_does_not_carry_across_chunks():
    """A Mamba2 layer that starts each chunk's SSM state from zero: chunked != one pass."""
    spec, source = _spec("nemotron_h")
    broken = source.replace(
        "return super().__call__(x, cache)",
        "if cache.ssm is not None:\n"
        "            cache.ssm = mx.zeros_like(cache.ssm)\n"
        "        return super().__call__(x, cache)",
    )
    assert broken != source
    with pytest.raises(VerifyError, match="differs from one (forward )?pass"):
        verify_module("nemotron_h", load_source("nemotron_h_broken", broken), spec.tiny_config)
