"""Sequence classification on the decoder families: transformers' ``*ForSequenceClassification``
(a bias-free ``score`` linear ``[num_labels, hidden]`` on the last token's hidden state after
the final norm) for Llama, Qwen2 and Qwen3, served with ``model.runner: pooling``.

The head runs in float32 on the pooled vector (`pkgd.runner.pooler.Pooler`): the output of a
request is its ``num_labels`` logits. Activations (sigmoid for one label, softmax otherwise,
as vLLM's classifier pooler) belong to the API server, which knows the route asking.

``classifier_from_token`` (vLLM's convention for LLM-based rerankers, in ``config.json`` or
``model.hf_overrides``) builds the head from the LM head of a causal-LM checkpoint instead:
one label per token, its row of the LM head; with ``is_original_qwen3_reranker`` and the
tokens ``[no, yes]``, one label whose weight is ``row(yes) - row(no)``, so that its sigmoid
is ``softmax([logit(no), logit(yes)])[1]``, the probability Qwen3-Reranker is read by.
The LM head itself is then dropped (untied) or kept only as the embedding (tied).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from pkgd.runner.distributed import SINGLE, TPGroup
from pkgd.runner.models.config import ArchConfig
from pkgd.runner.models.llama import LlamaForCausalLM
from pkgd.runner.models.qwen2 import Qwen2ForCausalLM
from pkgd.runner.models.qwen3 import Qwen3ForCausalLM

# ArchConfig.raw key the runner fills with the token ids of ``classifier_from_token``
# (`resolve_classifier_tokens`): the model is built from the config alone, without a tokenizer.
TOKEN_IDS_KEY = "pkgd_classifier_token_ids"
SEQ_CLS_SUFFIX = "ForSequenceClassification"


def is_classifier(architecture: str) -> bool:
    return architecture.endswith(SEQ_CLS_SUFFIX)


def num_labels_of(raw: dict[str, Any]) -> int:
    """The head's outputs: one for a Qwen3-Reranker conversion, one per token for another
    ``classifier_from_token``, else ``num_labels`` / ``id2label`` (transformers' default 2)."""
    tokens = raw.get("classifier_from_token")
    if tokens:
        return 1 if raw.get("is_original_qwen3_reranker") else len(tokens)
    if raw.get("num_labels"):
        return int(raw["num_labels"])
    id2label = raw.get("id2label")
    return len(id2label) if isinstance(id2label, dict) and id2label else 2


def labels_of(raw: dict[str, Any]) -> list[str]:
    """The label name of each output (``id2label``; transformers' ``LABEL_i`` where missing)."""
    n = num_labels_of(raw)
    id2label = raw.get("id2label") if isinstance(raw.get("id2label"), dict) else {}
    return [str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(n)]  # type: ignore[union-attr]


def uses_sep_token(raw: dict[str, Any]) -> bool:
    """Whether a score pair is tokenized as a text pair (``use_sep_token``, or its deprecated
    spelling ``use_pad_token``; default true), else as the concatenation of its two texts."""
    value = raw.get("use_sep_token", raw.get("use_pad_token"))
    return True if value is None else bool(value)


def resolve_classifier_tokens(raw: dict[str, Any], tokenizer_dir: Path) -> dict[str, Any]:
    """``raw`` with `TOKEN_IDS_KEY` set from ``classifier_from_token`` (each must be one token
    of the tokenizer's vocabulary), or unchanged when there are none.

    Raises:
        ValueError: a token is not in the vocabulary, the tokenizer cannot be read, or
            ``is_original_qwen3_reranker`` without exactly two tokens.
    """
    tokens = raw.get("classifier_from_token")
    if not tokens:
        return raw
    if raw.get("is_original_qwen3_reranker") and len(tokens) != 2:
        raise ValueError(f"is_original_qwen3_reranker needs classifier_from_token [no, yes], got {tokens}")
    from tokenizers import Tokenizer

    path = Path(tokenizer_dir) / "tokenizer.json"
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # the library raises its own exception types
        raise ValueError(f"{path}: cannot read the tokenizer for classifier_from_token ({e})") from e
    ids = []
    for t in tokens:
        i = tok.token_to_id(t)
        if i is None:
            raise ValueError(f"classifier_from_token: {t!r} is not one token of the model's vocabulary")
        ids.append(i)
    return {**raw, TOKEN_IDS_KEY: ids}


class SequenceClassifierMixin(LlamaForCausalLM):
    """Adds the ``score`` head to a ``*ForCausalLM`` of this package: put it first in the
    bases, before the family's causal LM (``super()`` then reaches that family's class)."""

    def __init__(
        self, cfg: ArchConfig, *, tp: TPGroup = SINGLE, dtype: torch.dtype = torch.float32, kernels=None
    ) -> None:
        super().__init__(cfg, tp=tp, dtype=dtype, kernels=kernels)
        self.num_labels = num_labels_of(cfg.raw)
        self.token_ids: list[int] | None = cfg.raw.get(TOKEN_IDS_KEY)
        if cfg.raw.get("classifier_from_token") and self.token_ids is None:
            raise ValueError("classifier_from_token needs its token ids (resolve_classifier_tokens)")
        # replicated on every rank: the pooled hidden state is whole on each one
        self.score = nn.Parameter(torch.zeros(self.num_labels, cfg.hidden_size, dtype=dtype), requires_grad=False)
        if not cfg.tie_word_embeddings:
            # never used: the head reads hidden states (its memory is back before loading)
            self.lm_head = None  # type: ignore[assignment]
        self.requires_lm_head = False

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """``pooled [N, H]`` or ``[H]`` (any float dtype) -> float32 logits ``[N, L]`` / ``[L]``."""
        return pooled.float() @ self.score.float().t()

    def _expected_names(self) -> list[str]:
        names = super()._expected_names()  # lm_head.weight only when tied (requires_lm_head is False)
        if self.token_ids is None:
            return [*names, "score.weight"]
        # the head comes from the LM head's rows: its tensor must be in the checkpoint
        return names if self.cfg.tie_word_embeddings else [*names, "lm_head.weight"]

    def _load_one(self, name: str, t: torch.Tensor) -> str | None:
        if name == "score.weight":
            if self.token_ids is not None:
                raise ValueError("the checkpoint has a score head and the config a classifier_from_token: use one")
            _copy(self.score, t, name)
            return name
        source = "model.embed_tokens.weight" if self.cfg.tie_word_embeddings else "lm_head.weight"
        if name == source and self.token_ids is not None:
            self._score_from_tokens(t)
        if name == "lm_head.weight" and not self.cfg.tie_word_embeddings:
            return name if self.token_ids is not None else None  # a causal-LM checkpoint's head: unused
        return super()._load_one(name, t)

    def _score_from_tokens(self, full: torch.Tensor) -> None:
        assert self.token_ids is not None
        if full.shape[0] <= max(self.token_ids):
            raise ValueError(
                f"classifier_from_token ids {self.token_ids} are outside the LM head's {full.shape[0]} rows"
            )
        rows = full[self.token_ids].float()
        w = rows[1:2] - rows[0:1] if self.cfg.raw.get("is_original_qwen3_reranker") else rows
        self.score.copy_(w.to(self.score.dtype))


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"{name}: checkpoint shape {tuple(src.shape)} does not match the model's {tuple(dst.shape)}")
    dst.copy_(src)


class LlamaForSequenceClassification(SequenceClassifierMixin, LlamaForCausalLM):
    pass


class Qwen2ForSequenceClassification(SequenceClassifierMixin, Qwen2ForCausalLM):
    pass


class Qwen3ForSequenceClassification(SequenceClassifierMixin, Qwen3ForCausalLM):
    pass
