"""Shared fixtures for the mlxc test-suite (kept minimal)."""

import numpy as np
import pytest

SEED = 1234


@pytest.fixture(scope="session")
def seed() -> int:
    """Base seed for test inputs; checkpoints take their own ``seed=`` argument."""
    return SEED


@pytest.fixture
def rng(seed) -> np.random.Generator:
    """A fresh, deterministic numpy Generator per test (independent of test order)."""
    return np.random.default_rng(seed)
