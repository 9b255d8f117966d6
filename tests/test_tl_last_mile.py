"""TransformerLens tutorial patterns on mixed-length, left-padded batches passed without a mask: what used
to be silently wrong (return_type=None, mid-model restarts, pad == BOS, patching misaligned rows), split
q/k/v inputs and direct path patching, text helpers' BOS and TransformerLens's hook aliases.

Every number is checked against an independent computation: each row alone (no padding), transformers'
own forward, or the einsum of the cached inputs and the weights. fp32 throughout: tolerance 1e-5.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import transformer_lens.patching as patching
import transformer_lens.utilities as tl_utils
from helpers import tiny_hf_model, word_tokenizer

from reward_lens import HookedRewardModel
from reward_lens.demo import demo_pairs, load_demo_model
from reward_lens.model.hooks import act_name

TOL = 1e-5


@pytest.fixture(scope="module")
def model():
    return load_demo_model(device="cpu", dtype="float32")


def pairs_of_lengths(model, n: int = 4):
    """n demo pairs whose (prompt, chosen) and (prompt, rejected) rows all differ in length."""
    seen, out = set(), []
    for p in demo_pairs():
        lc = int(model.to_tokens(p.prompt, p.chosen)["input_ids"].shape[1])
        lr = int(model.to_tokens(p.prompt, p.rejected)["input_ids"].shape[1])
        if lc not in seen and lc != lr:
            seen.add(lc)
            out.append(p)
        if len(out) == n:
            return out
    raise AssertionError("the demo set has too few distinct lengths")


@pytest.fixture(scope="module")
def batches(model):
    ps = pairs_of_lengths(model)
    clean = model.to_tokens([p.prompt for p in ps], [p.chosen for p in ps])
    corrupt = model.to_tokens([p.prompt for p in ps], [p.rejected for p in ps])
    T = min(clean["input_ids"].shape[1], corrupt["input_ids"].shape[1])  # equal widths, as TL's helpers need
    clean_ids, corrupt_ids = clean["input_ids"][:, -T:], corrupt["input_ids"][:, -T:]
    # cutting keeps every row's readout at -1; the independent rewards are those of each cut row alone
    return clean_ids, corrupt_ids


def alone(model, ids):
    """Each row's reward computed on its own, without its pads (the independent reference)."""
    pad = model.cfg.pad_token_id
    out = []
    for row in ids:
        keep = (row != pad).long().cumsum(0) > 0
        out.append(model(row[keep][None])[0])
    return torch.stack(out)


# --------------------------------------------------------------------------- 1. return_type=None
def test_return_type_none_runs_the_final_norm(model, batches):
    ids, _ = batches
    _, full = model.run_with_cache(ids)
    out, cache = model.run_with_cache(ids, return_type=None)
    assert out is None
    assert torch.equal(cache["ln_final.hook_scale"], full["ln_final.hook_scale"])
    stack = cache.decompose_resid(apply_ln=True, pos_slice=-1)
    assert torch.allclose(stack, full.decompose_resid(apply_ln=True, pos_slice=-1), atol=TOL)
    fired = {}

    def note(x, hook):
        fired[hook.name] = True

    model.run_with_hooks(ids, return_type=None, fwd_hooks=[(lambda n: True, note)])
    head_hooks = {n for n in model.hook_dict if n.startswith("reward_head.")}
    assert set(fired) == set(full.cache_dict) - head_hooks
    assert "ln_final.hook_scale" in fired and "ln_final.hook_normalized" in fired


# ----------------------------------------------------------------------- 2. start_at_layer infers the mask
def test_start_at_layer_infers_the_mask(model, batches):
    ids, _ = batches
    assert bool((ids == model.cfg.pad_token_id).any())
    reference = alone(model, ids)
    _, cache = model.run_with_cache(ids)
    assert torch.allclose(model(ids), reference, atol=TOL)
    for layer in range(model.cfg.n_layers):
        resid = cache[act_name("resid_pre", layer)]
        assert torch.allclose(model(resid, start_at_layer=layer, input_ids=ids), reference, atol=TOL), layer
    stopped = model(ids, stop_at_layer=2)
    assert torch.allclose(model(stopped, start_at_layer=2, input_ids=ids), reference, atol=TOL)


