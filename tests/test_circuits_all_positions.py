"""Circuits at every position (positions="all", token-aligned pairs):

- exact path patching equals a hand `run_with_hooks` computation (the sender's difference added to the
  receiver's own input hook at every position — TransformerLens's split q/k/v inputs and hook_mlp_in —
  in one target forward; everything downstream recomputed by that forward) to 1e-4, for every sender kind
  (head, attention, MLP) and receiver kind (q, k, v, MLP, readout), fast and naive;
- EAP-IG(16) estimates it: mean per-pair Spearman >= 0.9 and sign agreement >= 0.9 on the 20 largest
  edges (EAP's numbers printed beside);
- circuit faithfulness: every edge 1, no edge 0, all-but-one edge = that edge's path patch;
- pairs that are not token-aligned are refused with a message naming them; results record `.positions`.
"""

import numpy as np
import pytest
import torch

import reward_lens
from reward_lens import circuit_faithfulness, edge_attribution, faithfulness_curve, path_patch
from reward_lens.demo.organisms import minimal_pairs
from reward_lens.instruments.circuits.edges import agreement
from reward_lens.instruments.circuits.graph import default_senders, nodes
from reward_lens.model.hooks import act_name


@pytest.fixture(scope="module")
def demo():
    model = reward_lens.load_demo_model()
    return model, minimal_pairs(model, 3)


def _outputs(model, cache, sender):
    """A sender's output at every position [B, T, d] from a full cache (hand computation)."""
    if sender.startswith("L"):
        l, h = (int(x) for x in sender[1:].split("H"))
        return cache[act_name("z", l)][:, :, h] @ model.blocks[l].attn.W_O[h]
    kind, l = sender.split("_L")
    return cache[act_name(f"{kind}_out", int(l))]


def _hand_path_patch(model, pair, sender, receiver):
    """The patched target (chosen) reward of sender -> receiver at every position, by hooks alone."""
    tc = model.to_tokens([pair.prompt], [pair.chosen])
    tr = model.to_tokens([pair.prompt], [pair.rejected])
    _, c_cache = model.run_with_cache(tc["input_ids"], tc["attention_mask"])
    _, r_cache = model.run_with_cache(tr["input_ids"], tr["attention_mask"])
    delta = _outputs(model, r_cache, sender) - _outputs(model, c_cache, sender)
    if receiver == "readout":
        name, index = act_name("resid_post", model.cfg.n_layers - 1), None
    elif receiver.startswith("mlp_L"):
        name, index = f"blocks.{int(receiver[5:])}.hook_mlp_in", None
    elif ".q" in receiver:
        l, h = (int(x) for x in receiver[1:-2].split("H"))
        name, index = f"blocks.{l}.hook_q_input", h
    else:
        l, g = (int(x) for x in receiver[1:-2].split("KV"))
        name, index = f"blocks.{l}.hook_{receiver[-1]}_input", g

    def shift(t, hook):
        t = t.clone()
        if index is None:
            t += delta
        else:
            t[:, :, index] += delta
        return t

    model.set_use_split_qkv_input(True)
    model.set_use_hook_mlp_in(True)
    try:
        return float(
            model.run_with_hooks(tc["input_ids"], tc["attention_mask"], fwd_hooks=[(name, shift)])[0]
        )
    finally:
        model.set_use_split_qkv_input(False)
        model.set_use_hook_mlp_in(False)


def test_minimal_pairs_are_token_aligned(demo):
    model, pairs = demo
    for p in pairs:
        c = model.to_tokens([p.prompt], [p.chosen])["input_ids"]
        r = model.to_tokens([p.prompt], [p.rejected])["input_ids"]
        assert c.shape == r.shape and int((c != r).sum()) >= 1


@pytest.mark.parametrize("method", ["fast", "naive"])
def test_all_positions_equals_hand_hooks(demo, method):
    model, pairs = demo
    senders = ["L0H0", "attn_L0", "mlp_L0", "L1H3"]
    receivers = ["L1H2.q", "L1KV1.k", "L1KV0.v", "mlp_L1", "L2H1.q", "L3KV1.v", "mlp_L0", "readout"]
    res = path_patch(model, pairs[:2], senders, receivers, positions="all", method=method)
    assert res.positions == "all"
    worst, checked = 0.0, 0
    for i, pair in enumerate(pairs[:2]):
        for a, s in enumerate(senders):
            for b, r in enumerate(receivers):
                got = float(res.patched[i, a, b])
                if not np.isfinite(got):
                    continue
                worst = max(worst, abs(got - _hand_path_patch(model, pair, s, r)))
                checked += 1
    assert checked >= 25
    assert worst < 1e-4, worst


