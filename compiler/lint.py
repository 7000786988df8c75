"""``mlxc lint``: check specs, report findings that point at lines.

``check_file`` returns the validated ``Spec`` (None when it is unusable) and its findings; the
build runs the same checks and writes nothing when any finding remains.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from pathlib import Path as FsPath

import pydantic

from mlxc.compiler import blocks, expr, extends, schema
from mlxc.compiler.findings import Finding
from mlxc.compiler.labels import LABELS, LIVE_WINDOW
from mlxc.compiler.schema_base import BoolExpr, FloatExpr, IntExpr
from mlxc.compiler.source import Positions
from mlxc.compiler.vision import TOWERS

EXPR_TYPES = {IntExpr, FloatExpr, BoolExpr}


@dataclass
class Checked:
    path: str
    spec: schema.Spec | None
    positions: Positions
    findings: list[Finding]
    source: str


class _Reporter:
    def __init__(self, path: str, positions: Positions) -> None:
        self.path, self.positions = path, positions
        self.findings: list[Finding] = []

    def at_value(self, loc, code: str, message: str, col_shift: int = 0) -> None:
        line, col = self.positions.value(loc)
        if col_shift:
            col += col_shift + (1 if tuple(loc) in self.positions.quoted else 0)
        path = self.positions.value_file(loc) or self.path  # an inherited value: its base file
        self.findings.append(Finding(path, line, col, code, message))

    def at_key(self, loc, code: str, message: str) -> None:
        line, col = self.positions.key(loc)
        path = self.positions.key_file(loc) or self.path
        self.findings.append(Finding(path, line, col, code, message))


# --- schema errors ------------------------------------------------------------------------


def _resolve(data, loc) -> tuple[tuple, bool]:
    """Map a pydantic error location onto a path in ``data``, skipping union branch labels.

    Returns (path, relevant): an error from the list branch of ``X | list[X]`` raised on a
    mapping (or the reverse) is noise from the branch the data did not take.
    """
    path: list = []
    node = data
    kinds = blocks.kind_names()  # pydantic puts the discriminator tag into error locations
    for part in loc:
        if (isinstance(node, dict) and part in node) or (
            isinstance(node, list) and isinstance(part, int) and part < len(node)
        ):
            path.append(part)
            node = node[part]
        elif isinstance(part, str) and part.startswith("list["):
            if not isinstance(node, list):
                return tuple(path), False
        elif isinstance(part, str) and part.startswith(("tagged-union", "function-")):
            if isinstance(node, list):
                return tuple(path), False
        elif isinstance(part, str) and part in ("int", "float", "str", "bool", "none"):
            pass  # scalar branch of a union
        elif isinstance(part, str) and part[:1].isupper() and isinstance(node, list):
            return tuple(path), False  # model branch tried on a list
        elif isinstance(part, str) and part in kinds:
            pass  # discriminator tag
        else:
            path.append(part)  # a missing field: keep the name for the message
            node = None
    return tuple(path), True


_TYPE_WORDS = {
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "string_type": "an expression string",
    "list_type": "a list",
    "dict_type": "a mapping",
    "model_type": "a mapping",
    "model_attributes_type": "a mapping",
    "none_required": "null",
}


def _schema_findings(data, rep: _Reporter) -> schema.Spec | None:
    """Validate against the schema; report errors and return None, or return the spec."""
    try:
        return schema.Spec.model_validate(data)
    except pydantic.ValidationError as err:
        errors = err.errors(include_url=False)
    type_errors: dict[tuple, list[str]] = {}
    for e in errors:
        path, relevant = _resolve(data, e["loc"])
        if not relevant:
            continue
        kind = e["type"]
        if e["loc"][-1:] == ("[key]",):  # a mapping key: a param or layer-field name
            rep.at_key(path[:-1], "S003", _message(e))
        elif kind == "extra_forbidden":
            rep.at_key(path, "S001", f"unknown field '{path[-1]}'")
        elif kind == "missing":
            parent = path[:-1]
            where = f" in '{parent[-1]}'" if parent and isinstance(parent[-1], str) else ""
            rep.at_key(parent, "S002", f"missing required field '{path[-1]}'{where}")
        elif kind == "union_tag_invalid":
            tags = e["ctx"]["expected_tags"]
            rep.at_value(
                path + ("kind",), "S004", f"unknown kind '{e['ctx']['tag']}' (expected {tags})"
            )
        elif kind == "union_tag_not_found":
            rep.at_key(path, "S002", "missing required field 'kind'")
        elif kind in _TYPE_WORDS:
            type_errors.setdefault(path, []).append(_TYPE_WORDS[kind])
        else:
            rep.at_value(path, "S003", _message(e))
    for path, words in type_errors.items():
        expected = " or ".join(dict.fromkeys(words))
        got = _describe(_get(data, path))
        name = f"'{path[-1]}' " if path and isinstance(path[-1], str) else ""
        rep.at_value(path, "S003", f"{name}must be {expected}, got {got}")
    return None


def _message(error: dict) -> str:
    if error["type"] == "value_error":  # our own validators: their text, without pydantic's prefix
        return str(error["ctx"]["error"])
    return error["msg"].rstrip(".")


def _get(data, path):
    for part in path:
        try:
            data = data[part]
        except (KeyError, IndexError, TypeError):
            return None
    return data


def _describe(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (dict, list)):
        return "a mapping" if isinstance(value, dict) else "a list"
    return repr(value)


# --- semantic checks ----------------------------------------------------------------------


def _field_key(model: pydantic.BaseModel, name: str) -> str:
    alias = type(model).model_fields[name].alias
    return alias or name


def _is_expr_field(annotation) -> bool:
    if annotation in EXPR_TYPES:
        return True
    # `IntExpr | None` flattens to int | str | None: an expression field that may be left out.
    args = set(typing.get_args(annotation)) - {type(None)}
    if any(args == set(typing.get_args(t)) for t in EXPR_TYPES):
        return True
    return bool(args) and any(_is_expr_field(a) for a in args)


def _walk_exprs(model: pydantic.BaseModel, path: tuple):
    """Yield (path, text) for every expression string in ``model``'s expression fields."""
    for name, field in type(model).model_fields.items():
        value = getattr(model, name)
        key = _field_key(model, name)
        if isinstance(value, str) and _is_expr_field(field.annotation):
            yield path + (key,), value
        elif isinstance(value, pydantic.BaseModel):
            yield from _walk_exprs(value, path + (key,))
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, pydantic.BaseModel):
                    yield from _walk_exprs(item, path + (key, i))