# --------------------------------------------------------------------------- 3. pad == BOS
WORDS = [
    "<|endoftext|>",
    "<unk>",
    "the",
    "cat",
    "sat",
    "on",
    "a",
    "mat",
    "dog",
    "ran",
    "far",
    "away",
    "?",
    ".",
]


def pad_is_bos_model(add_bos: bool, seed: int = 0):
    """A GPT-2-style tiny checkpoint: one id (0) is BOS, EOS and pad."""
    one = "<|endoftext|>"
    tok = word_tokenizer(WORDS, bos=one, eos=one, pad=one, add_bos=add_bos)
    hf = tiny_hf_model("llama", seed=seed, pad_token_id=0, bos_token_id=0, eos_token_id=0)
    model = HookedRewardModel.from_hf_model(hf, tok, device="cpu")
    model.input_format = "{prompt} {response}"
    return model, hf


PAD_BOS_PAIRS = [("the cat sat", "on a mat ."), ("the dog", "ran far away ."), ("a cat ?", "ran .")]


def hf_alone(hf, ids, mask):
    """transformers' reward of each row alone (its masked positions dropped)."""
    out = []
    for row, m in zip(ids, mask):
        out.append(hf(input_ids=row[m.bool()][None]).logits[0, 0])
    return torch.stack(out)


@pytest.mark.parametrize("add_bos", [True, False])
def test_pad_is_bos_mask_is_inferred(add_bos):
    model, hf = pad_is_bos_model(add_bos)
    batch = model.to_tokens([p for p, _ in PAD_BOS_PAIRS], [r for _, r in PAD_BOS_PAIRS])
    ids, mask = batch["input_ids"], batch["attention_mask"]
    assert model.renders_bos() is add_bos
    assert bool((mask == 0).any()) and bool((ids[:, 0] == 0).all()) is add_bos
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # decidable: no warning
        inferred = model.infer_attention_mask(ids)
        rewards = model(ids)
    assert torch.equal(inferred.cpu(), mask.long())
    with torch.no_grad():
        reference = hf_alone(hf, ids, mask)
    assert torch.allclose(rewards, reference, atol=TOL)
    assert (rewards - model(ids, torch.ones_like(ids))).abs().max() > 1e-3  # attending the pads is wrong


def test_pad_is_bos_warns_where_undecidable():
    model, _ = pad_is_bos_model(add_bos=False)
    batch = model.to_tokens([p for p, _ in PAD_BOS_PAIRS], [r for _, r in PAD_BOS_PAIRS])
    ids = batch["input_ids"]
    by_hand = torch.cat([torch.zeros_like(ids[:, :1]), ids], dim=1)  # a BOS prepended by hand to every row
    with pytest.warns(UserWarning, match="attention_mask="):
        model(by_hand)
    model.input_format = "chat"  # no chat template: to_tokens fails, the rendering is unknown
    assert model.renders_bos() is None
    with pytest.warns(UserWarning, match="cannot render"):
        model(batch["input_ids"])


# --------------------------------------------------------------------------- 4. patching misaligned rows
def misaligned_positions(model, clean_ids, corrupt_ids):
    a = model.infer_attention_mask(clean_ids, warn=False).bool()
    b = model.infer_attention_mask(corrupt_ids, warn=False).bool()
    return int((a != b).any(0).sum())


