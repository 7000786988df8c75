"""The shared runtime that generated models run on (``mlxc.runtime``)."""

import os

# mlxc takes tokenizers, chat templates and image processors from transformers, never its torch
# models: the advice to install PyTorch that transformers logs on import without it is noise.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
