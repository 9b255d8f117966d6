"""The contrastive feature ranking (`contrastive_features`) against an independent computation: each
(layer, feature)'s summed value is the reward drop when that feature is zeroed at every position it is
active at, in the local replacement model run with TransformerLens hooks (`test_feature_graph.Frozen`,
never the graph code), for the text and for its control; the rows are the union of the features the
transcoders' own encode finds active. fp32 tolerance: 1e-4 (relative above 1), as for single values."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_feature_graph import Frozen

import reward_lens as rl
from reward_lens.app import bench_features as bf
from reward_lens.instruments.circuits.contrastive_features import contrast_graphs
from reward_lens.probes.suite import DIMENSIONS, demo_probe_items


@pytest.fixture(scope="module")
def model():
    return rl.load_demo_model(device="cpu")


@pytest.fixture(scope="module")
def tc():
    return rl.load_transcoders("demo")


@pytest.fixture(scope="module")
def texts(model):
    item = demo_probe_items()[3]
    prompt, long, short = DIMENSIONS["length"].make(item, 3)[:3]
    return bf.text_ids(model, prompt, long), bf.text_ids(model, prompt, short)


@pytest.fixture(scope="module")
def result(model, tc, texts):
    return rl.contrastive_features(model, texts[0], texts[1], transcoders=tc)


def _ablated_sums(model, tc, ids, features):
    """{(layer, feature): reward - reward with it zeroed at all its active positions} by hooks."""
    fz = Frozen(model, tc, ids)
    B = len(features)
    shift = [torch.zeros(B, *a.shape) for a in fz.act]
    _, errs, embed = fz.copies(B)
    for b, (l, i) in enumerate(features):
        shift[l][b, :, i] = -fz.act[l][:, i]
    r, _ = fz.local(shift, errs, embed)
    active = {(l, int(i)) for l in range(len(fz.act)) for i in torch.nonzero(fz.act[l].amax(0) > 0)[:, 0]}
    return {f: fz.reward - float(r[b]) for b, f in enumerate(features)}, active, fz.reward


def test_values_and_ranking_against_ablations(model, tc, texts, result):
    frame = result.to_frame()
    only_text = frame[frame.positions_control == 0].head(2)
    only_control = frame[frame.positions_text == 0].tail(2)
    picks = pd_pairs(frame.head(4)) + pd_pairs(frame.tail(3)) + pd_pairs(only_text) + pd_pairs(only_control)
    assert len(only_text) and len(only_control)  # the filler brings features of its own and removes some
    ref_text, active_text, reward_text = _ablated_sums(model, tc, texts[0], picks)
    ref_control, active_control, reward_control = _ablated_sums(model, tc, texts[1], picks)
    assert set(pd_pairs(frame)) == active_text | active_control
    assert abs(result.reward_text - reward_text) <= 1e-5 * abs(reward_text)
    assert abs(result.reward_control - reward_control) <= 1e-5 * abs(reward_control)
    rows = frame.set_index(["layer", "feature"])
    for f in picks:
        got = rows.loc[f]
        want_text = ref_text[f] if f in active_text else 0.0
        want_control = ref_control[f] if f in active_control else 0.0
        assert abs(got.value_text - want_text) <= 1e-4 * max(1.0, abs(want_text)), f
        assert abs(got.value_control - want_control) <= 1e-4 * max(1.0, abs(want_control)), f
        assert abs(got.delta - (want_text - want_control)) <= 2e-4 * max(1.0, abs(want_text)), f
    assert np.all(np.diff(frame.delta.to_numpy()) <= 0) and frame["rank"].tolist() == list(
        range(1, len(frame) + 1)
    )
    assert frame.delta.iloc[0] > 0 > frame.delta.iloc[-1]


def pd_pairs(frame):
    return [(int(l), int(i)) for l, i in zip(frame.layer, frame.feature)]


def test_positions_and_rank_of(result):
    frame = result.to_frame()
    for g, col in ((result.graph, "positions_text"), (result.control_graph, "positions_control")):
        nodes = g.nodes[g.nodes.kind == "feature"]
        counts = {(int(l), int(i)): n for (l, i), n in nodes.groupby(["layer", "feature"]).size().items()}
        assert [counts.get(f, 0) for f in pd_pairs(frame)] == frame[col].tolist()
    second, fifth = pd_pairs(frame.iloc[[1, 4]])
    assert result.rank_of({fifth, second}) == 2.0
    assert result.rank_of({(0, 10**6)}) == float("inf")
    assert result.summary(3).attrs["reward_change"] == pytest.approx(
        result.reward_text - result.reward_control
    )


def test_prebuilt_graphs_and_result_protocol(model, tc, texts, result):
    g = rl.attribution_graph(model, input_ids=texts[0], transcoders=tc, max_features=4)
    again = rl.contrastive_features(None, g, result.control_graph)
    # the rows cap does not change values (up to the summation order of fp32)
    assert np.allclose(again.to_frame().delta, result.to_frame().delta, atol=1e-6)
    import matplotlib

    matplotlib.use("Agg")
    assert result.plot() is not None and len(result.summary()) == 10


def test_bad_inputs(model, tc, texts, result):
    with pytest.raises(TypeError, match="pass a \\(prompt, response\\) tuple"):
        rl.contrastive_features(model, ["a", "b"], texts[1], transcoders=tc)
    with pytest.raises(ValueError, match="needs transcoders="):
        rl.contrastive_features(model, texts[0], texts[1])
    with pytest.raises(ValueError, match="max_features"):
        rl.contrastive_features(model, texts[0], texts[1], transcoders=tc, max_features=-1)
    with pytest.raises(TypeError, match="not a FeatureGraph"):
        contrast_graphs(result.graph, {"chosen": result.graph})
