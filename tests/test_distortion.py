"""Distortion index: hand-computed values, a planted under-covered dimension, the geometry path, a model."""

import matplotlib

matplotlib.use("Agg")

import numpy as np
import pandas as pd
import pytest
import torch

from reward_lens.theory import distortion_from_directions, distortion_from_model, distortion_index


def test_small_case_matches_hand_computation():
    # probe A: 2 pairs, probe B: 3 pairs; 2 dimensions; sensitivity given.
    qa = np.array([[1.0, 0.0], [2.0, 1.0]])
    qb = np.array([[0.0, 1.0], [0.0, 2.0], [1.0, 0.0]])
    g = np.array([2.0, 1.0])
    ra, rb = qa @ g, qb @ g
    res = distortion_index({"A": (ra, qa), "B": (rb, qb)}, ["x", "y"], sensitivity=g, n_boot=0)
    # by hand: a = q * g
    ea = np.array([(2 * 1) ** 2 + (2 * 2) ** 2, 0 + 1**2])  # [20, 1]
    eb = np.array([2**2, 1 + 4])  # [4, 5]
    C = np.stack([ea / ea.sum(), eb / eb.sum()])
    E = ea + eb
    c = E / E.sum()
    push = g**2 / (g**2).sum()
    np.testing.assert_allclose(res.coverage_matrix.values, C, rtol=1e-12)
    np.testing.assert_allclose(res.effective_energy, E, rtol=1e-12)
    np.testing.assert_allclose(res.effective_pairs, 2 * C[0] + 3 * C[1], rtol=1e-12)
    np.testing.assert_allclose(res.coverage_share, c, rtol=1e-12)
    np.testing.assert_allclose(res.push_share, push, rtol=1e-12)
    assert res.index == pytest.approx(0.5 * np.abs(push - c).sum(), rel=1e-12)
    np.testing.assert_allclose(res.explained.values, [1.0, 1.0], atol=1e-12)  # Δr is exactly Δq g


def test_pure_probes_equal_sizes_have_no_distortion_and_ratio_formula():
    rng = np.random.default_rng(0)
    g = np.array([1.0, -0.5, 2.0])
    sizes = [30, 30, 30]
    data = {}
    for k, n in enumerate(sizes):
        q = np.zeros((n, 3))
        q[:, k] = 1.0
        data[f"probe_{k}"] = (q @ g + 0.01 * rng.standard_normal(n), q)
    res = distortion_index(data, ["a", "b", "c"], sensitivity=g, n_boot=0)
    assert res.index == pytest.approx(0.0, abs=1e-12)
    np.testing.assert_allclose(res.ratio, 1.0)
    assert not res.under_covered.any()
    # unequal sizes: rho_k = n_k / sum_j pi_j n_j
    sizes = [60, 30, 5]
    data = {}
    for k, n in enumerate(sizes):
        q = np.zeros((n, 3))
        q[:, k] = 1.0
        data[f"probe_{k}"] = (q @ g, q)
    res = distortion_index(data, ["a", "b", "c"], sensitivity=g, n_boot=0)
    pi = g**2 / (g**2).sum()
    np.testing.assert_allclose(res.ratio, np.array(sizes) / (pi * np.array(sizes)).sum(), rtol=1e-12)
    assert res.flagged == ["c"]


def _planted(seed=0, syc_scale=0.05):
    """Four dimensions; sycophancy is barely moved by any evaluation probe."""
    rng = np.random.default_rng(seed)
    dims = ["length", "confidence", "formatting", "sycophancy"]
    g = np.array([1.0, 0.8, 0.6, 1.2])
    rows = []

    def add(probe, n, scales):
        q = rng.standard_normal((n, 4)) * np.asarray(scales)
        r = q @ g + 0.1 * rng.standard_normal(n)
        for qi, ri in zip(q, r):
            rows.append({"probe": probe, "reward_delta": ri, **dict(zip(dims, qi))})

    add("chat", 60, [1.0, 1.0, 0.0, 0.0])
    add("format", 40, [0.0, 0.0, 1.0, 0.0])
    add("mixed", 50, [0.7, 0.0, 0.7, syc_scale])
    return pd.DataFrame(rows), dims, g


