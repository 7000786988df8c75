"""bench.speculative's step costs: every timing starts from the prompt's cache (each forward and
the pipelined loop rewind what they added), and the ratios are of the times it reports."""

import mlx.core as mx
from checkpoints import spec_model

from bench import speculative
from mlxc.runtime.model import cache as cache_module


def test_step_cost_rewinds_and_reports(monkeypatch):
    model = spec_model("llama")
    made = []
    make_caches = cache_module.make_caches
    monkeypatch.setattr(
        cache_module, "make_caches", lambda m: made.append(make_caches(m)) or made[-1]
    )
    prompt = [3, 9, 4, 7, 1, 8, 2, 6]
    cost = speculative.step_cost(model, prompt, k=3, repeats=1)
    (cache,) = made
    assert cache.offset == len(prompt)  # every forward and the loop rewound
    assert all(cost[key] > 0 for key in ("one_token_s", "verify_s", "pipelined_step_s"))
    assert cost["ratio"] == cost["verify_s"] / cost["one_token_s"]
    assert cost["ratio_pipelined"] == cost["verify_s"] / cost["pipelined_step_s"]
    mx.eval(model(mx.array([prompt[-1:]]), cache=cache))  # the cache still takes a step
    assert cache.offset == len(prompt) + 1


def test_verify_probe_times_pieces_and_whole_and_restores_the_setting(monkeypatch):
    from bench import verify_probe
    from mlxc.runtime.model import layers

    model = spec_model("llama")
    seen = []
    early_dispatch = layers.early_dispatch
    monkeypatch.setattr(
        layers,
        "early_dispatch",
        lambda t, n: seen.append(layers.PIECE_LAYERS) or early_dispatch(t, n),
    )
    rows = verify_probe.probe(model, 12, [1, 3], count=1, repeats=1, parts=False)
    assert [r["queries"] for r in rows] == [1, 3]
    for key in ("forward_s", "forward_whole_s", "forward_build_s", "forward_device_s"):
        assert all(r[key] > 0 for r in rows)
    assert set(seen) == {layers.PIECE_LAYERS, 0}  # both ways, and the setting given back
