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

from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

import torch
from jaxtyping import Float, Int
from transformer_lens import FactoredMatrix

RETURN_TYPES = ("reward", "logits", None)

INPUT_FORMAT_DEFAULT = "auto"


def check_forward_input(input: Any, return_type: Optional[str]) -> None:
    """TL's forward takes text and return_type="loss"; a reward model takes token ids and has no loss."""
    if isinstance(input, str) or (isinstance(input, (list, tuple)) and input and isinstance(input[0], str)):
        raise TypeError(
            "the model takes token ids, not text: tokenise (prompt, response) pairs with "
            "model.to_tokens(prompts, responses) and pass batch['input_ids'] (a reward needs both parts)"
        )
    if return_type not in RETURN_TYPES:
        hint = " (a reward model has no language-modelling loss; use the reward as your metric)" if return_type == "loss" else ""
        raise ValueError(f"return_type must be 'reward', 'logits' (the same: the reward) or None, got {return_type!r}{hint}")


def leading_pad_mask(input_ids: Int[torch.Tensor, "batch pos"], pad_token_id: Optional[int]) -> torch.Tensor:
    """1 from each row's first non-pad token on, 0 on the leading run of pad tokens (left padding)."""
    if pad_token_id is None:
        return torch.ones_like(input_ids, dtype=torch.long)
    return ((input_ids != pad_token_id).long().cumsum(-1) > 0).long()


class TransformerLensConveniences:
    """Mixin for `HookedRewardModel`: TL's token helpers, weight stacks and mask-free padded batches."""

    # ------------------------------------------------------------------ tokens <-> strings
    def _tokenizer_or_error(self):
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer; set model.tokenizer = AutoTokenizer.from_pretrained(...)")
        return self.tokenizer

    def _text_ids(self, text: str, prepend_bos: Optional[bool]) -> torch.Tensor:
        tok = self._tokenizer_or_error()
        special = True if prepend_bos is None else bool(prepend_bos)
        return torch.tensor(tok(text, add_special_tokens=special)["input_ids"], dtype=torch.long)

    def to_str_tokens(
        self, input: Union[str, torch.Tensor, List], prepend_bos: Optional[bool] = None, padding_side: Optional[str] = None
    ) -> Union[List[str], List[List[str]]]:
        """Each token as a string. A str is tokenised as a whole text (the tokenizer's special tokens
        unless `prepend_bos=False`); a 2-D tensor gives one list per row (pads included); a list maps."""
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
        """Decode ids: one string for a 1-D input, a list for a 2-D batch (pads are decoded too)."""
        tok = self._tokenizer_or_error()
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
            raise ValueError(f"{string!r} is {ids.numel()} tokens, not a single token: {self.to_str_tokens(ids)}")
        return int(ids.item())

    def get_token_position(
        self,
        single_token: Union[str, int],
        input: Union[str, torch.Tensor],
        mode: str = "first",
        prepend_bos: Optional[bool] = None,
        padding_side: Optional[str] = None,
    ) -> int:
        """Position of `single_token` in `input` (a text, [pos] or [1, pos] ids); mode "first" or "last"."""
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
        self, tokens: Union[Int[torch.Tensor, "batch pos"], Int[torch.Tensor, "pos"]]
    ) -> Union[Float[torch.Tensor, "batch d_model"], Float[torch.Tensor, "d_model"]]:
        """The reward direction of each sequence of `tokens` (the input ids), TL's unembedding-column analogue:
        reward = direction . (resid_final[readout] / ln_final.hook_scale) + reward_bias, so
        `cache.logit_attrs(stack, tokens, pos_slice=-1)` sums to reward - reward_bias. Per sequence for
        ArmoRM (the prompt-conditioned direction); the one `reward_direction` for a linear head."""
        if not isinstance(tokens, torch.Tensor) or tokens.dim() not in (1, 2):
            raise TypeError(
                "tokens_to_residual_directions takes the input ids ([batch, pos] or [pos]): a reward model has one "
                "output direction per sequence, not one per vocabulary token"
            )
        ids = tokens if tokens.dim() == 2 else tokens[None]
        directions = self.reward_direction_for(ids.to(self.cfg.device))
        return directions if tokens.dim() == 2 else directions[0]

    # ------------------------------------------------------------------ parameters, TL style
    def tl_parameters(self) -> Dict[str, torch.Tensor]:
        """Parameters under TransformerLens names ('blocks.0.attn.W_Q', ...); kv weights as stored (kv heads)."""
        return dict(self.named_parameters())

    def tl_named_parameters(self) -> Iterator[Tuple[str, torch.Tensor]]:
        return iter(self.tl_parameters().items())

    def _stack_blocks(self, path: str) -> torch.Tensor:
        first, attr = path.split(".")
        return torch.stack([getattr(getattr(block, first), attr) for block in self.blocks], dim=0)

    def _expand_kv(self, w: torch.Tensor) -> torch.Tensor:
        """[layer, n_kv_heads, ...] -> [layer, n_heads, ...]: query head h reads kv head h // group."""
        return w.repeat_interleave(self.cfg.n_heads // self.cfg.n_key_value_heads, dim=1)

    @property
    def _W_K(self) -> Float[torch.Tensor, "layer kv_head d_model d_head"]:
        return self._stack_blocks("attn.W_K")

    @property
    def _W_V(self) -> Float[torch.Tensor, "layer kv_head d_model d_head"]:
        return self._stack_blocks("attn.W_V")

    @property
    def _b_K(self) -> Float[torch.Tensor, "layer kv_head d_head"]:
        return self._stack_blocks("attn.b_K")

    @property
    def _b_V(self) -> Float[torch.Tensor, "layer kv_head d_head"]:
        return self._stack_blocks("attn.b_V")

    @property
    def W_K(self) -> Float[torch.Tensor, "layer head d_model d_head"]:
        """Key weights repeated to n_heads (grouped-query attention), as TransformerLens exposes them."""
        return self._expand_kv(self._W_K)

    @property
    def W_V(self) -> Float[torch.Tensor, "layer head d_model d_head"]:
        return self._expand_kv(self._W_V)

    @property
    def b_K(self) -> Float[torch.Tensor, "layer head d_head"]:
        return self._expand_kv(self._b_K)

    @property
    def b_V(self) -> Float[torch.Tensor, "layer head d_head"]:
        return self._expand_kv(self._b_V)

    @property
    def b_Q(self) -> Float[torch.Tensor, "layer head d_head"]:
        return self._stack_blocks("attn.b_Q")

    @property
    def b_O(self) -> Float[torch.Tensor, "layer d_model"]:
        return self._stack_blocks("attn.b_O")

    @property
    def b_in(self) -> Float[torch.Tensor, "layer d_mlp"]:
        return self._stack_blocks("mlp.b_in")

    @property
    def b_out(self) -> Float[torch.Tensor, "layer d_model"]:
        return self._stack_blocks("mlp.b_out")

    @property
    def QK(self) -> FactoredMatrix:
        """W_Q W_K^T per layer and head, [layer, head, d_model, d_model] (before RoPE)."""
        return FactoredMatrix(self.W_Q, self.W_K.transpose(-2, -1))

    @property
    def OV(self) -> FactoredMatrix:
        """W_V W_O per layer and head, [layer, head, d_model, d_model]."""
        return FactoredMatrix(self.W_V, self.W_O)
