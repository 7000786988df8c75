"""Where mlxc keeps what it writes for itself: ``$MLXC_HOME``, else ``~/.cache/mlxc``.

Kept free of imports beyond ``os``: ``runtime/blas.py`` uses it before MLX is imported.
"""

from __future__ import annotations

import os


def mlxc_home() -> str:
    """``$MLXC_HOME``, else ``$XDG_CACHE_HOME/mlxc``, else ``~/.cache/mlxc`` (not created)."""
    if home := os.environ.get("MLXC_HOME"):
        return os.path.expanduser(home)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "mlxc")
