"""The readout fast path when the readout is not the last attended token: pad = EOS (TRL's default), each
sequence ends with EOS and transformers reads one token before it. Under causal attention the trailing EOS
never reaches the reward, so the KV-cache fast path stays exact: fast = naive within 1e-5 (fp32, relative to
max(1, |reward|)) for `patch` (every mode, component, head and residual levels, both padding sides, full
attention and sliding windows), `divergence_patch` and `path_patch`; and the fast path is actually taken."""

import pytest
import torch
from helpers import one_thread, tiny_hf_model, token_pairs, word_tokenizer  # noqa: F401

from reward_lens import HookedRewardModel
from reward_lens.core.batching import tokenize_pair_batch
from reward_lens.data.pairs import TokenPair
from reward_lens.instruments import divergence_patch, patch
from reward_lens.instruments.patching.path import path_patch

TOL = 1e-5
EOS = 2
MODES = ["noising", "denoising", "zero", "mean"]


def pad_is_eos_model(arch: str = "llama"):
    tok = word_tokenizer(
        ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(3, 97)], bos="<s>", eos="</s>", pad="</s>"
    )
    return HookedRewardModel.from_hf_model(tiny_hf_model(arch, pad_token_id=EOS), tokenizer=tok)


def eos_pairs(lengths, seed=0):
    """Token pairs whose ids never contain EOS except the one ending each sequence (as TRL tokenises)."""
    eos = torch.tensor([EOS])
    return [
        TokenPair(torch.cat([p.chosen, eos]), torch.cat([p.rejected, eos]), id=p.id)
        for p in token_pairs(lengths, prompt_len=3, seed=seed, low=3)
    ]


PAIRS = eos_pairs([(6, 3), (2, 7), (5, 5), (4, 1)])


@pytest.fixture(scope="module")
def model():
    return pad_is_eos_model()


def assert_close(fast: torch.Tensor, naive: torch.Tensor, what: str) -> None:
    err = ((fast - naive).abs() / naive.abs().clamp(min=1.0)).max().item()
    assert err < TOL, f"{what}: fast vs naive differ by {err:.2e}"


@pytest.mark.filterwarnings("ignore:rows .* read the reward before their last position")
def test_the_readout_is_one_before_the_trailing_eos(model):
    """The set-up the fast path is tested on: the trailing EOS is attended, the readout precedes it."""
    for side in ("right", "left"):
        batch = tokenize_pair_batch(model, PAIRS, slice(0, len(PAIRS)), side)
        for tok, rows in (
            (batch.chosen, [p.chosen for p in PAIRS]),
            (batch.rejected, [p.rejected for p in PAIRS]),
        ):
            last = tok.attention_mask.shape[1] - 1 - tok.attention_mask.flip(-1).argmax(-1)  # last attended
            assert torch.equal(tok.readout, last - 1)
            assert (tok.input_ids[torch.arange(len(rows)), last] == EOS).all()
            # the reward equals a transformers-style forward of the unpadded row (read one before EOS)
            ref = torch.stack([model(r[None])[0] for r in rows])
            assert (model(tok.input_ids, tok.attention_mask) - ref).abs().max() < 1e-5


@pytest.mark.parametrize("arch,side", [("llama", "right"), ("llama", "left"), ("mistral", "right")])
def test_patch_fast_equals_naive(model, arch, side, count_readout_sweeps):
    m = model if arch == "llama" else pad_is_eos_model(arch)
    kw = dict(
        mode=MODES, level=["component", "head", "residual"], padding_side=side, batch_size=3, progress=False
    )
    fast = patch(m, PAIRS, **kw)
    assert count_readout_sweeps, "the readout fast path was not taken"
    naive = patch(m, PAIRS, method="naive", **kw)
    assert fast.patched.keys() == naive.patched.keys() and len(fast.patched) == 6
    for key in fast.patched:
        assert_close(fast.patched[key], naive.patched[key], str(key))
        assert fast.patched[key].abs().max() > 0
    assert fast.effect("noising").abs().max() > 1e-3  # the patches move the reward: the comparison has teeth


def test_divergence_patch_on_pad_is_eos(model):
    for mode in ("noising", "denoising"):
        div = divergence_patch(
            model, PAIRS, mode=mode, level=["component", "head"], batch_size=3, progress=False
        )
        naive = patch(
            model, PAIRS, mode=mode, level=["component", "head"], method="naive", batch_size=3, progress=False
        )
        key = next(iter(div.patching.patched))
        assert_close(div.patching.patched[key], naive.patched[key], f"divergence {mode}")
        assert torch.isfinite(div.scores).all() and torch.isfinite(div.threshold).all()
        assert div.flagged.shape == (len(PAIRS), len(div.patching.sites))


def test_path_patch_fast_equals_naive(model):
    senders, receivers = ["L0H1", "attn_L0", "mlp_L1"], ["L1H0.q", "L1KV1.v", "mlp_L1", "L2H2.q", "readout"]
    for side, mode in (("right", "noising"), ("left", "denoising")):
        fast = path_patch(model, PAIRS, senders, receivers, mode=mode, padding_side=side)
        naive = path_patch(model, PAIRS, senders, receivers, mode=mode, padding_side=side, method="naive")
        ok = torch.isfinite(naive.patched)
        assert torch.equal(ok, torch.isfinite(fast.patched)) and ok.any()
        assert_close(fast.patched[ok], naive.patched[ok], f"path {mode}")
