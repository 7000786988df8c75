"""What the compiler knows about one block kind, in one object.

A block kind fills one sublayer slot of a decoder layer (``attention`` or ``mlp``). Its
``BlockKind`` holds the pydantic schema of its mapping, the attention inputs it consumes with
the label each needs, what the code generator does not compile yet (C001), its template or
constructor, and the runtime names the generated module imports for it. Lint, codegen, the
schema's block unions and the README's block table all read it from the registry
(``blocks/__init__.py``).
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from mlxc.compiler.schema_base import Block


def _always(raw: dict) -> bool:
    return True


@dataclass(frozen=True)
class Input:
    """An input a block may consume, the label it requires, and when the block consumes it.

    ``consumed`` reads the block's raw mapping, so that labels are checked even where other
    parts of the spec have schema errors; ``when`` says the same in words (README).
    """

    name: str
    label: str
    when: str = ""  # e.g. "`rope`"; "": always
    consumed: Callable[[dict], bool] = _always


@dataclass(frozen=True)
class NotCompiled:
    """A construct the schema accepts in this block that the code generator does not compile."""

    field: tuple  # path inside the block
    message: str
    at_key: bool = False  # point at the field's key instead of its value


@dataclass(frozen=True)
class CacheKind:
    """What a layer caches between forwards: the ``runtime.model.cache.LayerCache`` class its
    generated ``make_cache`` builds for it (None: nothing, and no entry in the cache list).

    ``built_by_layer``: the cache depends on the layer's settings (a window), so the attention
    class builds it (its ``new_cache()``) and ``runtime`` is what that method calls.
    """

    name: str
    runtime: tuple[str, str] | None  # (module, class or factory)
    built_by_layer: bool = False


FULL_KV = CacheKind("full-kv", ("mlxc.runtime.model.cache", "KVCache"))  # trimmed by --max-kv-size
# Keeps what its sliding window can see, bounded by the window; full KV where it is null.
WINDOWED_KV = CacheKind("windowed-kv", ("mlxc.runtime.model.cache", "attention_cache"), True)
NO_CACHE = CacheKind("none", None)


@dataclass(frozen=True)
class Sharding:
    """How a block's module splits over the ranks of a tensor-parallel group: what the
    generated ``DecoderLayer.shard`` hands to ``runtime.model.parallel.shard``.

    Names are attributes of the module (dotted paths inside it); one the module lacks or holds
    as None (an optional projection, sinks turned off) is skipped. Heads and widths are schema
    fields of the block: a size that does not divide by the ranks is an error naming the
    config entries it comes from. A kind without a ``Sharding`` is replicated on every rank.
    """

    doc: str = ""  # one line, the comment over the generated call
    by_output: tuple[str, ...] = ()  # all-to-sharded: each rank computes its share of outputs
    by_input: tuple[str, ...] = ()  # sharded-to-all: partial products, summed over the ranks
    kv: tuple[str, ...] = ()  # split by key/value head; replicated when fewer heads than ranks
    per_head: tuple[str, ...] = ()  # arrays [heads, ...] split by head (gpt-oss sinks)
    heads: tuple[tuple[str, str], ...] = ()  # (module attribute, schema field): divided by N
    kv_heads: tuple[str, str] | None = None  # (module attribute, schema field) of the kv heads
    widths: tuple[str, ...] = ()  # schema fields of the widths split (named in errors)
    # The block sums its ranks' outputs itself, once (moe: routed and shared experts together):
    # its weights split in place and it all-reduces through its ``sharding_group``.
    reduces: bool = False


class BlockKind:
    """One block kind. A subclass sets the class attributes and overrides what it compiles."""

    part: typing.ClassVar[str]  # the slot it fills: "attention" or "mlp"
    schema: typing.ClassVar[type[Block]]  # its mapping; `kind: Literal[...]` names it
    doc: typing.ClassVar[str]  # one line, for the README's block table
    inputs: typing.ClassVar[tuple[Input, ...]] = ()
    # A kind with a template compiles to a class of the generated module named class_name;
    # the template is rendered with the kind's context() under the name of its part.
    template: typing.ClassVar[str | None] = None
    template_dir: typing.ClassVar[Path | None] = None  # None: compiler/templates
    class_name: typing.ClassVar[str | None] = None
    cache: typing.ClassVar[CacheKind] = NO_CACHE  # what each layer of this kind caches
    # How it splits under tensor parallelism (Model.shard); None: replicated on every rank.
    sharding: typing.ClassVar[Sharding | None] = None

    @property
    def kind(self) -> str:
        return typing.get_args(self.schema.model_fields["kind"].annotation)[0]

    def cache_kind(self, block) -> CacheKind:
        """What each layer of this block caches (the kind's ``cache`` unless a field decides)."""
        return self.cache

    def sharding_of(self, block) -> Sharding | None:
        """How this block splits over ranks (the kind's ``sharding`` unless a field decides)."""
        return self.sharding

    def consumes(self, raw: dict) -> set[str]:
        """The inputs a block, given as its raw mapping, consumes."""
        return {i.name for i in self.inputs if i.consumed(raw)}

    def not_compiled(self, block, spec) -> Iterable[NotCompiled]:
        return ()

    def context(self, block, gen) -> dict:
        """The template's context; it includes ``per_layer``: whether the class reads per-layer
        fields or ``layer_idx`` (its constructor then takes ``layer_idx``; see
        ``codegen._Gen.layer_dependence``)."""
        raise NotImplementedError(f"{self.kind} has no template")

    def ctor(self, block, gen) -> str | None:
        """The constructor call of a kind without a template; None: no sublayer at all."""
        raise NotImplementedError(f"{self.kind} blocks are not compiled")

    def runtime_imports(self, block) -> dict[str, set[str]]:
        """Runtime names its code uses: module -> names imported from it."""
        return {}

    def model_context(self, block, gen) -> dict:
        """Features of the model template this block switches on (codegen.MODEL_FEATURES)."""
        return {}
