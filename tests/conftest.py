"""Shared fixtures for the mlxc test-suite (kept minimal)."""

import os
import sys
from pathlib import Path

import numpy as np
import pytest

# The numerical tests compare float32 runs at float32's tolerances; on a GPU MLX rounds float32
# matmuls through TF32 (~1e-3 a product; 4-bit KV then lands some values in the next bin), so
# the suite asks for full float32 unless told otherwise, as `mlxc verify` does. MLX reads the
# variable at its first matmul.
os.environ.setdefault("MLX_ENABLE_TF32", "0")

import mlxc  # noqa: F401 - before the repository root joins sys.path: its mlxc/ is the CLI only

# The benchmarks (bench/, not installed) build checkpoints the tests reuse; bench never imports
# tests. Appended, so every installed package comes first.
sys.path.append(str(Path(__file__).resolve().parent.parent))

SEED = 1234


@pytest.fixture(scope="session")
def seed() -> int:
    """Base seed for test inputs; checkpoints take their own ``seed=`` argument."""
    return SEED


@pytest.fixture
def rng(seed) -> np.random.Generator:
    """A fresh, deterministic numpy Generator per test (independent of test order)."""
    return np.random.default_rng(seed)


@pytest.fixture
def on_cpu():
    """MLX's default device is the CPU for the test (paths the CPU takes, or float32 without a
    GPU's TF32 rounding), and what it was again after."""
    import mlx.core as mx

    device = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(device)
