"""mlxc: declarative model-definition compiler to MLX, and the runtime its output runs on."""

from mlxc.runtime.loading import load, load_model

__all__ = ["load", "load_model"]
