"""bench.gil_contention's variants: the burner thread runs (holding the GIL in bursts) exactly
while a burning variant is measured, at that variant's switch interval, and the report's
ratios are against the faster run alone. The scheduler itself is stubbed: what is checked is
the harness around it."""

from __future__ import annotations

import sys
import threading

from bench import ceiling, gil_contention


def test_each_variant_measures_with_its_burner_and_switch_interval(monkeypatch):
    seen = []

    def scheduler_tps(model_dir, levels, prompt_tokens, steps):
        burners = [t for t in threading.enumerate() if t.name == gil_contention.BURNER]
        seen.append((len(burners), sys.getswitchinterval()))
        tps = {b: 100.0 * (len(seen)) for b in levels}
        return tps, {b: {"tick": 1.0} for b in levels}

    monkeypatch.setattr(ceiling, "scheduler_tps", scheduler_tps)
    default = sys.getswitchinterval()
    rows = gil_contention.run("unused", [16, 64], 8, 4)
    assert [r["variant"] for r in rows] == [v[0] for v in gil_contention.VARIANTS]
    for (label, busy, _, interval), (burners, switch) in zip(gil_contention.VARIANTS, seen):
        assert burners == (1 if busy else 0), label
        assert switch == interval, label
    assert sys.getswitchinterval() == default
    assert not [t for t in threading.enumerate() if t.name == gil_contention.BURNER]
    text = gil_contention.markdown(rows, [16, 64], "cmd", "machine")
    # the faster run alone is the last (500 tokens/s): the first alone is 100 / 500
    assert "| alone | 100 (0.20) | 100 (0.20) |" in text
    assert "| alone again | 500 (1.00) | 500 (1.00) |" in text
