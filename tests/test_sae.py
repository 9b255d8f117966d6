"""TopK SAE training, metrics, the SAELens disk format (ours and SAELens-written directories), width
errors."""

import json
from pathlib import Path

import pytest
import torch
from organism import organism, single_thread, sprinkled_texts  # noqa: F401 (single_thread: autouse fixture)
from safetensors.torch import load_file, save_file

from reward_lens import load_sae, train_sae
from reward_lens.core.readout import readout_run, stream_activations
from reward_lens.representations.sae import SAEConfig, SparseAutoencoder, gather_activations, topk_losses

HOOK = "blocks.1.hook_resid_post"


@pytest.fixture(scope="module")
def trained():
    o = organism()
    sae = train_sae(
        o.model,
        sprinkled_texts(200),
        hook_name=HOOK,
        d_sae=48,
        k=3,
        batch_size=256,
        epochs=30,
        progress=False,
        seed=0,
    )
    return o, sae


def test_topk_sae_recovers_the_planted_direction(trained):
    o, sae = trained
    cos = sae.decoder_directions @ o.u
    assert float(cos.max()) >= 0.9
    # The recovered latent fires on concept tokens and only there (the planted feature is sparse).
    best = int(cos.argmax())
    acts = gather_activations(o.model, sprinkled_texts(40, seed=11), HOOK)
    is_concept = (acts - acts.mean(0)) @ o.u > 0.5
    f = sae.encode(acts)[:, best]
    assert float((f[is_concept] > 0).float().mean()) > 0.6  # some concept words also get latents of their own
    assert float(f[~is_concept].mean()) < 0.05 * float(f[is_concept].mean())  # selective


def test_decoder_rows_unit_norm_and_metrics(trained):
    _, sae = trained
    assert torch.allclose(sae.W_dec.norm(dim=-1), torch.ones(sae.cfg.d_sae), atol=1e-5)
    m = sae.metrics
    assert m.l0 == pytest.approx(3.0, abs=1e-6)  # TopK: exactly k active (all positive on this data)
    assert 0.0 <= m.fvu < 0.1 and 0.0 <= m.dead_fraction < 0.5
    assert len(m.history) > 10 and m.history["fvu"].iloc[-1] < m.history["fvu"].iloc[0]
    assert sae.cfg.hook_name == HOOK and sae.cfg.k == 3 and sae.cfg.d_in == 64
    fig = m.plot()
    assert fig.axes


def test_evaluate_matches_an_independent_computation(trained):
    o, sae = trained
    x = gather_activations(o.model, sprinkled_texts(20, seed=5), HOOK)
    m = sae.evaluate(x, batch_size=37)  # odd batch size: the streaming sums must not depend on it
    pre = (x - sae.b_dec) @ sae.W_enc + sae.b_enc
    top = pre.topk(3, dim=-1)
    f = torch.zeros_like(pre).scatter(-1, top.indices, top.values.clamp(min=0))
    recon = f @ sae.W_dec + sae.b_dec
    fvu = float(((x - recon) ** 2).sum() / ((x - x.mean(0)) ** 2).sum())
    assert m.fvu == pytest.approx(fvu, rel=1e-4)
    assert m.l0 == pytest.approx(float((f > 0).sum(-1).float().mean()), abs=1e-6)
    assert m.dead_fraction == pytest.approx(float(((f > 0).sum(0) == 0).float().mean()), abs=1e-6)
    assert torch.allclose(sae.encode(x), f, atol=1e-6) and torch.allclose(sae(x), recon, atol=1e-5)


def test_aux_loss_gives_dead_latents_a_gradient():
    g = torch.Generator().manual_seed(0)
    d_in, d_sae, k = 8, 32, 2
    params = {
        n: t.requires_grad_(True)
        for n, t in {
            "W_enc": torch.randn(d_in, d_sae, generator=g),
            "W_dec": torch.randn(d_sae, d_in, generator=g),
            "b_enc": torch.zeros(d_sae),
            "b_dec": torch.zeros(d_in),
        }.items()
    }
    x = torch.randn(64, d_in, generator=g)
    dead = torch.zeros(d_sae, dtype=torch.bool)
    dead[20:] = True
    mse, aux, fired = topk_losses(params, x, k, dead, aux_k=4)
    assert fired.shape == (d_sae,) and float(aux.detach()) > 0
    aux.backward()
    grad = params["W_enc"].grad
    assert float(grad[:, 20:].abs().sum()) > 0  # dead latents learn from the AuxK loss
    assert float(grad[:, :20].abs().sum()) == 0  # live latents get nothing from it
    for p in params.values():
        p.grad = None
    mse, aux, _ = topk_losses(params, x, k, None, aux_k=4)
    assert float(aux.detach()) == 0.0