def _check_expr(text: str, scope: expr.Scope, loc: tuple, rep: _Reporter) -> None:
    try:
        expr.check(text, scope)
    except expr.ExprError as err:
        rep.at_value(loc, err.code, str(err), col_shift=err.col)


def _variants(block, loc: tuple) -> list[tuple[object, tuple]]:
    if isinstance(block, list):
        return [(b, loc + (i,)) for i, b in enumerate(block)]
    return [(block, loc)]


def _check_variants(block, loc: tuple, rep: _Reporter) -> None:
    if not isinstance(block, list):
        if block.when is not None:
            rep.at_key(loc + ("when",), "S005", "`when` only makes sense in a list of variants")
        return
    for i, b in enumerate(block):
        last = i == len(block) - 1
        if last and b.when is not None:
            rep.at_key(loc + (i, "when"), "S005", "the last variant is the fallback: drop `when`")
        if not last and b.when is None:
            rep.at_value(loc + (i,), "S005", "every variant but the last needs `when`")


def _check_labels(raw: dict, loc: tuple, rep: _Reporter) -> None:
    """Labels of one attention block, read from its raw mapping (labels are checked even when
    other parts of the spec have schema errors)."""
    kind = raw.get("kind")
    block = blocks.BLOCKS["attention"].get(kind) if isinstance(kind, str) else None
    needs = {} if block is None else {i.name: i.label for i in block.inputs}
    consumed = set() if block is None else block.consumes(raw)
    inputs = raw.get("inputs") or {}
    if not isinstance(inputs, dict):
        return  # a schema error (S003) already
    known = blocks.known_inputs()
    for name, label in inputs.items():
        at = loc + ("inputs", name)
        if name not in known:
            rep.at_key(at, "L005", f"unknown attention input '{name}' (known: {', '.join(known)})")
            continue
        if name not in consumed:
            rep.at_key(at, "L005", f"a {kind} block here does not consume '{name}'")
            continue
        if label not in LABELS:
            rep.at_value(
                at,
                "L004",
                f"'{label}' is not a label: use monotonic-position or live-window",
            )
            continue
        right = needs[name]
        if label == right:
            continue
        if right == LIVE_WINDOW:
            rep.at_value(
                at,
                "L001",
                f"{name} labelled monotonic-position: after trim_front the cache returns "
                f"live_len keys, so a {name} sized from offset is wider than K/V "
                f"(broadcast_shapes); label it live-window",
            )
        else:
            rep.at_value(
                at,
                "L002",
                f"{name} labelled live-window: live_len shrinks on trim_front, so {name} "
                f"would regress after a trim; label it monotonic-position (cache.offset)",
            )
    for name in sorted(consumed - set(inputs)):
        where = loc + ("inputs",) if "inputs" in raw else loc + ("kind",)
        rep.at_key(
            where,
            "L003",
            f"{kind} attention consumes '{name}' but has no label for it "
            f"(add `{name}: {needs[name]}` under inputs)",
        )


