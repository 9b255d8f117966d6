"""Loading a generative judge: any causal LM (a checkpoint directory or hub id, a GGUF file, or a transformers
model in memory) read as a reward model, reward = logit(positive) - logit(negative) at the last position
(`reward_lens.converters.judge`). The answer tokens must each be one token of the tokenizer."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Optional, Union

import torch

from reward_lens.converters.judge import judge_weight_map
from reward_lens.loading.checkpoint import load_hf_config, load_tokenizer, resolve_checkpoint_dir
from reward_lens.loading.streaming import LazyStateDict, converted_source
from reward_lens.model.heads.prm import is_unknown_token
from reward_lens.model.validation import as_index


def answer_token_id(tokenizer: Any, answer: Union[str, int], which: str) -> int:
    """The id of the one token `answer` (a string or an id); a clear error when it is several tokens or
    unknown to the tokenizer (it would read the unk token's logit)."""
    if not isinstance(answer, str):
        return as_index(answer, f"{which} token id", hint=" (or give the answer as a string)")
    if tokenizer is None:
        raise ValueError(
            f"{which}={answer!r} needs the model's tokenizer to find its token id; pass tokenizer= or "
            "give the token id as an int"
        )
    ids = tokenizer.encode(answer, add_special_tokens=False)
    if len(ids) != 1:
        pieces = tokenizer.convert_ids_to_tokens(ids)
        raise ValueError(
            f"{which}={answer!r} is {len(ids)} tokens {pieces} in this tokenizer, not one; a judge's "
            f"reward is one token's logit minus another's: pass a single-token answer (e.g. {pieces[:1]}) "
            "or its id"
        )
    if is_unknown_token(tokenizer, answer, ids[0]):
        raise ValueError(
            f"{which}={answer!r} is unknown to this tokenizer (it encodes as the unk token "
            f"{tokenizer.unk_token!r}, so the judge would read the unk logit); pass a word of its vocabulary"
        )
    return int(ids[0])


def answer_name(tokenizer: Any, answer: Union[str, int], token_id: int) -> str:
    if isinstance(answer, str):
        return answer
    return tokenizer.convert_ids_to_tokens(token_id) if tokenizer is not None else str(token_id)


def gguf_causal_lm(path_or_id: Union[str, Path], gguf_file: str, **overrides: Any) -> torch.nn.Module:
    """transformers' AutoModelForCausalLM from a GGUF file (dequantised to float32)."""
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(str(path_or_id), gguf_file=gguf_file, **overrides)
    return model.eval()


def load_judge(
    cls,
    source: Any,
    *,
    positive="Yes",
    negative="No",
    tokenizer=None,
    device=None,
    dtype=None,
    fold_ln: bool = True,
    gguf_file: Optional[str] = None,
    **overrides: Any,
):
    """A `cls` (HookedRewardModel) judge from a causal LM: `source` a directory / hub id (streamed block by
    block), a directory with `gguf_file`, or a transformers causal LM in memory."""
    if isinstance(source, torch.nn.Module) or gguf_file is not None:
        if isinstance(source, torch.nn.Module):
            hf = source
        else:
            hf = gguf_causal_lm(source, gguf_file, **overrides)
            if tokenizer is None:
                from reward_lens.loading.gguf import load_gguf_tokenizer

                tokenizer = load_gguf_tokenizer(source, gguf_file)
        hf_config, sd, where = hf.config, {k: v.detach() for k, v in hf.state_dict().items()}, "the causal LM"
    else:
        directory = resolve_checkpoint_dir(source)
        tokenizer = load_tokenizer(directory) if tokenizer is None else tokenizer
        hf_config, where = load_hf_config(directory, overrides), str(directory)
        sd = LazyStateDict.from_directory(directory)
    pos = answer_token_id(tokenizer, positive, "positive")
    neg = answer_token_id(tokenizer, negative, "negative")
    if pos == neg:
        raise ValueError(
            f"positive and negative are the same token (id {pos}); a judge contrasts two answers"
        )
    names = answer_name(tokenizer, positive, pos), answer_name(tokenizer, negative, neg)
    weight_map = judge_weight_map(hf_config, *names, pos, neg)
    src = converted_source(hf_config, sd, where, weight_map=weight_map)
    if tokenizer is not None and getattr(tokenizer, "pad_token_id", None) is not None:
        src.cfg.pad_token_id = int(tokenizer.pad_token_id)
    return cls.from_source(
        src, tokenizer=tokenizer, device=device, dtype=dtype, fold_ln=fold_ln, source=where
    )
