"""Transcoders on the reward model (`reward_lens.train_transcoders`, `load_transcoders`): the interface
(shapes, encode / decode / forward as documented), training on streamed activations, the held-out metrics
against a recomputation from TransformerLens hooks, the disk round trip, the shipped demo set's goals on the
bundled pairs (which its training never saw) and the CLI. fp32 tolerances: 1e-5 relative on sums over
thousands of tokens."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import reward_lens as rl
from reward_lens.demo import synthetic
from reward_lens.model.hooks import act_name

HELD_OUT = synthetic.held_out_pairs(1)


@pytest.fixture(scope="module")
def model():
    return rl.load_demo_model(device="cpu")


@pytest.fixture(scope="module")
def tiny(model):
    texts = synthetic.training_pairs(120, 7, exclude=HELD_OUT)
    return rl.train_transcoders(
        model,
        texts,
        d_tc=64,
        k=8,
        layers=[0, 2],
        steps=60,
        batch_size=256,
        buffer_tokens=2048,
        eval_texts=rl.demo_pairs()[:20],
        progress=False,
    )


def _mlp_io(model, pairs, layer):
    """(x, y) at every non-pad token of both responses, from a plain cache (not the training stream)."""
    xs, ys = [], []
    for p in pairs:
        for side in (p.chosen, p.rejected):
            ids = model.to_tokens(p.prompt, side)["input_ids"]
            _, cache = model.run_with_cache(ids)
            xs.append(cache[act_name("normalized", layer, norm="ln2")][0])
            ys.append(cache[act_name("mlp_out", layer)][0])
    return torch.cat(xs), torch.cat(ys)


def test_interface_shapes_and_maps(model, tiny):
    assert tiny.layers == [0, 2] and len(tiny) == 2
    t = tiny[2]
    d = model.cfg.d_model
    assert t.W_enc.shape == (64, d) and t.b_enc.shape == (64,)
    assert t.W_dec.shape == (64, d) and t.b_dec.shape == (d,) and t.W_skip.shape == (d, d)
    x = torch.randn(5, 3, d)
    f = t.encode(x)
    assert f.shape == (5, 3, 64) and bool((f >= 0).all()) and int((f > 0).sum(-1).max()) <= 8
    assert torch.allclose(t.decode(f), f @ t.W_dec + t.b_dec)
    assert torch.allclose(t(x), t.decode(t.encode(x)) + x @ t.W_skip.T)
    pre = x @ t.W_enc.T + t.b_enc
    top = pre.topk(8, -1)
    assert torch.equal(f, torch.zeros_like(pre).scatter(-1, top.indices, top.values.relu()))
    with pytest.raises(KeyError, match="covers layers"):
        tiny[1]


def test_training_lowers_the_loss_and_metrics_match_a_recomputation(model, tiny):
    hist = tiny.metrics.history
    first, last = hist[hist.step == hist.step.min()], hist[hist.step == hist.step.max()]
    assert (last.fvu.to_numpy() < 0.85 * first.fvu.to_numpy()).all()  # from the least-squares skip
    frame = tiny.metrics.to_frame()
    for l in (0, 2):
        x, y = _mlp_io(model, rl.demo_pairs()[:20], l)
        t = tiny[l]
        f = t.encode(x)
        err = (y - t(x)).double()
        fvu = float(err.pow(2).sum() / (y.double() - y.double().mean(0)).pow(2).sum())
        row = frame[frame.layer == l].iloc[0]
        assert abs(row.fvu - fvu) <= 1e-5 * fvu
        assert abs(row.l0 - float((f > 0).sum(-1).double().mean())) <= 1e-9
        assert row.dead_fraction == float((~(f > 0).any(0)).double().mean())
        assert row.n_tokens == x.shape[0]


def test_training_device_is_the_models_and_the_batches_do_not_depend_on_it(model):
    """The buffer and the optimisation live on the model's device by default; the draws come from the CPU
    generator on every device, so an explicit device="cpu" is the same run bit for bit."""
    texts = synthetic.training_pairs(40, 3, exclude=HELD_OUT)
    settings = dict(d_tc=32, k=4, layers=[1], steps=12, batch_size=64, buffer_tokens=512, progress=False)
    default = rl.train_transcoders(model, texts, **settings)
    explicit = rl.train_transcoders(model, texts, device="cpu", **settings)
    for name, value in default[1].state_dict().items():
        assert torch.equal(value, explicit[1].state_dict()[name]), name
    assert default[1].W_enc.device == model.cfg.device


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on a GPU machine)")
def test_training_on_cuda_equals_the_cpu_run_to_rounding(monkeypatch):
    """The same settings and texts train on the GPU (model, buffer and Adam there) to the CPU run's
    parameters: the same batches, so only matmul rounding separates them (TF32 off)."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    texts = synthetic.training_pairs(60, 5, exclude=HELD_OUT)
    settings = dict(d_tc=64, k=8, layers=[0, 3], steps=20, batch_size=128, buffer_tokens=1024, progress=False)
    cpu = rl.train_transcoders(rl.load_demo_model(device="cpu"), texts, **settings)
    gpu = rl.train_transcoders(rl.load_demo_model(device="cuda"), texts, **settings)
    for l in (0, 3):
        assert gpu[l].W_enc.device.type == "cuda"
        for name, value in cpu[l].state_dict().items():
            other = gpu[l].state_dict()[name].cpu()
            scale = float(value.abs().max()) or 1.0
            assert float((other - value).abs().max()) <= 1e-3 * scale, (l, name)


