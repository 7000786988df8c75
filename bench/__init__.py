"""mlxc benchmarks (never timed tests): bench.run, bench.serve_load, bench.profile_decode.

Run from the repository root (``python -m bench.run``), the current directory comes first on
``sys.path``, and there ``mlxc/`` holds only the CLI sources: the package's ``runtime`` and
``generated`` live beside it and are mapped in at install time. With a regular (non-editable)
install that directory would shadow the installed ``mlxc``, so it is taken off the path here;
``bench`` itself is already imported, and its submodules resolve through ``bench.__path__``.
"""

import os as _os
import sys as _sys

_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(_root, "mlxc", "runtime")) and "mlxc" not in _sys.modules:
    _sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != _root]
