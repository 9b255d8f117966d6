"""The model recomputing its readout token alone (`reward_lens.model.recompute`), against independent
computations on Llama- (llama3 RoPE), Mistral- (sliding window 4), Qwen3- (qk-norm) and Gemma-2-style
(post-norms, soft-caps, alternating windows) tiny models, fp32, both padding sides (right padding: the
readout is not the last position):

- the context's positional state is the full forward's (position ids, RoPE tables at the readout, the
  positions the readout sees under each window);
- no substitution: recomputing from any block and stage gives the clean run's final residual at the
  readout (1e-5);
- per-head q/k/v inputs: equal to a full forward whose hook_q / hook_k / hook_v at the readout hold the
  projections of the substituted inputs (1e-5); an MLP input shift: equal to two full forwards (compute
  the MLP's output from the shifted input, then write it in).
"""

import pytest
import torch
from helpers import padded_batch, tiny_hf_model
from test_gemma2 import tiny_gemma2

from reward_lens import HookedRewardModel
from reward_lens.model.hooks import act_name, final_resid_name
from reward_lens.model.recompute import MID, PRE, ReadoutEntry, readout_context

TOL = 1e-5
LENGTHS = [12, 7, 10, 3]


def build(arch: str) -> HookedRewardModel:
    if arch == "gemma2":
        return HookedRewardModel.from_hf_model(tiny_gemma2(), fold_ln=False)
    return HookedRewardModel.from_hf_model(tiny_hf_model(arch), fold_ln=arch != "mistral")


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen3", "gemma2"])
def model(request):
    return build(request.param)


@pytest.fixture(params=["right", "left"])
def batch(request, model):
    ids, mask = padded_batch(LENGTHS, request.param)
    _, cache = model.run_with_cache(ids, attention_mask=mask)
    readout = model.readout_positions(ids, mask)
    return ids, mask, readout, cache


def at_readout(t: torch.Tensor, readout: torch.Tensor) -> torch.Tensor:
    return t[torch.arange(t.shape[0]), readout]


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    err = ((got - want).abs().max() / want.abs().max().clamp(min=1.0)).item()
    assert err < TOL, f"{what}: differ by {err:.2e}"


def test_context_holds_the_forwards_positional_state(model, batch):
    ids, mask, readout, cache = batch
    ctx = model.readout_context(ids, mask)
    assert torch.equal(ctx.readout, readout)
    T = ids.shape[1]
    for b in range(ids.shape[0]):
        attended = mask[b].nonzero().flatten()
        assert torch.equal(ctx.position_ids[b, attended], torch.arange(len(attended)))
    cos, sin = model.rotary(ctx.position_ids, model.cfg.dtype)
    assert torch.equal(ctx.cos[:, 0], at_readout(cos, readout)) and torch.equal(
        ctx.sin[:, 0], at_readout(sin, readout)
    )
    for window in set(model.cfg.window_sizes):
        for b in range(ids.shape[0]):
            r = int(readout[b])
            want = [t for t in range(T) if mask[b, t] and t < r and (window is None or t > r - window)]
            assert ctx.sees[window][b].nonzero().flatten().tolist() == want
    windows = [w for w in model.cfg.window_sizes if w is not None]
    if windows:  # the window really cuts some row's view (the 12-token row reads at position 11)
        assert ctx.sees[min(windows)].sum() < (mask.bool() & (torch.arange(T) < readout[:, None])).sum()
    for layer in range(model.cfg.n_layers):  # the clean forward's post-RoPE keys and values (the cached run
        k, v = ctx.kv[
            layer
        ]  # hooks every pattern, so it takes the explicit attention: equal within rounding)
        assert_close(k, cache[act_name("rot_k", layer)], f"keys {layer}")
        assert_close(v, cache[act_name("v", layer)], f"values {layer}")


def test_no_substitution_gives_the_clean_final_residual(model, batch):
    ids, mask, readout, cache = batch
    L = model.cfg.n_layers
    ctx = model.readout_context(ids, mask)
    final = at_readout(cache[final_resid_name(L)], readout)
    entries = [ReadoutEntry(L, PRE, final)]
    for layer in range(L):
        pre = at_readout(cache[act_name("resid_pre", layer)], readout)
        mid = at_readout(cache[act_name("resid_mid", layer)], readout)
        entries += [ReadoutEntry(layer, MID, mid), ReadoutEntry(layer, PRE, pre)]  # unsorted on purpose
        assert_close(model.readout_with_inputs(ctx, layer, pre[:, None])[:, 0], final, f"from block {layer}")
    swept = model.readout_sweep(ctx, entries)
    assert swept.shape == (ids.shape[0], len(entries), model.cfg.d_model)
    for j, e in enumerate(entries):
        assert_close(swept[:, j], final, f"sweep from ({e.layer}, {e.stage})")


