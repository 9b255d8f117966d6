"""Pairs are normalised once, where they enter: `as_pairs` returns checked `Pairs` unchanged, so one
`run_audit` call checks its pairs once however many instruments it runs (the pipeline, token attribution,
the distortion index, the ArmoRM view and conflicts all receive the typed pairs)."""

import pytest
from helpers import one_thread  # noqa: F401
from test_audit_armorm import tiny_armorm

import reward_lens.data.pairs as pairs_module
from reward_lens import bundled_pairs, demo_pairs, load_demo_model
from reward_lens.app.audit import run_audit
from reward_lens.data.pairs import Pairs, PreferencePair, TokenPair, as_pairs


@pytest.fixture
def normalisations(monkeypatch):
    """The inputs `as_pairs` had to check (each call of the normalisation itself)."""
    seen = []
    check = pairs_module.checked_pairs

    def counted(pairs):
        seen.append(type(pairs).__name__)
        return check(pairs)

    monkeypatch.setattr(pairs_module, "checked_pairs", counted)
    return seen


def test_checked_pairs_pass_through_unchanged(normalisations):
    raw = [PreferencePair("p", "c", "r"), PreferencePair("q", "d", "s")]
    pairs = as_pairs(raw)
    assert isinstance(pairs, Pairs) and pairs == raw and normalisations == ["list"]
    assert as_pairs(pairs) is pairs and as_pairs(pairs[:1]) == raw[:1]
    assert isinstance(pairs[:1], Pairs) and isinstance(pairs.take([1, 0]), Pairs)
    assert pairs.take([1, 0]) == [raw[1], raw[0]] and pairs[0] is raw[0]
    assert normalisations == ["list"]  # the slice and the taken pairs were not checked again
    with pytest.raises(ValueError, match="no preference pairs given"):
        as_pairs(pairs[5:])
    with pytest.raises(ValueError, match="mixing"):
        as_pairs([raw[0], TokenPair([1, 2], [1, 3])])


def test_one_audit_normalises_its_pairs_once(normalisations):
    model = load_demo_model(device="cpu")
    audit = run_audit(model, demo_pairs()[:6], out_dir=None, echo=lambda s: None)
    assert "tokens" in audit.results and "distortion" in audit.record  # the steps that took pairs ran
    assert normalisations == ["list"]


def test_one_armorm_audit_normalises_its_pairs_once(tmp_path, normalisations):
    pairs = bundled_pairs()[:6]
    model = tiny_armorm(tmp_path, pairs)
    audit = run_audit(model, pairs, out_dir=None, batch_size=4, echo=lambda s: None)
    assert "armorm" in audit.results and "conflicts" in audit.results
    assert normalisations == ["list"]
