"""Spec expressions: a small, safe subset of Python over params, layer fields and ``layer_idx``.

``heads // n_heads_in_group`` in a spec compiles to ``args.heads // layer_args.n_heads_in_group``
in the generated module. Only arithmetic, comparisons, boolean logic, conditional expressions,
literals and a few whitelisted functions are allowed.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

# Spec function name -> the name generated code calls.
FUNCTIONS = {
    "ceil": "math.ceil",
    "floor": "math.floor",
    "round_up": "round_up",  # round_up(n, k): smallest multiple of k >= n
    "min": "min",
    "max": "max",
    "int": "int",
    "float": "float",
    "len": "len",
}

_ALLOWED = (
    ast.Expression, ast.BinOp, ast.UnaryOp, ast.BoolOp, ast.Compare, ast.IfExp, ast.Call,
    ast.Name, ast.Constant, ast.Load, ast.List, ast.Tuple,
    ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow, ast.USub, ast.UAdd,
    ast.Not, ast.And, ast.Or, ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.In,
    ast.NotIn,
)  # fmt: skip


class ExprError(ValueError):
    """An invalid expression; ``col`` is the 0-based column inside the expression text."""

    def __init__(self, code: str, message: str, col: int = 0) -> None:
        super().__init__(message)
        self.code = code
        self.col = col


@dataclass(frozen=True)
class Scope:
    """Names an expression may use: params (``args.``) and per-layer fields (``layer_args.``)."""

    params: frozenset[str]
    fields: frozenset[str] = frozenset()
    layer_idx: bool = False

    def known(self) -> list[str]:
        extra = ["layer_idx"] if self.layer_idx else []
        return sorted(self.params | self.fields) + extra


def parse(text: str) -> ast.Expression:
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as err:
        raise ExprError("P002", f"invalid expression '{text}': {err.msg}", (err.offset or 1) - 1)
    for node in ast.walk(tree):
        if not isinstance(node, _ALLOWED):
            col = getattr(node, "col_offset", 0)
            raise ExprError(
                "P002", f"'{type(node).__name__}' is not allowed in spec expressions", col
            )
        if isinstance(node, ast.Call) and not (
            isinstance(node.func, ast.Name) and not node.keywords
        ):
            raise ExprError("P002", "only plain calls of whitelisted functions", node.col_offset)
    return tree


def names(text: str) -> list[tuple[str, int]]:
    """Free names used as values (not called), with their columns."""
    tree = parse(text)
    called = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    return [
        (n.id, n.col_offset)
        for n in ast.walk(tree)
        if isinstance(n, ast.Name) and id(n) not in called
    ]


def check(text: str, scope: Scope) -> None:
    """Raise ExprError on bad syntax, a disallowed construct or an undefined name."""
    tree = parse(text)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.func.id not in FUNCTIONS:
            raise ExprError(
                "P001",
                f"unknown function '{node.func.id}' (known: {', '.join(sorted(FUNCTIONS))})",
                node.col_offset,
            )
    for name, col in names(text):
        if name in scope.params or name in scope.fields:
            continue
        if name == "layer_idx" and scope.layer_idx:
            continue
        known = ", ".join(scope.known()) or "none"
        raise ExprError("P001", f"undefined name '{name}' (defined here: {known})", col)


class _Rewrite(ast.NodeTransformer):
    def __init__(self, scope: Scope, args: str, layer_args: str) -> None:
        self.scope, self.args, self.layer_args = scope, args, layer_args

    def visit_Call(self, node: ast.Call) -> ast.AST:
        node.args = [self.visit(a) for a in node.args]
        node.func = ast.Name(FUNCTIONS[node.func.id], ast.Load())
        return node

    def visit_Name(self, node: ast.Name) -> ast.AST:
        if node.id in self.scope.fields:
            return ast.Attribute(ast.Name(self.layer_args, ast.Load()), node.id, ast.Load())
        if node.id in self.scope.params:
            if not self.args:
                return node
            return ast.Attribute(ast.Name(self.args, ast.Load()), node.id, ast.Load())
        return node


def to_python(text: str, scope: Scope, args: str = "args", layer_args: str = "layer_args") -> str:
    """Python source for an expression, names resolved into ``args``/``layer_args``."""
    tree = _Rewrite(scope, args, layer_args).visit(parse(text))
    return ast.unparse(tree)
