"""The generic hooked path: any transformers `*ForSequenceClassification` reward model, at component level.

Native architectures (the weight maps in `reward_lens.converters`) are re-implemented component by
component and expose every TransformerLens hook down to single heads. Every other sequence-classification
model runs here instead: the transformers model itself is kept and run, and HookPoints are spliced onto
its modules with torch hooks, under the names the native model uses at component level:

    hook_embed (the residual entering layer 0; with learned positions, the token embedding's output),
    hook_pos_embed (learned positions only)
    blocks.{l}.hook_resid_pre, blocks.{l}.hook_attn_out, blocks.{l}.hook_mlp_out, blocks.{l}.hook_resid_post
    blocks.{l}.hook_resid_mid (resid_pre + attn_out; sequential layers only, not GPT-NeoX-style parallel ones)
    ln_final.hook_scale [batch, pos, 1] (float32), ln_final.hook_normalized
    reward_head.hook_rewards, reward_head.hook_pooled

Every hook can read and replace its activation (run_with_hooks, run_with_cache, activation patching).
The decoder layers, embeddings, final norm and score head are found structurally (override with
`module_map`), and at load a probe input verifies that the hooks decompose the model exactly:
embed (+ pos) is the residual entering layer 0, every layer is resid_post = resid_pre + attn_out +
mlp_out, the last layer's output is the final norm's input, the final norm is reproduced, and the
reward equals transformers' own. A model that fails a check is refused with the failing part named.

The final norm (RMSNorm or LayerNorm, found by matching the module's output) is recomputed here so its
scale is a hook. With the scale s frozen, for LayerNorm

    reward = w_R . ((resid - mean(resid)) / s * w + b) + b_R
           = Σ_c  ((c - mean(c)) / s) . (w ⊙ w_R)  +  (w_R . b + b_R)

so `reward_direction` is the *centered* w ⊙ w_R (mean zero) and `reward_bias` = w_R . b + b_R: because
the direction has mean zero, (c - mean(c)) . d = c . d, and `resid / ln_final.hook_scale . reward_direction
+ reward_bias` is the reward exactly, as on the native (RMSNorm) path. With `fold_ln=True` (default) this
folding is what the model runs: `ln_final` outputs the un-weighted normalised residual and the reward
head holds (reward_direction, reward_bias), as native folded models do (cfg.normalization_type "LNPre" /
"RMSPre"); with `fold_ln=False` the final norm applies the checkpoint's weight (and bias) and the head is
the checkpoint's score layer (cfg.normalization_type "LN" / "RMS"). Norms inside the blocks are never
touched.

Head-level tools (per-head hooks, W_Q/W_K/W_V/W_O, MLP neurons) need a native architecture and raise a
`GenericPathError` saying so.
"""

from __future__ import annotations

import copy as copy_module
import inspect
import json
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

import torch
import torch.nn as nn
from jaxtyping import Float, Int
from transformer_lens.hook_points import HookPoint
from transformer_lens.HookedRootModule import HookedRootModule

from reward_lens.core.validation import check_model_inputs
from reward_lens.model.config import RewardModelConfig
from reward_lens.model.heads.scalar import RewardHead
from reward_lens.model.native import HookedRewardModel
from reward_lens.model.tl_compat import check_forward_input

GENERIC_MARKER = "reward_lens_generic.json"  # written by save_pretrained: reload on the generic path
MODULE_MAP_KEYS = ("base", "layers", "embed", "pos_embed", "final_norm", "score", "attn", "mlp")
NATIVE_HINT = (
    "the generic path hooks components only (embed, attn_out, mlp_out, residual stream, final norm, reward "
    "head); load a natively supported architecture for head-level hooks and weights (see conversion/GENERIC.md, "
    "`reward_lens.converters.supported_architectures()`)"
)
_HEAD_LEVEL_BLOCK_ATTRS = ("attn", "mlp", "ln1", "ln2", "ln1_post", "ln2_post")
_HEAD_LEVEL_NAME_PARTS = (
    ".attn.", ".mlp.", ".ln1.", ".ln2.", "hook_attn_in", "hook_mlp_in", "hook_q_input",
    "hook_k_input", "hook_v_input",
)
_HEAD_LEVEL_WEIGHTS = ("W_Q", "W_K", "W_V", "W_O", "W_in", "W_gate", "W_out", "b_Q", "b_K", "b_V", "b_O", "b_in", "b_out")
_ATTN_NAMES = ("self_attn", "attn", "attention", "self_attention", "mixer")
_MLP_NAMES = ("mlp", "feed_forward", "ffn", "feedforward", "block_sparse_moe", "moe")
_NORM_NAMES = ("norm", "ln_f", "final_layer_norm", "final_layernorm", "final_norm", "norm_f", "ln_final")
_SCORE_NAMES = ("score", "classifier", "v_head", "value_head", "reward_head", "rm_head")
_EPS_ATTRS = ("eps", "variance_epsilon", "epsilon", "layer_norm_eps", "norm_eps")


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


# ---------------------------------------------------------------------------------------------- discovery
@dataclass
class _Modules:
    base: nn.Module
    layers: nn.ModuleList
    embed: nn.Module
    pos_embed: Optional[nn.Module]
    final_norm: nn.Module
    score: nn.Linear
    attn: List[nn.Module]
    mlp: List[nn.Module]
    paths: Dict[str, Optional[str]]


def _get(root: nn.Module, path: str) -> nn.Module:
    try:
        return root.get_submodule(path) if path else root
    except AttributeError:
        raise GenericLoadError(f"module_map path {path!r} names no submodule of {type(root).__name__}") from None


def _path_of(root: nn.Module, module: nn.Module) -> str:
    for name, m in root.named_modules():
        if m is module:
            return name
    raise GenericLoadError(f"{type(module).__name__} is not a submodule of {type(root).__name__}")


