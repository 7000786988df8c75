"""``--model org/name``: a Hugging Face hub model id, resolved to a local snapshot directory.

:func:`resolve_model` takes what the user typed: an existing directory is used as is; anything
else that looks like a hub id goes through ``huggingface_hub.snapshot_download``, the files a
checkpoint needs only (config, weights, tokenizer, chat template, processor). Offline
(``HF_HUB_OFFLINE`` set, read when called) it looks in the local cache only
(``local_files_only=True``); online it downloads what the cache lacks, and falls back to the
cache when the hub cannot be reached. ``HF_HUB_CACHE`` (read when called) picks the cache
directory. When neither the cache nor the network has the model, :class:`ModelNotFound` says
so in one sentence.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# What a checkpoint directory needs (as mlx-lm fetches): no *.bin / *.pth / *.gguf duplicates.
ALLOW_PATTERNS = [
    "*.json",
    "*.safetensors",
    "*.py",
    "*.model",
    "*.tiktoken",
    "*.txt",
    "*.jinja",
]
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


class ModelNotFound(Exception):
    """``--model`` names neither a directory nor a model the hub cache or the hub has."""


def is_hub_id(name: str) -> bool:
    return bool(_HUB_ID.fullmatch(name)) and ".." not in name


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def resolve_model(name: str) -> tuple[Path, str | None]:
    """(the checkpoint directory, the hub id it came from or None for a directory)."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path, None
    if path.exists():
        raise ModelNotFound(f"{name} is not a directory")
    if not is_hub_id(name):
        raise ModelNotFound(f"{name}: no such directory (nor a hub model id, org/name)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    cache = os.environ.get("HF_HUB_CACHE") or None
    where = cache or "the default Hugging Face cache"
    try:
        snapshot = snapshot_download(
            name, allow_patterns=ALLOW_PATTERNS, local_files_only=offline(), cache_dir=cache
        )
    except LocalEntryNotFoundError:
        how = "HF_HUB_OFFLINE is set" if offline() else "the hub cannot be reached"
        raise ModelNotFound(
            f"{name} is not a directory, and the Hugging Face model {name} is not in {where} "
            f"({how}): download it with network access, or pass a checkpoint directory"
        ) from None
    except GatedRepoError:
        raise ModelNotFound(
            f"the Hugging Face model {name} is gated: accept its terms on the hub and log in "
            "(hf auth login, or HF_TOKEN)"
        ) from None
    except (RepositoryNotFoundError, RevisionNotFoundError):
        raise ModelNotFound(
            f"{name} is not a directory, and the Hugging Face hub has no model {name} "
            "(or it is private: log in with hf auth login, or set HF_TOKEN)"
        ) from None
    except (HfHubHTTPError, OSError) as e:
        raise ModelNotFound(f"cannot fetch the Hugging Face model {name}: {e}") from None
    return Path(snapshot), name
