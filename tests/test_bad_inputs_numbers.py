"""Careless inputs that used to give a silently wrong number. Each case is tagged with its class:

- ``model-text``: the text scored is exactly what the model's chat template renders, or it is refused;
- ``resume``: a resumed sweep never mixes settings;
- ``non-finite``: NaN/inf never escapes as an empty cell, a zero reward or R² = 1;
- ``ignored-keyword``: a keyword is honoured or refused, never accepted and ignored.
"""

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
import torch

from reward_lens import HookedRewardModel, PreferencePair, load_demo_model, load_pairs
from reward_lens.app.cli import main

SYSTEM = {"role": "system", "content": "You are terse."}
TURNS = [
    SYSTEM,
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "Sure?"},
]
COMPLETIONS = [
    [{"role": "assistant", "content": "2+2 is 4."}],
    [{"role": "assistant", "content": "2+2 is 5."}],
]


def one_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    assert len(lines) == 1, text
    assert "Traceback" not in text
    return lines[0]


@pytest.fixture(scope="module")
def model():
    return load_demo_model()


def _score(model, prompt, response):
    tok = model.to_tokens([prompt], [response])
    return model(tok["input_ids"], tok["attention_mask"]).item()


# ------------------------------------------------------------------------------- model-text
def test_trl_reward_scores_the_whole_conversation_as_trls_own_reward_model_path(model):
    """The reward equals the model on TRL's rendering of prompt + completion (trl.apply_chat_template, as
    GRPOTrainer does for a reward model), system prompt and earlier turns included."""
    from trl.data_utils import apply_chat_template

    from reward_lens.integrations.trl import RewardLensReward

    rewards = RewardLensReward(model)([TURNS, TURNS], COMPLETIONS)
    for r, c in zip(rewards, COMPLETIONS):
        text = apply_chat_template({"messages": TURNS + c}, model.tokenizer)["text"]
        ids = torch.tensor([model.tokenizer(text, add_special_tokens=False)["input_ids"]])
        assert r == pytest.approx(model(ids).item(), abs=1e-5)
        # not the last turn alone
        assert r != pytest.approx(_score(model, "Sure?", c[0]["content"]), abs=1e-3)


def test_trl_reward_refuses_what_it_cannot_render(model):
    from reward_lens.integrations.trl import RewardLensReward

    plain = load_demo_model()
    plain.input_format = "plain"
    with pytest.raises(ValueError, match="need a chat template"):
        RewardLensReward(plain)([TURNS], COMPLETIONS[:1])
    image = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is this?"}]}]
    with pytest.raises(ValueError, match="image parts; the reward model reads text only"):
        RewardLensReward(model)([image], COMPLETIONS[:1])
    with pytest.raises(ValueError, match="2 prompts but 1 completions"):
        RewardLensReward(model)([TURNS, TURNS], COMPLETIONS[:1])


def test_the_callbacks_sample_keeps_the_conversation(model):
    from reward_lens.integrations.signals import measure
    from reward_lens.integrations.trl import RewardLensReward

    fn = RewardLensReward(model)
    fn([TURNS, TURNS], COMPLETIONS)
    prompts, responses = fn.sample(2)
    assert prompts[0] == TURNS and responses == ["2+2 is 4.", "2+2 is 5."]
    metrics = measure(model, prompts * 2, responses * 2, probes=["sycophancy"], n_boot=200)
    assert metrics["probe/sycophancy"]["value"] is not None


HH = "\n\nHuman: What is 2+2?\n\nAssistant: 4"
PAIR_FILES = [  # (class, name, writer, expected (prompt, chosen) as the model must see them)
    (
        "model-text",
        "HH dialogue without prompt",
        lambda p: p.with_suffix(".jsonl").write_text(
            json.dumps({"chosen": HH, "rejected": HH[:-1] + "5"}) + "\n"
        ),
        ("What is 2+2?", "4"),
    ),
    (
        "model-text",
        "HH dialogue with an empty prompt",
        lambda p: p.with_suffix(".jsonl").write_text(
            json.dumps({"prompt": "", "chosen": HH, "rejected": HH[:-1] + "5"}) + "\n"
        ),
        ("What is 2+2?", "4"),
    ),
    (
        "model-text",
        "JSON text of messages in a JSONL value",
        lambda p: p.with_suffix(".jsonl").write_text(
            json.dumps(
                {
                    "prompt": json.dumps([SYSTEM, {"role": "user", "content": "What is 2+2?"}]),
                    "chosen": "4",
                    "rejected": "5",
                }
            )
            + "\n"
        ),
        ([SYSTEM, {"role": "user", "content": "What is 2+2?"}], "4"),
    ),
    (
        "model-text",
        "CSV cell with JSON messages",
        lambda p: pd.DataFrame(
            {
                "prompt": [json.dumps([SYSTEM, {"role": "user", "content": "What is 2+2?"}])],
                "chosen": ["4"],
                "rejected": ["5"],
            }
        ).to_csv(p.with_suffix(".csv"), index=False),
        ([SYSTEM, {"role": "user", "content": "What is 2+2?"}], "4"),
    ),
    (
        "model-text",
        "parquet cell with JSON messages",
        lambda p: pd.DataFrame(
            {
                "prompt": ["q"],
                "chosen": [json.dumps([{"role": "assistant", "content": "4"}])],
                "rejected": ["5"],
            }
        ).to_parquet(p.with_suffix(".parquet")),
        ("q", "4"),
    ),
]


