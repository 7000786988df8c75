"""Tokenizer loading (offline), prompt encoding with the chat template, streaming detokenizer.

No MLX here: prompts are built on the server's event-loop thread, and MLX belongs to the
scheduler thread.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def load_tokenizer(path: str | Path) -> Any | None:
    """The HF tokenizer stored in ``path``, or None when it holds no tokenizer files.

    Never touches the network: ``local_files_only=True`` (works under ``HF_HUB_OFFLINE=1``).
    Never runs checkpoint code: ``trust_remote_code=False`` (without it, a config.json with an
    ``auto_map``, e.g. nemotron-nas, makes transformers prompt on stdin).
    """
    path = Path(path)
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer, PreTrainedConfig  # slow import: only when needed

    offline = {"local_files_only": True, "trust_remote_code": False}
    # A model_type transformers does not know (a spec of your own): skip straight to the retry
    # below, or transformers warns that it builds a config "of type ``".
    first = {} if _transformers_knows(path) else {"config": PreTrainedConfig()}
    try:
        return AutoTokenizer.from_pretrained(str(path), **first, **offline)
    except Exception as e:  # noqa: BLE001 - transformers raises OSError, ValueError, KeyError...
        first_error = e
    # AutoTokenizer also parses config.json, which fails for configs that need remote code
    # (nemotron-nas's DeciLM). The tokenizer files alone usually suffice: retry without it.
    try:
        return AutoTokenizer.from_pretrained(str(path), config=PreTrainedConfig(), **offline)
    except Exception as e:
        from mlxc.runtime.checkpoint.loading import (
            CheckpointError,
        )  # loading imports MLX: only on failure

        # Report the first error: it tells more than the retry's.
        raise CheckpointError(f"cannot load the tokenizer in {path}: {first_error}") from e


def _transformers_knows(path: Path) -> bool:
    """Whether transformers has a config class for config.json's model_type (True when there
    is no readable one: transformers then reports the problem itself)."""
    from transformers import CONFIG_MAPPING

    try:
        model_type = json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return True
    return not isinstance(model_type, str) or model_type in CONFIG_MAPPING


def eos_token_ids(tokenizer: Any, path: str | Path | None = None) -> set[int]:
    """Ids that end generation: the tokenizer's EOS plus ``eos_token_id`` of config.json and
    generation_config.json in ``path`` (chat models often list several there, e.g. ``<|eot_id|>``).
    """
    ids: set[int] = set()
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    for name in ("config.json", "generation_config.json"):
        if path is None or not (Path(path) / name).is_file():
            continue
        try:
            value = json.loads((Path(path) / name).read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            continue  # these files only add ids; a broken one is reported by the loader
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(int(v) for v in value if isinstance(v, int))
    return ids


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


# How errors name a chat template given on the command line (`mlxc serve --chat-template`).
OVERRIDE_SOURCE = "--chat-template"


class ChatTemplateError(ValueError):
    """A chat template failed to render the messages (its ``raise_exception(...)``, or a template
    that cannot take them, e.g. a text-only one given image parts). The message names the
    template: ``the chat template from SOURCE failed: TYPE: DETAIL``."""


def tokenizer_template_source(tokenizer: Any) -> str:
    """The file the tokenizer's own chat template came from: transformers reads a
    chat_template.jinja beside the tokenizer over tokenizer_config.json's ``chat_template``."""
    where = getattr(tokenizer, "name_or_path", "")
    if where and (Path(where) / "chat_template.jinja").is_file():
        return "chat_template.jinja"
    return "tokenizer_config.json"


def render_chat_template(
    tokenizer: Any,
    messages: Sequence[dict],
    *,
    chat_template: str | None = None,
    source: str | None = None,
    add_generation_prompt: bool = True,
    template_kwargs: dict | None = None,
) -> str:
    """The text of ``messages`` through ``chat_template`` (None: the tokenizer's own).

    ``template_kwargs``: extra variables of the template (``enable_thinking``, ...), as
    ``apply_chat_template`` passes its keyword arguments.

    ``source`` names the template in errors (None: the tokenizer's file). Any rendering error
    becomes a :class:`ChatTemplateError`: it is the request's messages meeting the template,
    not a server fault.
    """
    try:
        return tokenizer.apply_chat_template(
            list(messages),
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **(template_kwargs or {}),
        )
    except Exception as e:  # jinja TemplateError (raise_exception), TypeError, UndefinedError...
        source = source or tokenizer_template_source(tokenizer)
        raise ChatTemplateError(
            f"the chat template from {source} failed: {type(e).__name__}: {e}"
        ) from e


