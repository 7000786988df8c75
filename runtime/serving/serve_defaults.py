"""Defaults of ``mlxc serve``'s request limits, in a module with no imports: the CLI's flags
(read at start-up, before MLX or FastAPI load) and the server's ``Limits`` share them."""

DEFAULT_MAX_TOKENS = 512
# No request may hold a slot for ever: under --max-kv-size the context no longer bounds it.
DEFAULT_MAX_TOKENS_LIMIT = 32768
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024  # room for base64 images; a text prompt needs far less
DEFAULT_MAX_IMAGES = 8
# Pixels of all of a request's images, read from their headers before any is decoded: 64 Mpx
# (8 images of 8 Mpx, 4K each) is 256 MiB decoded as RGBA.
DEFAULT_MAX_REQUEST_PIXELS = 64 * 2**20
# The prefix cache's budget (runtime.serving.prefix_cache): ~8k tokens of an 8B model's bf16 KV.
DEFAULT_PREFIX_CACHE_BYTES = 1 << 30
# Decode steps a fresh prompt may wait for others to prefill with (Scheduler._prompts_wait).
DEFAULT_PREFILL_WAIT_STEPS = 8
