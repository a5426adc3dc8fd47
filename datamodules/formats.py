"""TRL's dataset formats as plain text: chat messages rendered, implicit prompts split off, bad values named."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from alignment_games.modules.lm.text import render_chat

Messages = list[dict[str, Any]]


def is_messages(value: Any) -> bool:
    """Whether ``value`` looks like a conversation: a non-empty list of mappings (checked by :func:`as_messages`)."""
    return isinstance(value, (list, tuple)) and len(value) > 0 and all(isinstance(m, dict) for m in value)


def as_messages(value: Any, where: str) -> Messages:
    """``value`` as a list of messages with text ``role`` and ``content`` (keys ``datasets`` set to ``None`` dropped).

    Raises:
        ValueError: naming ``where`` (file, row, field) when a message is not a mapping or lacks a text role or content.
    """
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"{where}: expected a non-empty list of {{'role', 'content'}} messages, got {value!r:.80}")
    out = []
    for j, m in enumerate(value):
        if not isinstance(m, dict):
            raise ValueError(f"{where}: message {j} is {type(m).__name__}, not a {{'role', 'content'}} mapping")
        m = {k: v for k, v in m.items() if v is not None}
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                raise ValueError(f"{where}: message {j} has no text {key!r} (keys: {sorted(m)})")
        out.append(m)
    return out


def render_prompt_completion(
    tokenizer: Any, prompt: Sequence[dict[str, Any]], completion: Sequence[dict[str, Any]], where: str = "data"
) -> tuple[str, str]:
    """Prompt and completion messages as texts, as TRL's ``maybe_apply_chat_template`` renders them.

    Raises:
        ValueError: naming ``where`` when the template renders the prompt differently alone and before the completion.
    """
    prompt_text = render_chat(tokenizer, prompt, add_generation_prompt=True)
    full = render_chat(tokenizer, [*prompt, *completion], add_generation_prompt=False)
    if not full.startswith(prompt_text):
        raise ValueError(
            f"{where}: the chat template renders the prompt differently alone and followed by the completion, "
            "so the completion cannot be cut off it"
        )
    return prompt_text, full[len(prompt_text) :]


def extract_implicit_prompt(chosen: Any, rejected: Any) -> tuple[Any, Any, Any]:
    """``(prompt, chosen_rest, rejected_rest)``: the shared beginning split off, TRL's ``extract_prompt`` rule."""
    n = min(len(chosen), len(rejected))
    idx = next((i for i in range(n) if chosen[i] != rejected[i]), n)
    if isinstance(chosen, str) and idx > 0 and chosen[idx - 1] == " ":
        idx -= 1  # for text, a space just before the first difference goes with the completions
    return chosen[:idx], chosen[idx:], rejected[idx:]


def split_last_reply(messages: Messages, where: str) -> tuple[Messages, Messages]:
    """A conversation cut before its last assistant message: ``(context, [last assistant message])``.

    Raises:
        ValueError: naming ``where`` when the conversation has no assistant message, or only as its first message.
    """
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
    if last < 1:
        raise ValueError(f"{where}: the conversation needs an assistant message after at least one other message")
    return messages[:last], [messages[last]]
