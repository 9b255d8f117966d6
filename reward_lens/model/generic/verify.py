"""Load-time checks of the generic path, on probe inputs.

`sequential_layers`: per layer, whether its MLP reads the attention output (resid_mid exists) or runs in
parallel with it. `verify`: the hooks decompose the model exactly: each hooked module runs once per
forward, embed (+ pos) is the residual entering layer 0, every layer is resid_post = resid_pre + attn_out
+ mlp_out, the last layer's output is the final norm's input, and the reward equals transformers' own.
A model that fails a check is refused with the failing part named.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from reward_lens.model.generic.discovery import FoundModules, GenericLoadError
from reward_lens.model.generic.final_norm import dtype_tolerance
from reward_lens.model.hooks import act_name


def probe_ids(cfg, rows: int, length: int, seed: int) -> torch.Tensor:
    """[rows, length] random token ids (no pad token), every row the same."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.d_vocab, (1, length), generator=g)
    if cfg.pad_token_id is not None and 0 <= cfg.pad_token_id < cfg.d_vocab:
        ids[ids == cfg.pad_token_id] = (cfg.pad_token_id + 1) % cfg.d_vocab
    return ids.expand(rows, -1).contiguous().to(cfg.device)


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


@torch.no_grad()
def sequential_layers(
    found: FoundModules, cfg, base_kwargs: Callable[[torch.Tensor], Dict[str, Any]]
) -> List[bool]:
    """Per layer, whether its MLP reads the attention output (sequential) or runs in parallel with it:
    row l+1 of one batched probe perturbs layer l's attention output only."""
    n = len(found.layers)
    ids = probe_ids(cfg, n + 1, 6, seed=1)
    mlp_out: Dict[int, torch.Tensor] = {}

    def perturb(l: int):
        def fn(module, args, out):
            a = _first(out).clone()
            g = torch.Generator().manual_seed(l)
            noise = torch.randn(a.shape[1:], generator=g).to(device=a.device, dtype=a.dtype)
            a[l + 1] = a[l + 1] + (a[l + 1].float().abs().mean() + 1.0).to(a.dtype) * noise
            return (a,) + tuple(out[1:]) if isinstance(out, tuple) else a

        return fn

    def keep(l: int):
        def fn(module, args, out):
            mlp_out[l] = _first(out).float()

        return fn

    handles = [found.attn[l].register_forward_hook(perturb(l)) for l in range(n)]
    handles += [found.mlp[l].register_forward_hook(keep(l)) for l in range(n)]
    try:
        found.base(**base_kwargs(ids))
    finally:
        for h in handles:
            h.remove()
    out = []
    for l in range(n):
        if l not in mlp_out:
            raise GenericLoadError(f"the MLP module of layer {l} ({cfg.module_map['mlp']}) never ran")
        diff = (mlp_out[l][l + 1] - mlp_out[l][0]).abs().max().item()
        out.append(diff > 1e-3 * (mlp_out[l][0].abs().max().item() + 1e-6))
    return out


def site_path(module_map: Dict[str, Optional[str]], site: str) -> str:
    """The dotted module path of a counted hook site ("attn3", "resid_pre0", "embed", ...)."""
    for key in ("attn", "mlp", "resid_pre", "resid_post"):
        if site.startswith(key) and site[len(key) :].isdigit():
            l = site[len(key) :]
            if key in ("attn", "mlp"):
                return f"{module_map['layers']}.{l}.{module_map[key]}"
            return f"{module_map['layers']}.{l}"
    return str(module_map.get(site, site))


class _Checker:
    """`close(a, b)` within the dtype's tolerance, relative to b's magnitude; errors name the model."""

    def __init__(self, model):
        self.tol = dtype_tolerance(model.cfg.dtype)
        self.where = type(model.hf_model).__name__

    def close(self, a: torch.Tensor, b: torch.Tensor) -> Tuple[bool, float, float]:
        err = (a.float() - b.float()).abs().max().item()
        bound = self.tol * max(1.0, b.float().abs().max().item())
        return err <= bound, err, bound


