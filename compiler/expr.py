"""Spec expressions: a small, safe subset of Python over params, layer fields and ``layer_idx``.

``heads // n_heads_in_group`` in a spec compiles to ``args.heads // layer_args.n_heads_in_group``
in the generated module. Only arithmetic, comparisons, boolean logic, conditional expressions,
literals, indexing (``layer_types[layer_idx]``, no slices) and a few whitelisted functions are
allowed.
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
    ast.Name, ast.Constant, ast.Load, ast.List, ast.Tuple, ast.Subscript,
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


NUMBER_TYPES = ("int", "float", "bool")  # param and field types that arithmetic may use

# Evaluation must stay bounded, and it runs in generated code on config.json values, whose ints
# Python caps at 4300 digits. A number grows only by multiplying, so every subexpression's
# *degree* (the factors it multiplies; ``x ** 3`` is three) is bounded, which needs exponents to
# be literals. Arithmetic takes numbers only: ``[0] * n`` or ``"%09999d" % 1`` would size a value
# by a number's value, not by its digits.
MAX_DEGREE = 64
MAX_INT_LITERAL = 2**64


@dataclass(frozen=True)
class Scope:
    """Names an expression may use: params (``args.``) and per-layer fields (``layer_args.``).

    ``numbers``: those of them that hold numbers (types int, float, bool), the only names
    arithmetic may use; ``layer_idx`` is one too.
    """

    params: frozenset[str]
    fields: frozenset[str] = frozenset()
    layer_idx: bool = False
    numbers: frozenset[str] = frozenset()

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


def param_order(defaults: dict[str, str | None]) -> tuple[list[str], list[list[str]]]:
    """Params in declaration order, each moved after the params its default expression uses;
    and the cycles that make this impossible, each as ``[a, b, ..., a]``.

    ``defaults``: every param's default expression, None for a literal default.
    """
    uses: dict[str, list[str]] = {}
    for name, default in defaults.items():
        try:
            uses[name] = [n for n, _ in names(default) if n in defaults] if default else []
        except ExprError:
            uses[name] = []  # P002 says why
    order: list[str] = []
    cycles: list[list[str]] = []
    state: dict[str, str] = {}

    def visit(name: str, stack: list[str]) -> None:
        if state.get(name) == "done":
            return
        if state.get(name) == "visiting":
            cycles.append(stack[stack.index(name) :] + [name])
            return
        state[name] = "visiting"
        for used in uses[name]:
            visit(used, stack + [name])
        state[name] = "done"
        order.append(name)

    for name in defaults:
        visit(name, [])
    return order, cycles


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
    _size(tree.body, scope)


def _size(node: ast.AST, scope: Scope) -> tuple[float, bool]:
    """(degree, whether it is a number) of ``node``; ExprError where either is unbounded."""
    if isinstance(node, ast.Constant):
        if isinstance(node.value, int) and abs(node.value) > MAX_INT_LITERAL:
            raise ExprError("P002", "integer literal larger than 2**64", node.col_offset)
        return 1, isinstance(node.value, (int, float, complex))
    if isinstance(node, ast.Name):
        return 1, node.id in scope.numbers or (node.id == "layer_idx" and scope.layer_idx)
    if isinstance(node, ast.BinOp):
        if isinstance(node.op, ast.Pow):
            exponent = _number_literal(node.right)
            if exponent is None or abs(exponent) > MAX_DEGREE:
                raise ExprError(
                    "P002",
                    f"the exponent of ** must be a number literal (at most {MAX_DEGREE}), "
                    "so that the value stays bounded",
                    node.right.col_offset,
                )
        (left, _), (right, _) = _number(node.left, scope), _number(node.right, scope)
        if isinstance(node.op, ast.Pow):
            degree = left * max(abs(exponent), 1)
        elif isinstance(node.op, ast.Mult):
            degree = left + right
        else:
            degree = max(left, right)  # + - / // %: no more digits than the larger operand
        if degree > MAX_DEGREE:
            raise ExprError(
                "P002",
                f"'{ast.unparse(node)}' may grow too large to evaluate: it multiplies up to "
                f"{degree:g} factors (at most {MAX_DEGREE}; x ** n counts n)",
                node.col_offset,
            )
        return degree, True
    if isinstance(node, ast.UnaryOp) and not isinstance(node.op, ast.Not):
        return _number(node.operand, scope)
    if isinstance(node, ast.Call):
        sizes = [_size(arg, scope) for arg in node.args]
        degree = max((d for d, _ in sizes), default=1)
        if node.func.id in ("min", "max"):  # one of their arguments
            return degree, all(number for _, number in sizes)
        return (1 if node.func.id == "len" else degree), True
    if isinstance(node, (ast.IfExp, ast.BoolOp)):  # one of their operands
        if isinstance(node, ast.IfExp):
            _size(node.test, scope)
        values = [node.body, node.orelse] if isinstance(node, ast.IfExp) else node.values
        sizes = [_size(value, scope) for value in values]
        return max(d for d, _ in sizes), all(number for _, number in sizes)
    # `not`, comparisons (true or false), lists and tuples (not numbers): bound their parts
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.expr):
            _size(child, scope)
    return 1, isinstance(node, (ast.UnaryOp, ast.Compare))


def _number(node: ast.AST, scope: Scope) -> tuple[float, bool]:
    """_size of an arithmetic operand, which must be a number."""
    degree, number = _size(node, scope)
    if not number:
        if isinstance(node, ast.Constant):
            what = f"a {type(node.value).__name__}"
        elif isinstance(node, (ast.List, ast.Tuple)):
            what = f"a {type(node).__name__.lower()}"
        else:
            what = f"'{ast.unparse(node)}'"
        raise ExprError(
            "P002",
            f"arithmetic takes numbers, not {what} (number literals, and params and fields of "
            "type int, float or bool)",
            node.col_offset,
        )
    return degree, True


def _number_literal(node: ast.AST) -> float | None:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        node = node.operand
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    return None


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
