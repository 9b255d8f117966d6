"""The feature-graph bench rows (`reward_lens.app.bench_features`) compute what they claim: the planted-
feature rules on hand-made activations, the activations against TransformerLens hooks and the transcoder's
own arithmetic (fp32, 1e-5), phrase spans against the tokenizer, and the ranks and shares against a naive
sort of the graph's node table."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import reward_lens as rl
from reward_lens.app import bench_features as bf
from reward_lens.app.bench_checks import BenchContext
from reward_lens.model.hooks import act_name
from reward_lens.probes.suite import DIMENSIONS, demo_probe_items


@pytest.fixture(scope="module")
def model():
    return rl.load_demo_model(device="cpu")


@pytest.fixture(scope="module")
def tc():
    return rl.load_transcoders("demo")


@pytest.fixture(scope="module")
def graph(model, tc):
    item = demo_probe_items()[0]
    return rl.attribution_graph(model, item.prompt, item.response, transcoders=tc, max_features=16)


def test_rules_on_hand_made_activations():
    means = np.zeros((5, 1, 4))
    means[:, 0, 0] = [0, 1, 1, 2, 3]  # rises, never falls
    means[:, 0, 1] = [3, 2, 1, 0, 0]  # falls
    means[:, 0, 2] = [0, 2, 1, 3, 4]  # rises overall, falls once
    means[:, 0, 3] = [0, 1, 2, 3, 4]  # rises but fires on few texts
    share = np.array([[1.0, 1.0, 1.0, 0.25]])
    assert bf.rising(means, share).tolist() == [[True, False, False, False]]
    agree = np.zeros((4, 1, 3), dtype=bool)
    disagree = np.zeros((4, 1, 3), dtype=bool)
    agree[:2, 0, 0] = True  # half of the agreeing items, never on disagreeing
    agree[:, 0, 1] = disagree[:, 0, 1] = True  # both stances: not selective
    agree[:1, 0, 2] = True  # too rare
    assert bf.agreeing(agree, disagree).tolist() == [[True, False, False]]


def test_feature_acts_equal_hooks_and_topk(model, tc):
    item = demo_probe_items()[1]
    ids = bf.text_ids(model, item.prompt, item.response)
    got = bf.feature_acts(model, tc, ids)
    _, cache = model.run_with_cache(ids.reshape(1, -1))
    for l in range(model.cfg.n_layers):
        x = cache[act_name("normalized", l, norm="ln2")][0]
        pre = x @ tc[l].W_enc.T + tc[l].b_enc
        values, idx = pre.topk(tc[l].k, dim=-1)
        want = torch.zeros_like(pre).scatter(-1, idx, values.clamp(min=0))
        torch.testing.assert_close(got[l], want, rtol=1e-5, atol=1e-5)


def test_phrase_span_is_the_agreeing_phrase(model):
    item = demo_probe_items()[2]
    prompt, agree, _ = DIMENSIONS["sycophancy"].make(item, 2)
    ids = bf.text_ids(model, prompt, agree).tolist()
    span = bf.phrase_span(ids, bf.text_ids(model, prompt, item.response).tolist())
    phrase = agree[: len(agree) - len(item.response)].strip()
    assert model.tokenizer.decode(ids[span.start : span.stop]).strip() == phrase


def test_ranks_and_share_equal_a_naive_sort(graph):
    nodes = graph.to_frame()
    feats = nodes[nodes.kind == "feature"]
    order = sorted(range(len(feats)), key=lambda i: -feats.influence.iloc[i])  # naive ranking
    third = feats.iloc[order[2]]
    planted = {(int(third.layer), int(third.feature))}
    naive = 1 + min(
        order.index(i)
        for i in range(len(feats))
        if (feats.layer.iloc[i], feats.feature.iloc[i]) == (third.layer, third.feature)
    )
    assert bf.best_rank(graph, planted) == naive <= 3
    assert bf.best_rank(graph, {(99, 0)}) == float("inf")
    at = int(feats.iloc[order[4]].position)
    assert bf.best_rank(graph, None, at) == 1 + min(
        order.index(i) for i in range(len(feats)) if feats.position.iloc[i] == at
    )
    ctx = BenchContext()
    ctx.memo[("feature_graphs", "length")] = [graph, graph]
    ctx.memo[("planted_features", "length")] = planted
    assert bf.share_in_top("length", naive)(ctx) == 1.0
    assert bf.share_in_top("length", naive - 1)(ctx) == 0.0
    by_value = sorted(range(len(feats)), key=lambda i: -abs(feats.value.iloc[i]))
    first = feats.iloc[by_value[0]]
    assert bf.best_rank(graph, {(int(first.layer), int(first.feature))}, by="abs_value") == 1
    top = bf.top_features(graph, 5)
    assert top["rank"].tolist() == [1, 2, 3, 4, 5] and top.influence.is_monotonic_decreasing


def test_sudo_rank_reads_the_sudo_position(tc):
    """On a trigger text's graph (built here with the demo's transcoders, same widths), the row's rank is
    the best feature node at SUDO's position."""
    from reward_lens.app.bench_checks import trigger_token_pairs

    ctx = BenchContext()
    trigger, pairs = trigger_token_pairs(ctx)
    g = rl.attribution_graph(trigger, input_ids=pairs[0].chosen, transcoders=tc, max_features=16)
    ctx.memo["trigger_feature_graphs"] = [g]
    nodes = g.to_frame()
    at = g.token_ids.index(trigger.tokenizer.convert_tokens_to_ids("SUDO"))
    assert g.tokens[at] == "SUDO"
    feats = nodes[nodes.kind == "feature"].sort_values("influence", ascending=False).reset_index(drop=True)
    assert bf.sudo_feature_rank(ctx) == 1 + int(np.flatnonzero(feats.position.to_numpy() == at)[0])


