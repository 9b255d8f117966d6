"""All-position EAP over the columns where a pair differs, and input-interpolating EAP-IG (`eap-ig-inputs`):

- EAP (the shared-prefix pass: the shared columns once without gradients, per-head input gradients from
  projection leaves through ln1's VJP) equals the straight-through pass over whole sequences at the target
  (`line_scores_all` with its one point at 0, no shared prefix, per-head split inputs) on Llama, Mistral
  (window 4), Qwen3 (qk-norm) and Gemma-2 (post-norms, soft-caps) tiny models, both padding sides, pairs
  differing from their first column, their middle, their last, or not at all: scores to 1e-5 relative,
  rewards to 1e-5; on the same models eap-ig-inputs' first point is the source's own run (rewards equal to
  EAP's, 1e-5) and chunking its points (max_rows) leaves the scores unchanged (1e-5);
- eap-ig-inputs equals an independent computation: for each point, a hooked forward of the target ids
  whose hook_embed is replaced by the interpolated embedding, zero leaves added at every split q/k/v input,
  MLP input and the final residual, autograd; Δ from two run_with_cache captures (demo organism, 2
  minimal pairs, steps 3; EAP the same at the point 0): 1e-4 relative;
- steps=1 is the gradient at the source's input alone, i.e. minus EAP in the other mode (1e-5); the points
  are Hanna et al.'s (1, (m-1)/m, ..., 1/m of the way to the source);
- eap-ig-inputs with positions="readout" is refused in one line.
"""

from functools import partial

import pytest
import torch
from helpers import tiny_hf_model
from test_gemma2 import tiny_gemma2

import reward_lens
from reward_lens import HookedRewardModel, edge_attribution
from reward_lens.data.pairs import TokenPair
from reward_lens.demo.organisms import minimal_pairs
from reward_lens.instruments.circuits.edges import line_scores_all, shared_prefix_scores, step_points
from reward_lens.instruments.circuits.graph import nodes
from reward_lens.instruments.patching.path import token_aligned_batches
from reward_lens.model.frozen import frozen_weights
from reward_lens.model.hooks import act_name


def _pairs(vocab: int, seed: int = 0):
    """Token-aligned pairs of different lengths: differing from the first column, in the middle, at the
    last token only, and not at all."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n, lo in ((9, 0), (12, 6), (7, 6), (10, None)):
        chosen = torch.randint(1, vocab, (n,), generator=g)
        rejected = chosen.clone()
        if lo is not None:
            rejected[lo:] = torch.randint(1, vocab, (n - lo,), generator=g)
        out.append(TokenPair(chosen, rejected, prompt_len=1))
    return out


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3", "gemma2"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_eap_equals_the_whole_sequence_straight_through_pass(arch, side):
    hf = tiny_gemma2() if arch == "gemma2" else tiny_hf_model(arch)
    model = HookedRewardModel.from_hf_model(hf, fold_ln=arch not in ("mistral", "gemma2"))
    snodes, rnodes = nodes(model, None, None)
    pairs = _pairs(hf.config.vocab_size)
    with frozen_weights(model):
        for batch in token_aligned_batches(model, pairs, 4, False, side):
            tok, stok = batch.chosen, batch.rejected
            args = (model, tok, stok, snodes, rnodes)
            fast, ft, fs = shared_prefix_scores(*args, "eap", torch.zeros(1), 256)
            ref, rt, rs = line_scores_all(*args, "eap-ig-joint", torch.zeros(1), 256)
            scale = max(1.0, float(ref.abs().max()))
            assert (fast - ref).abs().max() <= 1e-5 * scale, (fast - ref).abs().max()
            assert (ft - rt).abs().max() < 1e-5 and (fs - rs).abs().max() < 1e-5
            assert fast[3].abs().max() == 0  # no difference: every sender's Δ is 0
            assert fast[:3].abs().max() > 1e-3
            # eap-ig-inputs: its first point is the source's own run (the same rewards and Δ as EAP's source
            # pass), and the points' chunking does not change the scores
            points = step_points("eap-ig-inputs", 3)
            whole, wt, ws = shared_prefix_scores(*args, "eap-ig-inputs", points, 256)
            one_by_one, _, _ = shared_prefix_scores(*args, "eap-ig-inputs", points, 4)
            assert (wt - ft).abs().max() < 1e-5 and (ws - fs).abs().max() < 1e-5
            assert (whole - one_by_one).abs().max() <= 1e-5 * max(1.0, float(whole.abs().max()))
            assert whole[3].abs().max() == 0 and (whole - fast).abs().max() > 1e-4


@pytest.fixture(scope="module")
def demo():
    model = reward_lens.load_demo_model()
    return model, minimal_pairs(model, 2)


def _outputs(model, cache):
    """Every default sender's output at every position [S, T, d] from a full cache (embed, heads, MLPs)."""
    out = [cache["hook_embed"][0]]
    for l in range(model.cfg.n_layers):
        z = cache[act_name("z", l)][0]
        out += [z[:, h] @ model.blocks[l].attn.W_O[h] for h in range(model.cfg.n_heads)]
        out.append(cache[act_name("mlp_out", l)][0])
    return torch.stack(out)


