"""Many suffixes continuing one shared prefix: the prefix's keys and values are computed once.

A search over strings inserted into a sequence (`reward_lens.instruments.triggers`) changes only the tokens
from the insertion point on; under causal attention the tokens before it are the same in every candidate.
`prefix_cache` runs the prefix once (one unpadded row) and keeps its post-RoPE keys and values per layer;
`suffix_rewards` then runs n suffixes of equal length over that cache, recomputing only the suffix tokens
(position ids continue the prefix's), and reads the reward at the suffix's last token (the readout: ids
end at their readout, as `to_tokens` makes them). Equal to full forwards of prefix + suffix (tested).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import torch
from jaxtyping import Float, Int
from transformer_lens.hook_points import HookPoint

from reward_lens.model.hooks import final_resid_name
from reward_lens.model.placement import is_placed
from reward_lens.model.recompute import kv_names


@dataclass
class PrefixCache:
    """A prefix's post-RoPE keys and values per layer ([1, P, n_kv, d_head] each) and its length P."""

    length: int
    kv: List[Tuple[torch.Tensor, torch.Tensor]]


def _check_native_blocks(model) -> None:
    if not model.has_readout_fast_path:
        raise ValueError(
            "suffix recomputation needs the native blocks' cached-key step (a native architecture)"
        )


def _check_native(model) -> None:
    _check_native_blocks(model)
    if getattr(model.reward_head, "is_gated", False):
        raise ValueError(
            "the reward head is gated by a prompt position the suffix may contain; score full sequences "
            "instead (method='naive'), or read one objective (read_objective)"
        )


@torch.no_grad()
def prefix_cache(model, prefix_ids: Int[torch.Tensor, "1 prefix"]) -> PrefixCache:
    """Keys and values of one unpadded prefix row, every layer, for `suffix_rewards` (one forward up to the
    last block)."""
    _check_native(model)
    prefix_ids = torch.as_tensor(prefix_ids, device=model.cfg.device).reshape(1, -1)
    names = kv_names(model)
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
        )[0]
    return resid


def suffix_rewards(
    model,
    cache: PrefixCache,
    suffix_ids: Optional[Int[torch.Tensor, "n suffix"]] = None,
    *,
    suffix_embeds: Optional[Float[torch.Tensor, "n suffix d_model"]] = None,
) -> Float[torch.Tensor, " n"]:
    """Rewards [n] of prefix + each of n equal-length suffixes (ids, or embeddings as `hook_embed` holds
    them, e.g. `embed_one_hot`), only the suffixes recomputed; read at the suffix's last token (the
    readout)."""
    resid = suffix_final_residual(model, cache, suffix_ids, suffix_embeds=suffix_embeds)
    h = model.ln_final(resid[:, -1:])
    readout = torch.zeros(h.shape[0], dtype=torch.long, device=h.device)
    return model.reward_head(h, readout, input_ids=None)


# ------------------------------------------------------------------ many rows sharing prefixes (a tree)
@dataclass
class PrefixTree:
    """The radix tree of a batch's rows (their attended tokens): node i holds `tokens[i]`, continuing
    `parent[i]` (-1: the root) after `depth[i]` tokens; `level[i]` counts its ancestors, `offset[i]` is
    its first token's index in the flat store; row r's last node is `ends[r]`. Every token shared by
    several rows' prefixes is one node token, computed once."""

    tokens: List[List[int]]
    parent: List[int]
    depth: List[int]
    level: List[int]
    offset: List[int]
    ends: List[int]
    _chains: dict = field(default_factory=dict, repr=False)

    @property
    def n_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    def flat_positions(self, node: int) -> List[int]:
        """Flat store indices of the tokens at positions 0 .. depth[node] + len(tokens[node]) - 1."""
        if node not in self._chains:
            before = self.flat_positions(self.parent[node]) if self.parent[node] >= 0 else []
            self._chains[node] = before + list(
                range(self.offset[node], self.offset[node] + len(self.tokens[node]))
            )
        return self._chains[node]