def encode_prompt(tokenizer: Any, text: str, chat_template: bool | None = None) -> list[int]:
    """Token ids for ``text``.

    ``chat_template``: None applies the tokenizer's chat template when it has one (``text`` as
    one user message, with the generation prompt); True requires a template; False encodes the
    raw text (with the tokenizer's usual special tokens, e.g. BOS). A template that fails
    raises :class:`ChatTemplateError`.
    """
    use_template = has_chat_template(tokenizer) if chat_template is None else chat_template
    if not use_template:
        return list(tokenizer.encode(text))
    if not has_chat_template(tokenizer):
        raise ValueError("the tokenizer has no chat template; encode the raw prompt instead")
    rendered = render_chat_template(tokenizer, [{"role": "user", "content": text}])
    # The template writes BOS and the other special tokens itself: do not add them twice.
    return list(tokenizer.encode(rendered, add_special_tokens=False))


def _rust_tokenizer(tokenizer: Any) -> Any:
    """The ``tokenizers`` library's ``Tokenizer`` behind ``tokenizer`` where the transformers
    class adds nothing to its decode (with ``clean_up_tokenization_spaces=False``, a plain
    ``TokenizersBackend`` only converts its arguments and calls the Rust one), so the Rust
    decoder can be called directly: the Python wrapper cost ~4x the Rust call on the server's
    decode step. None for any other tokenizer class."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: its decode, as is
        return None
    cls = type(tokenizer)
    if (
        isinstance(tokenizer, TokenizersBackend)
        and cls.decode is PreTrainedTokenizerBase.decode
        and cls._decode is TokenizersBackend._decode
    ):
        return tokenizer._tokenizer
    return None


class StreamingDetokenizer:
    """Turns a stream of token ids into text deltas.

    Decodes a short window of recent tokens (so tokenizers that drop a leading space at the start
    of a decode still see their left context) and emits only what is new. Text that ends in
    U+FFFD is an incomplete multi-byte character: it is held back until the next token completes
    it, so a delta never splits a character.

    Where the Rust tokenizer can be called directly, ``tokenizers``' own ``DecodeStream`` runs
    that window in Rust (one call per token, the window's text kept between calls: the server
    streams every row's token through here on each decode step). It keeps the same window as
    the Python path below, which serves other tokenizers, marker tokens written out (``keep``)
    and the end.
    """

    def __init__(self, tokenizer: Any, keep: frozenset[int] = frozenset()) -> None:
        self.tokenizer = tokenizer
        self._rust = _rust_tokenizer(tokenizer)
        self._stream = self._new_stream()
        self.tokens: list[int] = []
        self.prefix_offset = 0  # start of the context window
        self.read_offset = 0  # tokens before this one have been emitted
        # Special tokens written out all the same (a tool-call format's markers, such as
        # Mistral's [TOOL_CALLS]): id -> text.
        self.keep = {t: tokenizer.convert_ids_to_tokens(t) for t in keep}

    def _new_stream(self) -> Any:
        if self._rust is None:
            return None
        from tokenizers.decoders import DecodeStream

        return DecodeStream(skip_special_tokens=True)

    def _decode(self, tokens: list[int]) -> str:
        if not self.keep:
            return self._decode_run(tokens)
        parts, run = [], []
        for t in tokens:
            if t in self.keep:
                parts += [self._decode_run(run), self.keep[t]]
                run = []
            else:
                run.append(t)
        return "".join(parts) + self._decode_run(run)

    def _decode_run(self, tokens: list[int]) -> str:
        if self._rust is not None:
            return self._rust.decode(tokens, skip_special_tokens=True)
        return self.tokenizer.decode(
            tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False
        )

    def add(self, token: int) -> str:
        """Feed one token; return the newly completed text (maybe "")."""
        token = int(token)
        self.tokens.append(token)
        if self._stream is not None and token not in self.keep:
            try:
                text = self._stream.step(self._rust, token)
            except Exception:  # noqa: BLE001 - a decode that rewrites its window's start
                self._stream = None  # (DecodeStream refuses it): the Python path from here on
            else:
                if text is None:
                    return ""
                self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
                return text
        prefix = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        text = self._decode(self.tokens[self.prefix_offset :])
        if len(text) > len(prefix) and not text.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
            if token in self.keep and self._stream is not None:
                # The text after a written-out marker decodes without left context in the
                # Python path too (``_decode`` splits the window there): a fresh stream.
                self.prefix_offset = self.read_offset
                self._stream = self._new_stream()
            return text[len(prefix) :]
        return ""

    def finalize(self) -> str:
        """Whatever is still held back (an unfinished character included) at the end."""
        prefix = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        text = self._decode(self.tokens[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.tokens)
        return text[len(prefix) :]
