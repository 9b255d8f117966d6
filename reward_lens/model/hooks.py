"""The one source of hook names, in the spirit of TransformerLens's `get_act_name`.

Hook names are the public contract of the hooked model (`run_with_cache`, `run_with_hooks`,
`transformer_lens.patching` all speak them). Everything outside `reward_lens/model/` builds and parses
them here: a name from a kind and a layer (`act_name("resid_pre", 3)` -> "blocks.3.hook_resid_pre"),
the layer and kind back from a name, which axis is the query-position axis, whether a hook is per head,
and the width of its last axis.
"""

from __future__ import annotations

import operator
import re
from typing import Any, Dict, Optional

# kind -> (where the hook lives relative to a block, None for model-level hooks)
_BLOCK_KINDS = (
    "resid_pre",
    "resid_mid",
    "resid_post",
    "attn_out",
    "mlp_out",
    "attn_in",
    "mlp_in",
    "q_input",
    "k_input",
    "v_input",
)
# Block inputs with a head axis, [batch, pos, heads, d_model] (TransformerLens's split inputs).
_PER_HEAD_INPUT_KINDS = ("attn_in", "q_input", "k_input", "v_input")
_ATTN_KINDS = ("q", "k", "v", "rot_q", "rot_k", "z", "result", "attn_scores", "pattern")
_MLP_KINDS = ("pre", "pre_linear", "post")
_NORMS = ("ln1", "ln2", "ln1_post", "ln2_post")
_MODEL_KINDS = {
    "embed": "hook_embed",
    "pos_embed": "hook_pos_embed",
    "final_scale": "ln_final.hook_scale",
    "final_normalized": "ln_final.hook_normalized",
    "rewards": "reward_head.hook_rewards",
    "pooled": "reward_head.hook_pooled",
}
# TransformerLens's short aliases (`transformer_lens.utils.get_act_name`'s and the 4.x bridge's "in"/"out").
_ALIASES = {
    "attn": "pattern",
    "scores": "attn_scores",
    "attn_pattern": "pattern",
    "attn_logits": "attn_scores",
    "key": "k",
    "query": "q",
    "value": "v",
    "mlp_pre": "pre",
    "mlp_post": "post",
    "in": "resid_pre",
    "out": "resid_post",
}

QUERY_AXIS_2_KINDS = ("attn_scores", "pattern")  # [batch, head, query_pos, key_pos]
PER_HEAD_KINDS = _ATTN_KINDS  # every attention-internal hook carries a head axis
D_MODEL_KINDS = ("embed", "pos_embed", "final_normalized") + tuple(
    k for k in _BLOCK_KINDS if k not in _PER_HEAD_INPUT_KINDS
)
D_MLP_KINDS = _MLP_KINDS

_NAME = re.compile(r"^blocks\.(\d+)\.(?:(attn|mlp|ln1|ln2|ln1_post|ln2_post)\.)?hook_(\w+)$")


def act_name(kind: str, layer: Optional[int] = None, norm: Optional[str] = None) -> str:
    """The hook name of activation `kind` at block `layer`.

    Block kinds: resid_pre, resid_mid, resid_post, attn_out, mlp_out, mlp_in, and attn_in, q_input, k_input,
    v_input ([batch, pos, heads, d_model], TransformerLens's split inputs, named under `attn.` as in its 4.x
    bridge: "blocks.{l}.attn.hook_q_input"); attention kinds
    (per head): q, k, v, rot_q, rot_k, z, result, attn_scores, pattern; MLP kinds: pre, pre_linear, post;
    norm kinds: scale / normalized with `norm` in ln1, ln2, ln1_post, ln2_post (layer given) or the final
    norm (no layer). Model-level kinds (no layer): embed, pos_embed, final_scale, final_normalized,
    rewards, pooled, and any other `reward_head` hook by its short name (e.g. "gate").
    """
    kind = _ALIASES.get(kind, kind)
    if kind in ("scale", "normalized"):
        if layer is None:
            return f"ln_final.hook_{kind}"
        if norm not in _NORMS:
            raise ValueError(f"act_name({kind!r}, {layer}) needs norm= one of {_NORMS}")
        return f"blocks.{layer}.{norm}.hook_{kind}"
    if kind in _MODEL_KINDS:
        return _MODEL_KINDS[kind]
    if kind in _BLOCK_KINDS + _ATTN_KINDS + _MLP_KINDS:
        if layer is None:
            raise ValueError(f"act_name({kind!r}) needs a layer")
        in_attn = kind in _ATTN_KINDS + _PER_HEAD_INPUT_KINDS
        where = "attn." if in_attn else "mlp." if kind in _MLP_KINDS else ""
        return f"blocks.{_layer_index(layer, kind)}.{where}hook_{kind}"
    if layer is None and re.fullmatch(r"\w+", kind):
        return f"reward_head.hook_{kind}"
    raise ValueError(
        f"unknown activation kind {kind!r}; block kinds {_BLOCK_KINDS}, attention kinds {_ATTN_KINDS}, "
        f"MLP kinds {_MLP_KINDS}, model kinds {tuple(_MODEL_KINDS)}"
    )


def final_resid_name(n_layers: int) -> str:
    """The residual the final norm and the reward head read: the last block's resid_post."""
    return act_name("resid_post", n_layers - 1)


def resid_entering(layer: int, n_layers: int) -> str:
    """The residual entering block `layer` (`layer == n_layers`: the final residual)."""
    return final_resid_name(n_layers) if layer == n_layers else act_name("resid_pre", layer)


