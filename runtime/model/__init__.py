"""The model layer: everything generated model code imports, and nothing else does it need.

Cache kinds and the decode batch's caches, masks, RoPE / yarn / MRoPE, shared layers, MoE, the
image-attention overlay, the per-sequence prompt state, typed config reads, weight rules, and the
vision towers (``vision/``). It imports nothing from ``checkpoint`` or ``serving``
(tests/test_build.py checks what generated code imports).
"""
