"""TransformerLens conveniences of a hooked reward model, so TL tutorial code runs with only the model,
tokens and metric swapped.

- Padding: `to_tokens` pads on the left and drops everything after the readout, so the readout is the
  last position of every row and `pos_slice=-1` / `[:, -1]` is right. Called without an attention mask,
  the forward infers it (the leading run of pad tokens), as `transformer_lens.patching` passes none.
- Weights as TL exposes them: `W_K`, `W_V`, `b_K`, `b_V` repeated to `n_heads` for grouped-query
  attention (query head h reads key/value head h // (n_heads / n_kv_heads)); the raw kv-head stacks are
  `_W_K`, `_W_V`, `_b_K`, `_b_V`. `QK`, `OV` as `transformer_lens.FactoredMatrix`.
- Tokens: `to_str_tokens`, `to_string`, `to_single_token`, `get_token_position` with TL's signatures;
  `tokens_to_residual_directions(tokens)` is the reward direction of each sequence, so
  `cache.logit_attrs(stack, tokens) + model.reward_bias` is the reward.
"""

from __future__ import annotations

import functools
import sys
import warnings
import weakref
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

import torch
import transformer_lens.utilities as tl_utils
from jaxtyping import Float, Int
from transformer_lens import FactoredMatrix
from transformer_lens.ActivationCache import ActivationCache

from reward_lens.model import hooks
from reward_lens.model.tokenization import is_bare_text, text_ids, tl_bos_token_id, tokenize_texts

RETURN_TYPES = ("reward", "logits", None)

INPUT_FORMAT_DEFAULT = "auto"


def text_input(
    model, input: Any, attention_mask: Any, prepend_bos: Optional[bool], padding_side: Optional[str]
) -> Tuple[Any, Any]:
    """(input, attention_mask) of a forward: a bare text (or list of texts) becomes `model.to_tokens(text)`'s
    ids (TransformerLens's meaning: BOS + the text, no input format) and their mask; anything else is
    returned as given (`prepend_bos` / `padding_side` apply to text only)."""
    if not is_bare_text(input):
        if prepend_bos is not None or padding_side is not None:
            raise ValueError(
                "prepend_bos= and padding_side= apply to a text input; these ids are already tokenised"
            )
        return input, attention_mask
    if attention_mask is not None:
        raise ValueError("a text input makes its own attention mask; pass attention_mask= with ids only")
    batch = tokenize_texts(model, input, prepend_bos, padding_side)
    return batch["input_ids"], batch["attention_mask"]


def check_forward_input(input: Any, return_type: Optional[str]) -> None:
    """TL's forward takes return_type="loss"; a reward model has no loss."""
    if isinstance(input, (list, tuple)) and input and isinstance(input[0], str):
        raise TypeError("a list of texts must hold only strings (TransformerLens's text input)")
    if return_type not in RETURN_TYPES:
        hint = (
            " (a reward model has no language-modelling loss; use the reward as your metric)"
            if return_type == "loss"
            else ""
        )
        raise ValueError(
            "return_type must be 'reward', 'logits' (the same: the reward) or None, got "
            f"{return_type!r}{hint}"
        )


def leading_pad_mask(
    input_ids: Int[torch.Tensor, "batch pos"], pad_token_id: Optional[int], keep_last: bool = False
) -> torch.Tensor:
    """1 from each row's first non-pad token on, 0 on the leading run of pad tokens (left padding).
    `keep_last`: the run's last id stays attended (the row's own BOS when pad id == BOS id)."""
    if pad_token_id is None:
        return torch.ones_like(input_ids, dtype=torch.long)
    mask = ((input_ids != pad_token_id).long().cumsum(-1) > 0).long()
    if keep_last:
        first = mask.argmax(-1)  # the first non-pad position (0 for a row with no leading pad)
        rows = (first > 0).nonzero().flatten()
        mask[rows, first[rows] - 1] = 1
    return mask


def warn_pad_is_bos(input_ids: Int[torch.Tensor, "batch pos"], pad: int, renders_bos: Optional[bool]) -> None:
    """Warn where a pad id == BOS id leaves the mask of ids passed without one undecidable: the rendering is
    unknown and some row starts with the id, or no row is free of it (each may carry its own BOS)."""
    starts = input_ids[:, 0] == pad
    if renders_bos is None and bool(starts.any()):
        why = (
            "to_tokens cannot render a pair here to tell whether rows start with their own BOS, so every "
            "leading one is masked"
        )
    elif renders_bos is False and bool(starts.all()):
        why = (
            "every row starts with it, but to_tokens renders no BOS: a BOS prepended by hand is masked "
            "with the padding"
        )
    else:
        return
    warnings.warn(
        f"the pad id {pad} is also the BOS id: {why}. Pass attention_mask= (model.to_tokens returns it) "
        "to say which positions are padding",
        stacklevel=4,
    )