def test_sweep_layer_changes_are_the_clean_blocks_outputs(model, batch):
    """With no substitution each entry's per-block change is the clean run's attention + MLP output at
    the readout from where it resumes (the MLP's alone in its entry block at MID), zero before it."""
    ids, mask, readout, cache = batch
    L = model.cfg.n_layers
    ctx = model.readout_context(ids, mask)
    entries = []
    for layer in range(L):
        entries += [
            ReadoutEntry(layer, MID, at_readout(cache[act_name("resid_mid", layer)], readout)),
            ReadoutEntry(layer, PRE, at_readout(cache[act_name("resid_pre", layer)], readout)),
        ]
    final, changes = model.readout_sweep(ctx, entries, layer_changes=True)
    assert torch.equal(final, model.readout_sweep(ctx, entries))
    assert changes.shape == (ids.shape[0], len(entries), L, model.cfg.d_model)
    for j, e in enumerate(entries):
        for layer in range(L):
            attn = at_readout(cache[act_name("attn_out", layer)], readout)
            mlp = at_readout(cache[act_name("mlp_out", layer)], readout)
            if layer < e.layer:
                assert changes[:, j, layer].abs().max() == 0
            else:
                want = mlp if (layer == e.layer and e.stage == MID) else attn + mlp
                assert_close(changes[:, j, layer], want, f"block {layer} of entry ({e.layer}, {e.stage})")
        assert_close(e.state + changes[:, j].sum(1), final[:, j], f"entry ({e.layer}, {e.stage}) adds up")


def run_final(model, ids, mask, readout, hooks):
    """The final residual at the readout of a full forward with `hooks`."""
    kept = {}

    def keep(t, hook):
        kept["final"] = at_readout(t, readout).clone()

    name = final_resid_name(model.cfg.n_layers)
    model.run_with_hooks(ids, mask, readout_positions=readout, fwd_hooks=list(hooks) + [(name, keep)])
    return kept["final"]


def writer(readout, head, value):
    def write(t, hook):
        t = t.clone()
        t[torch.arange(t.shape[0]), readout, head] = value.to(t.dtype)
        return t

    return write


@pytest.mark.parametrize("layer", [0, -1])
def test_per_head_inputs_equal_hooked_full_forwards(model, batch, layer):
    ids, mask, readout, cache = batch
    cfg = model.cfg
    layer = layer % cfg.n_layers
    attn, ln1 = model.blocks[layer].attn, model.blocks[layer].ln1
    ctx = model.readout_context(ids, mask)
    pre = at_readout(cache[act_name("resid_pre", layer)], readout)  # [B, d]
    B, P = pre.shape[0], 3
    g = torch.Generator().manual_seed(layer)
    scale = pre.norm(dim=-1, keepdim=True) / cfg.d_model**0.5
    new = {
        kind: pre[:, None] + scale[:, None] * torch.randn(B, P, cfg.d_model, generator=g) for kind in "qkv"
    }
    heads = {"q": [0, cfg.n_heads - 1, 1], "k": [0, 1, cfg.n_key_value_heads - 1], "v": [1, 0, 0]}
    inputs = {}
    for kind, n in (("q", cfg.n_heads), ("k", cfg.n_key_value_heads), ("v", cfg.n_key_value_heads)):
        x = pre[:, None, None].expand(B, P, n, cfg.d_model).clone()
        for p, h in enumerate(heads[kind]):
            x[:, p, h] = new[kind][:, p]
        inputs[f"{kind}_input"] = x
    got = model.readout_with_inputs(ctx, layer, pre[:, None].expand(B, P, -1), **inputs)
    clean = at_readout(cache[final_resid_name(cfg.n_layers)], readout)
    assert (got - clean[:, None]).abs().max() > 1e-2  # the substitutions really change the readout
    weights = {"q": (attn.W_Q, attn.b_Q), "k": (attn.W_K, attn.b_K), "v": (attn.W_V, attn.b_V)}
    for p in range(P):
        hooks = []
        for kind, (W, b) in weights.items():
            h = heads[kind][p]
            value = ln1(new[kind][:, p]) @ W[h] + b[h]  # what hook_{q,k,v} holds for that head's input
            hooks.append((act_name(kind, layer), writer(readout, h, value)))
        assert_close(
            got[:, p], run_final(model, ids, mask, readout, hooks), f"block {layer}, alternative {p}"
        )