def test_patching_misaligned_rows_warns_once(model, batches):
    clean_ids, corrupt_ids = batches
    n_bad = misaligned_positions(model, clean_ids, corrupt_ids)
    assert n_bad > 0
    _, clean_cache = model.run_with_cache(clean_ids)
    metric = lambda rewards: rewards.mean()  # noqa: E731
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = patching.get_act_patch_resid_pre(model, corrupt_ids, clean_cache, metric)
    messages = [str(w.message) for w in caught if "differently padded" in str(w.message)]
    assert len(messages) == 1
    assert "reward_lens.patch" in messages[0] and f"{n_bad} of {clean_ids.shape[1]} positions" in messages[0]
    # the readout column is exact: both rows end with the same token, so layer 0's patch there is a no-op
    assert torch.equal(clean_ids[:, -1], corrupt_ids[:, -1])
    assert torch.allclose(result[0, -1], alone(model, corrupt_ids).mean(), atol=TOL)


def test_readout_only_and_aligned_patches_do_not_warn(model, batches):
    clean_ids, corrupt_ids = batches
    _, clean_cache = model.run_with_cache(clean_ids)
    name = act_name("resid_pre", 1)

    def readout_patch(act, hook):
        act[:, -1] = clean_cache[name][:, -1]
        return act

    def every_position(act, hook):
        act[:] = clean_cache[name]
        return act

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.run_with_hooks(corrupt_ids, fwd_hooks=[(name, readout_patch)])  # -1 is aligned
        model.run_with_hooks(clean_ids, fwd_hooks=[(name, every_position)])  # same padding
    with pytest.warns(UserWarning, match="differently padded"):  # a user's closure over the cache
        model.run_with_hooks(corrupt_ids[[1, 0, 2, 3]], fwd_hooks=[(name, every_position)])


clean_cache = None  # the Main Demo's global


def residual_stream_patching_hook(resid_pre, hook, position):
    """The Main Demo's hook: the clean cache is a global it names."""
    clean_resid_pre = clean_cache[hook.name]
    resid_pre[:, position, :] = clean_resid_pre[:, position, :]
    return resid_pre


def test_main_demo_patching_loop_warns_once_and_reads_right_at_minus_one(model, batches):
    global clean_cache
    clean_ids, corrupt_ids = batches
    _, clean_cache = model.run_with_cache(clean_ids)
    T = clean_ids.shape[1]
    result = torch.zeros(model.cfg.n_layers, T)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for layer in range(model.cfg.n_layers):
            for position in range(T):
                hook = functools.partial(residual_stream_patching_hook, position=position)
                name = tl_utils.get_act_name("in", layer)  # the 4.x bridge's name for resid_pre
                result[layer, position] = model.run_with_hooks(corrupt_ids, fwd_hooks=[(name, hook)]).mean()
    assert sum("differently padded" in str(w.message) for w in caught) == 1
    expected = patching.get_act_patch_resid_pre(model, corrupt_ids, clean_cache, lambda r: r.mean())
    assert torch.allclose(result, expected, atol=TOL)
    assert torch.allclose(result[0, -1], alone(model, corrupt_ids).mean(), atol=TOL)


# --------------------------------------------------------------------------- 5. split inputs
@pytest.mark.parametrize("flag", ["set_use_split_qkv_input", "set_use_attn_in", "set_use_hook_mlp_in"])
def test_split_inputs_leave_rewards_unchanged(model, batches, flag):
    ids, _ = batches
    before = model(ids)
    getattr(model, flag)(True)
    try:
        out, cache = model.run_with_cache(ids)
    finally:
        getattr(model, flag)(False)
    assert torch.allclose(out, before, atol=TOL) and torch.allclose(out, alone(model, ids), atol=TOL)
    B, T = ids.shape
    n, nkv, d = model.cfg.n_heads, model.cfg.n_key_value_heads, model.cfg.d_model
    shapes = {
        "set_use_split_qkv_input": {
            "q_input": (B, T, n, d),
            "k_input": (B, T, nkv, d),
            "v_input": (B, T, nkv, d),
        },
        "set_use_attn_in": {"attn_in": (B, T, n, d)},
        "set_use_hook_mlp_in": {"mlp_in": (B, T, d)},
    }[flag]
    for kind, shape in shapes.items():
        for layer in range(model.cfg.n_layers):
            act = cache[act_name(kind, layer)]
            assert tuple(act.shape) == shape
            source = cache[act_name("resid_mid" if kind == "mlp_in" else "resid_pre", layer)]
            assert torch.equal(act, source if kind == "mlp_in" else source[:, :, None].expand(shape))


