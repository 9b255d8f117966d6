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

Modules: `discovery` (which modules, the config), `final_norm`, `verify` (load-time checks); this one
holds the model. The public `GenericHookedRewardModel` is this class with its checkpoint I/O, defined in the
loading layer (the model never depends on the layers above it).
"""

from __future__ import annotations

import copy as copy_module
import inspect
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

import torch
import torch.nn as nn
from jaxtyping import Float, Int
from transformer_lens.hook_points import HookPoint

from reward_lens.model import hooks
from reward_lens.model.base import RewardModelBase
from reward_lens.model.devices import resolve_device, resolve_dtype
from reward_lens.model.generic.discovery import (
    HEAD_LEVEL_BLOCK_ATTRS,
    HEAD_LEVEL_WEIGHTS,
    NATIVE_HINT,
    GenericLoadError,
    GenericPathError,
    GenericRewardModelConfig,
    build_config,
    find_modules,
)
from reward_lens.model.generic.final_norm import GenericFinalNorm, identify_norm
from reward_lens.model.generic.verify import sequential_layers, verify
from reward_lens.model.heads.scalar import RewardHead
from reward_lens.model.tl_compat import check_forward_input, text_input
from reward_lens.model.validation import checked_arguments


class GenericBlock(nn.Module):
    """Hook points of one decoder layer; the layer itself runs inside the transformers model."""

    def __init__(self, layer: int, sequential: bool = True):
        super().__init__()
        self.layer = layer
        self.hook_resid_pre = HookPoint()  # [batch, pos, d_model]
        self.hook_attn_out = HookPoint()
        if (
            sequential
        ):  # resid_pre + attn_out, what the MLP reads; absent when attention and MLP run in parallel
            self.hook_resid_mid = HookPoint()
        self.hook_mlp_out = HookPoint()
        self.hook_resid_post = HookPoint()

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "hook_resid_mid":
                raise GenericPathError(
                    f"layer {self.layer} runs attention and MLP in parallel: it has no resid_mid"
                ) from None
            if name in HEAD_LEVEL_BLOCK_ATTRS:
                raise GenericPathError(
                    f"blocks[{self.layer}].{name} does not exist on a generic-path model: {NATIVE_HINT}"
                ) from None
            raise


# ---------------------------------------------------------------------------------------------- the model
class _StopForward(Exception):
    """Raised by a hook to end a forward at `stop_at_layer` with the residual there."""

    def __init__(self, residual: torch.Tensor):
        self.residual = residual


@dataclass
class RunState:
    """What the spliced hooks read during one forward."""

    start: int = 0  # layers before this are skipped (a forward started from a residual)
    inject: Optional[torch.Tensor] = None  # the residual entering layer `start`
    stop: Optional[int] = None  # raise _StopForward with the residual entering this layer
    bypass: bool = False  # run transformers untouched (load-time reference)
    calls: Optional[Dict[str, int]] = None  # hook-site call counts (load-time check)
    resid_pre: Optional[torch.Tensor] = None  # the current layer's residual (for resid_mid)


class GenericRewardModel(RewardModelBase):
    """A transformers sequence-classification reward model with component-level TransformerLens hooks.

    Wraps `hf_model` in place (its modules get torch hooks); `from_hf_model` wraps a copy. The shared
    surface of `RewardModelBase` (forward, run_with_cache, run_with_hooks, readout_positions,
    reward_direction, reward_bias, to_tokens, cfg); head-level tools raise `GenericPathError`.
    """

    has_head_hooks = False
    has_readout_fast_path = False

    def __init__(
        self,
        hf_model: nn.Module,
        tokenizer: Any = None,
        *,
        module_map: Optional[Dict[str, Optional[str]]] = None,
        fold_ln: bool = True,
        check: bool = True,
    ):
        super().__init__()
        hf_model.eval()
        found = find_modules(hf_model, module_map)
        d_model = found.score.in_features
        kind, offset, eps = identify_norm(
            found.final_norm, d_model, found.paths["final_norm"], hf_model.config
        )
        self.cfg = build_config(hf_model, found, kind, offset, eps, fold_ln)
        self.tokenizer = tokenizer
        self.hf_model = hf_model
        self.found = found
        self.run_state = RunState()
        self.hook_embed = HookPoint()
        if found.pos_embed is not None:
            self.hook_pos_embed = HookPoint()
        base_params = inspect.signature(found.base.forward).parameters
        self._base_takes_positions = "position_ids" in base_params
        self._base_takes_use_cache = "use_cache" in base_params
        self.cfg.sequential_layers = sequential_layers(found, self.cfg, self.base_kwargs)
        self.blocks = nn.ModuleList(
            [GenericBlock(l, seq) for l, seq in enumerate(self.cfg.sequential_layers)]
        )
        self.ln_final = GenericFinalNorm(kind, eps, offset, None if fold_ln else found.final_norm)
        self.reward_head = RewardHead(self.cfg)
        self._load_head(found.score, fold_ln)
        self._layer_returns_tuple = False
        self._handles: List[Any] = []
        self._install_hooks()
        self.setup()
        if check:
            verify(self)

    # ------------------------------------------------------------------ construction
    def setup(self) -> None:
        """HookedRootModule.setup over reward-lens's own modules only (the transformers tree is left
        alone)."""
        self.mod_dict, self.hook_dict = {}, {}
        for name, module in self.named_modules():
            if name == "" or name == "hf_model" or name.startswith("hf_model."):
                continue
            module.name = name
            self.mod_dict[name] = module
            if isinstance(module, HookPoint):
                self.hook_dict[name] = module

    def base_kwargs(
        self,
        ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
    ) -> Dict[str, Any]:
        """Keyword arguments of the transformers base model's forward for token ids `ids`."""
        attention_mask, position_ids = self.prepare_inputs(
            *ids.shape[:2], attention_mask, position_ids, ids.device
        )
        kwargs: Dict[str, Any] = {"input_ids": ids, "attention_mask": attention_mask}
        if self._base_takes_positions:
            kwargs["position_ids"] = position_ids
        if self._base_takes_use_cache:
            kwargs["use_cache"] = False
        return kwargs

    def _load_head(self, score: nn.Linear, fold_ln: bool) -> None:
        with torch.no_grad():
            W = score.weight.detach().float().T  # [d_model, n_out]
            b = (
                score.bias.detach().float()
                if score.bias is not None
                else torch.zeros(W.shape[1], device=W.device)
            )
            if fold_ln:
                norm = self.found.final_norm
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

    def _count(self, site: str) -> None:
        st = self.run_state
        if st.calls is not None:
            st.calls[site] = st.calls.get(site, 0) + 1

    def _on_output(self, hook_point: HookPoint, site: str, layer: Optional[int]):
        st = self.run_state

        def fn(module, args, output):
            if st.bypass or (layer is not None and layer < st.start):
                return None
            if layer is None and st.inject is not None:  # embeddings of a run started from a residual
                return None
            self._count(site)
            if isinstance(output, tuple):
                return (hook_point(output[0]),) + tuple(output[1:])
            return hook_point(output)

        return fn

    def _on_attn(self, l: int):
        st = self.run_state
        block, sequential = self.blocks[l], self.cfg.sequential_layers[l]

        def fn(module, args, output):
            if st.bypass or l < st.start:
                return None
            self._count(f"attn{l}")
            a = block.hook_attn_out(output[0] if isinstance(output, tuple) else output)
            if sequential:
                mid = st.resid_pre + a
                new_mid = block.hook_resid_mid(mid)
                if new_mid is not mid:  # a hook replaced resid_mid: the layer adds resid_pre + this
                    a = new_mid - st.resid_pre
            return (a,) + tuple(output[1:]) if isinstance(output, tuple) else a

        return fn

    def _on_layer_input(self, l: int, embed_at_layer0: bool):
        st = self.run_state

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
                self._count("embed")
                h = self.hook_embed(h)
            self._count(f"resid_pre{l}")
            h = self.blocks[l].hook_resid_pre(h)
            st.resid_pre = h
            if args:
                args[0] = h
            else:
                kwargs["hidden_states"] = h
            return tuple(args), kwargs

        return fn

    def _on_final_norm(self, module, args, kwargs, output):
        st, n = self.run_state, len(self.found.layers)
        if st.bypass:
            return None
        x = args[0] if args else next(iter(kwargs.values()))
        if st.start == n and st.inject is not None:
            x = st.inject
        if st.stop == n:
            raise _StopForward(x)
        self._count("final_norm")
        return self.ln_final(x)

    def _install_hooks(self) -> None:
        m = self.found
        # Without learned positions, hook_embed is the residual entering layer 0 (so embedding scales
        # or norms applied in the model's forward, e.g. Gemma's sqrt(d_model), are inside it); with
        # them, the two embedding modules' outputs, checked at load to sum to that residual.
        embed_at_layer0 = m.pos_embed is None
        reg = self._handles.append
        if not embed_at_layer0:
            reg(m.embed.register_forward_hook(self._on_output(self.hook_embed, "embed", None)))
        if m.pos_embed is not None:
            reg(m.pos_embed.register_forward_hook(self._on_output(self.hook_pos_embed, "pos_embed", None)))
        for l, layer in enumerate(m.layers):
            block = self.blocks[l]
            reg(layer.register_forward_pre_hook(self._on_layer_input(l, embed_at_layer0), with_kwargs=True))
            reg(m.attn[l].register_forward_hook(self._on_attn(l)))
            reg(m.mlp[l].register_forward_hook(self._on_output(block.hook_mlp_out, f"mlp{l}", l)))
            reg(layer.register_forward_hook(self._on_output(block.hook_resid_post, f"resid_post{l}", l)))
        reg(m.final_norm.register_forward_hook(self._on_final_norm, with_kwargs=True))

    def remove_torch_hooks(self) -> None:
        """Detach every torch hook from the transformers model (this wrapper stops working)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # ------------------------------------------------------------------ a model in memory
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
    ) -> "GenericRewardModel":
        """Wrap a transformers model in memory; a copy unless `copy=False` (then its modules get the
        hooks)."""
        hf = copy_module.deepcopy(hf_model) if copy else hf_model
        # device=None: CUDA when available, else CPU (as every loader)
        hf = hf.to(device=resolve_device(device), dtype=resolve_dtype(dtype) if dtype is not None else None)
        return cls(hf, tokenizer, module_map=module_map, fold_ln=fold_ln)

    # ------------------------------------------------------------------ forward
    # The signature is the native model's, on purpose: every instrument calls either model kind the same
    # way. The bodies are two: the native model runs its own blocks; this one runs the transformers model
    # with the residual injected and read through the spliced hooks (`RunState`).
    def forward(
        self,
        input: Union[Int[torch.Tensor, "batch pos"], Float[torch.Tensor, "batch pos d_model"]],
        attention_mask: Optional[Int[torch.Tensor, "batch pos"]] = None,
        position_ids: Optional[Int[torch.Tensor, "batch pos"]] = None,
        *,
        input_ids: Optional[Int[torch.Tensor, "batch pos"]] = None,
        start_at_layer: Optional[int] = None,
        stop_at_layer: Optional[int] = None,
        readout_positions: Optional[Int[torch.Tensor, " batch"]] = None,
        return_type: Optional[str] = "reward",
        prepend_bos: Optional[bool] = None,
        padding_side: Optional[str] = None,
    ) -> Optional[torch.Tensor]:
        """Rewards [batch] (or [batch, n_outputs]); the residual before block `stop_at_layer` if given.

        As `HookedRewardModel.forward` (ids without a mask: the leading pad run is masked; a text is
        `to_tokens(text)`'s ids; `return_type`).
        With `start_at_layer=l`, `input` is the residual entering block l (blocks before l are skipped);
        position ids default to cumsum(attention_mask) - 1.
        """
        input, attention_mask = text_input(self, input, attention_mask, prepend_bos, padding_side)
        check_forward_input(input, return_type)
        n = self.cfg.n_layers
        start = (
            0 if start_at_layer is None else (start_at_layer + n if start_at_layer < 0 else start_at_layer)
        )
        stop = None if stop_at_layer is None else (stop_at_layer + n if stop_at_layer < 0 else stop_at_layer)
        if not 0 <= start <= n or (stop is not None and not start <= stop <= n):
            raise ValueError(
                f"need 0 <= start_at_layer <= stop_at_layer <= n_layers={n}; got {start_at_layer}, "
                f"{stop_at_layer}"
            )
        device = self.cfg.device
        if start_at_layer is None:
            input_ids, attention_mask = self.checked_ids(
                input, attention_mask, warn=readout_positions is None
            )
            input, embeds = input_ids, None
        else:
            embeds = input
        batch, T = input.shape[:2]
        attention_mask, position_ids = self.prepare_inputs(batch, T, attention_mask, position_ids, device)
        if embeds is None:
            kwargs = self.base_kwargs(input_ids, attention_mask, position_ids)
        else:  # inputs_embeds are replaced by `input` where block `start` begins
            kwargs = self.base_kwargs(
                torch.zeros(batch, T, dtype=torch.long, device=device), attention_mask, position_ids
            )
            kwargs["inputs_embeds"] = torch.zeros_like(embeds)
            del kwargs["input_ids"]
        try:
            with self._run_state(start, embeds, stop):
                out = self.found.base(**kwargs)
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
        st = self.run_state
        saved = (st.start, st.inject, st.stop)
        skipped = list(self.found.layers)[:start] if inject is not None else []
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

    # ------------------------------------------------------------------ load-time verification (see
    # verify.py)
    def probe_run(self, ids: torch.Tensor, mask: torch.Tensor) -> Tuple[torch.Tensor, Any, Dict[str, int]]:
        """Rewards, the full cache and how often each hooked module ran, for one probe forward."""
        st = self.run_state
        probe = self.found.layers[0].register_forward_hook(
            lambda mod, a, out: setattr(self, "_layer_returns_tuple", isinstance(out, tuple))
        )
        st.calls = {}
        try:
            rewards, cache = self.run_with_cache(ids, attention_mask=mask)
            calls = st.calls
        finally:
            st.calls = None
            probe.remove()
        return rewards, cache, calls

    def reference_logits(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """transformers' own output for `ids`, every hook bypassed: the independent reference."""
        st = self.run_state
        st.bypass = True
        try:
            kwargs = {"attention_mask": mask}
            if "position_ids" in inspect.signature(self.hf_model.forward).parameters:
                kwargs["position_ids"] = torch.arange(ids.shape[1], device=ids.device)[None]
            ref = self.hf_model(ids, **kwargs)
        finally:
            st.bypass = False
        return ref.logits if isinstance(getattr(ref, "logits", None), torch.Tensor) else ref[0]

    # ------------------------------------------------------------------ hooks: clear errors for head-level
    # names
    def _check_names(self, names: Any) -> None:
        if names is None or callable(names):
            return
        for name in [names] if isinstance(names, str) else list(names):
            if name not in self.hook_dict:
                raise self._missing_hook(name)

    def _missing_hook(self, name: str) -> Exception:
        if name.endswith("hook_resid_mid"):
            return GenericPathError(
                f"no hook {name!r}: that layer runs attention and MLP in parallel (GPT-NeoX style), so "
                "there is no residual between them; use hook_resid_pre + hook_attn_out, or hook_resid_post"
            )
        if hooks.is_head_level(name):
            return GenericPathError(f"no hook {name!r} on a generic-path model: {NATIVE_HINT}")
        return KeyError(
            f"no hook point named {name!r}; this model's hook points: {', '.join(self.hook_dict)}"
        )

    @checked_arguments(flags=("is_permanent", "prepend"))
    def add_hook(self, name, hook, dir="fwd", is_permanent=False, level=None, prepend=False) -> None:
        if isinstance(name, str) and name not in self.hook_dict:
            raise self._missing_hook(name)
        super().add_hook(name, hook, dir=dir, is_permanent=is_permanent, level=level, prepend=prepend)

    def _enable_hook(self, name, hook, dir) -> None:
        if isinstance(name, str) and name not in self.hook_dict:
            raise self._missing_hook(name)
        super()._enable_hook(name, hook, dir)

    @checked_arguments(flags=("readout_only",))
    def run_with_cache(self, *model_args: Any, readout_only: bool = False, **kwargs: Any):
        """As `RewardModelBase.run_with_cache`; naming a hook this model lacks is an error, not an empty
        cache."""
        self._check_names(kwargs.get("names_filter"))
        return super().run_with_cache(*model_args, readout_only=readout_only, **kwargs)

    # ------------------------------------------------------------------ head-level switches and weights
    @checked_arguments(flags=("use_attn_result",))
    def set_use_attn_result(self, use_attn_result: bool) -> None:
        if use_attn_result:
            raise GenericPathError(f"per-head outputs (hook_result) are head-level: {NATIVE_HINT}")

    @checked_arguments(flags=("use_attn_in",))
    def set_use_attn_in(self, use_attn_in: bool) -> None:
        if use_attn_in:
            raise GenericPathError(f"hook_attn_in is not available: {NATIVE_HINT}")

    @checked_arguments(flags=("use_hook_mlp_in",))
    def set_use_hook_mlp_in(self, use_hook_mlp_in: bool) -> None:
        if use_hook_mlp_in:
            raise GenericPathError(f"hook_mlp_in is not available: {NATIVE_HINT}")

    @property
    def W_E(self) -> torch.Tensor:
        return self.found.embed.weight

    def __getattr__(self, name: str) -> Any:
        # A property that raises AttributeError falls through to __getattr__; keep its message.
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in HEAD_LEVEL_WEIGHTS:
                raise GenericPathError(f"{name} is a head-level weight: {NATIVE_HINT}") from None
            if name == "accumulated_bias":
                raise GenericPathError(
                    f"accumulated_bias needs per-layer output biases: {NATIVE_HINT}"
                ) from None
            raise


__all__ = [
    "GenericRewardModel",
    "GenericRewardModelConfig",
    "GenericPathError",
    "GenericLoadError",
    "GenericFinalNorm",
    "GenericBlock",
]