def mlp_input_name(layer: int) -> str:
    """What a layer's transcoder reads: the MLP's normalised input (before the norm's weight)."""
    return act_name("normalized", layer, norm="ln2")


def mlp_output_name(layer: int) -> str:
    """What a layer's transcoder reconstructs: the MLP's output."""
    return act_name("mlp_out", layer)


def layer_of(name: str) -> Optional[int]:
    """The block index a hook belongs to; None for model-level hooks (embed, ln_final, reward_head)."""
    m = _NAME.match(name)
    return int(m.group(1)) if m else None


def kind_of(name: str) -> str:
    """The activation kind of a hook name (inverse of `act_name`; norm hooks give 'scale'/'normalized')."""
    m = _NAME.match(name)
    if m:
        return m.group(3)
    for kind, full in _MODEL_KINDS.items():
        if name == full:
            return kind
    if name.startswith("reward_head.hook_"):
        return name[len("reward_head.hook_") :]
    if name.startswith("ln_final.hook_"):
        return "final_" + name[len("ln_final.hook_") :]
    raise ValueError(f"{name!r} is not a reward-lens hook name (e.g. 'blocks.0.hook_resid_pre')")


def is_query_axis_2(name: str) -> bool:
    """Whether the hook's position axis is dim 2 ([batch, head, query_pos, key_pos]) rather than dim 1."""
    return name.rsplit(".", 1)[-1] in tuple(f"hook_{k}" for k in QUERY_AXIS_2_KINDS)


def query_axis(name: str) -> int:
    """The axis of a hook's activation that indexes query (token) positions."""
    return 2 if is_query_axis_2(name) else 1


def is_per_head(name: str) -> bool:
    """Whether the activation has a head axis (attention-internal hooks: q, k, v, z, result, patterns)."""
    m = _NAME.match(name)
    return bool(m and m.group(2) == "attn" and m.group(3) in PER_HEAD_KINDS)


# Block-level hooks that exist only where a block is re-implemented (the native path): its inputs split
# per attention/MLP sub-module.
_NATIVE_BLOCK_INPUT_KINDS = ("attn_in", "mlp_in", "q_input", "k_input", "v_input")


def is_head_level(name: str) -> bool:
    """Whether a block hook is finer than the component level (inside attention, the MLP or a norm, or a
    sub-module's input): the hooks only natively re-implemented blocks have."""
    m = _NAME.match(name)
    return bool(m and (m.group(2) is not None or m.group(3) in _NATIVE_BLOCK_INPUT_KINDS))


def hook_width(cfg, name: str) -> Optional[int]:
    """The last-axis width of a hook's activation when it is one vector per token (else None: per-head,
    pattern and scale hooks)."""
    m = _NAME.match(name)
    if m:
        sub, kind = m.group(2), m.group(3)
        if sub == "mlp" and kind in D_MLP_KINDS:
            return cfg.d_mlp
        if sub is None and kind in D_MODEL_KINDS:
            return cfg.d_model
        if sub in _NORMS and kind == "normalized":
            return cfg.d_model
        return None
    return (
        cfg.d_model
        if name in (_MODEL_KINDS["embed"], _MODEL_KINDS["pos_embed"], _MODEL_KINDS["final_normalized"])
        else None
    )


def stop_layer(name: str) -> Optional[int]:
    """The `stop_at_layer` after which hook `name` has fired (None: it needs the full forward)."""
    if name in (_MODEL_KINDS["embed"], _MODEL_KINDS["pos_embed"]):
        return 0
    layer = layer_of(name)
    return None if layer is None else layer + 1


def tl_hook_aliases(n_layers: int, post_norms: bool = False, norms_folded: bool = True) -> Dict[str, str]:
    """TransformerLens names with an exact analogue here -> our hook name: the 4.x bridge's
    `blocks.{l}.hook_in` / `hook_out` (resid_pre / resid_post), the block-level `hook_q_input` / `k_input` /
    `v_input` / `hook_attn_in` of TransformerLens 2/3 and its `get_act_name` (ours, as the 4.x bridge's, are
    `attn.hook_q_input` etc., which TL 4.3's edge `attribution_patch` enumerates), `attn.hook_out` /
    `mlp.hook_out` (without post-norms, which act after them), and `attn.hook_in` / `mlp.hook_in` (the
    normalised inputs; only with the norms' weights folded, when `ln1/ln2.hook_normalized` is that input)."""
    aliases: Dict[str, str] = {}
    for layer in range(n_layers):
        block = f"blocks.{layer}"
        aliases[f"{block}.hook_in"] = act_name("resid_pre", layer)
        aliases[f"{block}.hook_out"] = act_name("resid_post", layer)
        for kind in _PER_HEAD_INPUT_KINDS:  # TransformerLens 2/3's block-level names
            aliases[f"{block}.hook_{kind}"] = act_name(kind, layer)
        if not post_norms:
            aliases[f"{block}.attn.hook_out"] = act_name("attn_out", layer)
            aliases[f"{block}.mlp.hook_out"] = act_name("mlp_out", layer)
        if norms_folded:
            aliases[f"{block}.attn.hook_in"] = act_name("normalized", layer, norm="ln1")
            aliases[f"{block}.mlp.hook_in"] = act_name("normalized", layer, norm="ln2")
    return aliases


def _layer_index(layer: Any, kind: str) -> int:
    """A layer as an integer (numpy / 0-d tensor integers too); a float is never truncated to a layer."""
    try:
        if isinstance(layer, bool):
            raise TypeError
        return operator.index(layer)
    except TypeError:
        raise ValueError(
            f"act_name({kind!r}, {layer!r}): the layer must be an integer, got {type(layer).__name__}"
        ) from None