def test_mlp_input_shift_equals_hooked_full_forwards(model, batch):
    ids, mask, readout, cache = batch
    cfg = model.cfg
    layer = 1
    ctx = model.readout_context(ids, mask)
    pre = at_readout(cache[act_name("resid_pre", layer)], readout)
    B, P = pre.shape[0], 2
    delta = torch.randn(B, P, cfg.d_model, generator=torch.Generator().manual_seed(1))
    got = model.readout_with_inputs(ctx, layer, pre[:, None].expand(B, P, -1), mlp_delta=delta)
    assert (got - at_readout(cache[final_resid_name(cfg.n_layers)], readout)[:, None]).abs().max() > 1e-2
    rows = torch.arange(B)
    for p in range(P):
        kept = {}

        def shift(t, hook, d=delta[:, p]):
            t = t.clone()
            t[rows, readout] += d
            return t

        def keep(t, hook, kept=kept):
            kept["mlp_out"] = at_readout(t, readout).clone()

        model.run_with_hooks(
            ids, mask, fwd_hooks=[(act_name("resid_mid", layer), shift), (act_name("mlp_out", layer), keep)]
        )
        write = writer(readout, slice(None), kept["mlp_out"])
        want = run_final(model, ids, mask, readout, [(act_name("mlp_out", layer), write)])
        assert_close(got[:, p], want, f"MLP shift {p}")


def test_one_readout_step_serves_shared_and_per_head_inputs(model, batch):
    """forward_readout with every head's input equal to the shared input is the shared-input step."""
    ids, mask, readout, cache = batch
    cfg, layer = model.cfg, 0
    ctx = model.readout_context(ids, mask)
    x = model.blocks[layer].ln1(at_readout(cache[act_name("resid_pre", layer)], readout))[:, None]
    cos, sin, sees = ctx.on(x.device)
    attn = model.blocks[layer].attn
    shared = attn.forward_readout(x, cos, sin, *ctx.kv[layer], sees)
    per_q = x[:, :, None].expand(-1, -1, cfg.n_heads, -1)
    per_kv = x[:, :, None].expand(-1, -1, cfg.n_key_value_heads, -1)
    assert_close(
        attn.forward_readout(per_q, cos, sin, *ctx.kv[layer], sees, per_kv, per_kv), shared, "per-head"
    )
    assert_close(shared[:, 0], at_readout(cache[act_name("z", layer)], readout), "z of the full forward")


def test_readout_context_refuses_the_generic_path():
    model = HookedRewardModel.from_hf_model(tiny_hf_model("llama"), generic=True)
    with pytest.raises(ValueError, match="native architecture"):
        readout_context(model, torch.randint(1, 97, (2, 5)))


# ---------------------------------------------------------------------------------------------------
# Whole sequences from a layer on (`reward_lens.model.sequence`)


class _Tok:
    def __init__(self, ids, mask, readout):
        self.input_ids, self.attention_mask, self.readout = ids, mask, readout


def test_final_from_layer_without_inputs_is_the_clean_run(model, batch):
    ids, mask, readout, cache = batch
    seq = model.sequence_context(_Tok(ids, mask, readout))
    want = at_readout(cache[final_resid_name(model.cfg.n_layers)], readout)
    for layer in range(model.cfg.n_layers):
        got = model.final_from_layer(seq, layer, cache[act_name("resid_pre", layer)])
        assert_close(got, want, f"from block {layer}")


def test_final_from_layer_with_inputs_at_every_position(model, batch):
    """Per-head inputs and an MLP input shift at every position, two alternatives per row (`repeat`): equal
    to a hooked full forward with TransformerLens's split inputs / hook_mlp_in shifted the same way."""
    ids, mask, readout, cache = batch
    seq = model.sequence_context(_Tok(ids, mask, readout)).repeat(2)
    cfg, layer = model.cfg, model.cfg.n_layers - 1
    g = torch.Generator().manual_seed(0)
    shift = torch.randn(ids.shape[0] * 2, ids.shape[1], cfg.d_model, generator=g) * 0.3
    pre = cache[act_name("resid_pre", layer)].repeat_interleave(2, 0)
    k_in = pre[:, :, None].expand(-1, -1, cfg.n_key_value_heads, -1).clone()
    k_in[:, :, 0] += shift
    got = model.final_from_layer(seq, layer, pre, k_input=k_in, mlp_delta=shift)

    def add_k(t, hook):
        t = t.clone()
        t[:, :, 0] += shift
        return t

    def add_mlp(t, hook):
        return t + shift

    model.set_use_split_qkv_input(True)
    model.set_use_hook_mlp_in(True)
    try:
        kept = {}
        model.run_with_hooks(
            ids.repeat_interleave(2, 0),
            attention_mask=mask.repeat_interleave(2, 0),
            fwd_hooks=[
                (act_name("k_input", layer), add_k),
                (f"blocks.{layer}.hook_mlp_in", add_mlp),
                (final_resid_name(cfg.n_layers), lambda t, hook: kept.setdefault("final", t.clone())),
            ],
        )
    finally:
        model.set_use_split_qkv_input(False)
        model.set_use_hook_mlp_in(False)
    assert_close(got, at_readout(kept["final"], readout.repeat_interleave(2, 0)), "k input and MLP shift")
