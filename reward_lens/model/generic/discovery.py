"""Discovery for the generic path: which modules of a transformers *ForSequenceClassification model are
the base transformer, its decoder layers, embeddings, final norm, score head and each layer's attention
and MLP (found structurally, or named by `module_map`), and the `GenericRewardModelConfig` they imply.
Also the generic path's two errors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch.nn as nn

from reward_lens.model.config import RewardModelConfig

MODULE_MAP_KEYS = ("base", "layers", "embed", "pos_embed", "final_norm", "score", "attn", "mlp")
NATIVE_HINT = (
    "the generic path hooks components only (embed, attn_out, mlp_out, residual stream, final norm, "
    "reward head); load a natively supported architecture for head-level hooks and weights (see "
    "conversion/GENERIC.md, `reward_lens.converters.supported_architectures()`)"
)
HEAD_LEVEL_BLOCK_ATTRS = ("attn", "mlp", "ln1", "ln2", "ln1_post", "ln2_post")
HEAD_LEVEL_WEIGHTS = (
    "W_Q",
    "W_K",
    "W_V",
    "W_O",
    "W_in",
    "W_gate",
    "W_out",
    "b_Q",
    "b_K",
    "b_V",
    "b_O",
    "b_in",
    "b_out",
)
ATTN_NAMES = ("self_attn", "attn", "attention", "self_attention", "mixer")
MLP_NAMES = ("mlp", "feed_forward", "ffn", "feedforward", "block_sparse_moe", "moe")
NORM_NAMES = ("norm", "ln_f", "final_layer_norm", "final_layernorm", "final_norm", "norm_f", "ln_final")
SCORE_NAMES = ("score", "classifier", "v_head", "value_head", "reward_head", "rm_head")
EPS_ATTRS = ("eps", "variance_epsilon", "epsilon", "layer_norm_eps", "norm_eps")


class GenericPathError(AttributeError, NotImplementedError):
    """A head-level tool was asked of a model on the generic (component-level) path.

    An AttributeError (so `hasattr(block, "attn")` is False) and a NotImplementedError.
    """


class GenericLoadError(ValueError):
    """The model cannot be wrapped exactly on the generic path (the message says which part and why)."""


@dataclass
class GenericRewardModelConfig(RewardModelConfig):
    """RewardModelConfig (TransformerLens field names) for a model on the generic path.

    `module_map`: the dotted paths (from the transformers model's root; `attn`/`mlp` relative to each
    layer) of the modules the hooks were spliced onto, as found or as overridden.
    """

    generic: bool = True
    module_map: Dict[str, Optional[str]] = field(default_factory=dict)
    sequential_layers: List[bool] = field(default_factory=list)  # False: attention and MLP in parallel


@dataclass
class FoundModules:
    base: nn.Module
    layers: nn.ModuleList
    embed: nn.Module
    pos_embed: Optional[nn.Module]
    final_norm: nn.Module
    score: nn.Linear
    attn: List[nn.Module]
    mlp: List[nn.Module]
    paths: Dict[str, Optional[str]]


def get_submodule(root: nn.Module, path: str) -> nn.Module:
    try:
        return root.get_submodule(path) if path else root
    except AttributeError:
        raise GenericLoadError(
            f"module_map path {path!r} names no submodule of {type(root).__name__}"
        ) from None


def path_of(root: nn.Module, module: nn.Module) -> str:
    for name, m in root.named_modules():
        if m is module:
            return name
    raise GenericLoadError(f"{type(module).__name__} is not a submodule of {type(root).__name__}")


def text_config(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def first_attr(obj: Any, names: Tuple[str, ...], default: Any = None) -> Any:
    for n in names:
        v = getattr(obj, n, None)
        if v is not None:
            return v
    return default


def find_modules(hf_model: nn.Module, module_map: Optional[Dict[str, Optional[str]]]) -> FoundModules:
    """The modules the hooks go on: `module_map` entries as given, the others found structurally."""
    module_map = dict(module_map or {})
    unknown = set(module_map) - set(MODULE_MAP_KEYS)
    if unknown:
        raise ValueError(
            f"unknown module_map keys {sorted(unknown)}; known keys: {', '.join(MODULE_MAP_KEYS)}"
        )
    name = type(hf_model).__name__
    if "score" not in module_map and not name.endswith("ForSequenceClassification"):
        raise GenericLoadError(
            f"{name} is not a sequence-classification model: the generic path wraps transformers "
            "*ForSequenceClassification models (a reward model's scalar head); load the reward checkpoint "
            "with its sequence-classification class, or pass module_map={'score': 'path.to.linear.head'}"
        )
    base = (
        get_submodule(hf_model, module_map["base"])
        if "base" in module_map
        else getattr(hf_model, "base_model", None)
    )
    if base is None or base is hf_model:
        raise GenericLoadError(
            f"cannot find the base transformer of {name}; pass module_map={{'base': 'path'}}"
        )
    layers = _find_layers(hf_model, base, module_map)
    embed = _find_embed(hf_model, module_map)
    pos_embed = _find_pos_embed(hf_model, base, embed, module_map)
    final_norm = _find_final_norm(hf_model, base, module_map)
    score = _find_score(hf_model, module_map)
    attn, mlp = [], []
    for l, layer in enumerate(layers):
        attn.append(_sublayer(layer, l, module_map.get("attn"), ATTN_NAMES, ("attention",), "attn"))
        mlp.append(
            _sublayer(layer, l, module_map.get("mlp"), MLP_NAMES, ("mlp", "feedforward", "moe"), "mlp")
        )
    paths = {
        "base": path_of(hf_model, base),
        "layers": path_of(hf_model, layers),
        "embed": path_of(hf_model, embed),
        "pos_embed": path_of(hf_model, pos_embed) if pos_embed is not None else None,
        "final_norm": path_of(hf_model, final_norm),
        "score": path_of(hf_model, score),
        "attn": path_of(layers[0], attn[0]),
        "mlp": path_of(layers[0], mlp[0]),
    }
    return FoundModules(base, layers, embed, pos_embed, final_norm, score, attn, mlp, paths)


def _find_layers(hf_model: nn.Module, base: nn.Module, module_map: Dict[str, Optional[str]]) -> nn.ModuleList:
    """The shallowest non-empty ModuleList under the base, preferring one of the config's layer count."""
    name = type(hf_model).__name__
    if "layers" in module_map:
        layers = get_submodule(hf_model, module_map["layers"])
    else:
        n_cfg = first_attr(text_config(hf_model.config), ("num_hidden_layers", "n_layer", "num_layers"))
        lists = [(n, m) for n, m in base.named_modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
        exact = [(n, m) for n, m in lists if len(m) == n_cfg]
        pool = exact or lists
        if not pool:
            raise GenericLoadError(
                f"cannot find the decoder layers of {name}; pass module_map={{'layers': 'path'}}"
            )
        layers = min(pool, key=lambda nm: (nm[0].count("."), -len(nm[1])))[1]
    if not isinstance(layers, nn.ModuleList):
        raise GenericLoadError(
            f"module_map['layers'] must name an nn.ModuleList, got {type(layers).__name__}"
        )
    return layers


def _find_embed(hf_model: nn.Module, module_map: Dict[str, Optional[str]]) -> nn.Module:
    if "embed" in module_map:
        return get_submodule(hf_model, module_map["embed"])
    try:
        embed = hf_model.get_input_embeddings()
    except (NotImplementedError, AttributeError):  # transformers' own signal that a model has none
        embed = None
    if embed is None:
        raise GenericLoadError(
            f"cannot find the token embedding of {type(hf_model).__name__}; pass module_map={{'embed': "
            "'path'}"
        )
    return embed


def _find_pos_embed(hf_model, base, embed, module_map: Dict[str, Optional[str]]) -> Optional[nn.Module]:
    """A learned position embedding directly under the base (GPT-2's wpe), or None (rotary, ...)."""
    if "pos_embed" in module_map:
        return get_submodule(hf_model, module_map["pos_embed"]) if module_map["pos_embed"] else None
    n_pos = first_attr(text_config(hf_model.config), ("max_position_embeddings", "n_positions"))
    others = [(n, m) for n, m in base.named_children() if isinstance(m, nn.Embedding) and m is not embed]
    positional = [m for n, m in others if "pos" in n.lower() or n == "wpe" or m.num_embeddings == n_pos]
    if len(positional) > 1:
        raise GenericLoadError(
            f"{type(hf_model).__name__} has several position-like embeddings; pass "
            "module_map={'pos_embed': 'path'} (or None)"
        )
    return positional[0] if positional else None


def _find_final_norm(hf_model, base, module_map: Dict[str, Optional[str]]) -> nn.Module:
    if "final_norm" in module_map:
        return get_submodule(hf_model, module_map["final_norm"])
    norms = [
        (n, m) for n, m in base.named_children() if n in NORM_NAMES or "norm" in type(m).__name__.lower()
    ]
    if not norms:
        raise GenericLoadError(
            f"cannot find the final norm of {type(hf_model).__name__} (a norm module directly under the "
            "base model); pass module_map={'final_norm': 'path'}"
        )
    return norms[-1][1]


def _find_score(hf_model, module_map: Dict[str, Optional[str]]) -> nn.Linear:
    name = type(hf_model).__name__
    if "score" in module_map:
        score = get_submodule(hf_model, module_map["score"])
    else:
        n_labels = getattr(hf_model.config, "num_labels", None)
        children = list(hf_model.named_children())
        named = [m for n, m in children if n in SCORE_NAMES]
        linear = [m for n, m in children if isinstance(m, nn.Linear) and m.out_features == n_labels]
        score = (named or linear or [None])[0]
        if score is None:
            raise GenericLoadError(
                f"cannot find the score head of {name}; pass module_map={{'score': 'path'}}"
            )
    if not isinstance(score, nn.Linear):
        raise GenericLoadError(
            f"the score head of {name} is a {type(score).__name__}, not a linear layer: the reward is not "
            "a linear read of the final norm, so it has no exact decomposition on the generic path"
        )
    return score


def _sublayer(layer: nn.Module, l: int, path: Optional[str], names, class_parts, key: str) -> nn.Module:
    if path:
        return get_submodule(layer, path)
    children = dict(layer.named_children())
    for n in names:
        if n in children:
            return children[n]
    matches = [m for m in children.values() if any(p in type(m).__name__.lower() for p in class_parts)]
    if len(matches) == 1:
        return matches[0]
    raise GenericLoadError(
        f"cannot find the {key} module of layer {l} ({type(layer).__name__}: children "
        f"{sorted(children)}); pass module_map={{'{key}': 'child_name'}}"
    )


def build_config(
    hf_model, found: FoundModules, kind: str, offset: float, eps: float, fold_ln: bool
) -> GenericRewardModelConfig:
    tc = text_config(hf_model.config)
    d_model = found.score.in_features
    n_heads = int(first_attr(tc, ("num_attention_heads", "n_head", "num_heads"), 1))
    d_head = int(first_attr(tc, ("head_dim",), d_model // n_heads))
    n_kv = int(first_attr(tc, ("num_key_value_heads", "num_kv_heads"), n_heads))
    if n_kv <= 0 or n_heads % n_kv:
        n_kv = n_heads
    if found.pos_embed is not None:
        pos_type = "standard"
    elif any("rotary" in type(mod).__name__.lower() for mod in found.base.modules()):
        pos_type = "rotary"
    else:
        pos_type = "none"
    param = next(hf_model.parameters())
    return GenericRewardModelConfig(
        n_layers=len(found.layers),
        d_model=d_model,
        n_heads=n_heads,
        d_head=d_head,
        d_mlp=int(first_attr(tc, ("intermediate_size", "n_inner", "ffn_dim", "d_ff"), 4 * d_model)),
        d_vocab=int(getattr(found.embed, "num_embeddings", None) or tc.vocab_size),
        n_ctx=int(first_attr(tc, ("max_position_embeddings", "n_positions"), 4096)),
        n_key_value_heads=n_kv,
        act_fn=str(first_attr(tc, ("hidden_act", "activation_function"), "unknown")),
        normalization_type=kind + ("Pre" if fold_ln else ""),
        eps=eps,
        positional_embedding_type=pos_type,
        rotary_dim=d_head,
        original_architecture=type(hf_model).__name__,
        norm_weight_offset=offset,
        n_outputs=found.score.out_features,
        pad_token_id=getattr(tc, "pad_token_id", None),
        device=param.device,
        dtype=param.dtype,
        model_name=str(getattr(hf_model.config, "_name_or_path", "") or type(hf_model).__name__),
        module_map=dict(found.paths),
    )
