"""Over-long inputs: one truncation warning per instrument call (and per audit), naming how many distinct
inputs were cut; not one warning per batch."""

import warnings

import pytest
from helpers import one_thread, tiny_tokenizer  # noqa: F401

from reward_lens import HookedRewardModel
from reward_lens import instruments as ins
from reward_lens.data.pairs import bundled_pairs
from reward_lens.model.truncation import one_truncation_warning, report_truncation

LIMIT = 19


@pytest.fixture(scope="module")
def model(llama_hf):
    tok = tiny_tokenizer()
    tok.model_max_length = LIMIT
    return HookedRewardModel.from_hf_model(llama_hf, tok)


def truncation_warnings(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in caught if "truncated from the left" in str(w.message)]


def n_too_long(model, pairs) -> int:
    """Distinct texts longer than LIMIT tokens, each tokenised alone with no limit."""
    texts = {(p.prompt, r) for p in pairs for r in (p.chosen, p.rejected)}
    return sum(
        int(model.to_tokens([p], [r], max_length=10**6)["attention_mask"].sum()) > LIMIT for p, r in texts
    )


def test_one_warning_per_instrument_call(model):
    pairs = bundled_pairs()[:6]
    expected = n_too_long(model, pairs)
    assert 2 < expected < 12  # some, not all, inputs are cut: the count is informative
    messages = truncation_warnings(lambda: ins.lens(model, pairs, batch_size=2))  # 3 batches x 2 sides
    assert len(messages) == 1 and messages[0].startswith(f"{expected} input(s) longer than {LIMIT} tokens")

    # Two instruments inside one collector (as the audit runs them): still one warning, distinct inputs.
    def both():
        with one_truncation_warning():
            ins.lens(model, pairs, batch_size=2)
            ins.attribute(model, pairs, batch_size=4)

    messages = truncation_warnings(both)
    assert len(messages) == 1 and messages[0].startswith(f"{expected} input(s)")


def test_direct_report_warns_at_once_and_collector_resets():
    assert truncation_warnings(lambda: report_truncation(["a", "b", "a"], 5)) == [
        truncation_warnings(lambda: report_truncation(["x", "y"], 5))[0]
    ]
    with pytest.raises(RuntimeError):
        with one_truncation_warning():
            raise RuntimeError("boom")
    assert len(truncation_warnings(lambda: report_truncation(["a"], 5))) == 1  # no collector left open
