"""mlxc: declarative model-definition compiler to MLX, and the runtime its output runs on.

``mlxc.load_model(path)`` and ``mlxc.load(path)`` are imported lazily so that the compiler and
``mlxc lint`` never import MLX.
"""

__all__ = ["load", "load_model"]


def __getattr__(name: str):
    if name in __all__:
        from mlxc.runtime import loading

        return getattr(loading, name)
    raise AttributeError(f"module 'mlxc' has no attribute '{name}'")
