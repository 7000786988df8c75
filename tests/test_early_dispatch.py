"""A forward of several tokens sends its hidden state to the device every few layers on a GPU
(``layers.early_dispatch``): which layers, and that every generated model's logits and caches
are the same bit for bit with the pieces sent early as without."""

from __future__ import annotations

import mlx.core as mx
import pytest
from checkpoints import SPEC_NAMES, spec_model

from mlxc.runtime.model import layers
from mlxc.runtime.model.cache import cache_arrays


@pytest.fixture
def on_gpu_paths(monkeypatch):
    """``mx.default_device()`` answering a GPU (MLX's ops still run where they run)."""
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))


def test_pieces_on_a_gpu(on_gpu_paths, monkeypatch):
    monkeypatch.setattr(layers, "PIECE_LAYERS", 4)
    assert layers.early_dispatch(9, 16) == {3, 7, 11}  # never after the last layer
    assert layers.early_dispatch(2, 8) == {3}
    assert layers.early_dispatch(512, 4) == frozenset()
    assert layers.early_dispatch(1, 16) == frozenset()  # a decode step stays whole
    monkeypatch.setattr(layers, "PIECE_LAYERS", 0)
    assert layers.early_dispatch(9, 16) == frozenset()


def test_cpu_stays_whole(monkeypatch):
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.cpu))
    assert layers.early_dispatch(9, 16) == frozenset()


@pytest.mark.parametrize("name", SPEC_NAMES)
def test_same_logits_with_pieces(name, monkeypatch):
    model = spec_model(name)
    prompt, step = mx.array([[5, 9, 2, 7, 1]]), mx.array([[3]])

    def run(every: int) -> list[mx.array]:
        sent, chosen = [], []

        def early_dispatch(tokens: int, n_layers: int) -> frozenset[int]:
            chosen.append(frozenset(range(0, n_layers - 1, every or 1)) if tokens > 1 else set())
            return chosen[-1] if every else frozenset()

        monkeypatch.setattr(layers, "early_dispatch", early_dispatch)
        async_eval = mx.async_eval
        monkeypatch.setattr(mx, "async_eval", lambda *a: (sent.append(a), async_eval(*a)))
        cache = model.make_cache()
        out = [model(prompt, cache=cache), model(step, cache=cache)]
        mx.eval(out, cache_arrays(cache))
        monkeypatch.setattr(mx, "async_eval", async_eval)
        assert len(chosen) == 2 and not chosen[1]  # the one-token step is left whole
        if every:  # after each chosen layer of the prompt's forward
            assert chosen[0] and len(sent) == len(chosen[0])
        return out + cache_arrays(cache)

    whole = run(0)
    for every in (1, 2):
        pieces = run(every)
        assert len(pieces) == len(whole)
        for a, b in zip(whole, pieces):
            assert mx.array_equal(a, b, equal_nan=True).item()