def test_planted_under_covered_dimension_is_flagged():
    frame, dims, g = _planted()
    res = distortion_index(frame, sensitivity=dict(zip(dims, g)), n_boot=200, seed=1)
    assert res.dimensions == dims
    assert res.flagged == ["sycophancy"]
    k = dims.index("sycophancy")
    assert res.push_share[k] > 0.3 and res.coverage_share[k] < 0.01
    assert res.coverage_share_ci[k, 1] < 0.5 * res.push_share[k]  # the whole interval is under-covered
    assert res.index == pytest.approx(res.deficit.sum())
    assert res.index > 0.3 and res.index_ci[0] <= res.index <= res.index_ci[1]
    # covering sycophancy properly removes the flag
    frame2, _, _ = _planted(syc_scale=1.5)
    res2 = distortion_index(frame2, sensitivity=dict(zip(dims, g)), n_boot=0)
    assert "sycophancy" not in res2.flagged and res2.index < res.index
    # plain outputs
    assert set(res.to_frame().columns) >= {"dimension", "push_share", "coverage_share", "under_covered"}
    assert len(res.matrix_frame()) == 3 * 4
    assert isinstance(res.plot(), matplotlib.figure.Figure)


def test_estimated_sensitivity_and_never_varied_dimension():
    frame, dims, g = _planted(syc_scale=0.0)  # sycophancy never varied: unidentifiable
    res = distortion_index(frame, n_boot=50)
    assert res.sensitivity_source == "estimated"
    assert list(res.sensitivity_assumed) == [False, False, False, True]
    np.testing.assert_allclose(res.sensitivity[:3], np.abs(g[:3]), atol=0.03)  # least squares recovers g
    assert res.sensitivity[3] == pytest.approx(res.sensitivity[:3].max())  # worst case assumed
    assert res.flagged == ["sycophancy"] and res.coverage_share[3] == 0.0
    assert res.notes and "sycophancy" in res.notes[0]


def test_bad_inputs_give_clear_errors():
    frame, dims, g = _planted()
    with pytest.raises(ValueError, match="no column 'reward_delta'"):
        distortion_index(frame.drop(columns="reward_delta"))
    with pytest.raises(ValueError, match="no value for dimension"):
        distortion_index(frame, sensitivity={"length": 1.0})
    with pytest.raises(ValueError, match="NaN"):
        bad = frame.copy()
        bad.loc[0, "length"] = np.nan
        distortion_index(bad)
    with pytest.raises(ValueError, match="3 reward deltas but 2 rows"):
        distortion_index({"p": (np.zeros(3), np.zeros((2, 2)))})


def test_geometry_path_equals_plain_path_and_flags_missing_direction():
    rng = np.random.default_rng(2)
    d, K = 16, 3
    U = np.linalg.qr(rng.standard_normal((d, K)))[0].T  # orthonormal rows
    w = 1.5 * U[0] - 0.7 * U[1] + 1.1 * U[2] + 0.3 * rng.standard_normal(d)
    deltas = {
        "p1": rng.standard_normal((40, 2)) @ U[:2] + 0.05 * rng.standard_normal((40, d)),
        "p2": rng.standard_normal((30, 1)) @ U[:1] + 0.05 * rng.standard_normal((30, d)),
    }
    res = distortion_from_directions(w, {"u0": U[0], "u1": 3.0 * U[1], "u2": U[2]}, deltas, n_boot=0)
    # same as the plain path with Δq = δ U^T and g = U w (orthonormal U)
    plain = distortion_index(
        {p: (x @ w, x @ U.T) for p, x in deltas.items()}, ["u0", "u1", "u2"], sensitivity=U @ w, n_boot=0
    )
    np.testing.assert_allclose(res.coverage_matrix.values, plain.coverage_matrix.values, atol=1e-10)
    assert res.index == pytest.approx(plain.index, abs=1e-10)
    assert res.flagged == ["u2"]
    assert res.sensitivity_source == "geometry"