@pytest.mark.parametrize("cls,name,write,expected", PAIR_FILES, ids=[c[1] for c in PAIR_FILES])
def test_pair_files_are_scored_as_the_conversation_they_hold(model, tmp_path, cls, name, write, expected):
    write(tmp_path / "pairs")
    pair = load_pairs(next(tmp_path.glob("pairs.*")))[0]
    got = model.to_tokens([pair.prompt], [pair.chosen])["input_ids"]
    assert torch.equal(got, model.to_tokens([expected[0]], [expected[1]])["input_ids"])
    assert '"role"' not in model.tokenizer.decode(got[0])


def test_plain_text_without_a_prompt_column_is_refused(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"chosen": "Paris.", "rejected": "Rome."}) + "\n")
    with pytest.raises(ValueError) as info:
        load_pairs(path)
    assert "no 'prompt' column" in one_line(str(info.value)) and "line 1" in str(info.value)


# ------------------------------------------------------------------------------- resume
@pytest.fixture
def sweep_out(tmp_path):
    out = tmp_path / "sw"
    assert main(["sweep", "--out", str(out), "--max-pairs", "2", "--chunk-size", "1"]) == 0
    return out


def _edit(path: Path, **changes):
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


RESUME = [  # (class, name, damage to the earlier sweep, extra options of the rerun, words)
    ("resume", "other --dtype", lambda o: None, ["--dtype", "bfloat16"], "other dtype"),
    ("resume", "other --input-format", lambda o: None, ["--input-format", "plain"], "other input format"),
    ("resume", "hand-edited manifest", lambda o: _edit(o / "sweep.json", n_pairs=3), [], "edited by hand"),
    ("resume", "garbage manifest", lambda o: (o / "sweep.json").write_text("{garbage"), [], "is damaged"),
    (
        "resume",
        "foreign manifest",
        lambda o: (o / "sweep.json").write_text("[1, 2]"),
        [],
        "not a reward-lens sweep manifest",
    ),
]


@pytest.mark.parametrize("cls,name,damage,extra,words", RESUME, ids=[c[1] for c in RESUME])
def test_a_resumed_sweep_never_mixes_settings(sweep_out, capsys, cls, name, damage, extra, words):
    damage(sweep_out)
    table = (sweep_out / "sweep.parquet").read_bytes()
    capsys.readouterr()
    assert main(["sweep", "--out", str(sweep_out), "--max-pairs", "2", "--chunk-size", "1", *extra]) == 2
    assert words in one_line(capsys.readouterr().err)
    assert (sweep_out / "sweep.parquet").read_bytes() == table


def test_a_sweep_that_finished_no_part_restarts_with_the_advised_fix(sweep_out, capsys):
    shutil.rmtree(sweep_out / "parts")
    (sweep_out / "sweep.parquet").unlink()
    (sweep_out / "sweep.csv").unlink()
    argv = ["sweep", "--out", str(sweep_out), "--max-pairs", "2", "--chunk-size", "1", "--dtype", "float64"]
    assert main(argv) == 0
    assert json.loads((sweep_out / "sweep.json").read_text())["dtype"] == "float64"
    assert "finished no part" in capsys.readouterr().err  # a progress line: on stderr


# ------------------------------------------------------------------------------- non-finite
def _overflowing_fp16_model():
    m = load_demo_model(dtype="float16")
    with torch.no_grad():
        m.blocks[0].mlp.W_out.mul_(3e4)
    return m


def test_an_overflowing_fp16_sweep_is_refused_not_written_as_empty_cells(tmp_path):
    from reward_lens import demo_pairs
    from reward_lens.app.sweep import run_sweep

    with pytest.raises(ValueError) as info:
        run_sweep(_overflowing_fp16_model(), demo_pairs()[:2], tmp_path / "sw", echo=lambda _: None)
    message = one_line(str(info.value))
    assert "non-finite" in message and "float32" in message
    assert not list((tmp_path / "sw" / "parts").glob("*.parquet"))


