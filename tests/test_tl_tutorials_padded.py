"""TransformerLens tutorial patterns on batches of MIXED-LENGTH pairs from `to_tokens`, with no attention mask
passed (what `transformer_lens.patching` does): the readout is position -1, the mask is inferred from the
leading pad run, and every number equals an independent unpadded computation. fp32, tol 1e-5 (1e-4 for
patching metrics summed over pairs).

Models: the demo RM (GQA: 4 query heads, 2 kv heads), the demo with pad = EOS (Llama-3 style: the chat
template ends with EOS, so transformers reads one token before it), and a tiny ArmoRM (per-sequence
direction).
"""

import warnings

import pytest
import torch
import transformer_lens.patching as patching
from armorm_reference import chat_ids, save_tiny_armorm
from transformer_lens import FactoredMatrix

from reward_lens import HookedRewardModel
from reward_lens.demo import demo_pairs, load_demo_model
from reward_lens.model.hooks import act_name

TOL = 1e-5


def _demo(pad_is_eos: bool):
    model = load_demo_model(dtype="float32")
    if pad_is_eos:
        model.cfg.pad_token_id = model.tokenizer.eos_token_id
    return model


@pytest.fixture(scope="module")
def demo_model():
    return _demo(False)


@pytest.fixture(scope="module")
def pad_eos_model():
    return _demo(True)


@pytest.fixture(scope="module", params=["demo", "demo_pad_eos"])
def model(request, demo_model, pad_eos_model):
    return demo_model if request.param == "demo" else pad_eos_model


def mixed_pairs():
    """Three short demo pairs whose (prompt, chosen) rows have different token lengths: short rows keep
    patching fast."""
    model = _demo(False)
    by_length = {}
    for p in demo_pairs():
        n = int(model.to_tokens(p.prompt, p.chosen)["input_ids"].shape[1])
        by_length.setdefault(n, p)
    lengths = sorted(by_length)
    return [by_length[lengths[0]], by_length[lengths[2]], by_length[lengths[4]]]


MIXED = []


def clean_batch(model):
    if not MIXED:
        MIXED.extend(mixed_pairs())
    pairs = MIXED
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # ids from to_tokens read at -1: no warning anywhere below
        batch = model.to_tokens([p.prompt for p in pairs], [p.chosen for p in pairs])
    return batch["input_ids"], batch["attention_mask"]


def rows(ids, mask):
    return [ids[b][mask[b].bool()] for b in range(ids.shape[0])]


def test_to_tokens_rows_end_at_the_readout_left_padded(model):
    ids, mask = clean_batch(model)
    lengths = mask.sum(-1)
    assert len(set(lengths.tolist())) == 3  # mixed lengths
    assert (mask[:, -1] == 1).all() and (model.readout_positions(ids, mask) == ids.shape[1] - 1).all()
    assert torch.equal(model.infer_attention_mask(ids, warn=False), mask)
    if (
        model.cfg.pad_token_id == model.tokenizer.eos_token_id
    ):  # the trailing EOS (after the readout) is dropped
        assert (ids[:, -1] != model.tokenizer.eos_token_id).all()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        no_mask = model(ids)
    singles = torch.stack([model(r[None])[0] for r in rows(ids, mask)])
    assert torch.allclose(no_mask, model(ids, attention_mask=mask), atol=TOL)
    assert torch.allclose(no_mask, singles, atol=TOL)