def stacked_weight(path: str, doc: str) -> property:
    """A read-only property: every block's `path` ("attn.W_Q") stacked on a leading layer axis."""
    module, attr = path.split(".")

    def get(self) -> torch.Tensor:
        return torch.stack([getattr(getattr(block, module), attr) for block in self.blocks], dim=0)

    return property(get, doc=doc)


def _kv_expanded(stored: str, doc: str) -> property:
    """A read-only property: the stored kv-head weight `stored` repeated to n_heads (`_expand_kv`)."""
    return property(lambda self: self._expand_kv(getattr(self, stored)), doc=doc)


class TransformerLensConveniences:
    """Mixin for `HookedRewardModel`: TL's token helpers, weight stacks and mask-free padded batches."""

    # ------------------------------------------------------------------ tokens <-> strings
    def _tokenizer_or_error(self):
        if self.tokenizer is None:
            raise ValueError(
                "this model has no tokenizer; set model.tokenizer = AutoTokenizer.from_pretrained(...)"
            )
        return self.tokenizer

    @property
    def tl_bos_token_id(self) -> Optional[int]:
        """The id TransformerLens prepends: the tokenizer's BOS, else its EOS (TL's fallback), else None."""
        return tl_bos_token_id(self._tokenizer_or_error())

    def _text_ids(self, text: str, prepend_bos: Optional[bool]) -> torch.Tensor:
        """A text's ids as `to_tokens(text, prepend_bos)` makes them (`tokenization.text_ids`)."""
        self._tokenizer_or_error()
        return torch.tensor(text_ids(self, text, prepend_bos), dtype=torch.long)

    def to_str_tokens(
        self,
        input: Union[str, torch.Tensor, List],
        prepend_bos: Optional[bool] = None,
        padding_side: Optional[str] = None,
    ) -> Union[List[str], List[List[str]]]:
        """Each token as a string. A str is tokenised as TransformerLens does (one BOS in front unless
        `prepend_bos=False`, `tl_bos_token_id`); ids are decoded as they are (a 2-D tensor: one list per row,
        pads included); a list maps."""
        tok = self._tokenizer_or_error()
        if isinstance(input, list) and not all(isinstance(x, int) for x in input):
            return [self.to_str_tokens(item, prepend_bos, padding_side) for item in input]
        if isinstance(input, str):
            ids = self._text_ids(input, prepend_bos)
        else:
            ids = torch.as_tensor(input)
            if ids.dim() == 2 and ids.shape[0] > 1:
                return [self.to_str_tokens(row) for row in ids]
            ids = ids.reshape(-1)
        return tok.batch_decode([[int(t)] for t in ids.tolist()], clean_up_tokenization_spaces=False)

    def to_string(self, tokens: Union[List[int], torch.Tensor]) -> Union[str, List[str]]:
        """Decode ids as TransformerLens does (special tokens such as BOS kept): one string for a 0-/1-D input
        (a list of ints, a tensor or an array), a list for a 2-D batch or a list of 1-D tensors (pads too)."""
        tok = self._tokenizer_or_error()
        if (
            isinstance(tokens, list)
            and tokens
            and all(isinstance(t, torch.Tensor) and t.dim() == 1 for t in tokens)
        ):
            return [self.to_string(t) for t in tokens]
        tokens = torch.as_tensor(tokens)
        if tokens.dim() == 2:
            return tok.batch_decode(tokens.tolist(), clean_up_tokenization_spaces=False)
        if tokens.dim() <= 1:
            return tok.decode(tokens.reshape(-1).tolist(), clean_up_tokenization_spaces=False)
        raise ValueError(f"to_string takes a 1-D or 2-D tensor of ids, got shape {tuple(tokens.shape)}")

    def to_single_token(self, string: str) -> int:
        """The id of a string that is exactly one token (no special tokens added)."""
        ids = self._text_ids(string, prepend_bos=False)
        if ids.numel() != 1:
            raise ValueError(
                f"{string!r} is {ids.numel()} tokens, not a single token: {self.to_str_tokens(ids)}"
            )
        return int(ids.item())

    def get_token_position(
        self,
        single_token: Union[str, int],
        input: Union[str, torch.Tensor],
        mode: str = "first",
        prepend_bos: Optional[bool] = None,
        padding_side: Optional[str] = None,
    ) -> int:
        """Position of `single_token` in `input` (a text, tokenised as `to_str_tokens` does, so with one BOS
        in front unless `prepend_bos=False`, as in TransformerLens; or [pos] / [1, pos] ids); mode "first"
        or "last"."""
        tokens = self._text_ids(input, prepend_bos) if isinstance(input, str) else torch.as_tensor(input)
        if tokens.dim() == 2:
            if tokens.shape[0] != 1:
                raise ValueError(f"2-D tokens must have shape [1, pos], got {tuple(tokens.shape)}")
            tokens = tokens[0]
        if isinstance(single_token, str):
            single_token = self.to_single_token(single_token)
        single_token = int(single_token)
        where = (tokens == single_token).nonzero().flatten()
        if len(where) == 0:
            raise ValueError(f"token {single_token} does not occur in the input")
        if mode not in ("first", "last"):
            raise ValueError(f"mode must be 'first' or 'last', not {mode!r}")
        return int(where[0] if mode == "first" else where[-1])

    def tokens_to_residual_directions(
        self, tokens: Union[Int[torch.Tensor, "batch pos"], Int[torch.Tensor, " pos"]]
    ) -> Union[Float[torch.Tensor, "batch d_model"], Float[torch.Tensor, " d_model"]]:
        """The reward direction of each sequence of `tokens` (the input ids), TL's unembedding-column
        analogue:
        reward = direction . (resid_final[readout] / ln_final.hook_scale) + reward_bias, so
        `cache.logit_attrs(stack, tokens, pos_slice=-1)` sums to reward - reward_bias. Per sequence for
        ArmoRM (the prompt-conditioned direction); the one `reward_direction` for a linear head."""
        if not isinstance(tokens, torch.Tensor) or tokens.dim() not in (1, 2):
            raise TypeError(
                "tokens_to_residual_directions takes the input ids ([batch, pos] or [pos]): a reward "
                "model has one output direction per sequence, not one per vocabulary token"
            )
        ids = tokens if tokens.dim() == 2 else tokens[None]
        directions = self.reward_direction_for(ids.to(self.cfg.device))
        return directions if tokens.dim() == 2 else directions[0]

    # ------------------------------------------------------------------ TransformerLens 4.x's bridge
    def enable_compatibility_mode(
        self,
        disable_warnings: bool = False,
        no_processing: bool = False,
        fold_ln: bool = True,
        center_writing_weights: bool = True,
        center_unembed: bool = True,
        fold_value_biases: bool = True,
        refactor_factored_attn_matrices: bool = False,
    ) -> None:
        """TransformerLens 4.x's `TransformerBridge.enable_compatibility_mode`, so a tutorial's first cell
        runs: a hooked reward model already has TL's hook names, aliases and split inputs, and its weights
        stay as loaded (norms folded at load: `from_pretrained(fold_ln=True)`). RMSNorm does not centre,
        there is no unembed, value biases stay in `b_V` and RoPE leaves no QK refactoring, so those requests
        change nothing; a warning (unless `disable_warnings`) names the ones that would have changed
        numbers."""
        if no_processing or disable_warnings:
            return
        unapplied = []
        if fold_ln and any(getattr(b.ln1, "w", None) is not None for b in self.blocks):
            unapplied.append("fold_ln (this model was loaded with fold_ln=False; reload with fold_ln=True)")
        if fold_value_biases and any(bool(b.attn.b_V.detach().abs().max() > 0) for b in self.blocks):
            unapplied.append("fold_value_biases (value biases stay in b_V)")
        if refactor_factored_attn_matrices:
            unapplied.append("refactor_factored_attn_matrices (rotary attention has no such refactoring)")
        if unapplied:
            warnings.warn(
                "enable_compatibility_mode leaves the weights as loaded: not applied: "
                + "; ".join(unapplied),
                stacklevel=2,
            )

    # ------------------------------------------------------------------ parameters, TL style
    def tl_parameters(self) -> Dict[str, torch.Tensor]:
        """Parameters under TransformerLens names ('blocks.0.attn.W_Q', ...); kv weights as stored (kv
        heads)."""
        return dict(self.named_parameters())

    def tl_named_parameters(self) -> Iterator[Tuple[str, torch.Tensor]]:
        return iter(self.tl_parameters().items())

    def _expand_kv(self, w: torch.Tensor) -> torch.Tensor:
        """[layer, n_kv_heads, ...] -> [layer, n_heads, ...]: query head h reads kv head h // group."""
        return w.repeat_interleave(self.cfg.n_heads // self.cfg.n_key_value_heads, dim=1)

    _W_K = stacked_weight("attn.W_K", "[layer, kv_head, d_model, d_head]: key weights as stored")
    _W_V = stacked_weight("attn.W_V", "[layer, kv_head, d_model, d_head]: value weights as stored")
    _b_K = stacked_weight("attn.b_K", "[layer, kv_head, d_head]")
    _b_V = stacked_weight("attn.b_V", "[layer, kv_head, d_head]")
    W_K = _kv_expanded(
        "_W_K",
        "[layer, head, d_model, d_head]: key weights repeated to n_heads (grouped-query attention), as "
        "TransformerLens exposes them.",
    )
    W_V = _kv_expanded("_W_V", "[layer, head, d_model, d_head]")
    b_K = _kv_expanded("_b_K", "[layer, head, d_head]")
    b_V = _kv_expanded("_b_V", "[layer, head, d_head]")
    b_Q = stacked_weight("attn.b_Q", "[layer, head, d_head]")
    b_O = stacked_weight("attn.b_O", "[layer, d_model]")
    b_in = stacked_weight("mlp.b_in", "[layer, d_mlp]")
    b_out = stacked_weight("mlp.b_out", "[layer, d_model]")

    @property
    def QK(self) -> FactoredMatrix:
        """W_Q W_K^T per layer and head, [layer, head, d_model, d_model] (before RoPE)."""
        return FactoredMatrix(self.W_Q, self.W_K.transpose(-2, -1))

    @property
    def OV(self) -> FactoredMatrix:
        """W_V W_O per layer and head, [layer, head, d_model, d_model]."""
        return FactoredMatrix(self.W_V, self.W_O)


# ------------------------------------------------------------------------------------------ hook aliases
def tl_act_key(key: Any, n_layers: int) -> Optional[str]:
    """The full hook name TransformerLens's `ActivationCache.__getitem__` makes of `key` (a name, a shorthand
    such as "resid_pre3", or a (name, layer, layer_type) tuple with negative layers counted from the end)."""
    if isinstance(key, str):
        return tl_utils.get_act_name(key)
    if isinstance(key, tuple) and key and isinstance(key[0], str):
        key = list(key)
        if len(key) > 1 and isinstance(key[1], int) and key[1] < 0:
            key[1] += n_layers
        return tl_utils.get_act_name(*key)
    return None


class AliasedActivationCache(ActivationCache):
    """`transformer_lens.ActivationCache` that also answers TransformerLens names with an exact analogue here
    (`model.hook_aliases`: e.g. `cache["in", 0]`, `cache["blocks.0.attn.hook_q_input"]`)."""

    def __getitem__(self, key: Any) -> torch.Tensor:
        try:
            return super().__getitem__(key)
        except KeyError:
            name = tl_act_key(key, self.model.cfg.n_layers)
            target = getattr(self.model, "hook_aliases", {}).get(name)
            if target is None or target not in self.cache_dict:
                raise
            return self.cache_dict[target]

    def __contains__(self, key: Any) -> bool:
        """True exactly when `cache[key]` finds an activation: a hook name, a TransformerLens alias
        (`"blocks.1.hook_q_input"`), or a (name, layer) key (TransformerLens's plain `in` iterates the hook
        names only, so an alias that looks up would not be "in" the cache)."""
        if isinstance(key, str) and key in self.cache_dict:
            return True
        try:
            self[key]
        except (KeyError, TypeError, ValueError, IndexError):
            return False
        return True


def resolve_names_filter(names_filter: Any, aliases: Dict[str, str]) -> Any:
    """A TransformerLens `names_filter` with alias names replaced by the hook names they stand for."""
    if isinstance(names_filter, str):
        return aliases.get(names_filter, names_filter)
    if isinstance(names_filter, (list, tuple)):
        return [aliases.get(n, n) if isinstance(n, str) else n for n in names_filter]
    return names_filter


# ------------------------------------------------------------------------------------------ patching check
# id(cached tensor or cache) -> (weak reference, attention mask of the run it was cached from).
_CACHE_MASKS: Dict[int, Tuple[weakref.ref, torch.Tensor]] = {}


def record_cache_mask(cache: ActivationCache, mask: torch.Tensor) -> None:
    """Remember which padded batch (its mask) the activations of `cache` came from."""
    for key in [k for k, (ref, _) in _CACHE_MASKS.items() if ref() is None]:
        del _CACHE_MASKS[key]
    mask = mask.detach()
    for obj in [cache, *cache.cache_dict.values()]:
        _CACHE_MASKS[id(obj)] = (weakref.ref(obj), mask)


def cached_mask_of(obj: Any) -> Optional[torch.Tensor]:
    entry = _CACHE_MASKS.get(id(obj))
    return entry[1] if entry is not None and entry[0]() is obj else None


def hook_source_masks(fn: Any) -> List[torch.Tensor]:
    """The masks of cached activations a hook carries: in a `functools.partial`'s arguments (as
    `transformer_lens.patching` binds `clean_activation=`), in the function's closure, or in the globals its
    code names (a tutorial's `clean_cache`)."""
    found: List[Any] = []
    while isinstance(fn, functools.partial):
        found += list(fn.args) + list(fn.keywords.values())
        fn = fn.func
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            found.append(cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    code, names = getattr(fn, "__code__", None), getattr(fn, "__globals__", {})
    found += [names[n] for n in (code.co_names if code is not None else ()) if n in names]
    masks = [cached_mask_of(obj) for obj in found if isinstance(obj, (torch.Tensor, ActivationCache))]
    return [m for m in masks if m is not None]


def patching_caller_masks(depth: int = 8) -> List[torch.Tensor]:
    """The masks of cached activations held by a calling `transformer_lens.patching` function (e.g.
    `get_act_patch_direct_path`'s `clean_cache`, whose derived write its hook adds)."""
    frame, masks = sys._getframe(1), []
    for _ in range(depth):
        frame = frame.f_back
        if frame is None:
            break
        if frame.f_globals.get("__name__") == "transformer_lens.patching":
            masks += [
                m
                for v in frame.f_locals.values()
                if isinstance(v, ActivationCache)
                for m in [cached_mask_of(v)]
                if m is not None
            ]
    return masks


def misaligned_rows(source: torch.Tensor, target: torch.Tensor) -> Optional[torch.Tensor]:
    """[batch, pos] bool: where one batch has a pad and the other a real token (None when shapes differ)."""
    if source.shape != target.shape:
        return None
    return source.to(target.device).bool() != target.bool()


def check_patch_alignment(model: Any, fwd_hooks: Any, run_mask: Optional[torch.Tensor], run_key: Any) -> list:
    """`fwd_hooks` with each hook that writes cached activations of a differently padded batch wrapped so
    that it warns (once per sweep: consecutive patches of one activation kind between the same two batches)
    when it changes a position where one batch has a pad and the other a real token."""
    if run_mask is None:
        return list(fwd_hooks)
    out, callers = [], patching_caller_masks()
    for name, fn in fwd_hooks:
        masks = hook_source_masks(fn) + callers
        sources = [m for m in masks if not torch.equal(m.to(run_mask.device), run_mask)]
        if sources:
            fn = _aligned_patch_hook(model, fn, sources[0], run_mask, run_key)
        out.append((name, fn))
    return out


def _aligned_patch_hook(model: Any, fn: Any, source: torch.Tensor, target: torch.Tensor, run_key: Any):
    bad_positions = misaligned_rows(source, target)
    # one warning per sweep: consecutive patches of one activation kind between the same two batches (the
    # objects themselves are kept, so that no id is reused while the key is)
    key = (source, run_key)

    def checked(activation: torch.Tensor, hook: Any):
        before = activation.detach().clone()
        result = fn(activation, hook=hook)
        after = activation if result is None else result
        if bad_positions is None:
            where = "the clean and corrupted batches differ in length"
        else:
            axis = hooks.query_axis(hook.name)
            changed = (after.detach() != before).movedim(axis, 1)
            changed = changed.reshape(changed.shape[0], changed.shape[1], -1)
            hit = changed.any(-1) & bad_positions.to(changed.device)
            if not bool(hit.any()):
                return result
            cols = (bad_positions.any(0).nonzero().flatten() - bad_positions.shape[1]).tolist()
            where = (
                f"{len(cols)} of {bad_positions.shape[1]} positions (e.g. {cols[:4]}, counted from the "
                "end) are padding in one batch and real tokens in the other"
            )
        last, kind = model.__dict__.get("_misaligned_warned"), hooks.kind_of(hook.name)
        if last is None or last[0] is not key[0] or last[1] is not key[1] or last[2] != kind:
            model.__dict__["_misaligned_warned"] = (*key, kind)
            warnings.warn(
                f"{hook.name}: the patch writes activations cached from a differently padded batch, and "
                f"{where}; pad activations are patched into real tokens (or the reverse). The readout "
                "column (-1) is aligned; for other positions use reward_lens.patch(model, pairs, "
                "positions='prompt' or 'all'), which patches token k onto token k",
                stacklevel=2,
            )
        return result

    return checked