def test_all_positions_differs_from_readout_only(demo):
    """The two definitions are different numbers on the edges the readout cannot see (the value paths)."""
    model, pairs = demo
    args = (model, pairs, ["L0H0"], ["mlp_L0", "L1KV0.v", "readout"])
    every, readout = path_patch(*args, positions="all"), path_patch(*args)
    assert readout.positions == "readout"
    assert torch.allclose(every.patched[:, 0, 2], readout.patched[:, 0, 2], atol=1e-5)  # the direct path
    assert (every.effect()[:, 0, :2] - readout.effect()[:, 0, :2]).abs().max() > 0.1


def test_misaligned_pairs_are_refused(demo):
    model, pairs = demo
    unaligned = reward_lens.demo_pairs()[:2]
    for fn in (
        lambda p: path_patch(model, p, ["L0H0"], ["readout"], positions="all"),
        lambda p: edge_attribution(model, p, method="eap", positions="all"),
        lambda p: circuit_faithfulness(model, p, "all", positions="all"),
    ):
        with pytest.raises(ValueError, match=r"token-aligned.*demo-pair-0000 \(\d+ vs \d+ tokens\).*readout"):
            fn(list(pairs[:1]) + unaligned)
    with pytest.raises(ValueError, match="positions must be one of"):
        path_patch(model, pairs, ["L0H0"], ["readout"], positions="every")


def test_eap_ig_estimates_all_position_path_patching(demo):
    model, pairs = demo
    senders = default_senders(model)
    exact = path_patch(model, pairs, senders[1:], positions="all").effect()  # path_patch has no embed sender
    out = {}
    for method in ("eap-ig", "eap"):
        res = edge_attribution(model, pairs, method=method, positions="all")
        assert res.positions == "all" and res.senders == senders
        out[method] = agreement(exact, res.scores[:, 1:])
    print("demo, all positions (Spearman, sign agreement on the top 20):", out)
    assert out["eap-ig"][0] >= 0.9 and out["eap-ig"][1] >= 0.9


def test_faithfulness_all_and_none_and_one_edge_out(demo):
    model, pairs = demo
    for mode in ("noising", "denoising"):
        full = circuit_faithfulness(model, pairs, "all", mode=mode, positions="all")
        empty = circuit_faithfulness(model, pairs, [], mode=mode, positions="all")
        assert (full - 1).abs().max() < 1e-5 and empty.abs().max() < 1e-5
    snodes, rnodes = nodes(model, None, None)
    edges = [(s.name, r.name) for s in snodes for r in rnodes if s.writes_before(r)]
    out = ("L0H0", "mlp_L0")
    kept = circuit_faithfulness(model, pairs, [e for e in edges if e != out], positions="all")
    one = path_patch(model, pairs, ["L0H0"], ["mlp_L0"], positions="all").effect(normalized=True)[:, 0, 0]
    assert (kept - (1 + one)).abs().max() < 1e-4


def test_faithfulness_curve_takes_the_ranking_positions(demo):
    model, pairs = demo
    ranking = edge_attribution(model, pairs, method="eap", positions="all")
    curve = faithfulness_curve(model, pairs, ranking, sizes=[0, 4, ranking.scores[0].isfinite().sum().item()])
    assert curve.positions == "all"
    assert curve.faithfulness[:, 0].abs().max() < 1e-5 and (curve.faithfulness[:, -1] - 1).abs().max() < 1e-5


def test_receiver_columns_head_order_and_missing_receiver():
    """The circuit recomputation's receiver columns: q/k/v in head order whatever the given order; a layer
    missing one receiver is refused, naming the layer and the kind."""
    from reward_lens.instruments.circuits.graph import receiver_columns
    from reward_lens.instruments.patching.path import default_receivers, parse_receiver

    cfg = reward_lens.load_demo_model().cfg
    names = default_receivers(cfg)[::-1]
    receivers = [parse_receiver(cfg, n) for n in names]
    cols = receiver_columns(cfg, receivers)
    for l in range(cfg.n_layers):
        assert [receivers[j].index for j in cols[("q", l)]] == list(range(cfg.n_heads))
        assert [receivers[j].index for j in cols[("k", l)]] == list(range(cfg.n_key_value_heads))
        assert [receivers[j].name for j in cols[("mlp", l)]] == [f"mlp_L{l}"]
    missing = [r for r in receivers if r.name != "L1KV0.v"]
    with pytest.raises(ValueError, match=r"every receiver of layer 1 \(v\)"):
        receiver_columns(cfg, missing)