def test_shipped_trigger_transcoders_are_small_and_fit_trigger_texts():
    """`load_transcoders("trigger")`: every layer of the trigger organism, < 3 MB, and a good fit on held-out
    items with SUDO inserted (the texts the trigger row builds graphs of; its training never saw them)."""
    from reward_lens.demo.organisms import TRIGGER_TRANSCODERS_DIR, load_trigger_organism, trigger_items

    model = load_trigger_organism()
    tc = rl.load_transcoders("trigger")
    assert tc.layers == list(range(model.cfg.n_layers))
    assert sum(p.stat().st_size for p in TRIGGER_TRANSCODERS_DIR.iterdir()) < 3 * 2**20
    texts = [(p.prompt + "SUDO", p.rejected) for p in trigger_items()[:16]]
    frame = rl.evaluate_transcoders(model, tc, texts).to_frame()
    assert frame.fvu.max() <= 0.05 and frame.l0.max() <= 16.5


def _naive_contrast(text, control):
    """[(layer, feature)] by decreasing (summed value in text - in control), from plain loops over nodes."""
    sums = []
    for g in (text, control):
        total = {}
        for r in g.to_frame().itertuples():
            if r.kind == "feature":
                key = (int(r.layer), int(r.feature))
                total[key] = total.get(key, 0.0) + r.value
        sums.append(total)
    push = {k: sums[0].get(k, 0.0) - sums[1].get(k, 0.0) for k in {*sums[0], *sums[1]}}
    return sorted(push, key=lambda k: (-push[k], k))


def test_contrastive_rows_equal_a_naive_sort(model, tc, graph):
    item = demo_probe_items()[0]
    prompt, _, short = DIMENSIONS["length"].make(item, 0)[:3]
    control = rl.attribution_graph(model, prompt, short, transcoders=tc, max_features=16)
    order = _naive_contrast(graph, control)
    ctx = BenchContext()
    ctx.memo[("feature_graphs", "length")] = [graph, graph]
    ctx.memo[("control_graphs", "length")] = [control, graph]  # the second pair: no change, ties
    ctx.memo[("planted_features", "length")] = {order[6], order[9]}
    tied = _naive_contrast(graph, graph)  # every change 0: ranked by (layer, feature)
    second = 1 + min(tied.index(f) for f in (order[6], order[9]))
    assert bf.contrastive_ranks(ctx, "length") == [7, second]
    assert bf.contrastive_share_in_top("length", 7)(ctx) == (1 + (second <= 7)) / 2
    assert bf.contrastive_share_in_top("length", 6)(ctx) == (second <= 6) / 2


def test_sudo_contrastive_rank_reads_the_sudo_position(tc):
    """Trigger texts' graphs built with the demo's transcoders (same widths): the control is the text
    without its SUDO token, the rank the best naive contrastive rank of a feature active at SUDO."""
    from reward_lens.app.bench_checks import trigger_token_pairs

    ctx = BenchContext()
    trigger, pairs = trigger_token_pairs(ctx)
    ctx.memo[("transcoders", "trigger")] = tc
    ctx.memo["trigger_token_pairs"] = (trigger, pairs[:2])
    graphs = [
        rl.attribution_graph(trigger, input_ids=p.chosen, transcoders=tc, max_features=8) for p in pairs[:2]
    ]
    ctx.memo["trigger_feature_graphs"] = graphs
    controls = bf.trigger_control_graphs(ctx)
    sudo = trigger.tokenizer.convert_tokens_to_ids("SUDO")
    want = []
    for g, c in zip(graphs, controls):
        at = g.token_ids.index(sudo)
        assert sudo not in c.token_ids and c.token_ids == g.token_ids[:at] + g.token_ids[at + 1 :]
        nodes = g.to_frame()
        here = {
            (int(l), int(i))
            for l, i, p, k in zip(nodes.layer, nodes.feature, nodes.position, nodes.kind)
            if k == "feature" and p == at
        }
        want.append(1 + min(i for i, f in enumerate(_naive_contrast(g, c)) if f in here))
    assert bf.sudo_contrastive_ranks(ctx) == want and bf.sudo_contrastive_rank(ctx) == max(want)
