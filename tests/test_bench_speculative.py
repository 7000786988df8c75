"""The step benches: bench.speculative's step costs (every timing starts from the prompt's cache,
each forward and the pipelined loop rewind what they added, and the ratios are of the times it
reports), bench.verify_probe's forward in pieces and whole, bench.step_compile's two ways."""

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


def test_step_compile_times_both_ways_and_restores_the_settings(monkeypatch):
    from bench import step_compile
    from mlxc.runtime.model import layers

    model = spec_model("llama")
    seen = []
    step_compiled = layers.step_compiled
    monkeypatch.setattr(
        layers,
        "step_compiled",
        lambda *a: seen.append((layers.STEP_TOKENS, mx.default_device())) or step_compiled(*a),
    )
    default, pieces = layers.STEP_TOKENS, layers.PIECE_LAYERS
    with step_compile._gpu_paths(True):
        got = step_compile.measure(model, [3, 9, 4, 7, 1, 8], queries=3, repeats=1, decode_tokens=4)
    assert mx.default_device() == mx.cpu and layers.PIECE_LAYERS == pieces
    assert layers.STEP_TOKENS == default
    assert {s for s, _ in seen} == {0, default} and all(d == mx.gpu for _, d in seen)
    for way in step_compile.WAYS:
        assert set(got[way]) == {"forward_1q", "forward_3q", "decode_tps"}
        assert got[way]["decode_tps"] > 0
        assert all(t > 0 for t in got[way]["forward_3q"].values())
    assert "| llama | 3q build |" in step_compile.report(
        {
            "device": "cpu",
            "mlx": "x",
            "size": "tiny",
            "quant": "bf16",
            "prompt_len": 6,
            "gpu_paths": True,
            "archs": {"llama": got},
        }
    )
