"""Suffixes over a cached prefix (`reward_lens.model.suffix`): equal to full forwards of prefix + suffix on
Llama-, Mistral- (sliding window 4), Qwen3- (qk-norm) and Gemma-2-style (post-norms, soft-caps, windows)
tiny models, fp32, for ids and for one-hot embeddings (whose gradient is the full forward's too)."""

import pytest
import torch
from helpers import tiny_hf_model
from test_gemma2 import tiny_gemma2

from reward_lens import HookedRewardModel

TOL = 1e-5


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen3", "gemma2"])
def model(request):
    if request.param == "gemma2":
        return HookedRewardModel.from_hf_model(tiny_gemma2(), fold_ln=False)
    return HookedRewardModel.from_hf_model(tiny_hf_model(request.param), fold_ln=request.param != "mistral")


def rows(model, P=7, S=5, n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    low = 1 if model.cfg.pad_token_id == 0 else 0
    prefix = torch.randint(low, model.cfg.d_vocab, (1, P), generator=g)
    suffix = torch.randint(low, model.cfg.d_vocab, (n, S), generator=g)
    suffix[suffix == model.cfg.pad_token_id] = low + 1
    prefix[prefix == model.cfg.pad_token_id] = low + 1
    return prefix, suffix


def full(model, prefix, suffix):
    ids = torch.cat([prefix.expand(len(suffix), -1), suffix], 1)
    return model(ids, attention_mask=torch.ones_like(ids))


@pytest.mark.parametrize("P,S", [(7, 5), (1, 3), (9, 1)])
def test_suffix_rewards_equal_full_forwards(model, P, S):
    prefix, suffix = rows(model, P, S)
    want = full(model, prefix, suffix)
    got = model.suffix_rewards(model.prefix_cache(prefix), suffix)
    assert got.shape == want.shape
    assert (got - want).abs().max() / want.abs().max().clamp(min=1) < TOL


def test_one_hot_embeddings_and_their_gradient(model):
    prefix, suffix = rows(model)
    one_hot = torch.nn.functional.one_hot(suffix, model.cfg.d_vocab).float().requires_grad_(True)
    got = model.suffix_rewards(model.prefix_cache(prefix), suffix_embeds=model.embed_one_hot(one_hot))
    want = full(model, prefix, suffix)
    assert (got - want).abs().max() / want.abs().max().clamp(min=1) < TOL
    (g_fast,) = torch.autograd.grad(got.sum(), one_hot)
    # the reference gradient: a full forward whose embedding hook is replaced by one_hot @ W_E
    ids = torch.cat([prefix.expand(len(suffix), -1), suffix], 1)
    ref = one_hot.detach().clone().requires_grad_(True)

    def swap(embed, hook):
        return torch.cat([embed[:, : prefix.shape[1]], model.embed_one_hot(ref)], 1)

    r = model.run_with_hooks(ids, torch.ones_like(ids), fwd_hooks=[("hook_embed", swap)])
    (g_ref,) = torch.autograd.grad(r.sum(), ref)
    assert (g_fast - g_ref).abs().max() / g_ref.abs().max() < 1e-4
