"""mlxc: declarative model-definition compiler to MLX, and the runtime its output runs on.

``mlxc.load_model(path)`` and ``mlxc.load(path)`` are imported lazily so that the compiler and
``mlxc lint`` never import MLX. Both take ``specs=DIR``: your own specs, compiled in memory next
to the built-in ones.
"""

from mlxc.runtime import blas as _blas

# MLX binds its CPU BLAS when mlx.core is first imported: an optimised one (OpenBLAS) must be
# loaded before that. The hook runs the preload just before that import, and only then.
_blas.install_import_hook()

__all__ = ["load", "load_model"]


def __getattr__(name: str):
    if name in __all__:
        from mlxc.runtime.checkpoint import loading

        return getattr(loading, name)
    raise AttributeError(f"module 'mlxc' has no attribute '{name}'")
