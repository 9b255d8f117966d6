"""Circuit faithfulness (fp32): every edge keeps the whole gap and no edge none of it (to 1e-4, both modes);
the circuit of every edge but one is exactly that edge's path patch (an independent engine, to 1e-5);
the faithfulness curve of EAP-IG's ranking rises to 1 with CPR/CMD as docs/theory.md defines them."""

import numpy as np
import pytest
from helpers import one_thread  # noqa: F401

import reward_lens
from reward_lens import circuit_faithfulness, edge_attribution, faithfulness_curve, path_patch
from reward_lens.instruments.circuits.faithfulness_curve import FaithfulnessCurve


@pytest.fixture(scope="module")
def demo():
    return reward_lens.load_demo_model(device="cpu"), reward_lens.demo.demo_pairs()[:6]


@pytest.mark.parametrize("mode", ["noising", "denoising"])
def test_all_edges_keep_everything_and_none_nothing(demo, mode):
    model, pairs = demo
    assert (circuit_faithfulness(model, pairs, "all", mode=mode) - 1).abs().max() < 1e-4
    assert circuit_faithfulness(model, pairs, [], mode=mode).abs().max() < 1e-4


def test_all_but_one_edge_is_that_path_patch(demo):
    model, pairs = demo
    ig = edge_attribution(model, pairs, method="eap")
    edges = ig.ranking()
    picked = [e for e in edges if e[0] != "embed"][:6]
    exact = path_patch(model, pairs, sorted({s for s, _ in picked}), sorted({r for _, r in picked}))
    for s, r in picked:
        kept = circuit_faithfulness(model, pairs, [e for e in edges if e != (s, r)])
        patched = kept * exact.clean_gap + exact.clean_rejected  # r(circuit)
        want = exact.patched[:, exact.senders.index(s), exact.receivers.index(r)]
        assert (patched - want).abs().max() < 1e-5 * max(1.0, float(want.abs().max())), (s, r)
    assert (exact.effect().nan_to_num().abs().max()) > 0.1


def test_curve_cpr_cmd(demo):
    model, pairs = demo
    ig = edge_attribution(model, pairs)
    curve = faithfulness_curve(model, pairs, ig)
    assert isinstance(curve, FaithfulnessCurve)
    assert curve.sizes[0] == 0 and curve.sizes[-1] == curve.n_edges == len(ig.ranking())
    assert abs(curve.mean[0]) < 1e-4 and abs(curve.mean[-1] - 1) < 1e-4
    x = np.asarray(curve.sizes) / curve.n_edges
    assert curve.cpr == pytest.approx(float(np.sum(np.diff(x) * (curve.mean[1:] + curve.mean[:-1]) / 2)))
    assert curve.cmd == pytest.approx(
        float(np.sum(np.diff(x) * (np.abs(1 - curve.mean[1:]) + np.abs(1 - curve.mean[:-1])) / 2))
    )
    assert curve.cpr > 0.9  # EAP-IG's ranking: a few edges carry the preference
    rev = faithfulness_curve(model, pairs, ig.ranking()[::-1], sizes=curve.sizes)
    assert rev.cpr < curve.cpr  # the reverse ranking is worse: the measure has teeth
    frame = curve.to_frame()
    assert len(frame) == len(pairs) * len(curve.sizes)
    assert set(curve.summary().columns) >= {"cpr", "cmd"}
    import matplotlib.figure

    assert isinstance(curve.plot(), matplotlib.figure.Figure)
    with pytest.raises(ValueError, match="not an edge"):
        circuit_faithfulness(model, pairs, [("L3H0", "L1H0.q")])


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
def test_other_architectures(hf_models, arch):
    # GQA, a sliding window, q/k norms: the circuit engine against path patching, and EAP-IG's completeness.
    from helpers import token_pairs

    from reward_lens import HookedRewardModel

    model = HookedRewardModel.from_hf_model(hf_models[arch])
    pairs = token_pairs([(5, 9), (12, 3), (7, 7)], prompt_len=4)
    assert (circuit_faithfulness(model, pairs, "all") - 1).abs().max() < 1e-4
    assert circuit_faithfulness(model, pairs, []).abs().max() < 1e-4
    ig = edge_attribution(model, pairs)
    edges = ig.ranking()
    picked = [e for e in edges if e[0] != "embed" and e[1] != "readout"][:3]
    exact = path_patch(model, pairs, sorted({s for s, _ in picked}), sorted({r for _, r in picked}))
    for s, r in picked:
        r_circ = circuit_faithfulness(model, pairs, [e for e in edges if e != (s, r)]) * exact.clean_gap
        want = exact.patched[:, exact.senders.index(s), exact.receivers.index(r)] - exact.clean_rejected
        assert (r_circ - want).abs().max() < 1e-4 * max(1.0, float(exact.clean_gap.abs().max())), (arch, s, r)
    into = ig.scores[:, :, ig.receivers.index("readout")].sum(1)
    assert ((into - (ig.clean_rejected - ig.clean_chosen)).abs() / ig.clean_gap.abs()).max() < 0.01