def test_the_replacement_model_reward_matches_hand_hooks(model, tiny):
    """The replacement model's decisions and Pearson r, recomputed with hooks written here."""
    pairs = rl.demo_pairs()[:20]

    def reward(prompt, response, replace):
        ids = model.to_tokens(prompt, response)["input_ids"]
        if not replace:
            return float(model(ids).detach())
        seen = {}
        hooks = []
        for l in tiny.layers:
            hooks.append((act_name("normalized", l, norm="ln2"), lambda t, hook, l=l: seen.__setitem__(l, t)))
            hooks.append((act_name("mlp_out", l), lambda t, hook, l=l: tiny[l](seen[l])))
        return float(model.run_with_hooks(ids, fwd_hooks=hooks).detach())

    r = np.array(
        [[reward(p.prompt, s, rep) for s in (p.chosen, p.rejected)] for p in pairs for rep in (0, 1)]
    )
    orig, repl = r[0::2], r[1::2]
    m = tiny.metrics
    assert abs(m.reward_pearson - np.corrcoef(orig.flatten(), repl.flatten())[0, 1]) <= 1e-6
    agree = np.mean(np.sign(orig[:, 0] - orig[:, 1]) == np.sign(repl[:, 0] - repl[:, 1]))
    assert m.decision_agreement == agree and m.n_pairs == 20


def test_save_and_load_round_trip(tiny, tmp_path):
    tiny.save(tmp_path / "tc")
    back = rl.load_transcoders(tmp_path / "tc")
    assert back.layers == tiny.layers
    for l in tiny.layers:
        for name in ("W_enc", "b_enc", "W_dec", "b_dec", "W_skip", "threshold"):
            assert torch.equal(getattr(back[l], name), getattr(tiny[l], name))
    assert back.config["training"]["steps"] == 60
    assert np.allclose(back.metrics.to_frame().fvu, tiny.metrics.to_frame().fvu)
    with pytest.raises(FileNotFoundError, match="holds no transcoders"):
        rl.load_transcoders(tmp_path)


def test_first_token_left_out_of_training_metrics_and_the_replacement_model(model, tmp_path):
    """`exclude_first_token`: the buffer holds every non-pad token but each text's first; the metrics are
    over those tokens (recomputed from a plain cache); the replacement model keeps the MLP's own output at
    the first token (hooks written here); the flag survives the disk."""
    from reward_lens.representations.transcoders.train import _Buffer

    texts = synthetic.training_pairs(30, 12, exclude=HELD_OUT)
    prompts, responses = [t.prompt for t in texts], [t.chosen for t in texts]

    def first_fill(exclude):  # size 1: one text batch of 8 texts
        g = torch.Generator().manual_seed(0)
        buf = _Buffer(model, (prompts, responses), [1], 1, 8, g, exclude_first=exclude)
        buf.fill()
        return buf.tokens_drawn

    assert first_fill(False) - first_fill(True) == 8  # the same 8 texts, less one first token each

    tc = rl.train_transcoders(
        model,
        texts,
        d_tc=32,
        k=4,
        layers=[0, 1],
        steps=10,
        batch_size=128,
        buffer_tokens=512,
        progress=False,
        exclude_first_token=True,
    )
    assert tc.exclude_first_token and tc.config["exclude_first_token"] is True
    pairs = rl.demo_pairs()[:6]
    m = rl.evaluate_transcoders(model, tc, pairs)
    x, y = _mlp_io(model, pairs, 1)
    starts = np.cumsum(
        [0]
        + [model.to_tokens(p.prompt, s)["input_ids"].shape[1] for p in pairs for s in (p.chosen, p.rejected)]
    )[:-1]
    keep = torch.ones(len(x), dtype=torch.bool)
    keep[torch.as_tensor(starts)] = False
    x, y = x[keep], y[keep]
    err = (y - tc[1](x)).double()
    fvu = float(err.pow(2).sum() / (y.double() - y.double().mean(0)).pow(2).sum())
    row = m.to_frame().set_index("layer").loc[1]
    assert abs(row.fvu - fvu) <= 1e-5 * fvu and row.n_tokens == len(x)

    def reward(p, side):
        ids = model.to_tokens(p.prompt, side)["input_ids"]
        seen = {}
        hooks = []
        for l in tc.layers:
            hooks.append((act_name("normalized", l, norm="ln2"), lambda t, hook, l=l: seen.__setitem__(l, t)))
            hooks.append(
                (act_name("mlp_out", l), lambda t, hook, l=l: torch.cat([t[:, :1], tc[l](seen[l])[:, 1:]], 1))
            )
        return float(model.run_with_hooks(ids, fwd_hooks=hooks).detach())

    orig = np.array(
        [
            [float(model(model.to_tokens(p.prompt, s)["input_ids"]).detach()) for s in (p.chosen, p.rejected)]
            for p in pairs
        ]
    )
    repl = np.array([[reward(p, s) for s in (p.chosen, p.rejected)] for p in pairs])
    assert abs(m.reward_pearson - np.corrcoef(orig.flatten(), repl.flatten())[0, 1]) <= 1e-6
    tc.save(tmp_path / "tc")
    assert rl.load_transcoders(tmp_path / "tc").exclude_first_token
    assert not rl.load_transcoders("demo").exclude_first_token


