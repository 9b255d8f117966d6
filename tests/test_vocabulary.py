"""One vocabulary and one tie rule across instruments: residuals have one name everywhere, and a pair whose
chosen and rejected responses tie (reward gap exactly 0) gives NaN, never ±inf, in every normalised quantity
of every instrument."""

import numpy as np
import pandas as pd
import pytest

from reward_lens import (
    PreferencePair,
    attribute,
    attribution_patch,
    demo_pairs,
    divergence_patch,
    faithfulness,
    lens,
    load_demo_model,
    patch,
    path_patch,
    token_attribution,
)
from reward_lens.instruments.sites import resid_sites


@pytest.fixture(scope="module")
def tie_run():
    model = load_demo_model(device="cpu")
    pairs = demo_pairs()[:2]
    same = pairs[0].chosen
    pairs = pairs + [PreferencePair(pairs[0].prompt, same, same, id="tie")]  # alone in the second batch
    kw = dict(batch_size=2, progress=False)
    attr = attribute(model, pairs, **kw)
    pat = patch(model, pairs, mode=["noising", "denoising", "zero", "mean"], **kw)
    results = {
        "lens": lens(model, pairs, **kw),
        "attribution": attr,
        "patch": pat,
        "atp": attribution_patch(model, pairs, mode=["noising", "zero"], **kw),
        "path": path_patch(model, pairs, ["L0H0", "mlp_L0"], ["L1H1.q", "readout"], batch_size=2),
        "tokens": token_attribution(model, pairs, batch_size=2),
        "faithfulness": faithfulness(attr, pat, n_boot=20),
        "divergence": divergence_patch(model, pairs, **kw),
    }
    return pairs, results


def test_the_tie_is_exact(tie_run):
    _, results = tie_run
    gap = results["patch"].clean_gap
    assert gap[2].item() == 0.0 and (gap[:2].abs() > 0).all()


@pytest.mark.parametrize(
    "name", ["lens", "attribution", "patch", "atp", "path", "tokens", "faithfulness", "divergence"]
)
def test_no_infinity_in_any_frame(tie_run, name):
    res = tie_run[1][name]
    for frame in (res.to_frame(), res.summary()):
        numeric = frame.select_dtypes(include=[np.number])
        assert not np.isinf(numeric.to_numpy(dtype=float)).any(), f"{name}: ±inf in {list(numeric.columns)}"


@pytest.mark.parametrize(
    "name, column",
    [("patch", "normalized_effect"), ("atp", "normalized_effect"), ("path", "normalized_effect")],
)
def test_normalised_effects_of_a_tie_are_nan(tie_run, name, column):
    frame = tie_run[1][name].to_frame()
    tie = frame[frame["pair"] == "tie"]
    assert len(tie) and tie[column].isna().all()
    assert frame[frame["pair"] != "tie"][column].notna().all()


def test_path_patching_normalised_effect_is_nan_not_inf(tie_run):
    eff = tie_run[1]["path"].effect(normalized=True)
    assert not eff.isinf().any() and eff[2].isnan().all()


def test_residual_sites_have_one_name(tie_run):
    """The lens names each residual as patching's residual sites do (resid_L{l}: entering block l)."""
    model = load_demo_model(device="cpu")
    lens_sites = [s for s in tie_run[1]["lens"].sites if "mid" not in s]
    assert lens_sites == [s.name for s in resid_sites(model.cfg)]
    pairs = tie_run[0][:2]
    residual = patch(model, pairs, mode="noising", level="residual", batch_size=2, progress=False)
    assert residual.components == lens_sites  # the same residual, the same name, in both instruments
    frame = tie_run[1]["lens"].to_frame()
    assert isinstance(frame, pd.DataFrame) and set(lens_sites) <= set(frame["site"])
