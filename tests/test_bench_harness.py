"""bench.harness takes the sides of a comparison in turn: no side always runs first in a round."""

from __future__ import annotations

from bench import harness


def test_in_turn_puts_each_item_in_every_place_equally_often():
    items = ["a", "b", "c"]
    orders = [harness.in_turn(items, r) for r in range(6)]
    assert orders[0] == items and orders[3] == items
    for place in range(3):
        firsts = [order[place] for order in orders]
        assert sorted(firsts) == sorted(items * 2)  # each item twice in each place
    assert all(sorted(order) == items for order in orders)  # nothing lost or repeated
    assert harness.in_turn([], 3) == []


def test_measure_takes_the_sides_in_turn(monkeypatch):
    order = []

    def run_once(side, ids, max_tokens):
        order.append(side.name)
        return harness.Run(1.0, 10.0, [100.0], 0, 0.0, [1])

    class Fake:
        def __init__(self, name):
            self.name = name

    monkeypatch.setattr(harness, "run_once", run_once)
    sides = [Fake("mlxc"), Fake("mlx-lm")]
    harness.measure(
        sides,
        harness.Cell("x", [1, 2], 2),
        repeats=4,
        budget_s=1e9,
        warmup=False,
        log=lambda m: None,
    )
    assert order == ["mlxc", "mlx-lm", "mlx-lm", "mlxc", "mlxc", "mlx-lm", "mlx-lm", "mlxc"]
