"""The registry of block kinds: one module each (``gqa.py``, ``moe.py``, ...), listed here.

The schema's block unions, lint (labels, C001), codegen and the README's block table read what
a kind needs from its ``BlockKind`` here, and from nowhere else: a new kind is one module, its
template and its runtime module, plus a ``register`` call.
"""

from __future__ import annotations

from mlxc.compiler.blocks import dense, gqa, linear, mamba, mamba2, mla, moe, none, swiglu
from mlxc.compiler.blocks.base import BlockKind

PARTS = ("attention", "mlp")  # the sublayer slots of a decoder layer (fields of schema.Layers)

# slot -> kind name -> BlockKind, in the order the schema's unions (and S004's message) list them
BLOCKS: dict[str, dict[str, BlockKind]] = {part: {} for part in PARTS}

for _kind in (
    gqa.KIND, mla.KIND, linear.ATTENTION, none.ATTENTION, mamba2.KIND, mamba.KIND,
    swiglu.KIND, linear.MLP, none.MLP, moe.KIND, dense.KIND,
):  # fmt: skip
    BLOCKS[_kind.part][_kind.kind] = _kind


def _rebuild_schema() -> None:
    from mlxc.compiler import schema  # schema imports this module: import it when needed

    schema.rebuild()


def register(kind: BlockKind) -> None:
    """Add a block kind; specs may use it from now on."""
    if kind.kind in BLOCKS[kind.part]:
        raise ValueError(f"a {kind.part} kind '{kind.kind}' is registered already")
    BLOCKS[kind.part][kind.kind] = kind
    _rebuild_schema()


def unregister(kind: BlockKind) -> None:
    del BLOCKS[kind.part][kind.kind]
    _rebuild_schema()


def kind_of(part: str, block) -> BlockKind:
    """The kind of a validated block in slot ``part``."""
    return BLOCKS[part][block.kind]


def variants(slot) -> list:
    """The blocks of a slot: its list of variants, or the one block."""
    return slot if isinstance(slot, list) else [slot]


def kind_names() -> set[str]:
    return {name for kinds in BLOCKS.values() for name in kinds}


def known_inputs() -> dict[str, str]:
    """Every input an attention kind consumes -> its label, in registration order."""
    known: dict[str, str] = {}
    for kind in BLOCKS["attention"].values():
        for i in kind.inputs:
            known.setdefault(i.name, i.label)
    return known
