"""The spec language of the hybrids (specs/nemotron_h.yaml, specs/jamba.yaml): state-space
block kinds in the attention slot, and weight renames that hold for some layers only."""

from pathlib import Path

import mlx.core as mx

from mlxc.compiler import build, lint
from mlxc.runtime.checkpoint.user_specs import load_source

ROOT = Path(__file__).resolve().parents[1]
SPEC = (ROOT / "specs" / "nemotron_h.yaml").read_text()


def findings(text: str) -> list[str]:
    return [f"{f.code} {f.message}" for f in lint.check_source(text, "nemotron_h.yaml").findings]


def test_a_per_layer_rename_condition_is_checked_in_the_layer_scope():
    assert findings(SPEC) == []
    broken = SPEC.replace("in ('mlp', 'moe', '-', 'E')", "in layer_kinds", 1)
    assert broken != SPEC
    [finding] = findings(broken)
    assert finding.startswith("P001 undefined name 'layer_kinds'")


def test_a_mamba_block_consumes_no_attention_input():
    labelled = SPEC.replace(
        "        kind: mamba2\n", "        kind: mamba2\n        inputs: {mask: live-window}\n"
    )
    assert labelled != SPEC
    assert findings(labelled) == ["L005 a mamba2 block here does not consume 'mask'"]


def test_per_layer_renames_follow_each_layers_type(tmp_path):
    """One checkpoint name (`mixer`, `norm`) becomes the attention slot's in the Mamba2 and
    attention layers, the MLP slot's in the others; other names pass through."""
    specs = tmp_path / "specs"
    specs.mkdir()
    (specs / "nemotron_h.yaml").write_text(SPEC)
    [checked] = lint.check_all([str(specs)])
    module = load_source("nemotron_h_renames", build.render([str(specs)]).files["nemotron_h.py"])
    config = dict(checked.spec.tiny_config, hybrid_override_pattern="M-*E")
    model = module.Model(module.ModelArgs.from_config(config))
    w = mx.zeros((1,))
    names = [f"backbone.layers.{i}.{part}" for i in range(4) for part in ("norm.weight", "mixer.x")]
    got = sorted(model.sanitize({n: w for n in names + ["backbone.norm_f.weight", "mtp.x"]}))
    assert got == sorted([
        "model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.x",
        "model.layers.1.post_attention_layernorm.weight", "model.layers.1.mlp.x",
        "model.layers.2.input_layernorm.weight", "model.layers.2.self_attn.x",
        "model.layers.3.post_attention_layernorm.weight", "model.layers.3.mlp.x",
        "model.norm.weight",
    ])  # fmt: skip
    # A layer the model does not have keeps its name (the strict load then names it).
    assert list(model.sanitize({"backbone.layers.9.mixer.x": w})) == ["model.layers.9.mixer.x"]


def test_an_expression_field_that_may_be_left_out_is_linted_too():
    """`IntExpr | None` fields (moe latent, gqa sliding_window, ...) were skipped by lint: an
    undefined name there passed lint and failed only when the model was built."""
    broken = SPEC.replace("latent: moe_latent_size", "latent: moe_latent_width")
    assert broken != SPEC
    [finding] = findings(broken)
    assert finding.startswith("P001 undefined name 'moe_latent_width'")
