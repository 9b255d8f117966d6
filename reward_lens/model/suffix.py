"""Many suffixes continuing one shared prefix: the prefix's keys and values are computed once.

A search over strings inserted into a sequence (`reward_lens.instruments.triggers`) changes only the tokens
from the insertion point on; under causal attention the tokens before it are the same in every candidate.
`prefix_cache` runs the prefix once (one unpadded row) and keeps its post-RoPE keys and values per layer;
`suffix_rewards` then runs n suffixes of equal length over that cache, recomputing only the suffix tokens
(position ids continue the prefix's), and reads the reward at the suffix's last token (the readout: ids
end at their readout, as `to_tokens` makes them). Equal to full forwards of prefix + suffix (tested).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
from jaxtyping import Float, Int
from transformer_lens.hook_points import HookPoint


@dataclass
class PrefixCache:
    """A prefix's post-RoPE keys and values per layer ([1, P, n_kv, d_head] each) and its length P."""

    length: int
    kv: List[Tuple[torch.Tensor, torch.Tensor]]


def _check_native(model) -> None:
    if not model.has_readout_fast_path:
        raise ValueError(
            "suffix recomputation needs the native blocks' cached-key step (a native architecture)"
        )
    if getattr(model.reward_head, "is_gated", False):
        raise ValueError(
            "the reward head is gated by a prompt position the suffix may contain; score full sequences "
            "instead (method='naive'), or read one objective (read_objective)"
        )


@torch.no_grad()
def prefix_cache(model, prefix_ids: Int[torch.Tensor, "1 prefix"]) -> PrefixCache:
    """Keys and values of one unpadded prefix row, every layer (one forward up to the last block)."""
    _check_native(model)
    prefix_ids = torch.as_tensor(prefix_ids, device=model.cfg.device).reshape(1, -1)
    names = [name for block in model.blocks for name in block.readout_kv_hooks]
    kept = {}

    def keep(t: torch.Tensor, hook: HookPoint) -> None:
        kept[hook.name] = t.detach()

    mask = torch.ones_like(prefix_ids)
    model.run_with_hooks(prefix_ids, mask, return_type=None, fwd_hooks=[(n, keep) for n in names])
    kv = [(kept[names[2 * l]], kept[names[2 * l + 1]]) for l in range(model.cfg.n_layers)]
    return PrefixCache(prefix_ids.shape[1], kv)


def _allowed(model, layer: int, P: int, S: int, device) -> torch.Tensor:
    """[1, S, P + S]: which keys each suffix position sees (causal, within the layer's window)."""
    q = torch.arange(P, P + S, device=device)[:, None]
    k = torch.arange(P + S, device=device)[None, :]
    ok = k <= q
    window = model.blocks[layer].attn.window
    if window is not None:
        ok = ok & (k > q - window)
    return ok[None]


def suffix_final_residual(
    model,
    cache: PrefixCache,
    suffix_ids: Optional[Int[torch.Tensor, "n suffix"]] = None,
    *,
    suffix_embeds: Optional[Float[torch.Tensor, "n suffix d_model"]] = None,
) -> Float[torch.Tensor, "n suffix d_model"]:
    """The final residual of n suffixes (ids, or embeddings as `hook_embed` holds them) after the prefix."""
    _check_native(model)
    resid = model.embed(suffix_ids.to(model.cfg.device)) if suffix_embeds is None else suffix_embeds
    n, S = resid.shape[:2]
    P = cache.length
    positions = torch.arange(P, P + S, device=resid.device)[None].expand(n, S)
    cos, sin = model.rotary(positions, resid.dtype)
    for layer, block in enumerate(model.blocks):
        past_k, past_v = cache.kv[layer]
        resid = block.forward_with_past(
            resid, cos, sin, past_k, past_v, _allowed(model, layer, P, S, resid.device)
        )
    return resid


def suffix_rewards(
    model,
    cache: PrefixCache,
    suffix_ids: Optional[Int[torch.Tensor, "n suffix"]] = None,
    *,
    suffix_embeds: Optional[Float[torch.Tensor, "n suffix d_model"]] = None,
) -> Float[torch.Tensor, " n"]:
    """Rewards [n] of prefix + each suffix, read at the suffix's last token (the readout)."""
    resid = suffix_final_residual(model, cache, suffix_ids, suffix_embeds=suffix_embeds)
    h = model.ln_final(resid[:, -1:])
    readout = torch.zeros(h.shape[0], dtype=torch.long, device=h.device)
    return model.reward_head(h, readout, input_ids=None)
