"""Prompts to token ids: strings, token id lists and chat messages."""

from __future__ import annotations

from typing import Sequence as Seq, Union

Prompt = Union[str, list[int], list[dict]]

# End-of-turn markers of the supported families; a chat model stops on any it has.
_END_OF_TURN = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>")


def prompt_to_ids(tokenizer, prompt: Prompt, vocab_size: int) -> list[int]:
    """Tokenize one prompt; chat messages go through the model's chat template."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is empty")
        return list(tokenizer(prompt)["input_ids"])
    if not isinstance(prompt, (list, tuple)) or len(prompt) == 0:
        raise ValueError("prompt must be a non-empty string, a non-empty list of token ids, "
                         f"or a non-empty list of chat messages; got {type(prompt).__name__}")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"token ids out of range [0, {vocab_size}): {bad[:5]}")
        return list(prompt)
    if all(isinstance(m, dict) for m in prompt):
        return chat_to_ids(tokenizer, prompt)
    raise ValueError("a list prompt must hold only token ids (int) or only chat messages (dict)")


def chat_to_ids(tokenizer, messages: Seq[dict]) -> list[int]:
    for i, message in enumerate(messages):
        if not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
            raise ValueError(f"chat message {i} needs string 'role' and 'content' fields, got {message!r}")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template; pass a plain string prompt instead")
    text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if not ids:
        raise ValueError("chat messages rendered to an empty prompt")
    return ids


def stop_token_ids(tokenizer, config_eos: Seq[int]) -> tuple[int, ...]:
    """Token ids that end generation unless a request sets ignore_eos."""
    ids = set(config_eos)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    vocab = tokenizer.get_vocab()
    ids.update(vocab[marker] for marker in _END_OF_TURN if marker in vocab)
    return tuple(sorted(ids))