def test_stream_activations_all_tokens_and_readout():
    o = organism()
    prompts, responses = sprinkled_texts(6, seed=2)
    tok = o.model.to_tokens(prompts, responses)
    all_tokens = torch.cat(list(stream_activations(o.model, prompts, responses, HOOK, batch_size=4)))
    assert all_tokens.shape == (int(tok["attention_mask"].sum()), 64)
    readout = torch.cat(
        list(stream_activations(o.model, prompts, responses, HOOK, positions="readout", batch_size=4))
    )
    reference = readout_run(o.model, prompts, responses, [HOOK]).acts[HOOK]
    assert torch.allclose(readout, reference, atol=1e-5)
    with pytest.raises(ValueError, match="unknown hook"):
        next(stream_activations(o.model, prompts, responses, "blocks.9.hook_resid_post"))


# ---------------------------------------------------------------------------------------------- disk format
def test_save_writes_saelens_format_and_loads_back(trained, tmp_path):
    o, sae = trained
    sae.save(tmp_path / "sae")
    cfg = json.loads((tmp_path / "sae" / "cfg.json").read_text())
    assert cfg["architecture"] == "topk" and cfg["d_in"] == 64 and cfg["d_sae"] == 48 and cfg["k"] == 3
    assert cfg["metadata"]["hook_name"] == HOOK and cfg["apply_b_dec_to_input"] is True
    assert cfg["normalize_activations"] == "none" and cfg["metadata"]["sae_lens_version"] >= "6"
    weights = load_file(str(tmp_path / "sae" / "sae_weights.safetensors"))
    assert {k: tuple(v.shape) for k, v in weights.items()} == {
        "W_enc": (64, 48),
        "W_dec": (48, 64),
        "b_enc": (48,),
        "b_dec": (64,),
    }
    loaded = load_sae(tmp_path / "sae", model=o.model)
    x = torch.randn(10, 64) + sae.b_dec
    assert torch.equal(loaded.encode(x), sae.encode(x)) and torch.equal(loaded.decode(sae.encode(x)), sae(x))
    assert loaded.cfg.hook_name == HOOK and loaded.metrics is not None
    assert loaded.metrics.fvu == pytest.approx(sae.metrics.fvu)
    assert torch.allclose(loaded.metrics.firing_frequency, sae.metrics.firing_frequency, atol=1e-6)


