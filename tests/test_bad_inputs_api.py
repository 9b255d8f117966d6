"""Careless inputs to the Python API and the pairs files that used to give a traceback, an unclear error or
misleading noise. Each case is tagged with its class:

- ``traceback``: one clear line (what was wrong, what to do) instead of a traceback or an unclear error;
- ``right-result``: the input is read as the user meant it;
- ``noise``: no misleading message (a wrong line number, a warning about something that is then fixed).
"""

import json
from pathlib import Path

import pytest
import torch

from reward_lens import HookedRewardModel, PreferencePair, load_demo_model, load_pairs


def one_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    assert len(lines) == 1, text
    assert "Traceback" not in text
    return lines[0]


@pytest.fixture(scope="module")
def model():
    return load_demo_model()


ROW = {"prompt": "q", "chosen": "a", "rejected": "b"}
GOOD = json.dumps(ROW)

FILES = [  # (class, file name, bytes, error words or None, expected first (prompt, chosen, rejected))
    ("right-result", "bom.jsonl", b"\xef\xbb\xbf" + GOOD.encode() + b"\n", None, ("q", "a", "b")),
    ("right-result", "bom.json", b"\xef\xbb\xbf[" + GOOD.encode() + b"]", None, ("q", "a", "b")),
    ("right-result", "bom.csv", b"\xef\xbb\xbfprompt,chosen,rejected\nq,a,b\n", None, ("q", "a", "b")),
    (
        "traceback",
        "surrogate.jsonl",
        b'{"prompt": "q \\ud83d", "chosen": "a", "rejected": "b"}\n',
        ["surrogate.jsonl", "line 1", "'prompt'", "lone surrogate"],
        None,
    ),
    (
        "traceback",
        "surrogate_msg.jsonl",
        b'{"prompt": "q", "chosen": [{"role": "assistant", "content": "\\udc00"}], "rejected": "b"}\n',
        ["'chosen'", "message 1", "lone surrogate"],
        None,
    ),
    (
        "noise",
        "unclosed_line3.jsonl",
        (GOOD + "\n" + GOOD + "\n" + '{"prompt": "q", "chosen": "a"\n' + GOOD + "\n" + GOOD + "\n").encode(),
        ["unclosed_line3.jsonl", "line 3:", "starting on line 3"],
        None,
    ),
]


@pytest.mark.parametrize("cls,name,data,words,expected", FILES, ids=[c[1] for c in FILES])
def test_pairs_files_with_a_bom_surrogates_or_a_broken_value(tmp_path, cls, name, data, words, expected):
    path = tmp_path / name
    path.write_bytes(data)
    if words is None:
        p = load_pairs(path)[0]
        assert (p.prompt, p.chosen, p.rejected) == expected
        return
    with pytest.raises(ValueError) as info:
        load_pairs(path)
    message = one_line(str(info.value))
    assert all(w in message for w in words), message
    if name.startswith("unclosed"):
        assert (
            not message.startswith(f"{path}: line 5") and "line 5 column" not in message.split("noticed")[0]
        )


API = [  # (class, name, call, exception, words)
    (
        "traceback",
        "lens(None, pairs)",
        lambda m: __import__("reward_lens").lens(None, _pairs()),
        TypeError,
        "lens(model, ...) needs a HookedRewardModel",
    ),
    (
        "traceback",
        "attribute('demo', pairs)",
        lambda m: __import__("reward_lens").attribute("demo", _pairs()),
        TypeError,
        "attribute(model, ...) needs a HookedRewardModel as its first argument, got str",
    ),
    (
        "traceback",
        "concept_vector(model, 42)",
        lambda m: __import__("reward_lens").concept_vector(m, 42),
        TypeError,
        "the contrast set is int 42",
    ),
    (
        "traceback",
        "to_tokens with a lone surrogate",
        lambda m: m.to_tokens(["q\ud800"], ["a"]),
        ValueError,
        "prompt 1 holds a lone surrogate",
    ),
    (
        "traceback",
        "PreferencePair with a lone surrogate",
        lambda m: PreferencePair("q", "a\udfff", "b"),
        ValueError,
        "lone surrogate",
    ),
]


def _pairs():
    return [PreferencePair("What is 2+2?", "4", "5", id="a")]


@pytest.mark.parametrize("cls,name,call,exc,words", API, ids=[c[1] for c in API])
def test_api_misuse_is_one_line(model, cls, name, call, exc, words):
    with pytest.raises(exc) as info:
        call(model)
    assert words in one_line(str(info.value))


def test_a_transformers_style_device_map(tmp_path):
    from reward_lens.demo import DEMO_DIR

    # everything on one device: honoured
    one = HookedRewardModel.from_pretrained(DEMO_DIR, device_map={"": "cpu"})
    assert str(one.cfg.device) == "cpu"
    with pytest.raises(ValueError) as info:
        HookedRewardModel.from_pretrained(DEMO_DIR, device_map={"blocks.0": "cpu", "blocks.1": 0})
    message = one_line(str(info.value))
    assert "transformers' form" in message and "list of devices" in message


def test_from_hf_model_on_a_meta_device_model():
    import transformers
    from helpers import tiny_config

    cfg, cls = tiny_config("llama")
    with torch.device("meta"):
        hf = cls(cfg)
    with pytest.raises(ValueError) as info:
        HookedRewardModel.from_hf_model(hf)
    assert "meta device" in one_line(str(info.value))
    with pytest.raises(TypeError, match="needs a transformers model"):
        HookedRewardModel.from_hf_model("Skywork/Skywork-Reward")
    assert transformers  # the real transformers classes above


def test_the_smollm2_organism_loads_without_transformers_missing_head_report(capfd):
    """transformers' load report ('score.weight MISSING ... consider training') is not shown: the head is
    then loaded (the organism's ground truth holds)."""
    from reward_lens.demo import smollm2

    try:
        smollm2.gguf_dir()
    except FileNotFoundError:
        pytest.skip(f"the SmolLM2 GGUF wheel is not installed ({smollm2.INSTALL_COMMAND})")
    model = smollm2.load_smollm2_organism()
    out = capfd.readouterr()
    assert "MISSING" not in out.out + out.err and "LOAD REPORT" not in out.out + out.err
    assert Path(smollm2.GGUF_FILE).suffix == ".gguf" and model.cfg.n_layers > 0
