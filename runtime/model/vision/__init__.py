"""Vision towers that generated multimodal models call (one module per family)."""