def _label_findings(data: dict, rep: _Reporter) -> None:
    loc = ("text", "layers", "attention")
    block = _get(data, loc)
    blocks = enumerate(block) if isinstance(block, list) else [(None, block)]
    for i, raw in blocks:
        if isinstance(raw, dict):
            _check_labels(raw, loc if i is None else loc + (i,), rep)


def _check_supported(spec: schema.Spec, rep: _Reporter) -> None:
    layers = spec.text.layers
    base = ("text", "layers")
    for part in blocks.PARTS:
        for b, loc in _variants(getattr(layers, part), base + (part,)):
            for nc in blocks.kind_of(part, b).not_compiled(b, spec):
                report = rep.at_key if nc.at_key else rep.at_value
                report(loc + nc.field, "C001", nc.message)
        # Each variant of a kind with a template compiles to its own class, under its name.
        classes = [
            b.name or kind.class_name
            for b, _ in _variants(getattr(layers, part), ())
            if (kind := blocks.kind_of(part, b)).template is not None
        ]
        for name in {c for c in classes if classes.count(c) > 1}:
            rep.at_key(
                base + (part,),
                "C001",
                f"two {part} variants compile to class {name}: give one a `name`",
            )
    if layers.deepstack and (spec.vision is None or not TOWERS[spec.vision.tower].deepstack):
        towers = " or ".join(name for name, t in TOWERS.items() if t.deepstack)
        rep.at_key(base + ("deepstack",), "C001", f"deepstack needs the {towers} tower")
    if spec.vision is not None and spec.vision.image_token not in spec.params:
        rep.at_value(
            ("vision", "image_token"), "P001", f"'{spec.vision.image_token}' is not a param"
        )


def _check_param_cycles(spec: schema.Spec, rep: _Reporter) -> None:
    _, cycles = expr.param_order({n: p.default_expr for n, p in spec.params.items()})
    for cycle in cycles:
        loc = ("params", cycle[0], "default")
        rep.at_key(loc, "P003", f"cyclic param defaults: {' -> '.join(cycle)}")


