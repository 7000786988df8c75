"""Block kinds come from one registry (compiler/blocks/): the README's block table, the labels
lint checks and what generated code imports agree with it, and a new kind is one registered
BlockKind, one template and one runtime module (a test-only kind here)."""

import re
import sys
import types
from pathlib import Path
from typing import Any, Literal

import mlx.core as mx
import pytest
from mlx import nn
from pydantic import Field

from mlxc.compiler import blocks, build, codegen, lint
from mlxc.compiler.blocks.base import FULL_KV, BlockKind, Input, NotCompiled
from mlxc.compiler.labels import LIVE_WINDOW, route
from mlxc.compiler.schema_base import Block, IntExpr
from mlxc.compiler.vision import TOWERS
from mlxc.verify import load_source

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
OK_SPEC = (ROOT / "tests" / "fixtures" / "lint" / "ok.yaml").read_text()


# --- the registry and what reads it ---------------------------------------------------------


def readme_row(kind: BlockKind) -> str:
    inputs = "; ".join(
        f"`{i.name}: {i.label}`" + (f" with {i.when}" if i.when else "") for i in kind.inputs
    )
    return f"| {kind.part} | `{kind.kind}` | {kind.doc} | {inputs or 'none'} |"


def test_readme_block_table_is_the_registry():
    rows = re.findall(r"^\| (?:attention|mlp) \| `.*$", README, re.MULTILINE)
    assert rows == [readme_row(k) for kinds in blocks.BLOCKS.values() for k in kinds.values()]


def test_readme_lists_the_vision_towers():
    [listed] = re.findall(r"`vision: \{tower: ([\w|]+)\}`", README)
    assert sorted(listed.split("|")) == sorted(TOWERS)


def test_an_input_needs_the_same_label_in_every_kind():
    labels: dict[str, set[str]] = {}
    for kind in blocks.BLOCKS["attention"].values():
        for i in kind.inputs:
            labels.setdefault(i.name, set()).add(i.label)
    assert all(len(found) == 1 for found in labels.values()), labels


@pytest.mark.parametrize("name", sorted(p.stem for p in (ROOT / "specs").glob("*.yaml")))
def test_model_template_imports_what_the_kinds_declare(name):
    # model.py.j2 still spells its runtime imports out; until it prints `runtime_imports`, they
    # must be exactly what codegen gathers from the block kinds, the vision tower and the
    # expressions (codegen.MODEL_IMPORTS for the template's own names).
    path = ROOT / "specs" / f"{name}.yaml"
    [checked] = lint.check_all([str(path)])
    label = build.spec_label(checked.path)
    declared = codegen.model_context(checked.spec, checked.source, label)["runtime_imports"]
    source = codegen.render_model(checked.spec, checked.source, label)
    header = [line for line in source.splitlines() if line.startswith("from mlxc.runtime")]
    assert "\n".join(header) == declared, (
        "model.py.j2 imports other runtime names than codegen gathers: print "
        "{{ runtime_imports }} there, or update codegen.MODEL_IMPORTS / the kinds' runtime_imports"
    )


# --- a test-only block kind ----------------------------------------------------------------

RUNTIME = "mlxc_test_toy_runtime"


class ToyMixer(nn.Module):
    """The toy kind's runtime: single-head causal attention over a cache's live keys."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)

    def project(self, x: mx.array) -> list[mx.array]:
        return [t[:, None] for t in mx.split(self.qkv(x), 3, axis=-1)]  # [B, 1, L, D] each

    def __call__(self, q: mx.array, keys: mx.array, values: mx.array, n_keys: int) -> mx.array:
        L = q.shape[2]
        # query i is live key n_keys - L + i: it sees the live keys up to itself
        seen = mx.arange(n_keys)[None] <= (n_keys - L + mx.arange(L))[:, None]
        scores = mx.where(seen, (q @ keys.swapaxes(-1, -2)) * q.shape[-1] ** -0.5, -mx.inf)
        return self.out((mx.softmax(scores, axis=-1) @ values)[:, 0])


TEMPLATE = """\
from mlxc_test_toy_runtime import ToyMixer  # until model.py.j2 prints runtime_imports


class ToyAttention(nn.Module):
    \"\"\"A test-only attention kind (tests/test_compiler_blocks.py).\"\"\"

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.mixer = ToyMixer({{ attention.dim }})

    def __call__(self, x: mx.array, cache: KVCache, *per_forward) -> mx.array:
        queries, keys, values = self.mixer.project(x)
        keys, values = cache.update_and_fetch(keys, values)
        # mask is {{ attention.mask.label }}: {{ attention.mask.accessor }}, {{ attention.mask.why }}
        return self.mixer(queries, keys, values, n_keys={{ attention.mask.accessor }})
"""


class Toy(Block):
    kind: Literal["toy"]
    window: IntExpr | None = None
    inputs: dict[str, Any] = Field(default_factory=dict)


class ToyKind(BlockKind):
    part = "attention"
    schema = Toy
    doc = "a test-only attention"
    inputs = (Input("mask", LIVE_WINDOW),)
    template = "attention_toy.py.j2"
    class_name = "ToyAttention"
    cache = FULL_KV

    def not_compiled(self, b: Toy, spec):
        if b.window is not None:
            yield NotCompiled(("window",), "toy windows are not compiled", at_key=True)

    def context(self, b: Toy, gen) -> dict:
        # model.py.j2 reads the routed mask, positions and scale of every attention context
        return {
            "dim": gen.py(gen.spec.text.embed.dim),
            "per_layer": False,
            "mask": route(b, "mask"),
            "positions": None,
            "attn_scale": None,
        }

    def runtime_imports(self, b: Toy) -> dict[str, set[str]]:
        return {RUNTIME: {"ToyMixer"}}


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """The toy kind, registered for one test; its template and runtime module live here."""
    runtime = types.ModuleType(RUNTIME)
    runtime.ToyMixer = ToyMixer
    monkeypatch.setitem(sys.modules, RUNTIME, runtime)
    (tmp_path / "templates").mkdir()
    (tmp_path / "templates" / ToyKind.template).write_text(TEMPLATE)
    kind = ToyKind()
    kind.template_dir = tmp_path / "templates"
    blocks.register(kind)
    yield kind
    blocks.unregister(kind)


GQA_BLOCK = """      kind: gqa
      heads: num_attention_heads
      kv_heads: num_attention_heads
      head_dim: hidden_size // num_attention_heads
      rope: {param: rope}
      inputs:
        positions: monotonic-position
        mask: live-window