def test_direct_reward_attribution_at_pos_minus_one(model):
    ids, mask = clean_batch(model)
    rewards, cache = model.run_with_cache(ids)  # no mask, as a tutorial does
    w, b = model.reward_direction, model.reward_bias
    acc = cache.accumulated_resid(layer=-1, incl_mid=True, pos_slice=-1)
    lens = cache.apply_ln_to_stack(acc, layer=-1, pos_slice=-1) @ w
    assert torch.allclose(lens[-1] + b, rewards, atol=TOL)
    per_layer = (
        cache.apply_ln_to_stack(cache.decompose_resid(layer=-1, pos_slice=-1), layer=-1, pos_slice=-1) @ w
    )
    assert torch.allclose(per_layer.sum(0) + b, rewards, atol=TOL)
    heads, labels = cache.stack_head_results(layer=-1, pos_slice=-1, return_labels=True)
    per_head = cache.apply_ln_to_stack(heads, layer=-1, pos_slice=-1) @ w
    attn_rows = [
        i
        for i, l in enumerate(cache.decompose_resid(layer=-1, return_labels=True)[1])
        if l.endswith("attn_out")
    ]
    assert per_head.shape == (model.cfg.n_layers * model.cfg.n_heads, 3)
    assert torch.allclose(per_head.sum(0), per_layer[attn_rows].sum(0), atol=TOL)
    # logit_attrs with the input ids as "tokens" (tokens_to_residual_directions = the reward direction).
    attrs = cache.logit_attrs(cache.decompose_resid(layer=-1, pos_slice=-1), ids, pos_slice=-1)
    assert torch.allclose(attrs.sum(0) + b, rewards, atol=TOL)
    # Each row's lens equals the unpadded sequence's own last-position lens.
    for r, row in enumerate(rows(ids, mask)):
        _, single = model.run_with_cache(row[None])
        acc1 = single.accumulated_resid(layer=-1, incl_mid=True, pos_slice=-1)
        assert torch.allclose(
            lens[:, r], (single.apply_ln_to_stack(acc1, layer=-1, pos_slice=-1) @ w)[:, 0], atol=TOL
        )


# --------------------------------------------------------------------------- activation patching
def corrupt(model, ids):
    """Replace the second-to-last token of every row (inside each response) by another token."""
    other = model.to_single_token("Pear")
    out = ids.clone()
    out[:, -2] = torch.where(out[:, -2] == other, other + 1, torch.full_like(out[:, -2], other))
    return out


def manual_patch(model, hook: str, clean_row, corrupt_row, head=None):
    """Rewards of the UNPADDED corrupted row with `hook` at position i (and head) taken from the clean
    row, for every i (row i of the batch patches position i): one batched forward."""
    n = len(corrupt_row)
    _, clean_cache = model.run_with_cache(clean_row[None], names_filter=hook)
    clean_act = clean_cache[hook][0]

    def put(act, hook):
        for i in range(n):
            if head is None:
                act[i, i] = clean_act[i]
            else:
                act[i, i, head] = clean_act[i, head]
        return act

    return model.run_with_hooks(corrupt_row[None].expand(n, -1), fwd_hooks=[(hook, put)])


def expected_grid(model, hook, ids, corrupted, mask, weights, head=None):
    """Σ_b weights[b] * (pair b's unpadded manual patch at padded position p), for every p."""
    T = ids.shape[1]
    total = torch.zeros(T)
    for b, (c, r) in enumerate(zip(rows(ids, mask), rows(corrupted, mask))):
        offset = T - len(r)
        per_pos = torch.full((T,), float(model(r[None])[0]))  # pad positions: patching them changes nothing
        per_pos[offset:] = manual_patch(model, hook, c, r, head)
        total += weights[b] * per_pos
    return total


def patch_setup(model):
    ids, mask = clean_batch(model)
    corrupted = corrupt(model, ids)
    _, clean_cache = model.run_with_cache(ids)
    weights = torch.tensor([1.0, 2.5, -4.0])  # one scalar metric, per-pair terms distinguishable
    return ids, mask, corrupted, clean_cache, weights, (lambda out: (out * weights).sum())


def test_get_act_patch_resid_pre_equals_unpadded_manual_patches(model):
    ids, mask, corrupted, clean_cache, weights, metric = patch_setup(model)
    got = patching.get_act_patch_resid_pre(model, corrupted, clean_cache, metric)
    for l in range(model.cfg.n_layers):
        want = expected_grid(model, act_name("resid_pre", l), ids, corrupted, mask, weights)
        assert torch.allclose(got[l], want, atol=1e-4), l
    assert got[0, -1].abs() > 1e-3  # the readout column is not padding