def _semantic_findings(spec: schema.Spec, rep: _Reporter) -> None:
    params = frozenset(spec.params)
    numbers = {n for n, p in spec.params.items() if p.type in expr.NUMBER_TYPES}
    param_scope = expr.Scope(params, numbers=frozenset(numbers))
    for name, p in spec.params.items():
        if p.default_expr is not None:
            _check_expr(p.default_expr, param_scope, ("params", name, "default"), rep)
        for key in ("layer_type", "theta_from"):
            if getattr(p, key) is not None and p.type != "rope":
                rep.at_key(("params", name, key), "S003", f"`{key}` is for params of type rope")
        is_number = isinstance(p.default, int | float) and not isinstance(p.default, bool)
        if p.type == "rope" and p.default is not None and not is_number:
            rep.at_key(
                ("params", name, "default"), "S003", "a rope's default is its theta, a number"
            )
    _check_param_cycles(spec, rep)

    layers = spec.text.layers
    lbase = ("text", "layers")
    if (layers.repeat is None) == (layers.for_each is None):
        rep.at_key(lbase, "S003", "layers need exactly one of `repeat` or `for_each`")
    if layers.fields and layers.for_each is None:
        rep.at_key(lbase + ("fields",), "S003", "`fields` are read per entry of `for_each`")
    if layers.for_each is not None:
        p = spec.params.get(layers.for_each)
        if p is None or p.type != "list":
            rep.at_value(lbase + ("for_each",), "P001", f"'{layers.for_each}' is not a list param")
    fields = frozenset(layers.fields)
    numbers = (numbers - fields) | {
        n for n, f in layers.fields.items() if f.type in expr.NUMBER_TYPES
    }
    layer_scope = expr.Scope(params, fields, layer_idx=True, numbers=frozenset(numbers))

    for path, text in _walk_exprs(spec.text, ("text",)):
        in_layers = path[:2] == lbase and path[2:3] != ("repeat",)
        _check_expr(text, layer_scope if in_layers else param_scope, path, rep)

    for i, rule in enumerate(spec.weights.rename):  # per-layer renames: layer scope
        if isinstance(rule.when, str):
            _check_expr(rule.when, layer_scope, ("weights", "rename", i, "when"), rep)

    for part in blocks.PARTS:
        block = getattr(layers, part)
        _check_variants(block, lbase + (part,), rep)
        for b, loc in _variants(block, lbase + (part,)):
            if part == "attention":
                rope = getattr(b, "rope", None)
                if rope is not None:
                    p = spec.params.get(rope.param)
                    if p is None or p.type != "rope":
                        rep.at_value(
                            loc + ("rope", "param"), "P001", f"'{rope.param}' is not a rope param"
                        )
    _check_supported(spec, rep)


def check_source(text: str, path: str) -> Checked:
    """Check the spec ``text`` at ``path`` (its ``extends:`` base is read from path's directory).

    ``Checked.source`` is the text the generated header hashes: ``text``, then its bases' texts.
    """
    loaded = extends.load(text, path)
    data, positions = loaded.data, loaded.positions
    rep = _Reporter(path, positions)
    rep.findings.extend(loaded.findings)
    spec = None
    if data is not None and not isinstance(data, dict):
        rep.at_value((), "S003", "a spec must be a mapping at the top level")
    elif data is not None:
        valid = _schema_findings(data, rep)
        _label_findings(data, rep)
        if valid is not None:
            _semantic_findings(valid, rep)
        if not rep.findings:
            spec = valid
    return Checked(path, spec, positions, sorted(set(rep.findings)), loaded.source)


def check_file(path: FsPath) -> Checked:
    text, finding = extends.read(path)
    if finding is not None:
        return Checked(str(path), None, Positions(), [finding], "")
    return check_source(text, str(path))


class UnusableInput(Exception):
    """Nothing to lint: a path that does not exist, or a directory without specs."""


def spec_files(paths: list[str]) -> list[FsPath]:
    files: list[FsPath] = []
    for p in map(FsPath, paths):
        if p.is_dir():
            found = sorted([*p.glob("*.yaml"), *p.glob("*.yml")])
            if not found:
                raise UnusableInput(f"{p}: no *.yaml specs in this directory")
            files.extend(found)
        elif p.is_file():
            files.append(p)
        else:
            raise UnusableInput(f"{p}: no such file or directory")
    return files


def check_all(paths: list[str]) -> list[Checked]:
    """Check every spec under ``paths``, plus the rules that span specs (R001)."""
    checked = [check_file(f) for f in spec_files(paths)]
    seen: set[Finding] = set()
    for c in checked:  # a finding in a base shows once, not once more per spec extending it
        c.findings = [f for f in c.findings if f not in seen]
        seen.update(c.findings)
    served: dict[str, str] = {}
    for c in checked:
        if c.spec is None:
            continue
        rep = _Reporter(c.path, c.positions)
        for mt in c.spec.serves.registry_keys():
            if mt in served:
                i = c.spec.serves.model_types.index(mt.split(":")[0])
                rep.at_value(
                    ("serves", "model_types", i),
                    "R001",
                    f"model_type '{mt}' is already served by {served[mt]}",
                )
            else:
                served[mt] = c.path
        if c.spec.name != FsPath(c.path).stem:
            rep.at_value(("name",), "R002", f"spec name '{c.spec.name}' must match its file name")
        c.findings = sorted(set(c.findings + rep.findings))
    return checked