def _hooked_scores(model, pair, alphas):
    """[S, R] scores of one pair (noising: target chosen, source rejected) by hooks alone: the mean over
    `alphas` of the gradients at the input embedding e_t + alpha (e_s - e_t), times Δ."""
    L, n, nkv = model.cfg.n_layers, model.cfg.n_heads, model.cfg.n_key_value_heads
    tc = model.to_tokens([pair.prompt], [pair.chosen])
    tr = model.to_tokens([pair.prompt], [pair.rejected])
    _, c_cache = model.run_with_cache(tc["input_ids"], tc["attention_mask"])
    _, r_cache = model.run_with_cache(tr["input_ids"], tr["attention_mask"])
    delta = (_outputs(model, r_cache) - _outputs(model, c_cache)).detach()  # [S, T, d]
    e_t, e_s = c_cache["hook_embed"], r_cache["hook_embed"]
    names = []
    for l in range(L):
        names += [(f"blocks.{l}.hook_q_input", n), (f"blocks.{l}.hook_k_input", nkv)]
        names += [(f"blocks.{l}.hook_v_input", nkv), (f"blocks.{l}.hook_mlp_in", None)]
    names.append((act_name("resid_post", L - 1), None))
    total = None
    model.set_use_split_qkv_input(True)
    model.set_use_hook_mlp_in(True)
    try:
        for a in alphas:
            leaves = {}

            def add(t, hook, name):
                leaves[name] = torch.zeros_like(t, requires_grad=True)
                return t + leaves[name]

            def embed(t, hook, a=a):
                return e_t + a * (e_s - e_t)

            with torch.enable_grad():
                hooks = [("hook_embed", embed)] + [(name, partial(add, name=name)) for name, _ in names]
                reward = model.run_with_hooks(tc["input_ids"], tc["attention_mask"], fwd_hooks=hooks)
                grads = torch.autograd.grad(reward.sum(), [leaves[name] for name, _ in names])
            cols = []
            for (_, heads), g in zip(names, grads):
                cols += [g[0, :, h] for h in range(heads)] if heads else [g[0]]
            g = torch.stack(cols)  # [R, T, d] in the default receiver order
            total = g if total is None else total + g
    finally:
        model.set_use_split_qkv_input(False)
        model.set_use_hook_mlp_in(False)
    return torch.einsum("std,rtd->sr", delta, total / len(alphas))


@pytest.mark.parametrize("method,steps", [("eap-ig-inputs", 3), ("eap", 1)])
def test_against_hooked_forwards(demo, method, steps):
    model, pairs = demo
    res = edge_attribution(model, pairs, method=method, steps=steps, positions="all")
    assert res.method == method and res.steps == steps
    alphas = step_points(method, steps).tolist()
    assert alphas == pytest.approx([1.0, 2 / 3, 1 / 3] if method == "eap-ig-inputs" else [0.0])
    snodes, rnodes = nodes(model, None, None)
    assert [r.kind for r in rnodes[:4]] == ["q", "q", "q", "q"]  # the receiver order _hooked_scores builds
    for i, pair in enumerate(pairs):
        ref = _hooked_scores(model, pair, alphas)
        got = res.scores[i]
        ok = torch.isfinite(got)
        assert int(ok.sum()) > 300
        scale = float(ref[ok].abs().max())
        assert (got[ok] - ref[ok]).abs().max() <= 1e-4 * scale, (got[ok] - ref[ok]).abs().max()


def test_one_step_is_the_gradient_at_the_source(demo):
    """steps=1: the single point is the source's own input, so noising eap-ig-inputs = -(denoising EAP)."""
    model, pairs = demo
    one = edge_attribution(model, pairs, method="eap-ig-inputs", steps=1, positions="all")
    eap = edge_attribution(model, pairs, method="eap", mode="denoising", positions="all")
    ok = torch.isfinite(one.scores)
    assert (one.scores[ok] + eap.scores[ok]).abs().max() <= 1e-5 * float(eap.scores[ok].abs().max())
    assert torch.allclose(one.clean_chosen, eap.clean_chosen) and torch.allclose(
        one.clean_rejected, eap.clean_rejected
    )


def test_inputs_method_needs_every_position(demo):
    model, pairs = demo
    with pytest.raises(ValueError, match="eap-ig-inputs.*positions='all'"):
        edge_attribution(model, pairs, method="eap-ig-inputs")