def _text_config(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _first_attr(obj: Any, names: Tuple[str, ...], default: Any = None) -> Any:
    for n in names:
        v = getattr(obj, n, None)
        if v is not None:
            return v
    return default


def _find_modules(hf_model: nn.Module, module_map: Optional[Dict[str, Optional[str]]]) -> _Modules:
    module_map = dict(module_map or {})
    unknown = set(module_map) - set(MODULE_MAP_KEYS)
    if unknown:
        raise ValueError(f"unknown module_map keys {sorted(unknown)}; known keys: {', '.join(MODULE_MAP_KEYS)}")
    tc = _text_config(hf_model.config)
    name = type(hf_model).__name__
    if "score" not in module_map and not name.endswith("ForSequenceClassification"):
        raise GenericLoadError(
            f"{name} is not a sequence-classification model: the generic path wraps transformers "
            "*ForSequenceClassification models (a reward model's scalar head); load the reward checkpoint with "
            "its sequence-classification class, or pass module_map={'score': 'path.to.linear.head'}"
        )

    base = _get(hf_model, module_map["base"]) if "base" in module_map else getattr(hf_model, "base_model", None)
    if base is None or base is hf_model:
        raise GenericLoadError(f"cannot find the base transformer of {name}; pass module_map={{'base': 'path'}}")

    if "layers" in module_map:
        layers = _get(hf_model, module_map["layers"])
    else:
        n_cfg = _first_attr(tc, ("num_hidden_layers", "n_layer", "num_layers"))
        lists = [(n, m) for n, m in base.named_modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
        exact = [(n, m) for n, m in lists if len(m) == n_cfg]
        pool = exact or lists
        if not pool:
            raise GenericLoadError(f"cannot find the decoder layers of {name}; pass module_map={{'layers': 'path'}}")
        layers = min(pool, key=lambda nm: (nm[0].count("."), -len(nm[1])))[1]
    if not isinstance(layers, nn.ModuleList):
        raise GenericLoadError(f"module_map['layers'] must name an nn.ModuleList, got {type(layers).__name__}")

    if "embed" in module_map:
        embed = _get(hf_model, module_map["embed"])
    else:
        try:
            embed = hf_model.get_input_embeddings()
        except (NotImplementedError, AttributeError):
            embed = None
        if embed is None:
            raise GenericLoadError(f"cannot find the token embedding of {name}; pass module_map={{'embed': 'path'}}")

    if "pos_embed" in module_map:
        pos_embed = _get(hf_model, module_map["pos_embed"]) if module_map["pos_embed"] else None
    else:
        n_pos = _first_attr(tc, ("max_position_embeddings", "n_positions"))
        others = [(n, m) for n, m in base.named_children() if isinstance(m, nn.Embedding) and m is not embed]
        positional = [m for n, m in others if "pos" in n.lower() or n == "wpe" or m.num_embeddings == n_pos]
        if len(positional) > 1:
            raise GenericLoadError(
                f"{name} has several position-like embeddings; pass module_map={{'pos_embed': 'path'}} (or None)"
            )
        pos_embed = positional[0] if positional else None

    if "final_norm" in module_map:
        final_norm = _get(hf_model, module_map["final_norm"])
    else:
        norms = [
            (n, m) for n, m in base.named_children()
            if n in _NORM_NAMES or "norm" in type(m).__name__.lower()
        ]
        if not norms:
            raise GenericLoadError(
                f"cannot find the final norm of {name} (a norm module directly under the base model); "
                "pass module_map={'final_norm': 'path'}"
            )
        final_norm = norms[-1][1]

    if "score" in module_map:
        score = _get(hf_model, module_map["score"])
    else:
        n_labels = getattr(hf_model.config, "num_labels", None)
        children = list(hf_model.named_children())
        named = [m for n, m in children if n in _SCORE_NAMES]
        linear = [m for n, m in children if isinstance(m, nn.Linear) and m.out_features == n_labels]
        score = (named or linear or [None])[0]
        if score is None:
            raise GenericLoadError(f"cannot find the score head of {name}; pass module_map={{'score': 'path'}}")
    if not isinstance(score, nn.Linear):
        raise GenericLoadError(
            f"the score head of {name} is a {type(score).__name__}, not a linear layer: the reward is not a linear "
            "read of the final norm, so it has no exact decomposition on the generic path"
        )

    attn, mlp = [], []
    for l, layer in enumerate(layers):
        attn.append(_sublayer(layer, l, module_map.get("attn"), _ATTN_NAMES, ("attention",), "attn"))
        mlp.append(_sublayer(layer, l, module_map.get("mlp"), _MLP_NAMES, ("mlp", "feedforward", "moe"), "mlp"))

    paths = {
        "base": _path_of(hf_model, base), "layers": _path_of(hf_model, layers), "embed": _path_of(hf_model, embed),
        "pos_embed": _path_of(hf_model, pos_embed) if pos_embed is not None else None,
        "final_norm": _path_of(hf_model, final_norm), "score": _path_of(hf_model, score),
        "attn": _path_of(layers[0], attn[0]), "mlp": _path_of(layers[0], mlp[0]),
    }
    return _Modules(base, layers, embed, pos_embed, final_norm, score, attn, mlp, paths)


def _sublayer(layer: nn.Module, l: int, path: Optional[str], names, class_parts, key: str) -> nn.Module:
    if path:
        return _get(layer, path)
    children = dict(layer.named_children())
    for n in names:
        if n in children:
            return children[n]
    matches = [m for m in children.values() if any(p in type(m).__name__.lower() for p in class_parts)]
    if len(matches) == 1:
        return matches[0]
    raise GenericLoadError(
        f"cannot find the {key} module of layer {l} ({type(layer).__name__}: children {sorted(children)}); "
        f"pass module_map={{'{key}': 'child_name'}}"
    )


# ---------------------------------------------------------------------------------------------- final norm
def _dtype_tol(dtype: torch.dtype) -> float:
    return 1e-5 if dtype in (torch.float32, torch.float64) else 3e-2


def _identify_norm(norm: nn.Module, d_model: int, path: str, config: Any) -> Tuple[str, float, float]:
    """(kind "LN"/"RMS", weight offset, eps) reproducing `norm` on a test input; refuse when none does."""
    eps = _first_attr(norm, _EPS_ATTRS)
    if eps is None:
        eps = _first_attr(_text_config(config), ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps"))
    if eps is None:
        raise GenericLoadError(f"cannot tell the epsilon of the final norm {path} ({type(norm).__name__})")
    weight = getattr(norm, "weight", None)
    bias = getattr(norm, "bias", None)
    param = weight if isinstance(weight, torch.Tensor) else next(norm.parameters(), None)
    dtype = param.dtype if param is not None else torch.float32
    device = param.device if param is not None else torch.device("cpu")
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 5, d_model, generator=g) * 3 + 0.7).to(device=device, dtype=dtype)
    with torch.no_grad():
        ref = norm(x)
        ref = (ref[0] if isinstance(ref, tuple) else ref).float()
    first = "LN" if isinstance(norm, nn.LayerNorm) or "rms" not in type(norm).__name__.lower() else "RMS"
    candidates = [(first, 0.0), ("RMS" if first == "LN" else "LN", 0.0), ("RMS", 1.0), ("LN", 1.0)]
    tol = _dtype_tol(dtype) * max(1.0, ref.abs().max().item())
    errors = []
    for kind, offset in candidates:
        with torch.no_grad():
            out = _norm_forward(x, kind, eps, offset, weight, bias).float()
        err = (out - ref).abs().max().item()
        if err <= tol:
            return kind, offset, float(eps)
        errors.append(f"{kind}{'(1+w)' if offset else ''}: {err:.2g}")
    raise GenericLoadError(
        f"the final norm {path} ({type(norm).__name__}) is neither LayerNorm nor RMSNorm as reward-lens computes "
        f"them (max errors {', '.join(errors)}; tolerance {tol:.2g}); the reward cannot be decomposed exactly. "
        "Ask for a native weight map for this architecture"
    )


def _norm_forward(x, kind, eps, offset, weight, bias, scale_hook=None, normalized_hook=None):
    xf = x.float()
    if kind == "LN":
        xf = xf - xf.mean(-1, keepdim=True)
    scale = (xf.pow(2).mean(-1, keepdim=True) + eps).sqrt()
    if scale_hook is not None:
        scale = scale_hook(scale)
    normalized = xf / scale
    if weight is None and bias is None:
        normalized = normalized.to(x.dtype)
        return normalized_hook(normalized) if normalized_hook is not None else normalized
    if normalized_hook is not None:
        normalized = normalized_hook(normalized)
    out = normalized
    if weight is not None:
        out = out * (offset + weight.float())
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


class GenericFinalNorm(nn.Module):
    """The checkpoint's final norm recomputed with hooks: hook_scale [batch, pos, 1] (float32) and
    hook_normalized ((x - mean) / scale for LayerNorm, x / scale for RMSNorm, before any weight).

    Un-folded, it applies the transformers module's own weight and bias (read, not copied); folded
    (`w is None`), it returns the normalised residual and the weight lives in the reward head.
    """

    def __init__(self, kind: str, eps: float, offset: float, source: Optional[nn.Module]):
        super().__init__()
        self.kind = kind
        self.eps = eps
        self.offset = offset
        self._source = (source,)  # a tuple, so the transformers module is not registered twice
        self.hook_scale = HookPoint()
        self.hook_normalized = HookPoint()

    @property
    def w(self) -> Optional[torch.Tensor]:
        src = self._source[0]
        return getattr(src, "weight", None) if src is not None else None

    @property
    def b(self) -> Optional[torch.Tensor]:
        src = self._source[0]
        return getattr(src, "bias", None) if src is not None else None

    def forward(self, x: Float[torch.Tensor, "... d_model"]) -> Float[torch.Tensor, "... d_model"]:
        return _norm_forward(x, self.kind, self.eps, self.offset, self.w, self.b, self.hook_scale, self.hook_normalized)


class GenericBlock(nn.Module):
    """Hook points of one decoder layer; the layer itself runs inside the transformers model."""

    def __init__(self, layer: int, sequential: bool = True):
        super().__init__()
        self.layer = layer
        self.hook_resid_pre = HookPoint()  # [batch, pos, d_model]
        self.hook_attn_out = HookPoint()
        if sequential:  # resid_pre + attn_out, what the MLP reads; absent when attention and MLP run in parallel
            self.hook_resid_mid = HookPoint()
        self.hook_mlp_out = HookPoint()
        self.hook_resid_post = HookPoint()

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "hook_resid_mid":
                raise GenericPathError(f"layer {self.layer} runs attention and MLP in parallel: it has no resid_mid") from None
            if name in _HEAD_LEVEL_BLOCK_ATTRS:
                raise GenericPathError(
                    f"blocks[{self.layer}].{name} does not exist on a generic-path model: {NATIVE_HINT}"
                ) from None
            raise


# ---------------------------------------------------------------------------------------------- the model
class _StopForward(Exception):
    def __init__(self, residual: torch.Tensor):
        self.residual = residual


@dataclass
class _RunState:
    start: int = 0  # layers before this are skipped (a forward started from a residual)
    inject: Optional[torch.Tensor] = None  # the residual entering layer `start`
    stop: Optional[int] = None  # raise _StopForward with the residual entering this layer
    bypass: bool = False  # run transformers untouched (load-time reference)
    calls: Optional[Dict[str, int]] = None  # hook-site call counts (load-time check)
    resid_pre: Optional[torch.Tensor] = None  # the current layer's residual (for resid_mid)


class GenericHookedRewardModel(HookedRewardModel):
    """A transformers sequence-classification reward model with component-level TransformerLens hooks.

    Wraps `hf_model` in place (its modules get torch hooks); `from_hf_model` wraps a copy. Same public
    surface as `HookedRewardModel` where it applies (forward, run_with_cache, run_with_hooks,
    readout_positions, reward_direction, reward_bias, to_tokens, cfg); head-level tools raise
    `GenericPathError`.
    """

    def __init__(
        self,
        hf_model: nn.Module,
        tokenizer: Any = None,
        *,
        module_map: Optional[Dict[str, Optional[str]]] = None,
        fold_ln: bool = True,
        check: bool = True,
    ):
        HookedRootModule.__init__(self)
        hf_model.eval()
        hf_model.requires_grad_(False)
        found = _find_modules(hf_model, module_map)
        d_model = found.score.in_features
        kind, offset, eps = _identify_norm(found.final_norm, d_model, found.paths["final_norm"], hf_model.config)
        self.cfg = _build_config(hf_model, found, kind, offset, eps, fold_ln)
        self.tokenizer = tokenizer
        self.hf_model = hf_model
        self._mods = found
        self._state = _RunState()
        self.hook_embed = HookPoint()
        if found.pos_embed is not None:
            self.hook_pos_embed = HookPoint()
        base_params = inspect.signature(found.base.forward).parameters
        self._base_takes_positions = "position_ids" in base_params
        self._base_takes_use_cache = "use_cache" in base_params
        self.cfg.sequential_layers = self._sequential_layers()
        self.blocks = nn.ModuleList([GenericBlock(l, seq) for l, seq in enumerate(self.cfg.sequential_layers)])
        self.ln_final = GenericFinalNorm(kind, eps, offset, None if fold_ln else found.final_norm)
        self.reward_head = RewardHead(self.cfg)
        self._load_head(found.score, fold_ln)
        self._layer_returns_tuple = False
        self._handles: List[Any] = []
        self._install_hooks()
        self.setup()
        if check:
            self._verify()

    # ------------------------------------------------------------------ construction
    def setup(self) -> None:
        """HookedRootModule.setup over reward-lens's own modules only (the transformers tree is left alone)."""
        self.mod_dict, self.hook_dict = {}, {}
        for name, module in self.named_modules():
            if name == "" or name == "hf_model" or name.startswith("hf_model."):
                continue
            module.name = name
            self.mod_dict[name] = module
            if isinstance(module, HookPoint):
                self.hook_dict[name] = module

    def _probe_ids(self, rows: int, length: int, seed: int) -> torch.Tensor:
        cfg = self.cfg
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, cfg.d_vocab, (1, length), generator=g)
        if cfg.pad_token_id is not None and 0 <= cfg.pad_token_id < cfg.d_vocab:
            ids[ids == cfg.pad_token_id] = (cfg.pad_token_id + 1) % cfg.d_vocab
        return ids.expand(rows, -1).contiguous().to(cfg.device)

    @torch.no_grad()
    def _sequential_layers(self) -> List[bool]:
        """Per layer, whether its MLP reads the attention output (sequential, resid_mid exists) or runs in
        parallel with it: row l+1 of one batched probe perturbs layer l's attention output only."""
        m = self._mods
        n = len(m.layers)
        ids = self._probe_ids(n + 1, 6, seed=1)
        mlp_out: Dict[int, torch.Tensor] = {}

        def perturb(l: int):
            def fn(module, args, out):
                a = (out[0] if isinstance(out, tuple) else out).clone()
                g = torch.Generator().manual_seed(l)
                noise = torch.randn(a.shape[1:], generator=g).to(device=a.device, dtype=a.dtype)
                a[l + 1] = a[l + 1] + (a[l + 1].float().abs().mean() + 1.0).to(a.dtype) * noise
                return (a,) + tuple(out[1:]) if isinstance(out, tuple) else a

            return fn

        def keep(l: int):
            def fn(module, args, out):
                mlp_out[l] = (out[0] if isinstance(out, tuple) else out).float()

            return fn

        handles = [m.attn[l].register_forward_hook(perturb(l)) for l in range(n)]
        handles += [m.mlp[l].register_forward_hook(keep(l)) for l in range(n)]
        kwargs: Dict[str, Any] = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if self._base_takes_positions:
            kwargs["position_ids"] = torch.arange(ids.shape[1], device=ids.device)[None].expand_as(ids)
        if self._base_takes_use_cache:
            kwargs["use_cache"] = False
        try:
            m.base(**kwargs)
        finally:
            for h in handles:
                h.remove()
        out = []
        for l in range(n):
            if l not in mlp_out:
                raise GenericLoadError(f"the MLP module of layer {l} ({self.cfg.module_map['mlp']}) never ran")
            diff = (mlp_out[l][l + 1] - mlp_out[l][0]).abs().max().item()
            out.append(diff > 1e-3 * (mlp_out[l][0].abs().max().item() + 1e-6))
        return out

    def _load_head(self, score: nn.Linear, fold_ln: bool) -> None:
        with torch.no_grad():
            W = score.weight.detach().float().T  # [d_model, n_out]
            b = score.bias.detach().float() if score.bias is not None else torch.zeros(W.shape[1], device=W.device)
            if fold_ln:
                norm = self._mods.final_norm
                w, nb = getattr(norm, "weight", None), getattr(norm, "bias", None)
                if nb is not None:
                    b = b + nb.detach().float() @ W
                if w is not None:
                    W = W * (self.cfg.norm_weight_offset + w.detach().float())[:, None]
                if self.cfg.normalization_type == "LNPre":
                    W = W - W.mean(0, keepdim=True)  # exact: the normalised residual has mean zero
            dtype = score.weight.dtype
            self.reward_head.W_R = nn.Parameter(W.to(dtype), requires_grad=False)
            self.reward_head.b_R = nn.Parameter(b.to(dtype), requires_grad=False)

    def _install_hooks(self) -> None:
        m, st = self._mods, self._state

        def count(site: str) -> None:
            if st.calls is not None:
                st.calls[site] = st.calls.get(site, 0) + 1

        def on_output(hook_point: HookPoint, site: str, layer: Optional[int]):
            def fn(module, args, output):
                if st.bypass or (layer is not None and layer < st.start):
                    return None
                if layer is None and st.inject is not None:  # embeddings of a run started from a residual
                    return None
                count(site)
                if isinstance(output, tuple):
                    return (hook_point(output[0]),) + tuple(output[1:])
                return hook_point(output)

            return fn

        def on_attn(l: int):
            block, sequential = self.blocks[l], self.cfg.sequential_layers[l]

            def fn(module, args, output):
                if st.bypass or l < st.start:
                    return None
                count(f"attn{l}")
                a = block.hook_attn_out(output[0] if isinstance(output, tuple) else output)
                if sequential:
                    mid = st.resid_pre + a
                    new_mid = block.hook_resid_mid(mid)
                    if new_mid is not mid:  # a hook replaced resid_mid: the layer adds resid_pre + this
                        a = new_mid - st.resid_pre
                return (a,) + tuple(output[1:]) if isinstance(output, tuple) else a

            return fn

        def on_layer_input(l: int):
            def fn(module, args, kwargs):
                if st.bypass or l < st.start:
                    return None
                args = list(args)
                h = args[0] if args else kwargs["hidden_states"]
                if l == st.start and st.inject is not None:
                    h = st.inject
                if st.stop == l:
                    raise _StopForward(h)
                if l == 0 and embed_at_layer0 and st.inject is None:
                    count("embed")
                    h = self.hook_embed(h)
                count(f"resid_pre{l}")
                h = self.blocks[l].hook_resid_pre(h)
                st.resid_pre = h
                if args:
                    args[0] = h
                else:
                    kwargs["hidden_states"] = h
                return tuple(args), kwargs

            return fn

        def on_final_norm(module, args, kwargs, output):
            if st.bypass:
                return None
            x = args[0] if args else next(iter(kwargs.values()))
            if st.start == len(m.layers) and st.inject is not None:
                x = st.inject
            if st.stop == len(m.layers):
                raise _StopForward(x)
            count("final_norm")
            return self.ln_final(x)

        # Without learned positions, hook_embed is the residual entering layer 0 (so embedding scales
        # or norms applied in the model's forward, e.g. Gemma's sqrt(d_model), are inside it); with
        # them, the two embedding modules' outputs, checked at load to sum to that residual.
        embed_at_layer0 = m.pos_embed is None
        reg = self._handles.append
        if not embed_at_layer0:
            reg(m.embed.register_forward_hook(on_output(self.hook_embed, "embed", None)))
        if m.pos_embed is not None:
            reg(m.pos_embed.register_forward_hook(on_output(self.hook_pos_embed, "pos_embed", None)))
        for l, layer in enumerate(m.layers):
            block = self.blocks[l]
            reg(layer.register_forward_pre_hook(on_layer_input(l), with_kwargs=True))
            reg(m.attn[l].register_forward_hook(on_attn(l)))
            reg(m.mlp[l].register_forward_hook(on_output(block.hook_mlp_out, f"mlp{l}", l)))
            reg(layer.register_forward_hook(on_output(block.hook_resid_post, f"resid_post{l}", l)))
        reg(m.final_norm.register_forward_hook(on_final_norm, with_kwargs=True))

    def remove_torch_hooks(self) -> None:
        """Detach every torch hook from the transformers model (this wrapper stops working)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_hf_model(
        cls,
        hf_model: nn.Module,
        tokenizer: Any = None,
        *,
        device: Union[str, torch.device, None] = None,
        dtype: Union[str, torch.dtype, None] = None,
        fold_ln: bool = True,
        module_map: Optional[Dict[str, Optional[str]]] = None,
        copy: bool = True,
    ) -> "GenericHookedRewardModel":
        """Wrap a transformers model in memory; a copy unless `copy=False` (then its modules get the hooks)."""
        from reward_lens.model.loading import resolve_device, resolve_dtype

        hf = copy_module.deepcopy(hf_model) if copy else hf_model
        if dtype is not None or device is not None:
            hf = hf.to(device=resolve_device(device) if device is not None else None,
                       dtype=resolve_dtype(dtype) if dtype is not None else None)
        return cls(hf, tokenizer, module_map=module_map, fold_ln=fold_ln)

    @classmethod
    def from_pretrained(
        cls,
        path_or_id: Union[str, Path],
        *,
        device: Union[str, torch.device, None] = None,
        dtype: Union[str, torch.dtype, None] = None,
        fold_ln: bool = True,
        **kwargs: Any,
    ) -> "GenericHookedRewardModel":
        """`HookedRewardModel.from_pretrained(..., generic=True)`."""
        kwargs["generic"] = True
        return HookedRewardModel.from_pretrained(path_or_id, device=device, dtype=dtype, fold_ln=fold_ln, **kwargs)

    def save_pretrained(self, path: Union[str, Path]) -> None:
        """Save the transformers checkpoint (+ tokenizer) and a marker so `from_pretrained` reloads it here."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.hf_model.save_pretrained(str(path))
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(str(path))
        (path / GENERIC_MARKER).write_text(json.dumps({"module_map": self.cfg.module_map}, indent=1))

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        input: Union[Int[torch.Tensor, "batch pos"], Float[torch.Tensor, "batch pos d_model"]],
        attention_mask: Optional[Int[torch.Tensor, "batch pos"]] = None,
        position_ids: Optional[Int[torch.Tensor, "batch pos"]] = None,
        *,
        input_ids: Optional[Int[torch.Tensor, "batch pos"]] = None,
        start_at_layer: Optional[int] = None,
        stop_at_layer: Optional[int] = None,
        readout_positions: Optional[Int[torch.Tensor, "batch"]] = None,
        return_type: Optional[str] = "reward",
    ) -> Optional[torch.Tensor]:
        """Rewards [batch] (or [batch, n_outputs]); the residual before block `stop_at_layer` if given.

        As `HookedRewardModel.forward`. With `start_at_layer=l`, `input` is the residual entering block l
        (blocks before l are skipped); position ids default to cumsum(attention_mask) - 1.
        """
        check_forward_input(input, return_type)
        n = self.cfg.n_layers
        start = 0 if start_at_layer is None else (start_at_layer + n if start_at_layer < 0 else start_at_layer)
        stop = None if stop_at_layer is None else (stop_at_layer + n if stop_at_layer < 0 else stop_at_layer)
        if not 0 <= start <= n or (stop is not None and not start <= stop <= n):
            raise ValueError(f"need 0 <= start_at_layer <= stop_at_layer <= n_layers={n}; got {start_at_layer}, {stop_at_layer}")
        device = self.cfg.device
        if start_at_layer is None:
            input, attention_mask = check_model_inputs(self, input, attention_mask)
            input_ids = input.to(device)
            embeds = None
            batch, T = input_ids.shape
        else:
            embeds = input
            batch, T = input.shape[:2]
        if attention_mask is None and input_ids is not None and start_at_layer is None:
            attention_mask = self.infer_attention_mask(input_ids, warn=readout_positions is None)
        if attention_mask is None:
            attention_mask = torch.ones(batch, T, dtype=torch.long, device=device)
        attention_mask = attention_mask.to(device)
        if position_ids is None:
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        kwargs: Dict[str, Any] = {"attention_mask": attention_mask}
        if self._base_takes_positions:
            kwargs["position_ids"] = position_ids.to(device)
        if self._base_takes_use_cache:
            kwargs["use_cache"] = False
        if embeds is None:
            kwargs["input_ids"] = input_ids
        else:
            kwargs["inputs_embeds"] = torch.zeros_like(embeds)  # replaced by `input` where block `start` begins
        try:
            with self._run_state(start, embeds, stop):
                out = self._mods.base(**kwargs)
        except _StopForward as stopped:
            return stopped.residual
        hidden = out[0] if isinstance(out, (tuple, list)) else out.last_hidden_state
        if return_type is None:
            return None
        if readout_positions is None:
            readout_positions = self.readout_positions(input_ids, attention_mask)
        return self.reward_head(hidden, readout_positions, input_ids=input_ids)

    @contextmanager
    def _run_state(self, start: int, inject: Optional[torch.Tensor], stop: Optional[int]) -> Iterator[None]:
        st = self._state
        saved = (st.start, st.inject, st.stop)
        skipped = list(self._mods.layers)[:start] if inject is not None else []
        as_tuple = self._layer_returns_tuple

        def passthrough(*args: Any, **kwargs: Any):
            h = args[0] if args else kwargs["hidden_states"]
            return (h,) if as_tuple else h

        st.start, st.inject, st.stop = (start if inject is not None else 0), inject, stop
        for layer in skipped:  # skip the work of blocks before `start` (their output is replaced anyway)
            layer.forward = passthrough
        try:
            yield
        finally:
            for layer in skipped:
                del layer.forward
            st.start, st.inject, st.stop = saved

    # ------------------------------------------------------------------ load-time verification
    @torch.no_grad()
    def _verify(self) -> None:
        """Check on a probe input that the hooks decompose this model exactly; refuse it otherwise."""
        cfg, m, st = self.cfg, self._mods, self._state
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, cfg.d_vocab, (1, 7), generator=g)
        if cfg.pad_token_id is not None and 0 <= cfg.pad_token_id < cfg.d_vocab:
            ids[ids == cfg.pad_token_id] = (cfg.pad_token_id + 1) % cfg.d_vocab
        ids = ids.to(cfg.device)
        mask = torch.ones_like(ids)
        pos = torch.arange(ids.shape[1], device=ids.device)[None]
        probe = m.layers[0].register_forward_hook(lambda mod, a, out: setattr(self, "_layer_returns_tuple", isinstance(out, tuple)))
        st.calls = {}
        try:
            rewards, cache = self.run_with_cache(ids, attention_mask=mask)
            calls, st.calls = st.calls, None
        finally:
            st.calls = None
            probe.remove()
        tol = _dtype_tol(cfg.dtype)
        where = f"{type(self.hf_model).__name__}"
        lp = cfg.module_map["layers"]

        for site in ["embed", "final_norm"] + [f"{k}{l}" for l in range(cfg.n_layers) for k in ("attn", "mlp", "resid_pre", "resid_post")]:
            if calls.get(site, 0) != 1:
                part = _site_path(cfg.module_map, site)
                raise GenericLoadError(
                    f"{where}: the module {part} ran {calls.get(site, 0)} times in one forward (expected once), so its "
                    "output is not one residual term; pass module_map naming the right module, or ask for a native "
                    "weight map"
                )

        def close(a: torch.Tensor, b: torch.Tensor) -> Tuple[bool, float, float]:
            err = (a.float() - b.float()).abs().max().item()
            bound = tol * max(1.0, b.float().abs().max().item())
            return err <= bound, err, bound

        embed = cache["hook_embed"] + (cache["hook_pos_embed"] if "hook_pos_embed" in cache else 0)
        ok, err, bound = close(embed, cache["blocks.0.hook_resid_pre"])
        if not ok:
            raise GenericLoadError(
                f"{where}: the embedding output ({cfg.module_map['embed']}"
                f"{' + ' + cfg.module_map['pos_embed'] if cfg.module_map['pos_embed'] else ''}) is not the residual "
                f"entering layer 0 (max error {err:.3g} > {bound:.3g}): the model scales or transforms its embeddings "
                "in its forward, which the generic path cannot split exactly; ask for a native weight map or pass "
                "module_map={'embed': ..., 'pos_embed': ...}"
            )
        for l in range(cfg.n_layers):
            pre, post = cache[f"blocks.{l}.hook_resid_pre"], cache[f"blocks.{l}.hook_resid_post"]
            terms = pre + cache[f"blocks.{l}.hook_attn_out"] + cache[f"blocks.{l}.hook_mlp_out"]
            ok, err, bound = close(terms, post)
            if not ok:
                raise GenericLoadError(
                    f"{where}: layer {l} ({lp}.{l}, {type(m.layers[l]).__name__}) is not resid_post = resid_pre + "
                    f"attn_out + mlp_out on a probe input (max error {err:.3g} > tolerance {bound:.3g}): its "
                    f"'{cfg.module_map['attn']}' / '{cfg.module_map['mlp']}' outputs are transformed before they "
                    "reach the residual (post-norms, residual scaling, ...), so the reward has no exact component "
                    "decomposition on the generic path. Pass module_map={'attn': ..., 'mlp': ...} naming the modules "
                    "whose outputs are added to the residual, or ask for a native weight map (conversion/GENERIC.md)"
                )
            if l + 1 < cfg.n_layers:
                ok, err, bound = close(cache[f"blocks.{l + 1}.hook_resid_pre"], post)
                if not ok:
                    raise GenericLoadError(
                        f"{where}: the residual entering layer {l + 1} is not layer {l}'s output (max error {err:.3g}); "
                        "the model changes the residual between layers, which the generic path cannot decompose"
                    )
        # The final norm must read the last layer's output; hook_normalized * scale gives back its input.
        normalized, scale = cache["ln_final.hook_normalized"].float(), cache["ln_final.hook_scale"]
        last = cache[f"blocks.{cfg.n_layers - 1}.hook_resid_post"].float()
        if cfg.normalization_type.startswith("LN"):
            last = last - last.mean(-1, keepdim=True)
        ok, err, bound = close(normalized * scale, last)
        if not ok:
            raise GenericLoadError(
                f"{where}: the final norm {cfg.module_map['final_norm']} does not read the last layer's output "
                f"(max error {err:.3g}); the model transforms the residual after its last layer"
            )
        # Independent reference: transformers' own forward with every hook bypassed.
        st.bypass = True
        try:
            kwargs = {"attention_mask": mask}
            if "position_ids" in inspect.signature(self.hf_model.forward).parameters:
                kwargs["position_ids"] = pos
            ref = self.hf_model(ids, **kwargs)
        finally:
            st.bypass = False
        logits = ref.logits if hasattr(ref, "logits") else ref[0]
        ours = rewards.reshape(logits.shape)
        ok, err, bound = close(ours, logits)
        if not ok:
            raise GenericLoadError(
                f"{where}: the reward from the hooked path differs from transformers' ({err:.3g} > {bound:.3g}): the "
                f"score head {cfg.module_map['score']} is not a plain linear read of the final norm at the rightmost "
                "non-pad token; ask for a native weight map"
            )

    # ------------------------------------------------------------------ reward direction
    def reward_direction_of(self, output: int = 0) -> Float[torch.Tensor, "d_model"]:
        """w with reward = w . (resid_final[readout] / ln_final.hook_scale) + reward_bias.

        For a LayerNorm final norm w is centered (mean zero), so the centering is implicit:
        (c - mean(c)) . w = c . w for every component c.
        """
        if self.ln_final.w is None and self.ln_final.b is None:  # folded: the head holds it
            return self.reward_head.direction(output)
        direction = self.reward_head.direction(output)
        if self.ln_final.w is not None:
            direction = direction * (self.cfg.norm_weight_offset + self.ln_final.w)
        if self.ln_final.kind == "LN":
            direction = direction - direction.mean()
        return direction

    @property
    def reward_bias(self) -> torch.Tensor:
        """The reward of an all-zero normalised residual: b_R (+ w_R . b for a LayerNorm with bias)."""
        return self.reward_bias_of(0)

    def reward_bias_of(self, output: int = 0) -> torch.Tensor:
        bias = self.reward_head.bias(output)
        if self.ln_final.b is not None:
            bias = bias + self.ln_final.b @ self.reward_head.direction(output)
        return bias

    def reward_direction_for(
        self, input_ids: Int[torch.Tensor, "batch pos"], attention_mask: Optional[torch.Tensor] = None
    ) -> Float[torch.Tensor, "batch d_model"]:
        """`reward_direction` for every row (a linear head reads every sequence the same way)."""
        return self.reward_direction.expand(input_ids.shape[0], -1)

    def accumulated_bias(self, layer: int, mlp_input: bool = False, include_mlp_biases: bool = True) -> torch.Tensor:
        raise GenericPathError(f"accumulated_bias needs per-layer output biases: {NATIVE_HINT}")

    # ------------------------------------------------------------------ hooks: clear errors for head-level names
    def _check_names(self, names: Any) -> None:
        if names is None or callable(names):
            return
        for name in [names] if isinstance(names, str) else list(names):
            if name not in self.hook_dict:
                raise self._missing_hook(name)

    def _missing_hook(self, name: str) -> Exception:
        if name.endswith("hook_resid_mid"):
            return GenericPathError(
                f"no hook {name!r}: that layer runs attention and MLP in parallel (GPT-NeoX style), so there is no "
                "residual between them; use hook_resid_pre + hook_attn_out, or hook_resid_post"
            )
        if any(part in name for part in _HEAD_LEVEL_NAME_PARTS):
            return GenericPathError(f"no hook {name!r} on a generic-path model: {NATIVE_HINT}")
        return KeyError(f"no hook point named {name!r}; this model's hook points: {', '.join(self.hook_dict)}")

    def add_hook(self, name, hook, dir="fwd", is_permanent=False, level=None, prepend=False) -> None:
        if isinstance(name, str) and name not in self.hook_dict:
            raise self._missing_hook(name)
        super().add_hook(name, hook, dir=dir, is_permanent=is_permanent, level=level, prepend=prepend)

    def _enable_hook(self, name, hook, dir) -> None:
        if isinstance(name, str) and name not in self.hook_dict:
            raise self._missing_hook(name)
        super()._enable_hook(name, hook, dir)

    def run_with_cache(self, *model_args: Any, readout_only: bool = False, **kwargs: Any):
        """As `HookedRewardModel.run_with_cache`; naming a hook this model lacks is an error, not an empty cache."""
        self._check_names(kwargs.get("names_filter"))
        return super().run_with_cache(*model_args, readout_only=readout_only, **kwargs)

    # ------------------------------------------------------------------ head-level switches and weights
    def set_use_attn_result(self, use_attn_result: bool) -> None:
        if use_attn_result:
            raise GenericPathError(f"per-head outputs (hook_result) are head-level: {NATIVE_HINT}")

    def set_use_attn_in(self, use_attn_in: bool) -> None:
        if use_attn_in:
            raise GenericPathError(f"hook_attn_in is not available: {NATIVE_HINT}")

    def set_use_hook_mlp_in(self, use_hook_mlp_in: bool) -> None:
        if use_hook_mlp_in:
            raise GenericPathError(f"hook_mlp_in is not available: {NATIVE_HINT}")

    def _head_level(self, what: str):
        raise GenericPathError(f"{what} is a head-level weight: {NATIVE_HINT}")

    W_Q = property(lambda self: self._head_level("W_Q"))
    W_K = property(lambda self: self._head_level("W_K"))
    W_V = property(lambda self: self._head_level("W_V"))
    W_O = property(lambda self: self._head_level("W_O"))
    W_in = property(lambda self: self._head_level("W_in"))
    W_gate = property(lambda self: self._head_level("W_gate"))
    W_out = property(lambda self: self._head_level("W_out"))

    @property
    def W_E(self) -> torch.Tensor:
        return self._mods.embed.weight

    def __getattr__(self, name: str) -> Any:
        # A property that raises AttributeError falls through to __getattr__; keep its message.
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in _HEAD_LEVEL_WEIGHTS:
                raise GenericPathError(f"{name} is a head-level weight: {NATIVE_HINT}") from None
            raise