def prefix_tree(rows: Sequence[Sequence[int]]) -> PrefixTree:
    """The radix tree of token rows (each non-empty): rows sorted, each group split where its rows
    diverge or one of them ends."""
    if any(len(r) == 0 for r in rows):
        raise ValueError("every row needs at least one attended token")
    tree = PrefixTree([], [], [], [], [], [-1] * len(rows))
    order = sorted(range(len(rows)), key=lambda i: list(rows[i]))
    stack = [(order, 0, -1, 0)]  # (rows sharing their first `depth` tokens, depth, parent node, level)
    while stack:
        group, depth, parent, level = stack.pop()
        first, last = rows[group[0]], rows[group[-1]]  # sorted: the group's common prefix is theirs
        end = depth
        while end < min(len(first), len(last)) and first[end] == last[end]:
            end += 1
        if end > depth:
            node = _add_node(tree, first[depth:end], parent, depth, level)
            for r in group:
                if len(rows[r]) == end:
                    tree.ends[r] = node
            parent, level = node, level + 1
        rest = [r for r in group if len(rows[r]) > end]
        start = 0
        for k in range(1, len(rest) + 1):  # children: runs of equal next token (consecutive when sorted)
            if k == len(rest) or rows[rest[k]][end] != rows[rest[start]][end]:
                stack.append((rest[start:k], end, parent, level))
                start = k
    return tree


def _add_node(tree: PrefixTree, tokens, parent: int, depth: int, level: int) -> int:
    tree.offset.append(tree.offset[-1] + len(tree.tokens[-1]) if tree.tokens else 0)
    tree.tokens.append([int(t) for t in tokens])
    tree.parent.append(parent)
    tree.depth.append(depth)
    tree.level.append(level)
    return len(tree.tokens) - 1


def _buckets(lengths: Sequence[int], nodes: Sequence[int], max_tokens: int) -> List[List[int]]:
    """Nodes of one level in runs of similar length (longest first): a run holds at most `max_tokens`
    padded tokens, and none shorter than half its longest (little padding)."""
    out: List[List[int]] = []
    for n in sorted(nodes, key=lambda n: -lengths[n]):
        run = out[-1] if out else None
        if run and (len(run) + 1) * lengths[run[0]] <= max_tokens and 2 * lengths[n] >= lengths[run[0]]:
            run.append(n)
        else:
            out.append([n])
    return out


def _tree_allowed(model, pos, valid, depth, P: int) -> dict:
    """Per window size [m, S, P + S]: which keys each node token sees: the node's past (positions 0 ..
    depth - 1) and its own tokens up to itself, within the window; a padded query sees itself."""
    m, S = pos.shape
    device = pos.device
    past_pos = torch.arange(P, device=device)[None].expand(m, P)
    key_pos = torch.cat([past_pos, pos], 1)[:, None, :]  # [m, 1, P + S]
    key_ok = torch.cat([past_pos < depth[:, None], valid], 1)[:, None, :]
    q = pos[:, :, None]
    own = torch.zeros(S, P + S, dtype=torch.bool, device=device)
    own[:, P:] = torch.eye(S, dtype=torch.bool, device=device)
    out = {}
    for window in {block.attn.window for block in model.blocks}:
        ok = key_ok & (key_pos <= q)
        if window is not None:
            ok = ok & (key_pos > q - window)
        out[window] = ok | own[None]
    return out


@torch.no_grad()
def shared_prefix_final_residual(
    model,
    input_ids: Int[torch.Tensor, "batch pos"],
    attention_mask: Int[torch.Tensor, "batch pos"],
    max_tokens: Optional[int] = None,
) -> Float[torch.Tensor, "batch pos d_model"]:
    """The final residual of every row at every attended position (zeros at padding), as a forward of the
    batch gives it, with every token that rows share with their prefix computed once: the rows' radix tree
    (`prefix_tree`) is run level by level, each node over its ancestors' cached keys and values. Rows may
    be padded on either side; each row's attended tokens must be one run. `max_tokens`: padded tokens per
    run of nodes (default: the batch's)."""
    _check_native_blocks(model)
    if is_placed(model):
        raise ValueError("shared-prefix scoring runs on one device; run a plain forward on a placed model")
    ids_host, mask_host = input_ids.cpu(), attention_mask.cpu().bool()
    batch, T = ids_host.shape
    counts = mask_host.sum(1)
    first = mask_host.long().argmax(1)
    contiguous = mask_host.long().cumsum(1).gather(1, (first + counts - 1).clamp(min=0)[:, None])[:, 0]
    if bool((counts == 0).any()) or bool((contiguous != counts).any()):
        raise ValueError(
            "shared-prefix scoring needs each row's attended tokens as one run (left or right padding), "
            "none empty; run a plain forward for other masks"
        )
    rows = [ids_host[r, first[r] : first[r] + counts[r]].tolist() for r in range(batch)]
    tree = prefix_tree(rows)
    device, cfg = model.cfg.device, model.cfg
    dtype = model.embed.W_E.dtype
    N, L = tree.n_tokens, cfg.n_layers
    kv_shape = (N, cfg.n_key_value_heads, cfg.d_head)
    store_k = [torch.zeros(kv_shape, dtype=dtype, device=device) for _ in range(L)]
    store_v = [torch.zeros(kv_shape, dtype=dtype, device=device) for _ in range(L)]
    final = torch.zeros(N, cfg.d_model, dtype=dtype, device=device)
    lengths = [len(t) for t in tree.tokens]
    budget = max_tokens or batch * T
    by_level: dict = {}
    for node, level in enumerate(tree.level):
        by_level.setdefault(level, []).append(node)
    for level in sorted(by_level):
        for run in _buckets(lengths, by_level[level], budget):
            _run_nodes(model, tree, run, store_k, store_v, final)
    where = torch.zeros(batch, T, dtype=torch.long)
    for r in range(batch):
        where[r, first[r] : first[r] + counts[r]] = torch.tensor(tree.flat_positions(tree.ends[r]))
    out = final[where.to(device)]
    return out * mask_host.to(device)[..., None].to(out.dtype)


