"""`extends: base`: a spec merged over another spec of its directory. Mappings merge key by key
(params per name and per field), lists and scalars replace; name, extends and tiny_config are
never inherited; findings about inherited values point into the base's file; the generated
header hashes the bases too, so a change to a base alone makes the child stale."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from mlxc.cli import main
from mlxc.compiler import build, lint

ROOT = Path(__file__).resolve().parents[1]
OK = (ROOT / "tests" / "fixtures" / "lint" / "ok.yaml").read_text()

CHILD = """\
name: child
extends: base
doc: A spec built on base.
serves: {model_types: [fixture-child]}
params:
  vocab_size: {from: text_config.vocab_size}
  extra: {type: list, default: [3]}
text:
  layers:
    attention:
      head_dim: 16
    mlp: [{kind: swiglu, hidden: 64}]
tiny_config: {hidden_size: 32, num_hidden_layers: 1, num_attention_heads: 2,
              text_config: {vocab_size: 64}}
"""


def write(directory: Path, name: str, text: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.yaml"
    path.write_text(text)
    return path


def base_text() -> str:
    return OK.replace("name: ok", "name: base")


def checked(paths) -> dict[str, lint.Checked]:
    return {Path(c.path).stem: c for c in lint.check_all([str(p) for p in paths])}


def codes(c: lint.Checked) -> list[str]:
    return [f.text() for f in c.findings]


def test_merge_semantics(tmp_path):
    write(tmp_path, "base", base_text())
    child = write(tmp_path, "child", CHILD)
    c = checked([child])["child"]
    assert c.findings == []
    spec = c.spec
    # params: the base's order, per field: the child's `from` over the base's type
    assert list(spec.params) == [
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "vocab_size",
        "rope",
        "extra",
    ]
    assert spec.params["vocab_size"].type == "int"
    assert spec.params["vocab_size"].from_ == "text_config.vocab_size"
    attention = spec.text.layers.attention
    assert attention.head_dim == 16  # a scalar replaced
    assert attention.heads == "num_attention_heads"  # siblings inherited
    assert attention.rope.param == "rope"
    assert [m.hidden for m in spec.text.layers.mlp] == [64]  # a list over a mapping replaces it
    assert spec.name == "child" and spec.doc == "A spec built on base."
    assert spec.tiny_config["text_config"] == {"vocab_size": 64}  # its own, not merged
    assert spec.serves.model_types == ["fixture-child"]


def test_own_fields_are_not_inherited(tmp_path):
    write(tmp_path, "base", base_text())
    child = write(tmp_path, "child", "\n".join(CHILD.splitlines()[:-2]) + "\n")  # no tiny_config
    [finding] = checked([child])["child"].findings
    assert finding.code == "S002" and "tiny_config" in finding.message


def test_lists_replace(tmp_path):
    write(tmp_path, "base", base_text() + "weights: {drop: ['a$', 'b$']}\n")
    child = write(tmp_path, "child", CHILD + "weights: {drop: ['c$']}\n")
    assert checked([child])["child"].spec.weights.drop == ["c$"]


def test_findings_in_inherited_values_point_at_the_base(tmp_path):
    base = write(
        tmp_path, "base", base_text().replace("hidden: 4 * hidden_size", "hidden: 4 * hiddn")
    )
    child = write(tmp_path, "child", CHILD.replace("    mlp: [{kind: swiglu, hidden: 64}]\n", ""))
    line = next(i for i, t in enumerate(base.read_text().splitlines(), 1) if "hiddn" in t)
    [finding] = checked([child])["child"].findings
    assert (finding.path, finding.line, finding.code) == (str(base), line, "P001")
    # a value the child overrides is checked where the child wrote it
    child.write_text(CHILD.replace("head_dim: 16", "head_dim: nope"))
    base.write_text(base_text())
    [finding] = checked([child])["child"].findings
    assert (finding.path, finding.line, finding.code) == (str(child), 11, "P001")
    # a field missing from a mapping both write: S002 at the mapping's key in the child
    base.write_text(base_text().replace("      kv_heads: num_attention_heads\n", ""))
    child.write_text(CHILD)
    [finding] = checked([child])["child"].findings
    assert (finding.path, finding.line, finding.col, finding.code) == (str(child), 10, 5, "S002")
    # ... and at the base's key where only the base writes it
    child.write_text(CHILD.replace("    attention:\n      head_dim: 16\n", ""))
    [finding] = checked([child])["child"].findings
    assert (finding.path, finding.code) == (str(base), "S002")


def test_a_base_finding_shows_once(tmp_path):
    write(tmp_path, "base", base_text().replace("hidden: 4 * hidden_size", "hidden: 4 * hiddn"))
    child = CHILD.replace("    mlp: [{kind: swiglu, hidden: 64}]\n", "")
    write(tmp_path, "child", child.replace("  extra: {type: list, default: [3]}\n", ""))
    result = CliRunner().invoke(main, ["lint", str(tmp_path)])
    assert result.exit_code == 1
    assert len(result.output.splitlines()) == 1 and "base.yaml" in result.output


def test_unknown_base_cycle_and_outside(tmp_path):
    a = write(tmp_path, "a", CHILD.replace("name: child", "name: a").replace("base", "b"))
    b = write(tmp_path, "b", CHILD.replace("name: child", "name: b").replace("base", "a"))
    found = checked([a, b])
    assert [f.code for f in found["a"].findings] == ["X002"]
    assert "a -> b -> a" in found["a"].findings[0].message
    assert (found["a"].findings[0].line, found["a"].findings[0].col) == (2, 10)
    assert found["a"].spec is None and found["b"].spec is None
    c = write(tmp_path, "c", CHILD.replace("name: child", "name: c").replace("base", "nothing"))
    assert [f.code for f in checked([c])["c"].findings] == ["X001"]
    (tmp_path / "sub").mkdir()
    write(tmp_path / "sub", "base", base_text())
    d = write(tmp_path, "d", CHILD.replace("name: child", "name: d").replace("base", "sub/base"))
    assert [f.code for f in checked([d])["d"].findings] == ["X003"]


def test_grandparent_chain(tmp_path):
    write(tmp_path, "base", base_text())
    write(tmp_path, "child", CHILD)
    grand = write(
        tmp_path,
        "grand",
        CHILD.replace("name: child", "name: grand")
        .replace("extends: base", "extends: child")
        .replace("fixture-child", "fixture-grand")
        .replace("head_dim: 16", "head_dim: 8"),
    )
    spec = checked([grand])["grand"].spec
    assert spec.text.layers.attention.head_dim == 8
    assert spec.params["vocab_size"].from_ == "text_config.vocab_size"
    assert spec.params["hidden_size"].type == "int"


def test_child_rebuilt_when_only_the_base_changes(tmp_path):
    specs, out = tmp_path / "specs", tmp_path / "generated"
    base = write(specs, "base", base_text())
    write(specs, "child", CHILD)
    build.write(build.render([str(specs)]).files, out)
    assert build.stale(build.render([str(specs)]).files, out) == ({}, [])
    base.write_text(base_text() + "# a comment: only the base changes\n")
    changed, _ = build.stale(build.render([str(specs)]).files, out)
    assert set(changed) == {"base.py", "child.py"}
    result = CliRunner().invoke(main, ["build", "--check", str(specs), "-o", str(out)])
    assert result.exit_code == 1
    assert "child.py" in result.output


def test_shipped_specs_extend():
    specs = checked([ROOT / "specs"])
    small, mistral4 = specs["mistral_small4"].spec, specs["mistral4"].spec
    assert list(small.params)[:-1] == list(mistral4.params)
    for name, p in mistral4.params.items():
        q = small.params[name]
        assert (q.type, q.default) == (p.type, p.default)
        assert q.from_ != p.from_
    assert small.text == mistral4.text
    q2, q25 = specs["qwen2_vl"].spec, specs["qwen2_5_vl"].spec
    assert (q25.params, q25.text, q25.weights) == (q2.params, q2.text, q2.weights)
    q3, q3m = specs["qwen3_vl"].spec, specs["qwen3_vl_moe"].spec
    assert q3.params == q2.params and q3.text.layers.attention == q3m.text.layers.attention


def test_user_specs_extend_in_their_directory(tmp_path):
    from mlxc.runtime.checkpoint.user_specs import compile_specs

    write(tmp_path, "base", base_text())
    write(tmp_path, "child", CHILD)
    compiled = {Path(c.path).stem: c for c in compile_specs([tmp_path], builtin={})}
    assert compiled["child"].spec.text.layers.attention.head_dim == 16
    assert hasattr(compiled["child"].module, "Model")
