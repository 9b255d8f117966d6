"""Readout capture: rewards and activations at each sequence's readout position, batch by batch (with a
progress bar on long runs), and whole activations streamed or captured in one forward. Instruments never
write hook plumbing of their own. Batching lives in `core.batching`, per-sequence directions in
`core.directions`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Union

import torch

from reward_lens.core.batching import Tokenized, batches, cat_padded, length_order, take_rows, tokenize
from reward_lens.model import hooks
from reward_lens.model.frozen import gradients_on, with_frozen_weights
from reward_lens.model.placement import is_placed
from reward_lens.model.validation import check_finite_rewards

NamesFilter = Union[None, str, Sequence[str], Callable[[str], bool]]


@dataclass
class ReadoutRun:
    """Rewards and activations at the readout position of each sequence, concatenated over batches.

    `acts[name]` has the readout position squeezed out: [n, d_model] for residual hooks, [n, n_heads,
    d_head] for hook_z, [n, 1] for ln_final.hook_scale, [n, n_heads, key_pos] for patterns (padded).
    """

    rewards: torch.Tensor  # [n] or [n, n_outputs]
    acts: Dict[str, torch.Tensor]


def readout_cache(model, tok: Tokenized, names_filter: Union[Sequence[str], Callable[[str], bool]]):
    """(rewards, cache) of one tokenised batch, the cache holding `names_filter`'s activations at each
    row's readout position only (`run_with_cache(readout_only=True)`)."""
    return model.run_with_cache(
        tok.input_ids,
        attention_mask=tok.attention_mask,
        readout_only=True,
        readout_positions=tok.readout,
        names_filter=names_filter,
    )


@torch.no_grad()
def readout_run(
    model,
    prompts: Sequence[str],
    responses: Sequence[str],
    names_filter: NamesFilter = None,
    *,
    batch_size: int = 8,
    progress: Union[bool, str] = False,
    by_length: bool = True,
    shared_prefixes: bool = False,
) -> ReadoutRun:
    """Rewards of every (prompt, response) and the named activations at each readout position, in input
    order. `by_length`: batch the texts sorted by token count (tokenised once, each batch padded to its own
    longest), so short texts are not padded to long ones; the results are put back in input order.
    `shared_prefixes`: texts that share token prefixes (variants of one response) compute each shared token
    once (`model.shared_prefix_run`; `names_filter` then a list of the final residual and final-norm or
    head hooks); equal to the plain forwards to float rounding."""
    n = len(prompts)
    if shared_prefixes and shares_prefixes(model):
        return _shared_prefix_readout_run(model, prompts, responses, names_filter, batch_size, progress)
    whole = tokenize(model, prompts, responses) if by_length and n > batch_size else None
    order = length_order(whole) if whole is not None else torch.arange(n)
    rewards: List[torch.Tensor] = []
    acts: Dict[str, List[torch.Tensor]] = {}
    for sl in batches(n, batch_size, progress):
        rows = order[sl]
        if whole is not None:
            tok = take_rows(model, whole, rows)
        else:
            tok = tokenize(model, prompts[sl], responses[sl])
        out, cache = readout_cache(
            model, tok, names_filter if names_filter is not None else (lambda n: False)
        )
        check_finite_rewards(out, [f"input {i} (prompt {str(prompts[i])[:40]!r})" for i in rows.tolist()])
        rewards.append(out.detach())
        for name, value in cache.items():
            if value.dim() >= 3:
                value = value[:, :, 0] if hooks.query_axis(name) == 2 else value[:, 0]
            acts.setdefault(name, []).append(value)
    back = torch.argsort(order)  # sorted position of each input

    def unsort(t: torch.Tensor) -> torch.Tensor:
        return t[back.to(t.device)]

    return ReadoutRun(unsort(torch.cat(rewards)), {k: unsort(cat_padded(v)) for k, v in acts.items()})


# Texts per radix tree: enough for the variants of several items to share their prompts and responses;
# each tree's nodes run in batches of at most `batch_size` rows' padded tokens.
TEXTS_PER_TREE = 64


