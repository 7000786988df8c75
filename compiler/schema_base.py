"""What the spec schema is built from: ``schema.py`` and every block kind's schema (``blocks/``).

Numbers and flags inside blocks may be literals or *expressions* (strings) over the spec's params,
the per-layer fields and ``layer_idx``; ``compiler/expr.py`` parses and checks them.
"""

from __future__ import annotations

import keyword
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict

IntExpr = int | str
FloatExpr = float | int | str
BoolExpr = bool | str


def _python_name(name: str) -> str:
    # Param and layer-field names (and the params other fields name) are emitted as names in
    # generated code; anything else there would be code (`__import__("os")...`).
    if not (name.isascii() and name.isidentifier()) or keyword.iskeyword(name):
        raise ValueError(
            f"{name!r} is not a Python name (ASCII letters, digits and _, not starting with a "
            "digit, not a keyword): the generated code uses it as one"
        )
    return name


Name = Annotated[str, AfterValidator(_python_name)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class Norm(Strict):
    kind: Literal["rms"] = "rms"
    eps: FloatExpr
    # Scale by 1 + weight: Gemma stores its norm weights around zero.
    unit_offset: bool = False


class RopeRef(Strict):
    """Which rope param an attention block applies, and how."""

    param: Name  # name of a param of type rope
    traditional: BoolExpr = False  # interleaved pairs (GPT-J style) instead of split halves
    dims: IntExpr | None = None  # rotate only the first `dims` features (default: all)
    mrope: Literal["chunked", "interleaved"] | None = None  # multimodal sections (Qwen VL)


class Block(Strict):
    """Base of every block kind's schema: a ``kind`` literal and these fields."""

    when: BoolExpr | None = None  # in a variant list: the condition that picks this variant
    # The class a kind with a template compiles to (default: the kind's own name for it); a
    # slot with two variants of one such kind names at least one of them.
    name: Name | None = None
