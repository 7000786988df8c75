"""An attention layer's work before its cache runs through ``mx.compile`` for a step's few tokens
on a GPU (``layers.step_compiled``): every generated model's logits are the same bit for bit
with it as without, for a sequence's steps and a verification's tokens (its offset an int, given
to the trace as an array) and for a decode batch (offsets per row). On this CPU the GPU's paths
are taken by ``mx.default_device`` answering a GPU; MLX's ops still run on the CPU."""

from __future__ import annotations

import mlx.core as mx
import pytest
from checkpoints import SPEC_NAMES, spec_model

from mlxc.runtime.model import layers
from mlxc.runtime.model.batch import BatchCache


def _forwards(model, compiled: bool, monkeypatch) -> list[mx.array]:
    monkeypatch.setattr(layers, "STEP_TOKENS", 16 if compiled else 0)
    prompt = mx.array([[(7 * i) % 50 + 3 for i in range(20)]])  # 20 tokens: as written
    cache = model.make_cache()
    out = [model(prompt, cache=cache)]
    for ids in ([[4]], [[9]], [[5, 8, 2, 6]]):  # two steps, then a verification of 4
        out.append(model(mx.array(ids), cache=cache))
    if BatchCache.accepts(cache):  # two rows at their own offsets, one step
        other = model.make_cache()
        out.append(model(prompt[:, :13], cache=other))
        batch = BatchCache.like(cache)
        batch.extend([cache, other])
        out.append(model(mx.array([[3], [11]]), cache=batch))
    mx.eval(out)
    return out


@pytest.mark.parametrize("name", SPEC_NAMES)
def test_same_logits_compiled(name, monkeypatch):
    model = spec_model(name)
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))
    calls = []
    compile_ = mx.compile
    monkeypatch.setattr(mx, "compile", lambda *a, **k: calls.append(a) or compile_(*a, **k))
    whole = _forwards(model, compiled=False, monkeypatch=monkeypatch)
    assert not any(getattr(a[0], "__name__", "") == "project" for a in calls)
    stepped = _forwards(model, compiled=True, monkeypatch=monkeypatch)
    assert any(getattr(a[0], "__name__", "") == "project" for a in calls)  # the path was taken
    assert len(whole) == len(stepped)
    for a, b in zip(whole, stepped):
        assert mx.array_equal(a, b).item()


def test_cpu_prompts_and_split_layers_run_as_written(monkeypatch):
    calls = []

    def project(x, offset):
        calls.append(offset)
        return x

    class Layer:  # stands in for a module: only its __dict__ is read
        pass

    layer = Layer()
    project.__self__ = layer  # what a bound method has
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.cpu))
    layers.step_compiled(project, mx.zeros((1, 1, 4)), 3)
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))
    layers.step_compiled(project, mx.zeros((1, layers.STEP_TOKENS + 1, 4)), 5)
    layer.split_over = "group"  # as parallel.split_module marks a layer split over ranks
    layers.step_compiled(project, mx.zeros((1, 1, 4)), 7)
    assert calls == [3, 5, 7] and "_step_compiled" not in layer.__dict__