def _write(path, cfg, tensors):
    path.mkdir(parents=True)
    (path / "cfg.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "sae_weights.safetensors"))
    return path


def _weights(d_in=8, d_sae=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "W_enc": torch.randn(d_in, d_sae, generator=g),
        "W_dec": torch.randn(d_sae, d_in, generator=g) * 2,
        "b_enc": torch.randn(d_sae, generator=g) * 0.1,
        "b_dec": torch.randn(d_in, generator=g),
    }


def _meta(hook="blocks.0.hook_resid_post"):
    return {
        "model_name": "m",
        "hook_name": hook,
        "hook_head_index": None,
        "prepend_bos": True,
        "context_size": 128,
        "dataset_path": "d",
        "sae_lens_version": "6.5.1",
        "sae_lens_training_version": "6.5.1",
    }


SAELENS_DIRS = Path(__file__).parent / "data" / "saelens"


@pytest.mark.parametrize("name", ["topk", "standard", "jumprelu", "topk_training_inference"])
def test_loads_directories_written_by_saelens(name):
    """tests/data/saelens: tiny SAEs saved by SAELens 6.54 itself, with SAELens's own encode/decode
    outputs."""
    directory = SAELENS_DIRS / name
    sae = load_sae(directory)
    expected = load_file(str(directory / "expected.safetensors"))
    assert torch.allclose(sae.encode(expected["x"]), expected["feature_acts"], atol=1e-6)
    assert torch.allclose(sae.decode(expected["feature_acts"]), expected["reconstruction"], atol=1e-5)
    cfg = json.loads((directory / "cfg.json").read_text())
    assert sae.cfg.architecture == cfg["architecture"] and sae.cfg.hook_name == cfg["metadata"]["hook_name"]


def test_loads_saelens_v6_standard(tmp_path):
    w = _weights()
    cfg = {
        "architecture": "standard",
        "d_in": 8,
        "d_sae": 16,
        "dtype": "float32",
        "device": "cpu",
        "apply_b_dec_to_input": True,
        "normalize_activations": "none",
        "reshape_activations": "none",
        "metadata": _meta(),
    }
    sae = load_sae(_write(tmp_path / "s", cfg, w))
    x = torch.randn(5, 8)
    f = torch.relu((x - w["b_dec"]) @ w["W_enc"] + w["b_enc"])
    assert torch.allclose(sae.encode(x), f, atol=1e-6)
    assert torch.allclose(sae.decode(f), f @ w["W_dec"] + w["b_dec"], atol=1e-5)
    assert sae.cfg.architecture == "standard" and sae.cfg.hook_name == "blocks.0.hook_resid_post"


def test_loads_saelens_v6_topk_with_decoder_norm_rescaling(tmp_path):
    w = _weights()
    cfg = {
        "architecture": "topk",
        "d_in": 8,
        "d_sae": 16,
        "k": 4,
        "rescale_acts_by_decoder_norm": True,
        "dtype": "float32",
        "apply_b_dec_to_input": True,
        "normalize_activations": "none",
        "metadata": _meta(),
    }
    sae = load_sae(_write(tmp_path / "s", cfg, w))
    x = torch.randn(5, 8)
    norms = w["W_dec"].norm(dim=-1)
    pre = ((x - w["b_dec"]) @ w["W_enc"] + w["b_enc"]) * norms
    top = pre.topk(4, dim=-1)
    f = torch.zeros_like(pre).scatter(-1, top.indices, top.values.relu())
    assert torch.allclose(sae.encode(x), f, atol=1e-5)
    assert torch.allclose(sae.decode(f), (f / norms) @ w["W_dec"] + w["b_dec"], atol=1e-5)
    assert torch.allclose(sae.decoder_directions.norm(dim=-1), torch.ones(16), atol=1e-6)


def test_loads_saelens_jumprelu_and_pre6_topk(tmp_path):
    w = _weights()
    w["threshold"] = torch.rand(16) * 0.5
    cfg = {
        "architecture": "jumprelu",
        "d_in": 8,
        "d_sae": 16,
        "dtype": "float32",
        "apply_b_dec_to_input": False,
        "normalize_activations": None,
        "metadata": _meta("blocks.2.hook_mlp_out"),
    }
    sae = load_sae(_write(tmp_path / "j", cfg, w))
    x = torch.randn(6, 8)
    pre = x @ w["W_enc"] + w["b_enc"]
    assert torch.allclose(sae.encode(x), pre.relu() * (pre > w["threshold"]), atol=1e-6)
    assert sae.cfg.hook_name == "blocks.2.hook_mlp_out"
    # SAELens < 6: flat hook_name, TopK as activation_fn_str + kwargs, a fine-tuning scaling factor.
    w2 = _weights(seed=1)
    w2["scaling_factor"] = torch.rand(16) + 0.5
    old = {
        "architecture": "standard",
        "activation_fn_str": "topk",
        "activation_fn_kwargs": {"k": 3},
        "d_in": 8,
        "d_sae": 16,
        "hook_name": "blocks.1.hook_resid_pre",
        "hook_layer": 1,
        "model_name": "m",
        "dtype": "float32",
        "apply_b_dec_to_input": True,
        "finetuning_scaling_factor": True,
        "normalize_activations": False,
    }
    sae = load_sae(_write(tmp_path / "old", old, w2))
    assert (
        sae.cfg.architecture == "topk" and sae.cfg.k == 3 and sae.cfg.hook_name == "blocks.1.hook_resid_pre"
    )
    f = sae.encode(x)
    assert int((f > 0).sum(-1).max()) <= 3
    expected = (f * w2["scaling_factor"]) @ w2["W_dec"] + w2["b_dec"]
    assert torch.allclose(sae.decode(f), expected, atol=1e-5)


def test_norm_scaling_factor_is_folded_and_unsupported_configs_are_clear_errors(tmp_path):
    w = _weights()
    cfg = {
        "architecture": "standard",
        "d_in": 8,
        "d_sae": 16,
        "apply_b_dec_to_input": True,
        "normalize_activations": "expected_average_only_in",
        "metadata": _meta(),
    }
    path = _write(tmp_path / "n", cfg, w)
    with pytest.raises(ValueError, match="norm_scaling_factor"):
        load_sae(path)
    c = 2.5
    sae = load_sae(path, norm_scaling_factor=c)
    x = torch.randn(4, 8)
    f = torch.relu((c * x - w["b_dec"]) @ w["W_enc"] + w["b_enc"])  # SAELens: SAE(c·x) / c
    assert torch.allclose(sae.encode(x), f, atol=1e-5)
    assert torch.allclose(sae.decode(f), (f @ w["W_dec"] + w["b_dec"]) / c, atol=1e-5)
    gated = dict(cfg, architecture="gated", normalize_activations="none")
    with pytest.raises(ValueError, match="not supported"):
        load_sae(_write(tmp_path / "g", gated, w))
    with pytest.raises(ValueError, match="layer_norm"):
        load_sae(_write(tmp_path / "ln", dict(cfg, normalize_activations="layer_norm"), w))
    with pytest.raises(FileNotFoundError, match="cfg.json"):
        load_sae(tmp_path / "nowhere")


def test_width_mismatch_is_a_clear_error(tmp_path):
    o = organism()
    narrow = SparseAutoencoder(SAEConfig(d_in=32, d_sae=64, k=4, hook_name=HOOK))
    with pytest.raises(ValueError, match="does not match"):
        narrow.check_hook(o.model)
    narrow.save(tmp_path / "narrow")
    with pytest.raises(ValueError, match="does not match"):
        load_sae(tmp_path / "narrow", model=o.model)
    with pytest.raises(ValueError, match="does not match"):
        narrow.encode(torch.randn(2, 64))
    with pytest.raises(ValueError, match="width"):
        train_sae(o.model, torch.randn(100, 32), hook_name=HOOK, k=2, d_sae=8, progress=False)
    with pytest.raises(ValueError, match="k must be"):
        train_sae(None, torch.randn(100, 8), k=20, d_sae=8, progress=False)