def _token_pairs(n, seed, vocab=97):
    from reward_lens.data.pairs import TokenPair

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = torch.randint(1, vocab, (5,), generator=g)
        c = torch.randint(1, vocab, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g)
        r = torch.randint(1, vocab, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g)
        out.append(TokenPair(torch.cat([prompt, c]), torch.cat([prompt, r]), id=f"{seed}-{i}"))
    return out


def test_model_path_reward_differences_are_exact(llama_model):
    from reward_lens.theory.distortion_model import readout_states

    pairs = _token_pairs(6, seed=0)
    delta, w = readout_states(llama_model, pairs, batch_size=4)
    gaps = []
    with torch.no_grad():
        for p in pairs:
            gaps.append(float(llama_model(p.chosen[None]) - llama_model(p.rejected[None])))
    np.testing.assert_allclose((delta * w).sum(1), gaps, atol=1e-5, rtol=1e-5)
    # a model-level run: two dimensions from pair sets, two probes
    dims = {
        "dim_a": _token_pairs(4, seed=1),
        "dim_b": torch.randn(llama_model.cfg.d_model, generator=torch.Generator().manual_seed(3)),
    }
    res = distortion_from_model(
        llama_model, {"eval1": pairs, "eval2": _token_pairs(5, seed=2)}, dims, n_boot=20
    )
    assert res.coverage_matrix.shape == (2, 2)
    np.testing.assert_allclose(res.coverage_matrix.values.sum(1), 1.0, atol=1e-12)
    assert 0.0 <= res.index <= 1.0


@pytest.fixture(scope="module")
def text_model():
    """A tiny random Llama RM with a byte-level BPE tokenizer (any text tokenises)."""
    from helpers import tiny_hf_model
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from reward_lens import HookedRewardModel

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(
        [
            "What is the capital of France? The capital of France is Paris.",
            "I agree with you. You are right. I hope this helps.",
        ],
        trainer=trainer,
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    return HookedRewardModel.from_hf_model(
        tiny_hf_model("llama", vocab_size=len(fast), max_position_embeddings=1024), tokenizer=fast
    )


def test_adapters_take_a_probe_suite_result(text_model):
    """distortion_from_model(dimensions=ProbeResult) and detect_cascades(ProbeResult) on real probe output."""
    from reward_lens.data.pairs import bundled_pairs
    from reward_lens.probes.suite import load_probe_items, probe_pairs, run_probes
    from reward_lens.theory import detect_cascades
    from reward_lens.theory.distortion_model import readout_states

    items = load_probe_items()[:6]
    probes = run_probes(
        text_model, items=items, dimensions=["length", "confidence", "formatting"], n_boot=100, n_perm=200
    )
    casc = detect_cascades(probes, n_boot=100)
    assert casc.dimensions == ["length", "confidence", "formatting"] and casc.n_items == 6
    wide = probes.per_item.pivot(index="item_id", columns="dimension", values="delta")[casc.dimensions]
    np.testing.assert_allclose(casc.corr, np.corrcoef(wide.to_numpy().T), atol=1e-12)

    evaluation = bundled_pairs()[:8]
    res = distortion_from_model(text_model, evaluation, probes, n_boot=20)
    assert res.dimensions == ["length", "confidence", "formatting"]
    assert res.probes == list(dict.fromkeys(p.subset or "all" for p in evaluation))
    assert res.sensitivity_source == "geometry"
    # each dimension's direction is the mean readout difference of its probe pairs, and w · δ = Δr exactly
    delta, w = readout_states(text_model, probe_pairs(items, "length"))
    np.testing.assert_allclose(
        (delta * w).sum(1), probes.per_item.query("dimension == 'length'").delta, atol=1e-4
    )
    # the probe suite keeps those readout differences from its own forward: the same as recomputed per pair
    rows = (probes.per_item.dimension == "length").to_numpy()
    np.testing.assert_allclose(probes.item_deltas[rows], delta, atol=1e-5)
    import dataclasses

    recomputed = distortion_from_model(
        text_model, evaluation, dataclasses.replace(probes, item_deltas=None), n_boot=20
    )
    pd.testing.assert_frame_equal(res.to_frame(), recomputed.to_frame(), atol=1e-5)
