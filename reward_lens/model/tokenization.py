"""Tokenisation of (prompt, response) pairs exactly as reward models are trained on them: named input formats.

    "chat"      the tokenizer's chat template over [prompt messages + response messages]: the ids of
                `tokenizer.apply_chat_template(messages, tokenize=True)` (no special tokens added: a
                template without BOS gets none), as TRL's RewardTrainer tokenises conversational data.
    "concat"    TRL's standard (non-conversational) data: `prompt + response`, plus the EOS string unless
                it already ends with it, tokenised with the tokenizer's special tokens (BOS if it adds one).
    "openrlhf"  OpenRLHF's reward dataset: the chat template's prompt (with generation prompt) + the rest
                of the rendered conversation (raw prompt + response without a template), stripped of
                trailing newlines, " " + EOS appended unless present, no special tokens added, and the last
                token replaced by EOS.
    "plain"     "User: {prompt}\\n\\nAssistant: {response}" with the tokenizer's special tokens.
    a string with "{prompt}" and "{response}": that template, like "plain".
    "auto"      (default) the checkpoint's own convention when it names one (`cfg.input_format`: an
                OpenRLHF checkpoint's "openrlhf"), else "chat" when the tokenizer has a chat template,
                else "plain" (`model_input_format`).

Prompts and responses are strings or lists of {"role", "content"} messages (TRL's conversational format;
a string prompt is one user message, a string response one assistant message).

The returned batch ends at each row's readout: under causal attention nothing after the readout changes
the reward, so tokens after it (a trailing EOS when pad = EOS) are dropped, and rows are padded on the
LEFT by default, so the readout is position -1 of every row. Over-long inputs are cut from the left
(the readout is kept) with a warning.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Dict, List, Optional, Sequence, Union

import torch

from reward_lens.model.readout import readout_needs_pad_id
from reward_lens.model.truncation import report_truncation

PLAIN_FORMAT = "User: {prompt}\n\nAssistant: {response}"
INPUT_FORMATS = ("auto", "chat", "concat", "openrlhf", "plain")

Message = Mapping
Text = Union[str, Sequence[Message]]


def is_messages(x: Any) -> bool:
    """A conversation: a non-empty list/tuple of {"role", "content"} mappings."""
    return isinstance(x, (list, tuple)) and len(x) > 0 and all(isinstance(m, Mapping) for m in x)


def check_input_format(fmt: Any) -> str:
    """`fmt` if it names a format or is a template with {prompt} and {response}; else a clear error."""
    if isinstance(fmt, str) and (fmt in INPUT_FORMATS or ("{prompt}" in fmt and "{response}" in fmt)):
        return fmt
    raise ValueError(
        f"unknown input_format {fmt!r}; use one of {', '.join(INPUT_FORMATS)} or a template string "
        "containing '{prompt}' and '{response}' (e.g. 'Q: {prompt}\\nA: {response}')"
    )


def resolve_input_format(fmt: Optional[str], tokenizer) -> str:
    """The concrete format: "auto" becomes "chat" when the tokenizer has a chat template, else "plain"."""
    fmt = check_input_format(fmt or "auto")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if fmt == "auto":
        return "chat" if has_template else "plain"
    if fmt == "chat" and not has_template:
        raise ValueError(
            "input_format='chat' but the tokenizer has no chat_template; set tokenizer.chat_template (a "
            "jinja string) or use input_format='concat' (TRL standard data), 'plain' or a "
            "'{prompt}...{response}' template"
        )
    return fmt


def model_input_format(model, fmt: Optional[str] = None) -> str:
    """The format `model` tokenises in: `fmt`, else `model.input_format`; "auto" is the checkpoint's own
    convention (`cfg.input_format`) when it has one, then resolved against the tokenizer (if any)."""
    fmt = check_input_format(fmt or getattr(model, "input_format", "auto"))
    if fmt == "auto" and model.cfg.input_format:
        fmt = model.cfg.input_format
    return fmt if model.tokenizer is None else resolve_input_format(fmt, model.tokenizer)


def _chat(tokenizer, messages: List[Dict[str, Any]], **kwargs: Any) -> Any:
    """`tokenizer.apply_chat_template`, its template's errors (a jinja2 TemplateError, SecurityError from the
    sandbox when a template reaches for unsafe attributes) as one-line ValueErrors."""
    try:
        return tokenizer.apply_chat_template(messages, **kwargs)
    except Exception as exc:
        import jinja2

        if not isinstance(exc, jinja2.TemplateError):
            raise
        first = (str(exc).strip().splitlines() or [""])[0]
        raise ValueError(
            f"the tokenizer's chat template failed ({type(exc).__name__}: {first}); fix or replace "
            "tokenizer.chat_template, or use another input_format (plain, concat or a template string)"
        ) from None


def _messages(x: Text, role: str) -> List[Dict[str, Any]]:
    if isinstance(x, str):
        return [{"role": role, "content": x}]
    return [dict(m) for m in x]


def conversation(prompt: Text, response: Text) -> List[Dict[str, Any]]:
    """The chat messages of (prompt, response). TRL's implicit-prompt rows (prompt "" and a response that is a
    whole conversation) and a response conversation that already starts with the prompt's messages are used
    whole, never duplicated; an empty response list means the prompt is the whole conversation."""
    tail = (
        [] if isinstance(response, (list, tuple)) and len(response) == 0 else _messages(response, "assistant")
    )
    if prompt == "" and is_messages(response):
        return tail
    head = _messages(prompt, "user")
    return tail if tail[: len(head)] == head and is_messages(response) else head + tail


def _template_ids(tokenizer, template: str, prompt: Text, response: Text) -> List[int]:
    if not (isinstance(prompt, str) and isinstance(response, str)):
        raise ValueError(
            "conversational pairs (lists of role/content messages) need a chat template: use "
            "input_format='chat' (or 'openrlhf') with a tokenizer that has one"
        )
    text = template.replace("{prompt}", prompt).replace("{response}", response)
    bos = getattr(tokenizer, "bos_token", None)
    return tokenizer(text, add_special_tokens=not (bos and text.startswith(bos)))["input_ids"]


def _openrlhf_ids(tokenizer, prompt: Text, response: Text) -> List[int]:
    eos, eos_id = tokenizer.eos_token, tokenizer.eos_token_id
    if eos is None:
        raise ValueError(
            "input_format='openrlhf' needs a tokenizer with an EOS token (OpenRLHF ends every text with it)"
        )
    if getattr(tokenizer, "chat_template", None):
        turns = _messages(prompt, "user")
        if (
            isinstance(response, (list, tuple)) and len(response) == 0
        ):  # one whole conversation, no prompt key
            prompt_text, response_text = "", _chat(tokenizer, turns, tokenize=False)
        else:
            prompt_text = _chat(tokenizer, turns, tokenize=False, add_generation_prompt=True)
            full = _chat(tokenizer, turns + _messages(response, "assistant"), tokenize=False)
            response_text = full[len(prompt_text) :]
    elif isinstance(prompt, str) and isinstance(response, str):
        prompt_text, response_text = prompt, response
    else:
        raise ValueError(
            "conversational pairs with input_format='openrlhf' need a tokenizer with a chat_template"
        )
    text = (prompt_text + response_text).rstrip("\n")
    if not text.endswith(eos):
        text += " " + eos
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    ids[-1] = eos_id  # OpenRLHF: "to avoid EOS truncation", the last token becomes EOS
    return ids


def encode_pair(tokenizer, prompt: Text, response: Text, input_format: str) -> List[int]:
    """The ids of one (prompt, response) in a concrete format (see the module docstring)."""
    if input_format == "chat":
        messages = conversation(prompt, response)
        return list(_chat(tokenizer, messages, tokenize=True, return_dict=True)["input_ids"])
    if input_format == "concat":
        if not (isinstance(prompt, str) and isinstance(response, str)):
            raise ValueError(
                "input_format='concat' is TRL's standard (string) format; conversational pairs use 'chat'"
            )
        text = prompt + response
        if tokenizer.eos_token and not text.endswith(tokenizer.eos_token):
            text += tokenizer.eos_token
        return tokenizer(text)["input_ids"]
    if input_format == "openrlhf":
        return _openrlhf_ids(tokenizer, prompt, response)
    return _template_ids(
        tokenizer, PLAIN_FORMAT if input_format == "plain" else input_format, prompt, response
    )


def encode_pairs(tokenizer, prompts: Sequence[Text], responses: Sequence[Text], input_format: str):
    """`encode_pair` of every (prompt, response); the chat format renders and tokenises them all in one
    batched `apply_chat_template` call (one fast-tokenizer call, not one per pair)."""
    if input_format == "chat" and len(prompts) > 1:
        convs = [conversation(p, r) for p, r in zip(prompts, responses)]
        return [list(x) for x in _chat(tokenizer, convs, tokenize=True, return_dict=True)["input_ids"]]
    return [encode_pair(tokenizer, p, r, input_format) for p, r in zip(prompts, responses)]


def render_pair(tokenizer, prompt: Text, response: Text, input_format: str = "auto") -> str:
    """The text of one pair in a format (decoded from its ids for "concat"/"openrlhf")."""
    fmt = resolve_input_format(input_format, tokenizer)
    if fmt == "chat":
        return _chat(tokenizer, conversation(prompt, response), tokenize=False)
    if fmt in ("concat", "openrlhf"):
        return tokenizer.decode(encode_pair(tokenizer, prompt, response, fmt))
    return (
        (PLAIN_FORMAT if fmt == "plain" else fmt)
        .replace("{prompt}", str(prompt))
        .replace("{response}", str(response))
    )


def check_unicode(x: Any, where: str) -> None:
    """Text (or every message's content) encodable as UTF-8: a lone surrogate (e.g. from a JSON escape
    "\\ud83d" without its pair) is a ValueError naming where it is, not a tokenizer error."""
    texts = [x] if isinstance(x, str) else [m.get("content") for m in x if isinstance(m, Mapping)]
    for t in texts:
        if not isinstance(t, str):
            continue
        try:
            t.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(
                f"{where} holds a lone surrogate {t[exc.start]!r} at character {exc.start} (half of an "
                "emoji or other character, e.g. from a cut JSON escape); fix or remove it"
            ) from None


def _as_list(x: Any, what: str) -> List[Text]:
    if isinstance(x, str) or is_messages(x):
        return [x]
    if x is None:
        raise ValueError(f"no {what} given")
    return list(x)


def trim_after_readout(model, ids: List[int]) -> List[int]:
    """`ids` up to and including where `model` reads the reward when they are scored alone."""
    row = torch.tensor([ids], dtype=torch.long, device=model.cfg.device)
    readout = int(model.readout_positions(row, torch.ones_like(row))[0])
    return ids[: readout + 1]


def pad_rows(model, ids: List[List[int]], side: str) -> Dict[str, torch.Tensor]:
    pad = model.cfg.pad_token_id
    if pad is None and len(ids) > 1 and readout_needs_pad_id(model.cfg):
        hint = getattr(model.tokenizer, "pad_token_id", None)
        raise ValueError(
            "the model config has no pad_token_id, so the readout of a padded batch is undefined "
            "(transformers refuses it too); tokenise one pair at a time or set model.cfg.pad_token_id"
            + (f" (the tokenizer's pad id is {hint})" if hint is not None else "")
        )
    T = max(len(x) for x in ids)
    input_ids = torch.full((len(ids), T), pad if pad is not None else 0, dtype=torch.long)
    attention_mask = torch.zeros((len(ids), T), dtype=torch.long)
    for i, x in enumerate(ids):
        sl = slice(T - len(x), T) if side == "left" else slice(0, len(x))
        input_ids[i, sl] = torch.tensor(x, dtype=torch.long)
        attention_mask[i, sl] = 1
    device = model.cfg.device
    return {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device)}


def tokenize_pairs(
    model,
    prompts: Union[Text, Sequence[Text]],
    responses: Union[Text, Sequence[Text], None] = None,
    *,
    padding_side: Optional[str] = None,
    max_length: Optional[int] = None,
    input_format: Optional[str] = None,
) -> Dict[str, torch.Tensor]:
    """{"input_ids", "attention_mask"} of the pairs, each row ending at its readout, padded on the left
    (default). `responses=None`: each prompt is a whole conversation (message list) or text."""
    tokenizer = model.tokenizer
    if tokenizer is None:
        raise ValueError(
            "this model has no tokenizer (the checkpoint ships no tokenizer files); set model.tokenizer "
            "= AutoTokenizer.from_pretrained(...) or pass input_ids directly"
        )
    if prompts is None:
        raise TypeError(
            "to_tokens needs prompts and responses (text or chat-message lists; responses may be omitted "
            "when each prompt is a whole conversation); got None"
        )
    if max_length is not None and (
        isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1
    ):
        raise ValueError(f"max_length must be a positive number of tokens, got {max_length!r}")
    prompts = _as_list(prompts, "prompts")
    if not prompts:
        raise ValueError("to_tokens got no prompts; pass at least one (prompt, response)")
    responses = (
        [[] if is_messages(p) else "" for p in prompts]
        if responses is None
        else _as_list(responses, "responses")
    )
    bad = [x for x in prompts + responses if not isinstance(x, (str, tuple, list))]
    if bad:
        raise TypeError(
            f"prompts and responses must be text or chat-message lists; got {type(bad[0]).__name__}"
        )
    if len(prompts) != len(responses):
        raise ValueError(
            f"got {len(prompts)} prompts but {len(responses)} responses; pass one response per prompt"
        )
    for i, x in enumerate(prompts + responses):
        check_unicode(x, f"{'prompt' if i < len(prompts) else 'response'} {i % len(prompts) + 1}")
    if padding_side not in (None, "left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    fmt = model_input_format(model, input_format)
    ids = [trim_after_readout(model, x) for x in encode_pairs(tokenizer, prompts, responses, fmt)]
    limit = max_length or getattr(tokenizer, "model_max_length", None)
    if limit is None or limit > 10**8:
        limit = model.cfg.n_ctx
    if any(len(x) > limit for x in ids):
        cut = [repr((p, r)) for p, r, x in zip(prompts, responses, ids) if len(x) > limit]  # distinct inputs
        report_truncation(cut, limit)  # one warning per call (collected)
        ids = [x[-limit:] for x in ids]
    return pad_rows(model, ids, padding_side or "left")


INSERTION_POINTS = ("prompt_end", "response_end")


def insertion_index(tokenizer, prompt: str, response: str, where: str, input_format: str = "auto") -> int:
    """Where a string is inserted into the ids of (prompt, response) as rendered in `input_format`.

    The pair is rendered (`render_pair`) and tokenised with character offsets; the index returned is the
    first token that starts at or after the end of the prompt text ("prompt_end": before whatever the
    template puts between the prompt and the response, e.g. "\\n<|assistant|>\\n") or of the response
    text ("response_end": before what the template appends, e.g. an EOS or end-of-turn token that may
    be the readout). A token that straddles the boundary stays whole (the insertion follows it). Needs
    string prompt and response and a fast tokenizer (offsets)."""
    if where not in INSERTION_POINTS:
        raise ValueError(f"where must be one of {', '.join(INSERTION_POINTS)}, got {where!r}")
    if not (isinstance(prompt, str) and isinstance(response, str)):
        raise ValueError("insertion points are defined for string prompts and responses")
    text = render_pair(tokenizer, prompt, response, input_format)
    r_start = text.rfind(response) if response else len(text)
    p_start = text.rfind(prompt, 0, r_start + (0 if response else 1)) if prompt else 0
    if r_start < 0 or p_start < 0:
        raise ValueError(
            "the rendered pair does not contain the prompt and response texts verbatim; insertion points "
            "need a template that copies them"
        )
    end = p_start + len(prompt) if where == "prompt_end" else r_start + len(response)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    for i, (start, _stop) in enumerate(enc["offset_mapping"]):
        if start >= end and _stop > start:
            return i
    return len(enc["input_ids"])


# ------------------------------------------------------------------------------ bare text, as TransformerLens
def is_bare_text(x: Any) -> bool:
    """A text or a non-empty list of texts (what TransformerLens's `to_tokens` and forward take)."""
    return isinstance(x, str) or (
        isinstance(x, (list, tuple)) and len(x) > 0 and all(isinstance(t, str) for t in x)
    )


def tl_bos_token_id(tokenizer) -> Optional[int]:
    """The id TransformerLens prepends: the tokenizer's BOS, else its EOS (TL's fallback), else None."""
    bos = getattr(tokenizer, "bos_token_id", None)
    return bos if bos is not None else getattr(tokenizer, "eos_token_id", None)


def text_ids(model, text: str, prepend_bos: Optional[bool] = None) -> List[int]:
    """A text's ids as TransformerLens's `to_tokens(text, prepend_bos)` makes them: the text without the
    tokenizer's own special tokens, then exactly one BOS in front when `prepend_bos` (default
    `cfg.default_prepend_bos`, True as in TransformerLens)."""
    tokenizer = model.tokenizer
    if tokenizer is None:
        raise ValueError(
            "this model has no tokenizer; set model.tokenizer = AutoTokenizer.from_pretrained(...)"
        )
    check_unicode(text, "the text")
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if prepend_bos is None:
        prepend_bos = getattr(model.cfg, "default_prepend_bos", True)
    elif not isinstance(prepend_bos, bool):  # the string 'no' would be truthy: a BOS nobody asked for
        raise ValueError(f"prepend_bos must be True, False or None, got {prepend_bos!r}")
    bos = tl_bos_token_id(tokenizer)
    return [bos] + ids if prepend_bos and bos is not None else ids


def tokenize_texts(
    model,
    texts: Union[str, Sequence[str]],
    prepend_bos: Optional[bool] = None,
    padding_side: Optional[str] = None,
) -> Dict[str, torch.Tensor]:
    """{"input_ids", "attention_mask"} [batch, pos] of bare texts, TransformerLens's meaning of
    `to_tokens(text)`: BOS + the text's ids (`text_ids`), no chat template or input format; several texts
    padded on the LEFT by default (the last position is every row's last token)."""
    if padding_side not in (None, "left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    rows = [text_ids(model, t, prepend_bos) for t in ([texts] if isinstance(texts, str) else texts)]
    if any(len(r) == 0 for r in rows):
        raise ValueError(
            "an empty text without a BOS has no tokens; pass prepend_bos=True or a non-empty text"
        )
    return pad_rows(model, rows, padding_side or "left")
