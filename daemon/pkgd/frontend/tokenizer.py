"""Tokenizer loading for the frontend (API servers, `LLM`), torch-free.

The tokenizer comes from the same place as the weights: the HF-layout directory the runner
resolves ``model.source`` to (``ModelFiles.model_dir``, holding ``tokenizer.json``,
``tokenizer_config.json`` and the chat template), or ``model.tokenizer`` when set. It is
loaded as transformers' ``PreTrainedTokenizerFast`` (the Rust ``tokenizers`` backend): unlike
``AutoTokenizer`` this does not import torch, so API-server processes stay light. The chat
template is rendered by transformers with jinja2; ``model.chat_template`` (a file path or the
template text itself) replaces the tokenizer's.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast


class TokenizerError(ValueError):
    """The tokenizer or chat template cannot be loaded; the message names the path."""


def resolve_chat_template(chat_template: str) -> str:
    """The template text for ``model.chat_template``: a file's content, or the text itself.

    Raises `TokenizerError` when it names no file and does not look like a Jinja template.
    """
    path = Path(chat_template).expanduser()
    if "{" not in chat_template and "\n" not in chat_template:
        try:
            return path.read_text(encoding="utf-8")
        except OSError as exc:
            raise TokenizerError(f"model.chat_template: cannot read {str(path)!r}: {exc.strerror or exc}") from None
    return chat_template


def load_tokenizer(
    model_dir: str | os.PathLike[str] | None,
    *,
    tokenizer: str | None = None,
    chat_template: str | None = None,
) -> PreTrainedTokenizerFast:
    """Load the tokenizer of a model.

    Args:
        model_dir: HF-layout directory with ``tokenizer.json`` (``ModelFiles.model_dir``).
        tokenizer: ``model.tokenizer``: another such directory, or a ``.gguf`` file whose
            embedded tokenizer is used (that path imports torch, through transformers' GGUF
            reader).
        chat_template: ``model.chat_template``: a file path or the template text; replaces
            the tokenizer's own template.

    Raises:
        TokenizerError: no tokenizer at the path, or the chat template file is unreadable.
    """
    from transformers import PreTrainedTokenizerFast

    source = tokenizer if tokenizer is not None else model_dir
    if source is None:
        raise TokenizerError("no tokenizer: neither a model directory nor model.tokenizer is given")
    path = Path(source).expanduser()
    try:
        if path.is_file() and path.suffix == ".gguf":
            tok = PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
        elif (path / "tokenizer.json").is_file():
            tok = PreTrainedTokenizerFast.from_pretrained(str(path))
        else:
            raise TokenizerError(
                f"no tokenizer at {str(path)!r}: expected a directory with tokenizer.json or a .gguf file"
            )
    except TokenizerError:
        raise
    except Exception as exc:  # corrupt files surface as many exception types
        raise TokenizerError(f"cannot load the tokenizer at {str(path)!r}: {exc}") from exc
    if chat_template is not None:
        tok.chat_template = resolve_chat_template(chat_template)
    return tok