@pytest.mark.parametrize(
    "dtype,hint", [(torch.float16, "--dtype bfloat16 or float32"), (torch.float32, "damaged")]
)
def test_nan_patched_rewards_are_refused_naming_pair_and_site(model, dtype, hint):
    """A NaN patched reward with finite clean rewards (an overflow in the patched forward only)."""
    from reward_lens import demo_pairs, patch
    from reward_lens.app.output import check_finite_columns
    from reward_lens.app.sweep import FINITE_COLUMNS

    res = patch(model, demo_pairs()[:2], mode="zero")
    frame = res.to_frame()
    check_finite_columns(frame, FINITE_COLUMNS, "sweep", dtype)  # all finite: passes
    key = next(iter(res.patched))
    res.patched[key][1, 2] = float("nan")
    with pytest.raises(ValueError) as info:
        check_finite_columns(res.to_frame(), FINITE_COLUMNS, "sweep patch", dtype)
    message = one_line(str(info.value))
    assert "are NaN or infinite" in message and "pair " in message and hint in message


def test_openrlhf_infinite_std_is_refused(tmp_path):
    from test_openrlhf import base_decoder, save_openrlhf

    d = save_openrlhf(tmp_path / "orl", *base_decoder())
    cfg = json.loads((d / "config.json").read_text())
    for std in ("Infinity", "NaN", "[1.0, 2.0]", '"big"'):
        (d / "config.json").write_text(json.dumps({**cfg, "std": "STD"}).replace('"STD"', std))
        with pytest.raises(ValueError) as info:
            HookedRewardModel.from_pretrained(d)
        message = one_line(str(info.value))
        assert "must be finite and std > 0" in message or "stores one number" in message


@pytest.mark.parametrize("temperature", [0, -1.0, float("inf")])
def test_armorm_gating_temperature_must_be_positive_and_finite(tmp_path, temperature):
    from armorm_reference import save_tiny_armorm

    d = save_tiny_armorm(tmp_path / "arm")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "gating_temperature": temperature}))
    with pytest.raises(ValueError) as info:
        HookedRewardModel.from_pretrained(d)
    assert "gating_temperature" in one_line(str(info.value)) and "> 0" in str(info.value)


def test_dose_response_r2_is_undefined_not_one(model):
    from reward_lens import dose_response

    items = (["What is 2+2?", "Capital of France?"], ["4", "Paris"])
    direction = torch.randn(model.cfg.d_model, generator=torch.Generator().manual_seed(0))
    two = dose_response(model, direction, items, layer=1, alphas=[-0.1, 0.1])
    assert two.slope != 0 and two.r2 != two.r2  # a line through two points: R² is NaN, not 1.0
    many = dose_response(model, direction, items, layer=1)
    assert 0.0 <= many.r2 <= 1.0
    with pytest.raises(ValueError, match="no finite intervention"):
        dose_response(model, direction, items, layer=1, scale=0.0)
    with pytest.raises(ValueError, match="no finite intervention"):
        dose_response(model, torch.zeros(model.cfg.d_model), items, layer=1)


# ------------------------------------------------------------------------------- ignored-keyword
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from helpers import tiny_hf_model

    d = tmp_path_factory.mktemp("ckpt") / "tiny"
    tiny_hf_model("llama").save_pretrained(d)
    return d


def test_torch_dtype_is_honoured_as_dtype(tiny_dir):
    assert HookedRewardModel.from_pretrained(tiny_dir, torch_dtype=torch.float16).cfg.dtype == torch.float16
    assert HookedRewardModel.from_pretrained(tiny_dir, torch_dtype="bfloat16").cfg.dtype == torch.bfloat16
    with pytest.raises(TypeError, match="disagree"):
        HookedRewardModel.from_pretrained(tiny_dir, dtype="float32", torch_dtype=torch.float16)
    with pytest.raises(ValueError, match="cannot hold the weights"):
        HookedRewardModel.from_pretrained(tiny_dir, dtype=torch.int8)


@pytest.mark.parametrize("kw", [{"senders": []}, {"receivers": []}, {"senders": "L0H1"}])
def test_path_patch_refuses_empty_or_string_node_lists(model, kw):
    from reward_lens import path_patch

    pairs = [PreferencePair("What is 2+2?", "4", "5", id="a")]
    with pytest.raises(ValueError, match="give a non-empty list of names"):
        path_patch(model, pairs, **kw)
