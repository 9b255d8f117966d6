"""RewardModelBase: what the native and the generic hooked reward models share.

Both are `HookedRootModule`s with `cfg`, `tokenizer`, `hook_embed`, `blocks`, `ln_final` and a
`reward_head` (a `reward_lens.model.heads.base.RewardHeadBase`). Here: where the reward is read
(`readout_positions`), `run_with_cache(readout_only=...)`, the reward-direction API, tokenisation and the
defaults of a forward's inputs, plus explicit capability flags that instruments ask instead of probing:

    has_head_hooks          per-head / per-neuron hooks and weights (hook_z, W_O, ...): native only
    has_readout_fast_path   blocks with a one-token readout step over cached keys/values: native only
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from jaxtyping import Float, Int
from transformer_lens.hook_points import HookPoint
from transformer_lens.HookedRootModule import HookedRootModule

from reward_lens.model import hooks
from reward_lens.model.readout import readout_positions as readout_by_rule
from reward_lens.model.tl_compat import (
    INPUT_FORMAT_DEFAULT,
    AliasedActivationCache,
    check_patch_alignment,
    leading_pad_mask,
    record_cache_mask,
    resolve_names_filter,
    text_input,
    warn_pad_is_bos,
)
from reward_lens.model.tokenization import check_input_format, is_bare_text, tokenize_pairs, tokenize_texts
from reward_lens.model.validation import check_model_inputs, checked_arguments


class RewardModelBase(HookedRootModule):
    """The shared surface of `HookedRewardModel` (native) and `GenericHookedRewardModel`."""

    has_head_hooks: bool = False
    has_readout_fast_path: bool = False
    # The devices a placed model's blocks span (`n_devices` / `device_map`); None on one device.
    placed_devices: Optional[List[torch.device]] = None

    # ------------------------------------------------------------------ inputs
    @property
    def input_format(self) -> Union[str, Any]:
        """How (prompt, response) pairs become ids by default
        (`reward_lens.model.tokenization.INPUT_FORMATS`)."""
        return self.__dict__.get("_input_format", INPUT_FORMAT_DEFAULT)

    @input_format.setter
    def input_format(self, value: Any) -> None:
        self.__dict__["_input_format"] = check_input_format(value)

    def checked_ids(
        self, input: Any, attention_mask: Optional[torch.Tensor], warn: bool
    ) -> Tuple[Int[torch.Tensor, "batch pos"], Optional[torch.Tensor]]:
        """The ids and mask a full forward starts from: validated (`check_model_inputs`), the ids on the
        model's device, and a missing mask inferred from the leading pad run (`infer_attention_mask`)."""
        input, attention_mask = check_model_inputs(self, input, attention_mask)
        input = input.to(self.cfg.device)
        if attention_mask is None:
            attention_mask = self.infer_attention_mask(input, warn=warn)
        return input, attention_mask

    def infer_attention_mask(
        self, input_ids: Int[torch.Tensor, "batch pos"], warn: bool = True
    ) -> Int[torch.Tensor, "batch pos"]:
        """The mask of ids passed without one: the leading pad run of each row masked (left padding, as
        `to_tokens` pads). With `warn`, a row whose readout is not its last position gets a warning:
        position -1 is then not where the reward is read.

        pad id == BOS id (GPT-2 / Pythia-style, one id for BOS, EOS and pad): when `to_tokens` renders a BOS
        (`renders_bos`), the last id of each leading run is the row's own BOS and stays attended; when it
        renders none, the whole run is padding, but if every row starts with that id (a BOS prepended by
        hand?) or the rendering is unknown (`to_tokens` fails), a warning asks for `attention_mask`."""
        pad = self.cfg.pad_token_id
        bos = getattr(self.tokenizer, "bos_token_id", None)
        own_bos = pad is not None and pad == bos and self.renders_bos()
        mask = leading_pad_mask(input_ids, pad, keep_last=bool(own_bos)).to(input_ids.device)
        if pad is not None and pad == bos and own_bos is not True:
            warn_pad_is_bos(input_ids, pad, own_bos)
        if warn:
            readout = self.readout_positions(input_ids, mask)
            late = (readout != input_ids.shape[1] - 1).nonzero().flatten().tolist()
            if late:
                warnings.warn(
                    f"rows {late[:8]} of these ids read the reward before their last position (right "
                    "padding or a trailing pad/EOS token), so position -1 is not the readout: gather at "
                    "model.readout_positions(ids, mask), or cache with run_with_cache(..., "
                    "readout_only=True), or tokenise with model.to_tokens (left-padded, readout last)",
                    stacklevel=3,
                )
        return mask

    def renders_bos(self) -> Optional[bool]:
        """Whether `to_tokens` starts a row with the tokenizer's BOS id (None: no BOS id, or it fails)."""
        key = (id(self.tokenizer), str(self.input_format))
        known = self.__dict__.get("_renders_bos")
        if known is None or known[0] != key:
            bos = getattr(self.tokenizer, "bos_token_id", None)
            try:
                ids = self.to_tokens("a", "b")["input_ids"][0] if bos is not None else None
            except Exception:  # any tokenizer failure means: unknown
                ids = None
            known = (key, None if ids is None else bool(ids.numel() and int(ids[0]) == bos))
            self.__dict__["_renders_bos"] = known
        return known[1]

    def prepare_inputs(
        self,
        batch: int,
        T: int,
        attention_mask: Optional[torch.Tensor],
        position_ids: Optional[torch.Tensor],
        device: Union[str, torch.device],
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """(attention_mask, position_ids) on `device`: all ones, and the count of attended tokens before
        each position (so a left-padded sequence gets the same reward as the unpadded one)."""
        if attention_mask is None:
            attention_mask = torch.ones(batch, T, dtype=torch.long, device=device)
        attention_mask = attention_mask.to(device)
        if position_ids is None:
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        return attention_mask, position_ids.to(device)

    def readout_positions(
        self,
        input_ids: Optional[Int[torch.Tensor, "batch pos"]],
        attention_mask: Optional[torch.Tensor] = None,
    ) -> Int[torch.Tensor, " batch"]:
        """Where the reward is read: `cfg.readout` ("last_non_pad", the default: the head's rule, i.e.
        transformers' rightmost non-pad token or ArmoRM's published `(argmax(ids == pad) - 1) mod T`;
        "last_attended": OpenRLHF's last attended position); see `reward_lens.model.readout`. Without input
        ids (a forward started from a residual), the rightmost attended position."""
        return readout_by_rule(self, input_ids, attention_mask)

    def to_tokens(
        self,
        prompts: Union[str, Sequence[Any]],
        responses: Union[str, Sequence[Any], None] = None,
        *,
        prepend_bos: Optional[bool] = None,
        padding_side: Optional[str] = None,
        max_length: Optional[int] = None,
        input_format: Optional[str] = None,
    ) -> Union[Dict[str, torch.Tensor], torch.Tensor]:
        """Tokenise (prompt, response) pairs as the reward model was trained on them, in `input_format`
        (default `model.input_format`): {"input_ids", "attention_mask"}. Rows end at their readout and are
        padded on the LEFT (default), so the readout is position -1; see `reward_lens.model.tokenization`.

        A bare text (or list of texts) with no responses has TransformerLens's meaning: a [batch, pos]
        tensor of BOS + the text's ids (`prepend_bos=False`: none), no input format, as `to_str_tokens(text)`
        and `model(text)` see it; several texts are padded on the left (`padding_side=`)."""
        if responses is None and is_bare_text(prompts):
            if max_length is not None or input_format is not None:
                raise ValueError(
                    "max_length= and input_format= apply to (prompt, response) pairs; a bare text is "
                    "tokenised as TransformerLens does (BOS + text): pass responses to render pairs"
                )
            return tokenize_texts(self, prompts, prepend_bos, padding_side)["input_ids"]
        if prepend_bos is not None:
            raise ValueError(
                "prepend_bos= applies to a bare text (TransformerLens's to_tokens(text)); a (prompt, "
                "response) pair is rendered in its input format, with the BOS that format has"
            )
        return tokenize_pairs(
            self,
            prompts,
            responses,
            padding_side=padding_side,
            max_length=max_length,
            input_format=input_format,
        )

    # ------------------------------------------------------------------ hooks and caches
    def setup(self) -> None:
        """`HookedRootModule.setup`, plus TransformerLens's alias names (`hooks.tl_hook_aliases`) in
        `mod_dict`, so hooks added by an alias name (`run_with_hooks`, `add_hook`, `names_filter`) land on
        the hook it stands for; `hook_dict` (and so every cache key) keeps one name per hook."""
        super().setup()
        ln1 = getattr(self.blocks[0], "ln1", None) if len(getattr(self, "blocks", ())) else None
        aliases = hooks.tl_hook_aliases(
            self.cfg.n_layers,
            post_norms=bool(getattr(self.cfg, "post_norms", False)),
            norms_folded=ln1 is not None and getattr(ln1, "w", 0) is None,
        )
        self.hook_aliases = {
            a: t for a, t in aliases.items() if t in self.hook_dict and a not in self.mod_dict
        }
        self.mod_dict.update({a: self.hook_dict[t] for a, t in self.hook_aliases.items()})

    def remove_all_hook_fns(self, direction="both", including_permanent: bool = False, level=None) -> None:
        """`HookedRootModule.remove_all_hook_fns`, visiting only the hook points that hold a hook: TL resets
        every hook point after each hooked run, and an empty one's reset (two nn.Module attribute writes)
        cost more than a tiny model's forward. The same hooks are removed."""
        for hp in self.hook_points():
            if hp.fwd_hooks or hp.bwd_hooks:
                hp.remove_hooks(direction, including_permanent=including_permanent, level=level)

    def clear_contexts(self) -> None:
        """`HookedRootModule.clear_contexts`, skipping hook points whose context is already empty."""
        for hp in self.hook_points():
            if hp.ctx:
                hp.clear_context()

    def batch_mask(self, model_args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional[torch.Tensor]:
        """The attention mask a forward on these arguments uses (None: it starts from a residual)."""
        ids = model_args[0] if model_args else kwargs.get("input")
        if kwargs.get("start_at_layer") is not None:
            ids = kwargs.get("input_ids")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.is_floating_point():
            return None
        mask = kwargs.get("attention_mask", model_args[1] if len(model_args) > 1 else None)
        if mask is not None:
            return torch.as_tensor(mask)
        with warnings.catch_warnings():  # the forward itself warns
            warnings.simplefilter("ignore")
            return self.infer_attention_mask(ids, warn=False)

    def run_with_hooks(self, *model_args: Any, fwd_hooks: Any = (), **kwargs: Any):
        """`HookedRootModule.run_with_hooks`. A hook that writes activations cached from a differently padded
        batch (as `transformer_lens.patching` writes `clean_cache` into the corrupted run) warns where it
        patches a pad into a real token or the reverse (`tl_compat.check_patch_alignment`)."""
        if fwd_hooks:
            run_key = model_args[0] if model_args else None
            fwd_hooks = check_patch_alignment(self, fwd_hooks, self.batch_mask(model_args, kwargs), run_key)
        return super().run_with_hooks(*model_args, fwd_hooks=list(fwd_hooks), **kwargs)

    @checked_arguments(flags=("readout_only",))
    def run_with_cache(self, *model_args: Any, readout_only: bool = False, **kwargs: Any):
        """`HookedRootModule.run_with_cache`, returning a `transformer_lens.ActivationCache` (that also
        answers TransformerLens alias names, `model.hook_aliases`).

        `readout_only=True` keeps only each sequence's readout position (position axis of length 1),
        so a long input's cache costs O(layers x d_model) per sequence.
        """
        if self.placed_devices:  # a placed model's activations, gathered on its home device
            kwargs.setdefault("device", self.cfg.device)
        if "names_filter" in kwargs:
            aliases = getattr(self, "hook_aliases", {})
            kwargs["names_filter"] = resolve_names_filter(kwargs["names_filter"], aliases)
        if readout_only:
            return self.run_with_readout_cache(*model_args, **kwargs)
        out, cache_dict = super().run_with_cache(*model_args, **kwargs)
        batched = not kwargs.get("remove_batch_dim", False)
        cache = AliasedActivationCache(cache_dict, self, has_batch_dim=batched)
        mask = self.batch_mask(model_args, kwargs)
        if mask is not None and batched:
            record_cache_mask(cache, mask)
        return out, cache

    def run_with_readout_cache(self, input, attention_mask=None, *, names_filter=None, device=None, **kwargs):
        """`run_with_cache(..., readout_only=True)`."""
        prepend_bos, padding_side = kwargs.pop("prepend_bos", None), kwargs.pop("padding_side", None)
        input, attention_mask = text_input(self, input, attention_mask, prepend_bos, padding_side)
        if kwargs.get("start_at_layer") is None:  # checked here too: the readout is found before the forward
            input, attention_mask = check_model_inputs(self, input, attention_mask)
        ids = kwargs.get("input_ids", input if kwargs.get("start_at_layer") is None else None)
        readout = kwargs.pop("readout_positions", None)
        if readout is None:
            readout = self.readout_positions(ids, attention_mask)
        cache: Dict[str, torch.Tensor] = {}

        def keep(tensor: torch.Tensor, hook: HookPoint):
            rows = torch.arange(tensor.shape[0])
            if tensor.dim() >= 3 and hooks.query_axis(hook.name) == 2:
                kept = tensor[rows, :, readout.to(tensor.device)][:, :, None]
            elif tensor.dim() >= 3:
                kept = tensor[rows, readout.to(tensor.device)][:, None]
            else:
                kept = tensor
            cache[hook.name] = kept.detach().to(device) if device is not None else kept.detach()

        out = self.run_with_hooks(
            input,
            attention_mask,
            readout_positions=readout,
            fwd_hooks=[(n, keep) for n in self.hook_names(names_filter)],
            **kwargs,
        )
        return out, AliasedActivationCache(cache, self)

    def hook_names(self, names_filter=None) -> List[str]:
        """The hook names a TransformerLens `names_filter` (None, a name, a list or a predicate) selects."""
        if names_filter is None:
            return list(self.hook_dict)
        if callable(names_filter):
            return [n for n in self.hook_dict if names_filter(n)]
        names = resolve_names_filter(
            [names_filter] if isinstance(names_filter, str) else list(names_filter),
            getattr(self, "hook_aliases", {}),
        )
        unknown = [n for n in names if n not in self.hook_dict]
        if unknown:
            raise ValueError(
                f"unknown hook name(s) {unknown[:3]}; see model.hook_dict (e.g. 'blocks.0.hook_resid_post')"
            )
        return names

    # ------------------------------------------------------------------ reward direction
    def through_final_norm(
        self, direction: Float[torch.Tensor, "... d_model"]
    ) -> Float[torch.Tensor, "... d_model"]:
        """A head direction (read from h = ln_final(resid)) as a direction read from resid /
        ln_final.hook_scale:
        times the final norm's gain, centred when the norm is a LayerNorm that centres it itself."""
        gain = self.ln_final.gain
        if gain is not None:
            direction = direction * gain
        if self.ln_final.centers_direction:
            direction = direction - direction.mean(-1, keepdim=True)
        return direction

    @property
    def reward_direction(self) -> Float[torch.Tensor, " d_model"]:
        """w such that reward = w . (resid_final[readout] / ln_final.hook_scale) + reward_bias."""
        return self.reward_direction_of(0)

    def reward_direction_of(self, output: int = 0) -> Float[torch.Tensor, " d_model"]:
        if self.cfg.n_outputs > 1 and output is None:
            raise ValueError("this head has several outputs; pass output=<index>")
        return self.through_final_norm(self.reward_head.direction(output)).to(self.cfg.device)

    def reward_direction_for(
        self, input_ids: Int[torch.Tensor, "batch pos"], attention_mask: Optional[torch.Tensor] = None
    ) -> Float[torch.Tensor, "batch d_model"]:
        """Per-sequence w such that reward[b] = w[b] . (resid_final[b, readout] / ln_final.hook_scale) +
        reward_bias.

        For a linear head every row is `reward_direction`; for ArmoRM it is the prompt-conditioned
        W_reg T g(prompt) (one forward pass to compute the gate).
        """
        direction = self.through_final_norm(self.reward_head.direction_for(self, input_ids, attention_mask))
        return direction.to(self.cfg.device)

    def reward_readout_for(
        self, input_ids: Int[torch.Tensor, "batch pos"], attention_mask: Optional[torch.Tensor] = None
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Per-sequence (direction [batch, d_model], bias [batch]) such that, exactly,
        reward[b] = direction[b] . (resid_final[b, readout] / ln_final.hook_scale) + bias[b].

        A linear head: `reward_direction` and `reward_bias` on every row; ArmoRM: its gate frozen; an MLP
        head: its ReLU masks frozen at the sequence's values (so the bias is per sequence too)."""
        direction, bias = self.reward_head.linear_readout(self, input_ids.to(self.cfg.device), attention_mask)
        if self.ln_final.b is not None:
            bias = bias + direction @ self.ln_final.b.to(direction.dtype)
        return self.through_final_norm(direction).to(self.cfg.device), bias.to(self.cfg.device)

    def reward_bias_for(
        self, input_ids: Int[torch.Tensor, "batch pos"], attention_mask: Optional[torch.Tensor] = None
    ) -> Float[torch.Tensor, " batch"]:
        """The per-sequence bias of `reward_readout_for` (the head's bias on every row of a linear head)."""
        return self.reward_readout_for(input_ids, attention_mask)[1]

    def step_rewards(
        self, input_ids: Int[torch.Tensor, "batch pos"], attention_mask: Optional[torch.Tensor] = None
    ) -> Float[torch.Tensor, "batch max_steps"]:
        """A process reward model's reward of every step [batch, max_steps] (log-odds; NaN after a
        sequence's last step). `model(...)` returns the selected step's (default: the last)."""
        return self.reward_head.step_rewards(self, input_ids, attention_mask)

    @property
    def reward_bias(self) -> torch.Tensor:
        """The reward of an all-zero normalised residual: the head's bias (+ w_R . b for a LayerNorm with
        bias)."""
        return self.reward_bias_of(0)

    def reward_bias_of(self, output: int = 0) -> torch.Tensor:
        bias = self.reward_head.bias(output)
        if self.ln_final.b is not None:
            bias = bias + self.ln_final.b @ self.reward_head.direction(output)
        return bias.to(self.cfg.device)

    # ------------------------------------------------------------------ device / dtype
    def to(self, *args: Any, **kwargs: Any):
        out = super().to(*args, **kwargs)
        param = next(self.parameters())
        if all(p.device == param.device for p in self.parameters()):
            self.placed_devices = None  # gathered on one device (a dtype-only `to` keeps a placement)
        self.cfg.device = param.device
        self.cfg.dtype = param.dtype
        return out

    def cuda(self, device: Any = None):
        return self.to(device if device is not None else "cuda")

    def cpu(self):
        return self.to("cpu")
