"""bench.encode_costs on the CPU at tiny shapes: every kind is built, evaluated and reported
(build, encode and wall microseconds an operation), in the JSON and as a Markdown row."""

from __future__ import annotations

import json

from bench import encode_costs


def test_every_kind_is_measured_and_reported(tmp_path, monkeypatch):
    tiny = {"H": 64, "E": 8, "K": 2, "I": 32, "HEADS": 4, "KV_HEADS": 2, "D": 64, "KEYS": 16}
    for name, value in tiny.items():
        monkeypatch.setattr(encode_costs, name, value)
    out = tmp_path / "enc"
    assert encode_costs.main(["--ops", "3", "--repeats", "2", "--out", str(out)]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    kinds = report["kinds"]
    assert len(kinds) >= 15 and "slice_update (a token into a cache buffer)" in kinds
    for r in kinds.values():
        assert set(r) == {"build", "encode", "wall"} and all(v >= 0 for v in r.values())
        assert r["build"] > 0  # making an operation costs the host something
    text = out.with_suffix(".md").read_text()
    assert all(f"| {kind} |" in text for kind in kinds)
