"""Tokenisation of (prompt, response) pairs the way reward models are trained on them.

With a chat template: the conversation [user: prompt, assistant: response] rendered by the tokenizer's
template, tokenised without adding special tokens again (templates already start with BOS, so adding it
would double it). Without a template, the documented plain format

    "User: {prompt}\\n\\nAssistant: {response}"

tokenised with the tokenizer's usual special tokens. Over-long inputs are cut from the left (the
response end, where the reward is read, is kept) with a warning.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Union

import torch

from reward_lens.model.truncation import report_truncation

PLAIN_FORMAT = "User: {prompt}\n\nAssistant: {response}"


def render_pair(tokenizer, prompt: str, response: str) -> str:
    if getattr(tokenizer, "chat_template", None):
        conversation = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
        return tokenizer.apply_chat_template(conversation, tokenize=False)
    return PLAIN_FORMAT.format(prompt=prompt, response=response)


def tokenize_pairs(
    model,
    prompts: Union[str, Sequence[str]],
    responses: Union[str, Sequence[str]],
    *,
    padding_side: Optional[str] = None,
    max_length: Optional[int] = None,
) -> Dict[str, torch.Tensor]:
    tokenizer = model.tokenizer
    if tokenizer is None:
        raise ValueError(
            "this model has no tokenizer (the checkpoint ships no tokenizer files); set model.tokenizer = "
            "AutoTokenizer.from_pretrained(...) or pass input_ids directly"
        )
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    responses = [responses] if isinstance(responses, str) else list(responses)
    if len(prompts) != len(responses):
        raise ValueError(f"got {len(prompts)} prompts but {len(responses)} responses; pass one response per prompt")
    if padding_side not in (None, "left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    texts = [render_pair(tokenizer, p, r) for p, r in zip(prompts, responses)]
    bos = getattr(tokenizer, "bos_token", None)
    ids: List[List[int]] = []
    for text in texts:
        add_special = not (bos and text.startswith(bos))
        ids.append(tokenizer(text, add_special_tokens=add_special)["input_ids"])
    limit = max_length or getattr(tokenizer, "model_max_length", None)
    if limit is None or limit > 10**8:
        limit = model.cfg.n_ctx
    if any(len(x) > limit for x in ids):
        report_truncation([t for t, x in zip(texts, ids) if len(x) > limit], limit)  # one warning per call
        ids = [x[-limit:] for x in ids]
    pad = model.cfg.pad_token_id
    if pad is None and len(ids) > 1:
        hint = getattr(tokenizer, "pad_token_id", None)
        raise ValueError(
            "the model config has no pad_token_id, so the readout of a padded batch is undefined (transformers "
            "refuses it too); tokenise one pair at a time or set model.cfg.pad_token_id"
            + (f" (the tokenizer's pad id is {hint})" if hint is not None else "")
        )
    side = padding_side or getattr(tokenizer, "padding_side", "right") or "right"
    T = max(len(x) for x in ids)
    input_ids = torch.full((len(ids), T), pad if pad is not None else 0, dtype=torch.long)
    attention_mask = torch.zeros((len(ids), T), dtype=torch.long)
    for i, x in enumerate(ids):
        sl = slice(T - len(x), T) if side == "left" else slice(0, len(x))
        input_ids[i, sl] = torch.tensor(x, dtype=torch.long)
        attention_mask[i, sl] = 1
    device = model.cfg.device
    return {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device)}