def test_split_inputs_are_exclusive(model):
    model.set_use_split_qkv_input(True)
    try:
        with pytest.raises(ValueError, match="exclusive"):
            model.set_use_attn_in(True)
    finally:
        model.set_use_split_qkv_input(False)


@pytest.mark.parametrize("kind,head", [("q_input", 1), ("k_input", 1), ("v_input", 0), ("attn_in", 2)])
def test_patching_one_head_input_changes_only_that_head(model, batches, kind, head):
    clean_ids, corrupt_ids = batches
    layer = 1
    flag = "set_use_attn_in" if kind == "attn_in" else "set_use_split_qkv_input"
    _, base = model.run_with_cache(corrupt_ids)
    resid_name = act_name("resid_pre", layer)
    other = model.run_with_cache(clean_ids, names_filter=resid_name)[1][resid_name]

    def swap(act, hook):
        act[:, :, head] = other
        return act

    getattr(model, flag)(True)
    try:
        with model.hooks(fwd_hooks=[(act_name(kind, layer), swap)]):
            patched, cache = model.run_with_cache(corrupt_ids)
    finally:
        getattr(model, flag)(False)
    attn = model.blocks[layer].attn
    x = model.blocks[layer].ln1(other)  # the swapped head's normalised input (ln1 folded: no weight)
    for which, W, b in (("q", attn.W_Q, attn.b_Q), ("k", attn.W_K, attn.b_K), ("v", attn.W_V, attn.b_V)):
        got, old = cache[act_name(which, layer)], base[act_name(which, layer)]
        if kind == "attn_in":
            touched = {head} if which == "q" else ({head} if head < model.cfg.n_key_value_heads else set())
        else:
            touched = {head} if kind[0] == which else set()
        for h in range(got.shape[2]):
            if h in touched:
                expected = torch.einsum("bpd,dh->bph", x, W[h]) + b[h]
                assert torch.allclose(got[:, :, h], expected, atol=TOL), (which, h)
            else:
                assert torch.allclose(got[:, :, h], old[:, :, h], atol=TOL), (which, h)
    assert not torch.allclose(patched, model(corrupt_ids), atol=1e-3)


def test_direct_path_patching_runs_and_is_right(model, batches):
    clean_ids, corrupt_ids = batches
    _, clean_cache = model.run_with_cache(clean_ids)
    _, corrupt_cache = model.run_with_cache(corrupt_ids)
    metric = lambda rewards: rewards.mean()  # noqa: E731
    src_layer, src_head = 0, 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = patching.get_act_patch_direct_path(
            model, corrupt_ids, clean_cache, corrupt_cache, metric, src_layer, src_head, verbose=False
        )
    # the write is added at every position, and these rows differ in length: warned once
    assert sum("differently padded" in str(w.message) for w in caught) == 1
    assert not model.cfg.use_split_qkv_input  # flags restored
    z = act_name("z", src_layer)
    W_O = model.blocks[src_layer].attn.W_O[src_head]
    delta = clean_cache[z][:, :, src_head] @ W_O - corrupt_cache[z][:, :, src_head] @ W_O
    for dst_layer, dst_head in [(1, 0), (2, 3), (3, 1)]:
        attn = model.blocks[dst_layer].attn
        resid = corrupt_cache[act_name("resid_pre", dst_layer)]
        q = torch.einsum("bpd,dh->bph", model.blocks[dst_layer].ln1(resid + delta), attn.W_Q[dst_head])
        q = q + attn.b_Q[dst_head]

        def set_q(act, hook, q=q, h=dst_head):
            act[:, :, h] = q
            return act

        expected = metric(model.run_with_hooks(corrupt_ids, fwd_hooks=[(act_name("q", dst_layer), set_q)]))
        assert abs(float(result[dst_layer, dst_head]) - float(expected)) < TOL
    assert torch.equal(result[: src_layer + 1], torch.zeros_like(result[: src_layer + 1]))


