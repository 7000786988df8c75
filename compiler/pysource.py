"""Python source text: every value a spec puts into generated code, and the lines around it.

``pyrepr`` and ``pydocstring`` turn plain YAML data into literals (no text of a spec is ever
code); ``format_source`` formats a generated module with ruff.
"""

from __future__ import annotations

import ast
import math
import subprocess
import warnings

LINE_LENGTH = 100


def pyrepr(value) -> str:
    """Python source that evaluates to exactly ``value``, as ruff format writes it.

    Every value a spec puts into generated code comes through here (or ``pydocstring``), so no
    text of the spec is ever code. ``value`` is plain YAML data.
    """
    if isinstance(value, str):
        return _pystr(value)
    if isinstance(value, tuple):
        return pytuple(value)
    if isinstance(value, list):
        return "[" + ", ".join(map(pyrepr, value)) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{pyrepr(k)}: {pyrepr(v)}" for k, v in value.items()) + "}"
    if isinstance(value, float) and not math.isfinite(value):
        return f'float("{value}")'  # repr would print a bare name: inf, nan
    if value is None or isinstance(value, (bool, int, float)):
        return repr(value)
    raise TypeError(f"no Python literal for a {type(value).__name__}")


def _pystr(value: str) -> str:
    """repr's literal in double quotes; a raw string instead where it reads the same (regexes)."""
    literal = repr(value)
    if literal[0] == "'":  # repr uses double quotes only for a value with ' and no "
        # Inside repr's single quotes ' is escaped and " is bare: swap both for double quotes.
        literal = '"' + literal[1:-1].replace("\\'", "'").replace('"', '\\"') + '"'
    raw = f'r"{value}"'
    if "\\" in value and '"' not in value and value.isprintable() and _reads_as(raw, value):
        return raw
    return literal


def pydocstring(text: str) -> str:
    """A docstring for ``text``: triple-quoted (raw, if backslashes need it) where that reads
    back the same, else pyrepr's one-line string."""
    if all(c == "\n" or c.isprintable() for c in text):
        for literal in (f'"""{text}"""', f'r"""{text}"""'):
            if _reads_as(literal, text):
                return literal
    return pyrepr(text)


def _reads_as(literal: str, value: str) -> bool:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an invalid escape warns: it does not read the same
        try:
            return ast.literal_eval(literal) == value
        except (SyntaxError, ValueError):
            return False


def pytuple(items) -> str:
    parts = [i if isinstance(i, Raw) else pyrepr(i) for i in items]
    if len(parts) == 1:
        return f"({parts[0]},)"
    return "(" + ", ".join(parts) + ")"


def tuple_field(name: str, items: list, indent: int = 4) -> str:
    """``name=(...),`` on one line if it fits, else one item per line (as ruff format does)."""
    pad = " " * indent
    line = f"{pad}{name}={pytuple(items)},"
    if len(line) <= LINE_LENGTH or len(items) < 2:
        return line
    body = "".join(f"{pad}    {i if isinstance(i, Raw) else pyrepr(i)},\n" for i in items)
    return f"{pad}{name}=(\n{body}{pad}),"


class Raw(str):
    """Already Python source: pytuple prints it as is."""


def comment_text(text: str) -> str:
    """``text`` for a ``#`` comment: a line break in it would start a line of code."""
    return text if text.isprintable() else ascii(text)


def format_source(source: str) -> str:
    """``source`` as the pinned ruff formats it (transformers' modular converter does the
    same): generated files read like hand-formatted ones, and are byte-stable across machines.
    ``--isolated``: no configuration of the directory mlxc runs in applies."""
    from ruff.__main__ import find_ruff_bin  # the ruff wheel ships its binary

    done = subprocess.run(
        [find_ruff_bin(), "format", "--isolated", f"--line-length={LINE_LENGTH}", "-"],
        input=source,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode == 0:
        return done.stdout
    try:
        compile(source, "<generated>", "exec", dont_inherit=True)
    except (SyntaxError, ValueError):
        return source  # it does not parse: the build's compile check reports it (C001)
    raise RuntimeError(f"ruff format failed on generated code: {done.stderr.strip()}")