def shares_prefixes(model) -> bool:
    """Whether `model` scores over shared prefixes (native blocks on one device); else plain forwards."""
    return bool(getattr(model, "has_readout_fast_path", False)) and not is_placed(model)


def _shared_prefix_readout_run(model, prompts, responses, names_filter, batch_size, progress) -> ReadoutRun:
    names = [] if names_filter is None else [names_filter] if isinstance(names_filter, str) else names_filter
    if callable(names):
        raise ValueError("shared-prefix scoring takes hook names as a list, not a filter function")
    whole = tokenize(model, prompts, responses)
    host_ids, host_mask = whole.input_ids.cpu(), whole.attention_mask.cpu().bool()
    rows = [host_ids[r][host_mask[r]].tolist() for r in range(len(prompts))]
    order = torch.tensor(sorted(range(len(rows)), key=lambda r: rows[r]), dtype=torch.long)
    rewards: List[torch.Tensor] = []
    acts: Dict[str, List[torch.Tensor]] = {}
    for sl in batches(len(rows), TEXTS_PER_TREE, progress):
        tok = take_rows(model, whole, order[sl])
        run = model.shared_prefix_run(
            tok.input_ids,
            tok.attention_mask,
            list(names),
            readout_positions=tok.readout,
            max_tokens=batch_size * tok.input_ids.shape[1],
        )
        check_finite_rewards(
            run.rewards, [f"input {i} (prompt {str(prompts[i])[:40]!r})" for i in order[sl].tolist()]
        )
        rewards.append(run.rewards)
        at = torch.arange(len(tok.readout), device=run.rewards.device)
        for name in names:
            acts.setdefault(name, []).append(run.acts[name][at, tok.readout.to(at.device)])
    back = torch.argsort(order)
    return ReadoutRun(
        torch.cat(rewards)[back.to(rewards[0].device)],
        {k: torch.cat(v)[back.to(v[0].device)] for k, v in acts.items()},
    )


@torch.no_grad()
def stream_activations(
    model,
    prompts: Optional[Sequence[str]] = None,
    responses: Optional[Sequence[str]] = None,
    hook_name: str = "",
    *,
    input_ids: Optional[torch.Tensor] = None,
    attention_mask: Optional[torch.Tensor] = None,
    positions: str = "all",
    batch_size: int = 8,
    progress: Union[bool, str] = False,
    device: Optional[Union[str, torch.device]] = "cpu",
) -> Iterator[torch.Tensor]:
    """Yield the activation at `hook_name` batch by batch: [n_tokens, ...] over every non-pad token
    (`positions="all"`) or [batch, ...] at each readout position (`positions="readout"`).

    Give either (prompts, responses) or already tokenised `input_ids` (+ `attention_mask`). The forward
    stops right after the hook's block, so streaming an early layer costs only that much of the model.
    """
    if positions not in ("all", "readout"):
        raise ValueError(f"positions must be 'all' or 'readout', got {positions!r}")
    if hook_name not in model.hook_dict:
        raise ValueError(f"unknown hook {hook_name!r}; e.g. 'blocks.0.hook_resid_post' (see model.hook_dict)")
    if hooks.query_axis(hook_name) == 2:
        raise ValueError(
            f"{hook_name} has no per-token layout [batch, pos, ...]; stream a residual-like hook"
        )
    if input_ids is None:
        if prompts is None or responses is None:
            raise ValueError("give (prompts, responses) or input_ids to stream activations from")
        n = len(prompts)
    else:
        n = input_ids.shape[0]
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
    stop = hooks.stop_layer(hook_name)
    for sl in batches(n, batch_size, progress):
        if input_ids is None:
            tok = tokenize(model, prompts[sl], responses[sl])
        else:
            ids, mask = input_ids[sl].to(model.cfg.device), attention_mask[sl].to(model.cfg.device)
            tok = Tokenized(ids, mask, model.readout_positions(ids, mask))
        grabbed: Dict[str, torch.Tensor] = {}

        def grab(tensor: torch.Tensor, hook) -> None:
            grabbed["acts"] = tensor.detach()

        model.run_with_hooks(
            tok.input_ids,
            tok.attention_mask,
            fwd_hooks=[(hook_name, grab)],
            **({"stop_at_layer": stop} if stop is not None else {"readout_positions": tok.readout}),
        )
        acts = grabbed["acts"]
        if positions == "all":
            out = acts[tok.attention_mask.bool().to(acts.device)]
        else:
            out = acts[torch.arange(acts.shape[0], device=acts.device), tok.readout.to(acts.device)]
        yield out.to(device) if device is not None else out