def test_direct_path_patching_refuses_post_norms():
    """Gemma-2's post-norm acts on the attention output before the residual: no silent wrong number."""
    from test_gemma2 import tiny_gemma2

    model = HookedRewardModel.from_hf_model(tiny_gemma2(), device="cpu")
    ids = torch.randint(3, 60, (2, 7))
    _, cache = model.run_with_cache(ids)
    with pytest.raises(ValueError, match="normalized or scaled"):
        patching.get_act_patch_direct_path(model, ids, cache, cache, lambda r: r.mean(), 0, 0, verbose=False)
    demo = load_demo_model(device="cpu")
    assert demo.blocks[0].hook_aliases == {} and "ln1_post" not in demo.blocks[0].submodules


# --------------------------------------------------------------------------- 6. text helpers' BOS
def test_text_helpers_prepend_bos_as_transformer_lens(model):
    tok = model.tokenizer
    text = "I feel that multiplication is strange. What is 4 times 3?"
    manual = tok(tok.bos_token + text, add_special_tokens=False)["input_ids"]  # TL's manual prepend
    assert manual[0] == tok.bos_token_id and manual[1] != tok.bos_token_id
    assert model.to_str_tokens(text) == [tok.decode([t]) for t in manual]
    assert model.to_str_tokens(text, prepend_bos=False) == [tok.decode([t]) for t in manual[1:]]
    token = model.to_single_token(" is")
    assert model.get_token_position(" is", text) == manual.index(token)
    assert model.get_token_position(" is", text, prepend_bos=False) == manual.index(token) - 1
    assert model.get_token_position(" is", text, mode="last") == len(manual) - 1 - manual[::-1].index(token)
    assert model.to_string(torch.tensor(manual)) == tok.decode(manual)
    assert model.to_string([torch.tensor(manual), torch.tensor(manual[1:])]) == [
        tok.decode(manual),
        tok.decode(manual[1:]),
    ]


# --------------------------------------------------------------------------- 7. TransformerLens aliases
def test_transformer_lens_aliases_resolve(model, batches):
    ids, _ = batches
    _, cache = model.run_with_cache(ids)
    assert torch.equal(cache["in", 0], cache["blocks.0.hook_resid_pre"])
    assert torch.equal(cache[tl_utils.get_act_name("out", 3)], cache["blocks.3.hook_resid_post"])
    assert torch.equal(cache["blocks.2.attn.hook_out"], cache["blocks.2.hook_attn_out"])
    assert torch.equal(cache["blocks.2.mlp.hook_out"], cache["blocks.2.hook_mlp_out"])
    assert torch.equal(cache["blocks.1.attn.hook_in"], cache["blocks.1.ln1.hook_normalized"])
    assert torch.equal(cache["attn_logits", 1], cache["blocks.1.attn.hook_attn_scores"])
    assert act_name("key", 2) == "blocks.2.attn.hook_k" and act_name("in", 1) == "blocks.1.hook_resid_pre"
    assert not set(cache.cache_dict) & set(model.hook_aliases)  # cache keys: one name per hook
    _, part = model.run_with_cache(ids, names_filter=["blocks.1.hook_out"])
    assert list(part.cache_dict) == ["blocks.1.hook_resid_post"]
    seen = []
    model.run_with_hooks(ids, fwd_hooks=[("blocks.0.hook_in", lambda x, hook: seen.append(hook.name))])
    assert seen == ["blocks.0.hook_resid_pre"]
    count = []
    model.run_with_hooks(ids, fwd_hooks=[(lambda n: True, lambda x, hook: count.append(hook.name))])
    assert len(count) == len(set(count))  # a predicate sees each hook once, never again under an alias