def _run_nodes(model, tree: PrefixTree, run: List[int], store_k, store_v, final) -> None:
    """One run of nodes of a level: their tokens over their ancestors' keys and values, every layer; each
    node's keys, values and final residual written to the flat stores."""
    device = final.device
    m, S = len(run), max(len(tree.tokens[n]) for n in run)
    P = max(tree.depth[n] for n in run)
    lengths = [len(tree.tokens[n]) for n in run]
    ids = torch.tensor([tree.tokens[n] + [0] * (S - len(tree.tokens[n])) for n in run])
    valid = torch.arange(S)[None] < torch.tensor(lengths)[:, None]
    past = torch.tensor(
        [
            (tree.flat_positions(tree.parent[n]) if tree.depth[n] else []) + [0] * (P - tree.depth[n])
            for n in run
        ],
        dtype=torch.long,
    ).reshape(m, P)
    depth = torch.tensor([tree.depth[n] for n in run])
    pos = depth[:, None] + torch.arange(S)[None]
    ids, valid, past, depth, pos = (t.to(device) for t in (ids, valid, past, depth, pos))
    own = torch.tensor([i for n in run for i in range(tree.offset[n], tree.offset[n] + len(tree.tokens[n]))])
    own = own.to(device)
    allowed = _tree_allowed(model, pos, valid, depth, P)
    resid = model.embed(ids)
    cos, sin = model.rotary(pos, resid.dtype)
    for layer, block in enumerate(model.blocks):
        resid, k, v = block.forward_with_past(
            resid, cos, sin, store_k[layer][past], store_v[layer][past], allowed[block.attn.window], valid
        )
        store_k[layer][own] = k[valid]
        store_v[layer][own] = v[valid]
    final[own] = resid[valid]


@dataclass
class SharedPrefixRun:
    """Rewards of a batch scored over shared prefixes, and the named activations at every position."""

    rewards: torch.Tensor
    acts: dict


@torch.no_grad()
def shared_prefix_run(
    model,
    input_ids: Int[torch.Tensor, "batch pos"],
    attention_mask: Int[torch.Tensor, "batch pos"],
    names: Sequence[str] = (),
    *,
    readout_positions: Optional[Int[torch.Tensor, " batch"]] = None,
    max_tokens: Optional[int] = None,
) -> SharedPrefixRun:
    """What `model(input_ids, attention_mask)` returns for a padded batch (left or right), every token that
    rows share with their prefix computed once (`shared_prefix_final_residual`: the rows' radix tree over
    cached keys and values), the final norm and the head then run on the whole final residual as
    in a forward (so heads that read other positions, e.g. ArmoRM's prompt gate, read them). `names`: the
    final residual (the last block's hook_resid_post) and any hook of the final norm or the head, kept
    whole [batch, pos, ...]."""
    last = final_resid_name(model.cfg.n_layers)
    other = [n for n in names if n != last]
    bad = [n for n in other if not n.startswith(("ln_final.", "reward_head.")) or n not in model.hook_dict]
    if bad:
        raise ValueError(
            f"shared-prefix scoring keeps the final residual ({last}) and the final norm's and the head's "
            f"hooks only, not {bad}; capture those with a forward (model.run_with_cache)"
        )
    h = shared_prefix_final_residual(model, input_ids, attention_mask, max_tokens)
    ids = input_ids.to(h.device)
    if readout_positions is None:
        readout_positions = model.readout_positions(ids, attention_mask.to(h.device))
    kept = {}

    def keep(t: torch.Tensor, hook: HookPoint) -> None:
        kept[hook.name] = t.detach()

    with model.hooks(fwd_hooks=[(n, keep) for n in other]):
        rewards = model.reward_head(model.ln_final(h), readout_positions.to(h.device), input_ids=ids)
    if last in names:
        kept[last] = h
    return SharedPrefixRun(rewards, kept)
