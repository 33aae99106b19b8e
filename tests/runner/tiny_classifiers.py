"""Tiny random-weight sequence classifiers (transformers' ``*ForSequenceClassification``) and a
word-level tokenizer for the tiny models (test helpers)."""

from __future__ import annotations

import torch
from tests.runner.tiny_models import hf_config

LABELS = {0: "negative", 1: "neutral", 2: "positive"}


def build_classifier(arch: str, out_dir, num_labels: int, seed: int = 0, **sizes):
    """A tiny ``*ForSequenceClassification`` with random weights saved to ``out_dir``; the
    transformers model (fp32, eval). Three labels are named `LABELS`; ``sizes`` override `TINY`'s."""
    import transformers as tf

    cfg = hf_config(arch, **sizes)
    cfg.num_labels = num_labels
    if num_labels == 3:
        cfg.id2label, cfg.label2id = LABELS, {v: k for k, v in LABELS.items()}
    torch.manual_seed(seed)
    model = tf.AutoModelForSequenceClassification.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.08 * torch.randn_like(p))
    model.save_pretrained(out_dir)
    return model


def write_word_tokenizer(out_dir, vocab_size: int = 160) -> list[str]:
    """A word-level ``tokenizer.json`` whose tokens 7 and 11 are ``no`` and ``yes``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [f"w{i}" for i in range(vocab_size)]
    words[7], words[11] = "no", "yes"
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(out_dir / "tokenizer.json"))
    return words