def test_get_act_patch_block_every_equals_unpadded_manual_patches(demo_model):
    model = demo_model  # (~250 forwards: one model; the pad = EOS one runs the per-head grid below)
    ids, mask, corrupted, clean_cache, weights, metric = patch_setup(model)
    got = patching.get_act_patch_block_every(model, corrupted, clean_cache, metric)
    for k, kind in enumerate(("resid_pre", "attn_out", "mlp_out")):
        for l in range(model.cfg.n_layers):
            want = expected_grid(model, act_name(kind, l), ids, corrupted, mask, weights)
            assert torch.allclose(got[k, l], want, atol=1e-4), (kind, l)


def test_get_act_patch_attn_head_out_by_pos_equals_unpadded_manual_patches(pad_eos_model):
    model = pad_eos_model
    ids, mask, corrupted, clean_cache, weights, metric = patch_setup(model)
    got = patching.get_act_patch_attn_head_out_by_pos(model, corrupted, clean_cache, metric)
    L = model.cfg.n_layers - 1  # the last layer (the others follow the same code path)
    for h in range(model.cfg.n_heads):
        want = expected_grid(model, act_name("z", L), ids, corrupted, mask, weights, head=h)
        assert torch.allclose(got[L, :, h], want, atol=1e-4), h


# --------------------------------------------------------------------------- weights like TransformerLens
# (GQA)
def test_gqa_weights_pair_query_head_h_with_its_kv_head(model):
    cfg = model.cfg
    group = cfg.n_heads // cfg.n_key_value_heads
    assert group == 2 and model.W_K.shape == model.W_Q.shape and model._W_K.shape[1] == cfg.n_key_value_heads
    assert model.W_V.shape == model.W_Q.shape and model.b_K.shape == model.b_Q.shape == model.b_V.shape
    for name in ("b_Q", "b_K", "b_V", "b_O", "b_in", "b_out"):
        assert getattr(model, name).shape[0] == cfg.n_layers
    assert isinstance(model.QK, FactoredMatrix) and isinstance(model.OV, FactoredMatrix)
    ids, mask = clean_batch(model)
    _, cache = model.run_with_cache(ids)
    assert (
        cfg.normalization_type == "RMSPre" and not cfg.qk_norm
    )  # so the attention input is ln1's normalised x
    real = mask.bool()
    wrong_pairing_differs = False
    for l in range(cfg.n_layers):
        x = cache["normalized", l, "ln1"]
        scores = cache["attn_scores", l]
        for h in range(cfg.n_heads):
            # The diagonal score q_p . k_p: RoPE rotates both by the same angle, so it is x W_Q W_K^T x /
            # scale.
            want = scores[:, h].diagonal(dim1=-2, dim2=-1)
            q = x @ model.W_Q[l, h] + model.b_Q[l, h]
            k = x @ model.W_K[l, h] + model.b_K[l, h]
            got = (q * k).sum(-1) / cfg.attn_scale
            assert torch.allclose(got[real], want[real], atol=1e-4), (l, h)
            qk = ((x @ model.QK[l, h].AB) * x).sum(-1) / cfg.attn_scale
            assert torch.allclose(qk[real], want[real], atol=1e-4)
            raw = (q * (x @ model._W_K[l, h % cfg.n_key_value_heads])).sum(-1) / cfg.attn_scale
            wrong_pairing_differs |= not torch.allclose(raw[real], want[real], atol=1e-4)
    assert wrong_pairing_differs  # the test can tell kv-head pairings apart
    assert torch.allclose(model.OV[1, 3].AB, model._W_V[1, 3 // group] @ model.W_O[1, 3], atol=1e-6)


# --------------------------------------------------------------------------- warnings, return_type, token
# helpers
def test_ids_read_before_their_end_without_a_mask_warn(model):
    ids, mask = clean_batch(model)
    clean_batch(model)
    right = model.to_tokens([p.prompt for p in MIXED], [p.chosen for p in MIXED], padding_side="right")
    with pytest.warns(UserWarning, match=r"readout_positions.*readout_only=True"):
        rewards = model(right["input_ids"])
    assert torch.allclose(rewards, model(ids), atol=TOL)  # causal: the reward itself is right
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(right["input_ids"], attention_mask=right["attention_mask"])  # a mask: the caller knows
        model.run_with_cache(right["input_ids"], readout_only=True)
    if model.cfg.pad_token_id == model.tokenizer.eos_token_id:  # an unpadded row that ends with EOS = pad
        full = torch.tensor(
            [
                model.tokenizer.apply_chat_template(
                    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
                    tokenize=True,
                    return_dict=True,
                )["input_ids"]
            ]
        )
        with pytest.warns(UserWarning, match="readout_positions"):
            model(full)


def test_return_type_and_text_input(model):
    ids, _ = clean_batch(model)
    rewards = model(ids)
    assert torch.allclose(model(ids, return_type="logits"), rewards) and torch.allclose(
        model(ids, return_type="reward"), rewards
    )
    assert model(ids, return_type=None) is None
    with pytest.raises(ValueError, match="loss"):
        model(ids, return_type="loss")
    # a bare text has TransformerLens's meaning: BOS + the text's ids, the reward read at its last token
    text = "What is 2 plus 3?"
    tok = model.tokenizer
    by_hand = torch.tensor([[tok.bos_token_id] + tok(text, add_special_tokens=False)["input_ids"]])
    assert torch.equal(model.to_tokens(text), by_hand)
    assert torch.equal(model(text), model(by_hand))


def test_token_helpers_follow_transformer_lens(model):
    ids, mask = clean_batch(model)
    tok = model.tokenizer
    row = rows(ids, mask)[0]
    assert model.to_str_tokens(row) == [tok.decode([t]) for t in row.tolist()]
    assert model.to_str_tokens(ids)[0][-len(row) :] == model.to_str_tokens(row)
    assert model.to_string(row) == tok.decode(row.tolist())
    assert model.to_string(ids[:1]) == [tok.decode(ids[0].tolist())]
    pear = model.to_single_token("Pear")
    assert tok.convert_ids_to_tokens([pear]) == ["Pear"]
    with pytest.raises(ValueError, match="not a single token"):
        model.to_single_token("Pear Pear")
    assert model.get_token_position(tok.bos_token, ids[2:3]) == int(mask[2].argmax())
    assert model.get_token_position(int(row[-1]), row, mode="last") == len(row) - 1
    names = dict(model.tl_named_parameters())
    assert "blocks.0.attn.W_Q" in names and torch.equal(names["blocks.0.attn.W_Q"], model.W_Q[0])


# --------------------------------------------------------------------------- ArmoRM: a per-sequence direction
def test_logit_attrs_sum_to_the_armorm_reward(tmp_path):
    model = HookedRewardModel.from_pretrained(save_tiny_armorm(tmp_path, seed=0))
    pad = model.cfg.pad_token_id
    seqs = [chat_ids(4, 5, seed=0), chat_ids(2, 2, seed=1), chat_ids(6, 3, seed=3)]
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, T - len(s) :] = s
    rewards, cache = model.run_with_cache(ids)  # left-padded, no mask
    singles = torch.stack([model(s[None])[0] for s in seqs])
    assert torch.allclose(rewards, singles, atol=1e-4)
    directions = model.tokens_to_residual_directions(ids)
    assert directions.shape == (3, model.cfg.d_model) and not torch.allclose(directions[0], directions[1])
    attrs = cache.logit_attrs(cache.decompose_resid(layer=-1, pos_slice=-1), ids, pos_slice=-1)
    assert torch.allclose(attrs.sum(0) + model.reward_bias, rewards, atol=1e-4)
