"""The two labels an attention input can carry, and the one cache accessor each routes to.

After ``trim_front`` the two quantities part ways: ``cache.offset`` keeps counting every token
ever written, ``cache.live_len`` counts the keys still present. A block kind says which label
each input it consumes needs (``blocks/``); lint checks the spec's labels against that, and the
generated code reads each input through its label's accessor only.
"""

from __future__ import annotations

from dataclasses import dataclass

MONOTONIC = "monotonic-position"
LIVE_WINDOW = "live-window"
LABELS = (MONOTONIC, LIVE_WINDOW)

# The one accessor each label routes to, and the comment generated code carries with it.
ACCESSORS = {
    MONOTONIC: ("cache.offset", "absolute, never moved by trim_front"),
    LIVE_WINDOW: ("cache.live_len", "the keys present after trim_front"),
}


@dataclass
class Route:
    """An input as a template prints it: its label, the accessor it reads, and why."""

    label: str
    accessor: str
    why: str

    @property
    def attribute(self) -> str:
        """The cache attribute the accessor reads (``live_len`` of ``cache.live_len``)."""
        return self.accessor.rsplit(".", 1)[1]


def route(block, name: str) -> Route:
    """Where input ``name`` of ``block`` is read from; lint guarantees its label is right."""
    label = block.inputs[name]
    accessor, why = ACCESSORS[label]
    return Route(label, accessor, why)
