"""Prompt text -> token ids and the stop ids of a target: one definition for every command,
so the prompts a draft is trained on are tokenized exactly like the prompts it serves."""

from __future__ import annotations

from dspark.errors import DSparkError


def encode_prompt(tokenizer, prompt, chat: bool) -> list[int]:
    """prompt: a string, or with chat a list of {role, content} messages."""
    if not chat:
        return tokenizer(prompt)["input_ids"]
    if not getattr(tokenizer, "chat_template", None):
        raise DSparkError("the target's tokenizer has no chat template")
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    # The template already holds any BOS it wants; letting the tokenizer add one would double it.
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


def eos_ids(model, tokenizer) -> tuple[int, ...]:
    """End-of-sequence ids named by the generation config, the model config or the tokenizer."""
    ids = set()
    for src in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(src, "eos_token_id", None) if src is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(x) for x in value)
    return tuple(sorted(ids))
