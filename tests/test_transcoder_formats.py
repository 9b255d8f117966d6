"""Transcoders in circuit-tracer's and SAELens's formats (`representations/transcoders/formats.py`):
directories written by the real tools (tests/data/, made in the tools' own venvs by
benchmarks/saelens_transcoders.py and benchmarks/circuit_tracer_transcoders.py) load here and reproduce
the tools' activations (fp32, <= 1e-6 absolute); our exports round-trip exactly and have the tools' own
keys and shapes; the TopK -> JumpReLU calibration matches TopK's per-feature firing counts on its
calibration tokens, recomputed from a plain TransformerLens cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import reward_lens as rl
from reward_lens.demo import synthetic
from reward_lens.model.hooks import act_name
from reward_lens.representations.transcoders import convert
from reward_lens.representations.transcoders.families import TopK

DATA = Path(__file__).parent / "data"
SAELENS = DATA / "saelens_transcoders"
CIRCUIT_TRACER = DATA / "circuit_tracer_transcoders"
HELD_OUT = synthetic.held_out_pairs(1)


@pytest.fixture(scope="module")
def model():
    return rl.load_demo_model(device="cpu")


@pytest.fixture(scope="module")
def calibration():
    return synthetic.training_pairs(12, 5, exclude=HELD_OUT)


@pytest.fixture(scope="module")
def jumprelu(model, calibration):
    return rl.jumprelu_from_topk(rl.load_transcoders("demo"), model, calibration)


@pytest.mark.parametrize(
    "name",
    [
        "jumprelu_skip_transcoder",
        "jumprelu_skip_negative_thresholds",
        "jumprelu_transcoder",
        "skip_transcoder",
    ],
)
def test_loads_transcoders_written_by_saelens(name):
    directory = SAELENS / name
    cfg = json.loads((directory / "cfg.json").read_text())
    expected = load_file(str(directory / "expected.safetensors"))
    tc = rl.load_transcoders(directory)
    layer = int(cfg["metadata"]["hook_name"].split(".")[1])
    assert tc.layers == [layer] and tc[layer].kind == "jumprelu"
    t = tc[layer]
    assert (t.W_skip is not None) == ("skip" in cfg["architecture"])
    x = expected["x"]
    assert torch.allclose(t.encode(x), expected["feature_acts"], rtol=0, atol=1e-6)
    assert torch.equal(t.encode(x) != 0, expected["feature_acts"] != 0)
    assert torch.allclose(t.decode(expected["feature_acts"]), expected["decode"], rtol=0, atol=1e-6)
    assert torch.allclose(t(x), expected["output"], rtol=0, atol=1e-6)


def test_loads_a_set_written_by_circuit_tracer():
    expected = load_file(str(CIRCUIT_TRACER / "expected.safetensors"))
    tc = rl.load_transcoders(CIRCUIT_TRACER)
    assert tc.layers == [0, 1] and bool((tc[0].threshold < 0).any())  # circuit-tracer fires pre > thr < 0
    for l in tc.layers:
        x, acts = expected[f"x.{l}"], expected[f"acts.{l}"]
        assert torch.allclose(tc[l].encode(x), acts, rtol=0, atol=1e-6)
        assert torch.equal(tc[l].encode(x) != 0, acts != 0)
        assert torch.allclose(tc[l](x), expected[f"out.{l}"], rtol=0, atol=1e-6)


def test_exports_round_trip_exactly(jumprelu, tmp_path):
    x = torch.randn(64, jumprelu[0].d_model)
    for fmt in ("circuit-tracer", "saelens", "reward-lens"):
        back = rl.load_transcoders(jumprelu.save(tmp_path / fmt, format=fmt))
        assert back.layers == jumprelu.layers
        for l in jumprelu.layers:
            a, b = jumprelu[l], back[l]
            assert b.kind == "jumprelu"
            for name in ("W_enc", "b_enc", "W_dec", "b_dec", "W_skip", "threshold"):
                assert torch.equal(getattr(a, name), getattr(b, name)), (fmt, l, name)
            assert torch.equal(a.encode(x), b.encode(x)) and torch.equal(a(x), b(x))
    assert back.config["jumprelu"]["source_family"] == "topk"


def test_saelens_export_has_saelens_own_layout(jumprelu, tmp_path):
    """Our cfg.json and tensors against a jumprelu_skip_transcoder saved by SAELens itself."""
    jumprelu.save(tmp_path, format="saelens")
    ours_dir, theirs_dir = tmp_path / "layer_2", SAELENS / "jumprelu_skip_transcoder"
    ours, theirs = (json.loads((d / "cfg.json").read_text()) for d in (ours_dir, theirs_dir))
    assert set(theirs) <= set(ours) and set(theirs["metadata"]) <= set(ours["metadata"])
    assert ours["architecture"] == theirs["architecture"] and ours["apply_b_dec_to_input"] is False
    assert ours["metadata"]["hook_name"] == "blocks.2.ln2.hook_normalized"
    assert ours["metadata"]["hook_name_out"] == "blocks.2.hook_mlp_out"
    w_ours, w_theirs = (load_file(str(d / "sae_weights.safetensors")) for d in (ours_dir, theirs_dir))
    assert set(w_ours) == set(w_theirs)
    d_model, d_tc = jumprelu[2].d_model, jumprelu[2].d_tc
    scale = {theirs["d_in"]: d_model, theirs["d_sae"]: d_tc}
    for name, t in w_theirs.items():
        assert tuple(w_ours[name].shape) == tuple(scale[s] for s in t.shape), name
    assert torch.equal(w_ours["W_enc"], jumprelu[2].W_enc.T)  # SAELens's [d_in, d_sae]


def test_circuit_tracer_export_has_circuit_tracers_own_layout(jumprelu, tmp_path):
    import yaml

    jumprelu.save(tmp_path, format="circuit-tracer")
    ours = yaml.safe_load((tmp_path / "config.yaml").read_text())
    theirs = yaml.safe_load((CIRCUIT_TRACER / "config.yaml").read_text())
    assert set(theirs) <= set(ours)
    for key in ("model_kind", "feature_input_hook", "feature_output_hook"):
        assert ours[key] == theirs[key]
    assert sorted(p.name for p in tmp_path.glob("layer_*.safetensors")) == [
        f"layer_{l}.safetensors" for l in range(4)
    ]
    w_ours, w_theirs = (
        load_file(str(tmp_path / "layer_0.safetensors")),
        load_file(str(CIRCUIT_TRACER / "layer_0.safetensors")),
    )
    assert set(w_ours) == set(w_theirs)  # circuit-tracer's load_state_dict is strict
    assert w_ours["W_enc"].shape == jumprelu[0].W_enc.shape == (512, 128)  # [d_tc, d_model], not transposed


def test_topk_calibration_matches_firing_counts(model, calibration, jumprelu):
    """Recomputed from a plain cache: on the calibration tokens, each feature fires under the JumpReLU on
    exactly as many tokens as under TopK (where no tie makes that impossible); thresholds are >= 0."""
    topk = rl.load_transcoders("demo")
    assert jumprelu.config["jumprelu"]["calibration_tokens"] > 500
    for l in (0, 3):
        xs = []
        for p in calibration:
            for side in (p.chosen, p.rejected):
                _, cache = model.run_with_cache(model.to_tokens(p.prompt, side)["input_ids"])
                xs.append(cache[act_name("normalized", l, norm="ln2")][0])
        x = torch.cat(xs)
        assert x.shape[0] == jumprelu.config["jumprelu"]["calibration_tokens"]
        pre = x @ topk[l].W_enc.T + topk[l].b_enc
        want = (TopK.activate(pre, topk[l].k, None) > 0).sum(0)
        got = (jumprelu[l].encode(x) != 0).sum(0)
        # Texts sharing a prompt repeat its activations, so a feature's c-th and (c+1)-th largest
        # pre-activations can tie and no threshold separates them: exact where they are apart.
        ranked = torch.cat([pre.sort(0, descending=True).values, torch.full((1, pre.shape[1]), -1e9)])
        gap = ranked.gather(0, (want - 1).clamp(min=0)[None])[0] - ranked.gather(0, want[None])[0]
        apart = (gap > 1e-4) & (want > 0)
        assert float(apart.float().mean()) > 0.6  # 0.73 on these texts
        assert torch.equal(got[apart], want[apart])
        assert abs(int(got.sum()) - int(want.sum())) <= 0.02 * int(want.sum())
        assert float(jumprelu[l].threshold.min()) >= 0.0
        assert torch.equal(jumprelu[l].W_enc, topk[l].W_enc) and torch.equal(
            jumprelu[l].W_skip, topk[l].W_skip
        )


def test_jumprelu_thresholds_definition():
    pre = torch.tensor(
        [[3.0, -1.0, 0.5, 2.0], [1.0, -2.0, 0.4, 2.0], [2.0, -3.0, 0.3, 2.0], [0.5, 1.0, 0.2, 1.0]]
    )
    fired = torch.zeros(4, 4, dtype=torch.bool)
    fired[[0, 2], 0] = True  # twice: halfway between its 2nd and 3rd largest
    # feature 1 never: above its largest (by 0.1%); feature 2 on every row: below its smallest, raised to 0
    fired[:, 2] = True
    fired[[0, 1], 3] = True  # twice, but its 2nd and 3rd largest tie (2.0): the cut nearest to 2 is 3
    want = torch.tensor([1.5, 1.0 + 1e-3 + 1e-6, 0.0, 1.5])
    assert torch.allclose(convert.jumprelu_thresholds(pre, fired), want)


def test_batchtopk_converts_exactly():
    t = rl.Transcoder(6, 10, 3, "batchtopk", skip=False)
    with torch.no_grad():
        for p in (t.W_enc, t.b_enc, t.W_dec, t.b_dec):
            p.copy_(torch.randn(p.shape))
        t.threshold.fill_(0.3)
    jr = rl.jumprelu_from_topk(rl.TranscoderSet({0: t}))
    x = torch.randn(40, 6)
    assert jr[0].kind == "jumprelu" and torch.equal(jr[0].encode(x), t.encode(x))
    assert jr.config["jumprelu"]["exact"]


def test_bad_input_is_one_clear_line(model, tmp_path):
    topk = rl.load_transcoders("demo")
    with pytest.raises(ValueError, match="convert first with jumprelu_from_topk"):
        topk.save(tmp_path / "a", format="saelens")
    with pytest.raises(ValueError, match="needs calibration text"):
        rl.jumprelu_from_topk(topk)
    with pytest.raises(ValueError, match="unknown transcoder format"):
        topk.save(tmp_path / "b", format="sparsify")
    partial = rl.TranscoderSet({l: topk[l] for l in (1, 2)})
    jr = rl.jumprelu_from_topk(partial, model, synthetic.training_pairs(2, 5, exclude=HELD_OUT))
    with pytest.raises(ValueError, match="every layer 0..2"):
        jr.save(tmp_path / "c", format="circuit-tracer")
    with pytest.raises(ValueError, match="inference form"):
        rl.train_transcoders(
            model, synthetic.training_pairs(2, 5, exclude=HELD_OUT), kind="jumprelu", steps=1
        )
    bad = tmp_path / "hooks"
    jr.save(bad, format="saelens")
    cfg = json.loads((bad / "layer_1" / "cfg.json").read_text())
    cfg["metadata"]["hook_name"] = "blocks.1.hook_resid_mid"
    (bad / "layer_1" / "cfg.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="reward-lens's transcoders map 'blocks.1.ln2.hook_normalized'"):
        rl.load_transcoders(bad)
    with pytest.raises(FileNotFoundError, match="holds no transcoders"):
        rl.load_transcoders(tmp_path / "c" / "nothing")