@torch.no_grad()
def verify(model) -> None:
    """Check on a probe input that the hooks decompose `model` (a GenericHookedRewardModel) exactly;
    raise GenericLoadError naming the failing part otherwise."""
    cfg = model.cfg
    ids = probe_ids(cfg, 1, 7, seed=0)
    mask = torch.ones_like(ids)
    rewards, cache, calls = model.probe_run(ids, mask)
    check = _Checker(model)
    _check_call_counts(cfg, calls, check.where)
    _check_embedding(cfg, cache, check)
    _check_layers(model, cache, check)
    _check_final_norm(cfg, cache, check)
    ok, err, bound = check.close(rewards.reshape(-1), model.reference_logits(ids, mask).reshape(-1))
    if not ok:
        raise GenericLoadError(
            f"{check.where}: the reward from the hooked path differs from transformers' ({err:.3g} > "
            f"{bound:.3g}): the score head {cfg.module_map['score']} is not a plain linear read of the "
            "final norm at the rightmost non-pad token; ask for a native weight map"
        )


def _check_call_counts(cfg, calls: Dict[str, int], where: str) -> None:
    sites = ["embed", "final_norm"] + [
        f"{k}{l}" for l in range(cfg.n_layers) for k in ("attn", "mlp", "resid_pre", "resid_post")
    ]
    for site in sites:
        if calls.get(site, 0) != 1:
            raise GenericLoadError(
                f"{where}: the module {site_path(cfg.module_map, site)} ran {calls.get(site, 0)} times in "
                "one forward (expected once), so its output is not one residual term; pass module_map "
                "naming the right module, or ask for a native weight map"
            )


def _check_embedding(cfg, cache, check: _Checker) -> None:
    embed = cache[act_name("embed")] + (cache[act_name("pos_embed")] if act_name("pos_embed") in cache else 0)
    ok, err, bound = check.close(embed, cache[act_name("resid_pre", 0)])
    if not ok:
        pos = cfg.module_map["pos_embed"]
        raise GenericLoadError(
            f"{check.where}: the embedding output ({cfg.module_map['embed']}{' + ' + pos if pos else ''}) "
            f"is not the residual entering layer 0 (max error {err:.3g} > {bound:.3g}): the model scales "
            "or transforms its embeddings in its forward, which the generic path cannot split exactly; "
            "ask for a native weight map or pass module_map={'embed': ..., 'pos_embed': ...}"
        )


def _check_layers(model, cache, check: _Checker) -> None:
    cfg = model.cfg
    for l in range(cfg.n_layers):
        post = cache[act_name("resid_post", l)]
        terms = (
            cache[act_name("resid_pre", l)] + cache[act_name("attn_out", l)] + cache[act_name("mlp_out", l)]
        )
        ok, err, bound = check.close(terms, post)
        if not ok:
            raise GenericLoadError(
                f"{check.where}: layer {l} ({cfg.module_map['layers']}.{l}, "
                f"{type(model.found.layers[l]).__name__}) is not resid_post = resid_pre + attn_out + "
                f"mlp_out on a probe input (max error {err:.3g} > tolerance {bound:.3g}): its "
                f"'{cfg.module_map['attn']}' / '{cfg.module_map['mlp']}' outputs are transformed before "
                "they reach the residual (post-norms, residual scaling, ...), so the reward has no exact "
                "component decomposition on the generic path. Pass module_map={'attn': ..., 'mlp': "
                "...} naming the modules whose outputs are added to the residual, or ask for a native "
                "weight map (conversion/GENERIC.md)"
            )
        if l + 1 < cfg.n_layers:
            ok, err, bound = check.close(cache[act_name("resid_pre", l + 1)], post)
            if not ok:
                raise GenericLoadError(
                    f"{check.where}: the residual entering layer {l + 1} is not layer {l}'s output (max "
                    f"error {err:.3g}); the model changes the residual between layers, which the generic "
                    "path cannot decompose"
                )


def _check_final_norm(cfg, cache, check: _Checker) -> None:
    """The final norm must read the last layer's output: hook_normalized * scale gives back its input."""
    normalized, scale = cache[act_name("final_normalized")].float(), cache[act_name("final_scale")]
    last = cache[act_name("resid_post", cfg.n_layers - 1)].float()
    if cfg.normalization_type.startswith("LN"):
        last = last - last.mean(-1, keepdim=True)
    ok, err, bound = check.close(normalized * scale, last)
    if not ok:
        raise GenericLoadError(
            f"{check.where}: the final norm {cfg.module_map['final_norm']} does not read the last layer's "
            f"output (max error {err:.3g}); the model transforms the residual after its last layer"
        )