@dataclass
class Capture:
    """One forward of a tokenised batch: its rewards, named activations at each readout position
    (`at_readout[name]`: [batch, ...]; a pattern's readout query row [batch, heads, key_pos]), named full
    activations (`full[name]`: [batch, pos, ...]) and, when asked, d(sum of rewards) / d activation of
    named hooks (`grads[name]`, whole, like `full`)."""

    tok: Tokenized
    rewards: torch.Tensor
    at_readout: Dict[str, torch.Tensor]
    full: Dict[str, torch.Tensor]
    grads: Dict[str, torch.Tensor] = field(default_factory=dict)


@with_frozen_weights
def capture(
    model,
    tok: Tokenized,
    readout_names: Sequence[str] = (),
    full_names: Sequence[str] = (),
    grad_names: Sequence[str] = (),
) -> Capture:
    """Run `tok` once, keeping `readout_names` at the readout and `full_names` whole (one forward). With
    `grad_names`, the same forward builds a graph from the embedding (parameters stay frozen: a hook
    makes the embedding's output the leaf) and one backward gives d reward / d activation of each."""
    at_readout: Dict[str, torch.Tensor] = {}
    full: Dict[str, torch.Tensor] = {}
    rows = torch.arange(tok.input_ids.shape[0], device=tok.input_ids.device)
    readout = tok.readout.to(tok.input_ids.device)
    grad_names = list(dict.fromkeys(grad_names))
    home = tok.input_ids.device  # a placed model's activations are kept on its home device
    graph: Dict[str, torch.Tensor] = {}

    def keep_readout(tensor: torch.Tensor, hook) -> None:
        here, tensor = tensor.device, tensor.detach()
        if tensor.dim() >= 3 and hooks.query_axis(hook.name) == 2:  # [B, H, q, k]: the readout query's row
            value = tensor[rows.to(here), :, readout.to(here)]
        else:
            value = tensor[rows.to(here), readout.to(here)] if tensor.dim() >= 3 else tensor
        at_readout[hook.name] = value.to(home)

    def keep_full(tensor: torch.Tensor, hook) -> None:
        full[hook.name] = tensor.detach().to(home)

    def leaf(tensor: torch.Tensor, hook) -> torch.Tensor:
        return tensor.detach().requires_grad_(True)

    def keep_graph(tensor: torch.Tensor, hook) -> None:
        graph[hook.name] = tensor

    fwd = []
    if grad_names:
        embeds = (hooks.act_name("embed"), hooks.act_name("pos_embed"))
        fwd += [(h, leaf) for h in embeds if h in model.hook_dict]
        fwd += [(n, keep_graph) for n in grad_names]
    fwd += [(n, keep_readout) for n in dict.fromkeys(readout_names)]
    fwd += [(n, keep_full) for n in dict.fromkeys(full_names)]
    with gradients_on("this gradient instrument", bool(grad_names)):
        rewards = model.run_with_hooks(
            tok.input_ids, tok.attention_mask, readout_positions=tok.readout, fwd_hooks=fwd
        )
        grads: Dict[str, torch.Tensor] = {}
        if grad_names:  # w.r.t. the activations only: no weight gradient is computed
            inputs = [graph[n] for n in grad_names]
            found = torch.autograd.grad(rewards.float().sum(), inputs, allow_unused=True)
            grads = {
                n: (g if g is not None else torch.zeros_like(graph[n])).detach().to(home)
                for n, g in zip(grad_names, found)
            }
            for n in grad_names:  # what was kept for the graph, detached, as every capture keeps it
                full.setdefault(n, graph[n].detach().to(home))
    rewards = rewards.detach()
    check_finite_rewards(rewards, tok.labels)
    return Capture(tok, rewards, at_readout, full, grads)