def _site_path(module_map: Dict[str, Optional[str]], site: str) -> str:
    for key in ("attn", "mlp", "resid_pre", "resid_post"):
        if site.startswith(key) and site[len(key):].isdigit():
            l = site[len(key):]
            if key in ("attn", "mlp"):
                return f"{module_map['layers']}.{l}.{module_map[key]}"
            return f"{module_map['layers']}.{l}"
    return str(module_map.get(site, site))


def _build_config(hf_model, found: _Modules, kind: str, offset: float, eps: float, fold_ln: bool) -> GenericRewardModelConfig:
    tc = _text_config(hf_model.config)
    d_model = found.score.in_features
    n_heads = int(_first_attr(tc, ("num_attention_heads", "n_head", "num_heads"), 1))
    d_head = int(_first_attr(tc, ("head_dim",), d_model // n_heads))
    n_kv = int(_first_attr(tc, ("num_key_value_heads", "num_kv_heads"), n_heads))
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
        d_mlp=int(_first_attr(tc, ("intermediate_size", "n_inner", "ffn_dim", "d_ff"), 4 * d_model)),
        d_vocab=int(getattr(found.embed, "num_embeddings", None) or tc.vocab_size),
        n_ctx=int(_first_attr(tc, ("max_position_embeddings", "n_positions"), 4096)),
        n_key_value_heads=n_kv,
        act_fn=str(_first_attr(tc, ("hidden_act", "activation_function"), "unknown")),
        normalization_type=kind + ("Pre" if fold_ln else ""),
        eps=eps,
        positional_embedding_type=pos_type,
        rotary_dim=d_head,
        original_architecture=type(hf_model).__name__,
        gated_mlp=False,
        final_rms=kind == "RMS",
        norm_weight_offset=offset,
        n_outputs=found.score.out_features,
        pad_token_id=getattr(tc, "pad_token_id", None),
        device=param.device,
        dtype=param.dtype,
        model_name=str(getattr(hf_model.config, "_name_or_path", "") or type(hf_model).__name__),
        module_map=dict(found.paths),
    )


# ---------------------------------------------------------------------------------------------- loading
def sequence_classification_class(hf_config: Any):
    """The transformers *ForSequenceClassification class named in the config's architectures, or None."""
    import transformers

    for name in getattr(hf_config, "architectures", None) or []:
        if name.endswith("ForSequenceClassification") and hasattr(transformers, name):
            return getattr(transformers, name)
    return None


def load_generic(
    directory: Path,
    hf_config: Any,
    *,
    tokenizer: Any = None,
    device: Union[str, torch.device, None] = None,
    dtype: Union[str, torch.dtype, None] = None,
    fold_ln: bool = True,
    module_map: Optional[Dict[str, Optional[str]]] = None,
) -> GenericHookedRewardModel:
    """Load a checkpoint directory with its transformers sequence-classification class and wrap it."""
    from reward_lens.converters import supported_architectures
    from reward_lens.model.loading import resolve_device, resolve_dtype

    marker = directory / GENERIC_MARKER
    if module_map is None and marker.exists():
        module_map = json.loads(marker.read_text()).get("module_map") or None
    cls = sequence_classification_class(hf_config)
    if cls is None:
        from reward_lens.model.loading import has_native_weight_map

        names = list(getattr(hf_config, "architectures", None) or [])
        if has_native_weight_map(hf_config):
            raise ValueError(
                f"generic=True needs a transformers *ForSequenceClassification class, and {names} is none; this "
                "architecture has a native weight map: load it without generic=True"
            )
        raise ValueError(
            f"unsupported reward-model architecture {names or '(config has no architectures field)'}; natively "
            f"supported: {', '.join(supported_architectures())}. Generic loading was tried too, but it needs a "
            "transformers *ForSequenceClassification architecture (a scalar reward head), and this checkpoint names "
            "none. OpenRLHF checkpoints load natively with architectures RewardModel / LLMForSequenceRegression, as "
            "OpenRLHF saves them. Open an issue to ask for a native weight map."
        )
    hf, info = cls.from_pretrained(str(directory), config=hf_config, dtype=resolve_dtype(dtype), output_loading_info=True)
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        raise GenericLoadError(
            f"{directory} lacks weights {missing[:6]}{' ...' if len(missing) > 6 else ''} that {cls.__name__} needs; "
            "transformers would initialise them at random, so the rewards would be meaningless"
        )
    return GenericHookedRewardModel(hf.to(resolve_device(device)), tokenizer, module_map=module_map, fold_ln=fold_ln)


__all__ = [
    "GenericHookedRewardModel", "GenericRewardModelConfig", "GenericPathError", "GenericLoadError",
    "GenericFinalNorm", "GenericBlock", "load_generic", "GENERIC_MARKER",
]
