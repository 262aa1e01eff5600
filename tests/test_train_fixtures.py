"""Shared helpers of the training tests (no tests here): a tiny target saved as a model
directory, a character-level tokenizer with a chat template, and a synthetic data shard."""

from __future__ import annotations

import json
import random
from pathlib import Path

from tests.tiny import tiny_target

CHARS = list(" abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,?!'-:\n")
SPECIALS = ["<pad>", "<s>", "<|im_end|>", "<|im_start|>"]  # ids 0..3; 2 = the tiny target's EOS
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def char_tokenizer(chat_template: bool = True):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.BPE(vocab, [], unk_token="<pad>")),
        bos_token="<s>",
        eos_token="<|im_end|>",
        pad_token="<pad>",
        unk_token="<pad>",
        additional_special_tokens=["<|im_start|>"],
    )
    if chat_template:
        tok.chat_template = TEMPLATE
    return tok


def save_tiny_target(path: Path, seed: int = 0) -> Path:
    tiny_target(seed=seed).save_pretrained(path)
    return path


def synthetic_shard(path: Path, n: int, seed: int = 0, vocab: int = 96) -> Path:
    """Sequences whose answers follow a simple rule (token + 3), so a draft can learn something."""
    rnd = random.Random(seed)
    lines = []
    for i in range(n):
        prompt = [1] + [rnd.randrange(4, vocab) for _ in range(rnd.randint(3, 8))]
        start = rnd.randrange(4, vocab)
        answer = [4 + (start + 3 * k) % (vocab - 4) for k in range(rnd.randint(10, 24))] + [2]
        lines.append(
            json.dumps(
                {"key": f"s{seed}-{i}", "ids": prompt + answer, "loss_mask": [0] * len(prompt) + [1] * len(answer)}
            )
        )
    path.write_text("\n".join(lines) + "\n")
    return path