def test_batchtopk_family(model):
    texts = synthetic.training_pairs(60, 8, exclude=HELD_OUT)
    tc = rl.train_transcoders(
        model,
        texts,
        d_tc=64,
        k=8,
        layers=[1],
        kind="batchtopk",
        steps=30,
        batch_size=256,
        buffer_tokens=1024,
        progress=False,
    )
    assert len(tc.metrics.history) and tc.metrics.to_frame().empty  # no held-out texts: curves only
    assert np.isnan(tc.metrics.summary().reward_pearson[0])
    t = tc[1]
    assert float(t.threshold[0]) > 0 and torch.equal(t.threshold, t.threshold[0].expand(64))
    x = torch.randn(7, model.cfg.d_model)
    pre = x @ t.W_enc.T + t.b_enc
    assert torch.equal(t.encode(x), pre.relu() * (pre > t.threshold))


def test_bad_inputs(model, tiny):
    texts = synthetic.training_pairs(4, 9)
    with pytest.raises(ValueError, match="unknown transcoder family 'relu'; use one of"):
        rl.train_transcoders(model, texts, kind="relu", steps=1, progress=False)
    with pytest.raises(ValueError, match="must not exceed d_tc"):
        rl.train_transcoders(model, texts, d_tc=4, k=8, steps=1, progress=False)
    with pytest.raises(ValueError, match=r"layers must be in \[0, 4\)"):
        rl.train_transcoders(model, texts, layers=[5], steps=1, progress=False)
    with pytest.raises(ValueError, match="cannot read texts from int"):
        rl.train_transcoders(model, [3], steps=1, progress=False)
    with pytest.raises(ValueError, match="does not match this transcoder's d_model"):
        tiny[0].encode(torch.zeros(3, 5))


def test_the_shipped_demo_transcoders_meet_their_goals(model):
    """Held-out (the bundled pairs; trained on fresh generator draws): mean FVU <= 0.02, every layer
    <= 0.05, L0 <= 16, dead <= 5%; replacement model r >= 0.9 and >= 90% of decisions kept."""
    tc = rl.load_transcoders("demo")
    assert tc.layers == list(range(model.cfg.n_layers)) and tc[0].d_tc == 512 and tc[0].k == 16
    held = rl.demo_pairs()
    keys = {(p.prompt, p.chosen, p.rejected) for p in held}
    cfg = tc.config["training"]
    drawn = synthetic.training_pairs(cfg["n_pairs"], cfg["text_seed"], exclude=HELD_OUT)
    assert not keys & {p.key() for p in drawn}  # training never saw a held-out pair
    m = rl.evaluate_transcoders(model, tc, held)
    f = m.to_frame()
    assert f.fvu.mean() <= 0.02 and f.fvu.max() <= 0.05
    assert f.l0.max() <= 16 and f.dead_fraction.max() <= 0.05
    assert m.reward_pearson >= 0.9 and m.decision_agreement >= 0.9
    assert np.allclose(f.fvu, tc.metrics.to_frame().fvu, rtol=1e-6)  # what the script recorded


def test_cli_trains_and_writes(tmp_path, capsys):
    from reward_lens.app.cli import main

    pairs = tmp_path / "train.jsonl"
    pairs.write_text(
        "".join(
            json.dumps({"prompt": p.prompt, "chosen": p.chosen, "rejected": p.rejected}) + "\n"
            for p in synthetic.training_pairs(20, 11, exclude=HELD_OUT)
        )
    )
    out = tmp_path / "tc"
    args = ["--pairs", str(pairs), "--eval-pairs", str(pairs), "--steps", "5", "--d-tc", "32", "--k", "4"]
    assert main(["train-transcoders", *args, "--layers", "1", "--out", str(out), "-q"]) == 0
    assert "mean FVU" in capsys.readouterr().out and (out / "transcoders.safetensors").exists()
    assert rl.load_transcoders(out).layers == [1]
    assert main(["train-transcoders", "--k", "0", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "--k must be >= 1" in err
    assert main(["train-transcoders", "--model", "demo", "--layers", "a", "--out", str(tmp_path / "y")]) == 2
    assert "--layers must be comma-separated integers" in capsys.readouterr().err


def test_cli_family_names_are_the_registry():
    from reward_lens.app.transcoder_cli import FAMILY_NAMES
    from reward_lens.representations.transcoders import FAMILIES

    assert set(FAMILY_NAMES) == {
        name for name, f in FAMILIES.items() if f.trainable
    }  # jumprelu: exported only