"""


def toy_spec(block: str = "kind: toy\n      inputs: {mask: live-window}") -> str:
    assert OK_SPEC.count(GQA_BLOCK) == 1
    return OK_SPEC.replace(GQA_BLOCK, f"      {block}\n")


def findings(text: str) -> list[str]:
    return [f"{f.code} {f.message}" for f in lint.check_source(text, "ok.yaml").findings]


def test_a_registered_kind_lints_builds_and_runs(toy, tmp_path):
    text = toy_spec()
    assert findings(text) == []
    specs = tmp_path / "specs"
    specs.mkdir()
    (specs / "ok.yaml").write_text(text)
    result = build.render([str(specs)])
    assert result.findings == []
    source = result.files["ok.py"]
    assert "class ToyAttention(nn.Module):" in source
    assert "n_keys=cache.live_len)" in source  # the mask's label, routed to its accessor
    [checked] = lint.check_all([str(specs)])
    ctx = codegen.model_context(checked.spec, text, "specs/ok.yaml")
    assert f"from {RUNTIME} import ToyMixer" in ctx["runtime_imports"].splitlines()

    module = load_source("ok_toy", source)
    mx.random.seed(0)
    config = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2}
    model = module.Model(module.ModelArgs.from_config(config | {"vocab_size": 64}))
    assert type(model.model.layers[0].self_attn).__name__ == "ToyAttention"
    ids = mx.array([[1, 5, 9, 2, 7, 3, 8, 4]])
    full = model(ids)
    assert full.shape == (1, 8, 64)
    cache = model.make_cache()
    chunks = [model(ids[:, :5], cache=cache), model(ids[:, 5:6], cache=cache)]
    chunks.append(model(ids[:, 6:], cache=cache))
    assert mx.allclose(mx.concatenate(chunks, axis=1), full, atol=1e-5)


def test_a_registered_kinds_labels_and_c001_come_from_it(toy):
    l001 = (
        "L001 mask labelled monotonic-position: after trim_front the cache returns live_len "
        "keys, so a mask sized from offset is wider than K/V (broadcast_shapes); label it "
        "live-window"
    )
    assert findings(toy_spec("kind: toy\n      inputs: {mask: monotonic-position}")) == [l001]
    l003 = (
        "L003 toy attention consumes 'mask' but has no label for it "
        "(add `mask: live-window` under inputs)"
    )
    assert findings(toy_spec("kind: toy")) == [l003]
    labels = "inputs: {mask: live-window, positions: monotonic-position}"
    assert findings(toy_spec(f"kind: toy\n      {labels}")) == [
        "L005 a toy block here does not consume 'positions'"
    ]
    window = "kind: toy\n      window: 4\n      inputs: {mask: live-window}"
    assert findings(toy_spec(window)) == ["C001 toy windows are not compiled"]


def test_an_unregistered_kind_is_unknown():
    assert "toy" not in blocks.BLOCKS["attention"]
    assert findings(toy_spec()) == [
        "S004 unknown kind 'toy' (expected 'gqa', 'mla', 'linear', 'none', 'mamba2', 'mamba')",
        "L005 a toy block here does not consume 'mask'",
    ]


def test_each_kind_declares_what_its_layers_cache():
    # make_cache is built per layer from these; mlp kinds cache nothing.
    caches = {name: kind.cache.name for name, kind in blocks.BLOCKS["attention"].items()}
    assert caches == {
        "gqa": "full-kv",
        "mla": "full-kv",
        "linear": "none",
        "none": "none",
        "mamba2": "recurrent-state",
        "mamba": "recurrent-state",
    }
    assert {kind.cache.name for kind in blocks.BLOCKS["mlp"].values()} == {"none"}


def test_cache_policy_is_derived_unless_the_spec_says_it():
    [checked] = lint.check_all([str(ROOT / "tests" / "fixtures" / "lint" / "ok.yaml")])
    assert checked.spec.cache is None  # ok.yaml has no `cache:`
    assert codegen.model_context(checked.spec, OK_SPEC, "ok.yaml")["cache_policy"] == "pooled-kv"
    owned = checked.spec.model_copy(update={"cache": "model-owned"})
    assert codegen.model_context(owned, OK_SPEC, "ok.yaml")["cache_policy"] == "model-owned"


def test_nemotron_nas_layers_build_their_own_caches():
    from mlxc.runtime.model.cache import KVCache

    module = load_source(
        "nemotron_nas_caches", (ROOT / "generated" / "nemotron_nas.py").read_text()
    )
    [checked] = lint.check_all([str(ROOT / "specs" / "nemotron_nas.yaml")])
    model = module.Model(module.ModelArgs.from_config(checked.spec.tiny_config))
    kinds = [layer.new_cache for layer in model.model.layers]
    assert kinds == [KVCache, None, None, KVCache, KVCache]  # attention, no-op, linear, ...
    assert [type(c) for c in model.make_cache()] == [KVCache] * 3
