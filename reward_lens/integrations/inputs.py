"""Prompts and completions as TRL passes them (strings or conversational message lists), turned into what
the reward model is given and what the lengths and features read."""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Tuple


def message_text(x: Any, role: str) -> str:
    """A prompt or completion as plain text: a string as is; a conversational list of messages as the
    content of its last `role` message. For display and lengths only: the reward scores `as_model_input`."""
    if isinstance(x, str):
        return x
    messages = _messages(x)
    chosen = [m for m in messages if m["role"] == role] or messages
    return chosen[-1]["content"]


def _content(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)) and all(isinstance(c, Mapping) for c in content):
        kinds = sorted({str(c.get("type", "text")) for c in content} - {"text"})
        if kinds:
            raise ValueError(f"a message holds {', '.join(kinds)} parts; the reward model reads text only")
        return "".join(str(c.get("text", "")) for c in content)
    raise TypeError(f"a message's content must be text, got {type(content).__name__}")


def _messages(x: Any) -> List[Dict[str, str]]:
    if isinstance(x, (list, tuple)) and x and all(isinstance(m, Mapping) and "content" in m for m in x):
        return [{"role": str(m.get("role", "user")), "content": _content(m["content"])} for m in x]
    raise TypeError(
        "a prompt or completion must be a string or a list of {'role', 'content'} messages, got "
        f"{type(x).__name__}"
    )


def as_model_input(prompt: Any, completion: Any) -> Tuple[Any, Any]:
    """(prompt, completion) as the reward model is given them: strings as they are; a conversational prompt
    whole (system prompt and every earlier turn), as a tuple of messages the chat template renders, and a
    conversational completion as its one assistant message's text (several messages: all of them), so the
    model scores exactly the conversation TRL generated (as TRL's own reward-model path renders it)."""
    p = prompt if isinstance(prompt, str) else tuple(_messages(prompt))
    if not isinstance(p, str) and len(p) == 1 and p[0]["role"] == "user":
        p = p[0]["content"]  # one user turn: its text renders to the same tokens
    if isinstance(completion, str):
        c: Any = completion
    else:
        msgs = _messages(completion)
        c = msgs[0]["content"] if len(msgs) == 1 and msgs[0]["role"] == "assistant" else tuple(msgs)
    if isinstance(p, str) != isinstance(c, str) and isinstance(p, str):
        p = ({"role": "user", "content": p},)
    return p, c


def hashable_text(x: Any) -> Any:
    return x if isinstance(x, str) else tuple((m["role"], m["content"]) for m in x)


def unhashable_text(x: Any) -> Any:
    return x if isinstance(x, str) else [{"role": r, "content": c} for r, c in x]
