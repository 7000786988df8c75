"""Checkpoint I/O: finding and loading a checkpoint (config, generated module, safetensors,
FP8, MXFP4), converting and quantising it, its tokenizer and chat template, the image processors
and their preprocessing, the demo checkpoint, and specs compiled from a user's directory."""
