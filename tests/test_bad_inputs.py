"""Bad and edge inputs, as a careless user would give them, to the CLI and the API.

Each case asserts either a clear one-line error (its type and the words that say what to fix) or a
correct result; a failed CLI run leaves no output files; no CSV or JSON holds ±inf or NaN; a report
never mixes two runs (stale files, an interrupt, a concurrent writer).
"""

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from reward_lens import PreferencePair, load_demo_model, load_pairs
from reward_lens.app import audit as audit_module
from reward_lens.app.cli import main
from reward_lens.app.output import MARKER, ReportDir
from reward_lens.model.validation import safe_ratio

PAIRS = [
    {"prompt": "What is 2+2?", "chosen": "2+2 is 4.", "rejected": "2+2 is 5."},
    {"prompt": "Capital of France?", "chosen": "Paris.", "rejected": "Rome."},
    {"prompt": "Say hi", "chosen": "Hello there", "rejected": "Hello there"},  # a tie
]


@pytest.fixture(scope="module")
def model():
    return load_demo_model()


def one_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    assert len(lines) == 1, text
    assert "Traceback" not in text
    return lines[0]


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def assert_clean_outputs(out: Path) -> None:
    """No ±inf or NaN in any CSV or JSON: strict JSON, and every CSV cell finite or empty."""
    for f in out.glob("*.json"):
        json.loads(f.read_text(), parse_constant=lambda c: pytest.fail(f"{f.name} holds {c}"))
    for f in out.glob("*.csv"):
        frame = pd.read_csv(f, keep_default_na=False, dtype=str)
        for col in frame.columns:
            assert not frame[col].str.fullmatch(r"[+-]?(inf|nan|NaN|Infinity|None)").any(), (f.name, col)


# ------------------------------------------------------------------------------------------- data
def _csv(p, text):
    p.write_text(text)
    return p


DATA_ERRORS = [
    # (file name, content writer, error type, words that must appear)
    (
        "empty_cell.csv",
        lambda p: _csv(p, "prompt,chosen,rejected\nq,a,b\nq2,,b\n"),
        ValueError,
        ["empty_cell.csv", "row 2", "'chosen'", "empty"],
    ),
    (
        "null.jsonl",
        lambda p: _csv(
            p, '{"prompt":"q","chosen":"a","rejected":"b"}\n{"prompt":"q","chosen":null,"rejected":"b"}\n'
        ),
        ValueError,
        ["null.jsonl", "line 2", "'chosen'", "missing"],
    ),
    (
        "number.json",
        lambda p: _csv(p, '[{"prompt": 3, "chosen": "a", "rejected": "b"}]'),
        ValueError,
        ["number.json", "item 1", "'prompt'", "int 3", "give text"],
    ),
    (
        "broken.jsonl",
        lambda p: _csv(
            p,
            '{"prompt":"q","chosen":"a","rejected":"b"}\n{"prompt":"q","chosen":"a","rejected":"b"}\n'
            '{"prompt": "q", "chosen" "a"}\n',
        ),
        ValueError,
        ["broken.jsonl", "line 3", "invalid JSON"],
    ),
    (
        "missing_col.jsonl",
        lambda p: _csv(p, '{"prompt":"q","chosen":"a","rejected":"b"}\n{"prompt":"q","chosen":"a"}\n'),
        ValueError,
        ["missing_col.jsonl", "line 2", "lacks column(s) ['rejected']"],
    ),
    (
        "bad_messages.json",
        lambda p: _csv(p, '[{"prompt":"q","chosen":[{"role":"assistant"}],"rejected":"b"}]'),
        ValueError,
        ["item 1", "'chosen'", "'role' and 'content'"],
    ),
    ("dict.json", lambda p: _csv(p, '{"a": 1, "b": 2}'), ValueError, ["dict.json", "list of pair objects"]),
    ("scalar.json", lambda p: _csv(p, '"hello"'), ValueError, ["scalar.json", "JSON str"]),
    ("empty.jsonl", lambda p: _csv(p, ""), ValueError, ["empty.jsonl", "holds no preference pairs"]),
    ("pairs.txt", lambda p: _csv(p, "x"), ValueError, ["unsupported pairs file type '.txt'"]),
    (
        "latin1.jsonl",
        lambda p: p.write_bytes('{"prompt":"caf\xe9","chosen":"a","rejected":"b"}'.encode("latin-1")),
        ValueError,
        ["latin1.jsonl", "UTF-8"],
    ),
    ("a_dir.jsonl", lambda p: p.mkdir(), ValueError, ["a_dir.jsonl", "is a directory"]),
    ("absent.jsonl", lambda p: None, FileNotFoundError, ["no pairs file"]),
]


@pytest.mark.parametrize("name,make,exc,words", DATA_ERRORS, ids=[c[0] for c in DATA_ERRORS])
def test_bad_pairs_files_name_file_row_and_column(tmp_path, name, make, exc, words):
    path = tmp_path / name
    make(path)
    with pytest.raises(exc) as info:
        load_pairs(path)
    message = one_line(str(info.value))
    for w in words:
        assert w in message, (w, message)


def test_parquet_none_is_refused_not_scored_as_text(tmp_path):
    path = tmp_path / "p.parquet"
    pd.DataFrame({"prompt": ["q", "q"], "chosen": ["a", None], "rejected": ["b", "c"]}).to_parquet(path)
    with pytest.raises(ValueError, match=r"p\.parquet, row 2, column 'chosen'.*missing"):
        load_pairs(path)


DATA_OK = [
    # (file name, content, expected pairs as (prompt, chosen, rejected))
    (
        "pretty.jsonl",
        '{\n  "prompt": "q",\n  "chosen": "a",\n  "rejected": "b"\n}\n{\n  "prompt": "q2",\n  "chosen": '
        '"c",\n  "rejected": "d"\n}\n',
        [("q", "a", "b"), ("q2", "c", "d")],
    ),
    ("one.json", '{"prompt": "q", "chosen": "a", "rejected": "b"}', [("q", "a", "b")]),
    ("wrapped.json", '{"pairs": [{"prompt": "q", "chosen": "a", "rejected": "b"}]}', [("q", "a", "b")]),
    (
        "columns.json",
        '{"prompt": ["q", "r"], "chosen": ["a", "c"], "rejected": ["b", "d"]}',
        [("q", "a", "b"), ("r", "c", "d")],
    ),
    ("na_text.csv", "prompt,chosen,rejected\nNA,null,None\n", [("NA", "null", "None")]),  # texts, not missing
    ("numbers.csv", "prompt,chosen,rejected,id\nWhat is 6*7?,42,41,7\n", [("What is 6*7?", "42", "41")]),
]


@pytest.mark.parametrize("name,content,expected", DATA_OK, ids=[c[0] for c in DATA_OK])
def test_valid_pair_files_in_every_shape_load_exactly(tmp_path, name, content, expected):
    path = tmp_path / name
    path.write_text(content)
    pairs = load_pairs(path)
    assert [(p.prompt, p.chosen, p.rejected) for p in pairs] == expected
    assert all(isinstance(p.id, str) for p in pairs)


@pytest.mark.parametrize(
    "args,words",
    [
        ((None, None, None), "PreferencePair.prompt is missing"),
        (("q", float("nan"), "b"), "PreferencePair.chosen is missing"),
        (("q", "a", 3.5), "PreferencePair.rejected is float 3.5"),
        (("q", "a", {"role": "user"}), "PreferencePair.rejected is dict"),
        (("q", [], "b"), "empty message list"),
    ],
)
def test_preference_pair_refuses_non_text(args, words):
    with pytest.raises(ValueError, match=words.replace(".", r"\.")):
        PreferencePair(*args)


def test_message_lists_are_conversations_rendered_by_the_chat_template(model, tmp_path):
    """A conversation gives exactly the tokens of the same text pair (the template renders both), never a
    repr."""
    conv = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]
    path = write_jsonl(
        tmp_path / "conv.jsonl",
        [
            {"prompt": conv[:1], "chosen": conv[1:], "rejected": "5"},
            {"prompt": "", "chosen": conv, "rejected": conv[:1] + [{"role": "assistant", "content": "5"}]},
        ],
    )
    pairs = load_pairs(path)
    assert pairs[0].prompt == tuple(conv[:1]) and pairs[0].chosen == tuple(conv[1:])
    for p in pairs:
        got = model.to_tokens([p.prompt], [p.chosen])["input_ids"]
        want = model.to_tokens(["What is 2+2?"], ["4"])["input_ids"]
        assert torch.equal(got, want)
    assert "{'role'" not in model.tokenizer.decode(
        model.to_tokens([pairs[0].prompt], [pairs[0].chosen])["input_ids"][0]
    )


def test_ties_are_kept_and_reported(tmp_path):
    path = write_jsonl(tmp_path / "ties.jsonl", PAIRS)
    with pytest.warns(UserWarning, match=r"1 of 3 pairs are ties"):
        pairs = load_pairs(path)
    assert len(pairs) == 3 and pairs[2].chosen == pairs[2].rejected


# ------------------------------------------------------------------------------------ model inputs
def _ids(model, n=2):
    return model.to_tokens(["What is 2+2?"] * n, ["4", "it is 4"][:n])


INPUT_ERRORS = [
    (
        "mask all zeros",
        lambda m, b: m(b["input_ids"], torch.zeros_like(b["attention_mask"])),
        ValueError,
        "all zeros",
    ),
    ("mask value 2", lambda m, b: m(b["input_ids"], b["attention_mask"] * 2), ValueError, "must be binary"),
    (
        "mask NaN",
        lambda m, b: m(b["input_ids"], b["attention_mask"].float() * float("nan")),
        ValueError,
        "NaN",
    ),
    (
        "mask wrong shape",
        lambda m, b: m(b["input_ids"], b["attention_mask"][:, :-1]),
        ValueError,
        "has shape",
    ),
    ("1-D mask for 2 rows", lambda m, b: m(b["input_ids"], b["attention_mask"][0]), ValueError, "has shape"),
    (
        "token id -1",
        lambda m, b: m(torch.tensor([[1, 5, -1]])),
        ValueError,
        "token id -1, outside the model's vocabulary",
    ),
    (
        "token id = d_vocab",
        lambda m, b: m(torch.tensor([[1, m.cfg.d_vocab]])),
        ValueError,
        "outside the model's vocabulary",
    ),
    ("float ids", lambda m, b: m(b["input_ids"].float()), TypeError, "integer token ids"),
    ("empty input", lambda m, b: m(torch.zeros(1, 0, dtype=torch.long)), ValueError, "is empty"),
    ("3-D ids", lambda m, b: m(b["input_ids"][None]), ValueError, "must be [batch, pos]"),
    ("text mixed with ids", lambda m, b: m(["hello", 3]), TypeError, "only strings"),
    ("ragged list", lambda m, b: m([[1, 2, 3], [1, 2]]), ValueError, "ragged"),
    ("beyond n_ctx", lambda m, b: m(torch.ones(1, m.cfg.n_ctx + 1, dtype=torch.long)), ValueError, "n_ctx"),
    ("to_tokens(None)", lambda m, b: m.to_tokens(None, ["a"]), TypeError, "needs prompts and responses"),
    (
        "max_length=0",
        lambda m, b: m.to_tokens(["q"], ["a"], max_length=0),
        ValueError,
        "max_length must be a positive",
    ),
    (
        "max_length=-3",
        lambda m, b: m.to_tokens(["q"], ["a"], max_length=-3),
        ValueError,
        "max_length must be a positive",
    ),
    ("to_tokens([])", lambda m, b: m.to_tokens([], []), ValueError, "no prompts"),
    ("to_tokens numbers", lambda m, b: m.to_tokens([1], [2]), TypeError, "text or chat-message lists"),
    (
        "unknown hook, readout cache",
        lambda m, b: m.run_with_cache(
            b["input_ids"], b["attention_mask"], readout_only=True, names_filter=["blocks.0.hook_nonsense"]
        ),
        ValueError,
        "unknown hook name",
    ),
    (
        "bad ids via run_with_cache",
        lambda m, b: m.run_with_cache(torch.tensor([[1, -1]]), readout_only=True),
        ValueError,
        "outside the model's vocabulary",
    ),
]


@pytest.mark.parametrize("name,call,exc,words", INPUT_ERRORS, ids=[c[0] for c in INPUT_ERRORS])
def test_bad_model_inputs_are_clear_errors(model, name, call, exc, words):
    with pytest.raises(exc) as info:
        call(model, _ids(model))
    assert words in one_line(str(info.value))


def test_lists_and_1d_inputs_are_converted_to_the_same_reward(model):
    b = _ids(model, 1)
    ref = model(b["input_ids"], b["attention_mask"])
    assert torch.equal(model(b["input_ids"][0].tolist()), ref)
    assert torch.equal(model(b["input_ids"][0]), ref)
    assert torch.equal(model(np.asarray(b["input_ids"]), b["attention_mask"].tolist()), ref)


def test_over_long_text_is_truncated_with_one_warning(model):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = model.to_tokens(["word " * 50] * 3, ["a", "b", "c"], max_length=8)
    assert out["input_ids"].shape[1] == 8
    assert sum("truncated" in str(w.message) for w in caught) == 1


# ------------------------------------------------------------------------------------ checkpoints
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from helpers import tiny_hf_model

    d = tmp_path_factory.mktemp("ckpt") / "tiny"
    tiny_hf_model("llama").save_pretrained(d)
    return d


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _edit_tensors(d: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    sd = load_file(str(d / "model.safetensors"))
    edit(sd)
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})


def _edit_config(d: Path, **changes) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def _nan(sd, key):
    sd[key] = sd[key].clone()
    sd[key][0, 0] = float("nan")


def _tokenizer_too_big(d: Path) -> None:
    from helpers import tiny_tokenizer

    tok = tiny_tokenizer(vocab_size=150, texts=[" ".join(f"w{i}" for i in range(200))])
    tok.save_pretrained(str(d))


CHECKPOINT_ERRORS = [
    (
        "missing weight",
        lambda d: _edit_tensors(d, lambda sd: sd.pop("model.layers.1.self_attn.q_proj.weight")),
        ValueError,
        ["model.safetensors", "model.layers.1.self_attn.q_proj.weight", "lacks tensor"],
    ),
    (
        "missing score.weight",
        lambda d: _edit_tensors(d, lambda sd: sd.pop("score.weight")),
        ValueError,
        ["model.safetensors", "score.weight"],
    ),
    (
        "wrong shape",
        lambda d: _edit_tensors(
            d, lambda sd: sd.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(95, 64)})
        ),
        ValueError,
        ["model.layers.0.mlp.up_proj.weight", "shape (95, 64)", "(96, 64)"],
    ),
    (
        "num_labels vs head",
        lambda d: _edit_config(d, num_labels=2, id2label={"0": "a", "1": "b"}, label2id={"a": 0, "b": 1}),
        ValueError,
        ["score.weight", "num_labels=2"],
    ),
    (
        "integer weights",
        lambda d: _edit_tensors(
            d, lambda sd: sd.update({"model.norm.weight": torch.ones(64, dtype=torch.int32)})
        ),
        ValueError,
        ["model.norm.weight", "dtype"],
    ),
    (
        "NaN weight",
        lambda d: _edit_tensors(d, lambda sd: _nan(sd, "model.layers.2.mlp.down_proj.weight")),
        ValueError,
        ["non-finite", "blocks.2.mlp.W_out"],
    ),
    (
        "truncated safetensors",
        lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:5000]),
        ValueError,
        ["model.safetensors", "corrupt or truncated"],
    ),
    (
        "garbage safetensors",
        lambda d: (d / "model.safetensors").write_bytes(b"not a safetensors file at all" * 10),
        ValueError,
        ["model.safetensors", "corrupt or truncated"],
    ),
    (
        "empty safetensors",
        lambda d: (d / "model.safetensors").write_bytes(b""),
        ValueError,
        ["model.safetensors", "empty"],
    ),
    (
        "invalid config.json",
        lambda d: (d / "config.json").write_text('{"model_type": "llama",'),
        ValueError,
        ["config.json", "not valid JSON", "line 1"],
    ),
    (
        "config.json not an object",
        lambda d: (d / "config.json").write_text("[1, 2]"),
        ValueError,
        ["config.json", "not an object"],
    ),
    ("tokenizer beyond vocab", _tokenizer_too_big, ValueError, ["tokenizer has", "97 rows"]),
]


@pytest.mark.parametrize("name,damage,exc,words", CHECKPOINT_ERRORS, ids=[c[0] for c in CHECKPOINT_ERRORS])
def test_damaged_checkpoints_name_the_file_and_tensor(tiny_dir, tmp_path, name, damage, exc, words):
    from reward_lens import HookedRewardModel

    d = _copy(tiny_dir, tmp_path / "ckpt")
    damage(d)
    with pytest.raises(exc) as info:
        HookedRewardModel.from_pretrained(d)
    message = one_line(str(info.value))
    for w in words:
        assert w in message, (w, message)


def test_intact_checkpoint_loads_and_unknown_kwargs_are_type_errors(tiny_dir):
    from reward_lens import HookedRewardModel

    assert HookedRewardModel.from_pretrained(tiny_dir).cfg.n_layers == 3
    with pytest.raises(TypeError, match="unexpected keyword argument 'devcie'"):
        HookedRewardModel.from_pretrained(tiny_dir, devcie="cpu")
    from reward_lens.demo import DEMO_DIR

    with pytest.raises(TypeError, match="unexpected keyword argument 'dytpe'"):
        HookedRewardModel.from_pretrained(DEMO_DIR, dytpe="float16")  # a hooked checkpoint too


def test_hooked_checkpoint_with_nan_weights_is_named(model, tmp_path):
    from reward_lens import HookedRewardModel

    model.save_pretrained(tmp_path / "m")
    _edit = tmp_path / "m" / "model.safetensors"
    from safetensors.torch import load_file, save_file

    sd = load_file(str(_edit))
    sd["blocks.1.attn.W_O"] = sd["blocks.1.attn.W_O"].clone()
    sd["blocks.1.attn.W_O"].view(-1)[3] = float("inf")
    save_file(sd, str(_edit))
    with pytest.raises(ValueError, match=r"non-finite.*blocks\.1\.attn\.W_O"):
        HookedRewardModel.from_pretrained(tmp_path / "m")


def test_non_finite_reward_in_a_run_names_the_pair_and_side(model):
    import copy

    from reward_lens import lens

    broken = copy.deepcopy(model)
    with torch.no_grad():
        broken.blocks[0].mlp.W_out.fill_(float("nan"))
    pairs = [PreferencePair(**r, id=f"p{i}") for i, r in enumerate(PAIRS[:2])]
    with pytest.raises(ValueError, match=r"non-finite reward .* for pair p0, chosen"):
        lens(broken, pairs)


# ------------------------------------------------------------------------------------ CLI options
@pytest.fixture
def no_model_load(monkeypatch):
    """A bad option must be refused before any model is loaded."""
    import reward_lens.app.cli as cli

    monkeypatch.setattr(
        cli, "load_model", lambda *a, **k: pytest.fail("the model was loaded before validation")
    )


CLI_ERRORS = [
    (["--device", "tpu"], "--device 'tpu' is not a device"),
    (["--device", "meta"], "--device meta is not supported"),
    (["--device", "mps"], "--device mps is not supported"),
    (["--device", "cuda:7"], "--device cuda:7"),
    (["--dtype", "int8"], "--dtype: unknown dtype 'int8'"),
    (["--max-pairs", "0"], "--max-pairs must be >= 1"),
    (["--batch-size", "0"], "--batch-size must be >= 1"),
    (["--threads", "-2"], "--threads must be >= 1"),
    (["--batch-size", "many"], "invalid batch size 'many' (give an integer >= 1 or auto)"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--pairs", "{tmp}/nope.jsonl"], "--pairs: no pairs file"),
    (["--pairs", "{tmp}"], "is a directory"),
    (["--pairs", "{tmp}/x.txt"], "unsupported file type '.txt'"),
    (["--out", ""], "--out '')"),
    (["--out", "."], "is the current directory"),
    (["--out", "{tmp}/afile"], "is a file, not a directory"),
    (["--out", "{tmp}/afile/sub"], "which is a file"),
    (["--out", "/proc/reward-lens-out"], "cannot write in '/proc'"),
    (["--out", "{tmp}/foreign"], "not a reward-lens report"),
]


@pytest.mark.parametrize("command", ["audit", "compare"])
@pytest.mark.parametrize("args,words", CLI_ERRORS, ids=[" ".join(c[0]) or "empty" for c in CLI_ERRORS])
def test_every_command_checks_every_option_before_any_work(
    tmp_path, capsys, no_model_load, monkeypatch, command, args, words
):
    if "cuda:7" in args and torch.cuda.device_count() > 7:
        args = ["--device", "cuda:99"]
    (tmp_path / "afile").write_text("keep me")
    (tmp_path / "x.txt").write_text("x")
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "thesis.tex").write_text("mine")
    monkeypatch.chdir(tmp_path)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    argv = (
        [command]
        + (["demo", "demo"] if command == "compare" else [])
        + [a.format(tmp=tmp_path) for a in args]
    )
    if "--out" not in args:
        argv += ["--out", str(tmp_path / "out")]
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    assert code == 2
    message = one_line(capsys.readouterr().err)
    assert words in message and "error" in message
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing written
    assert (tmp_path / "afile").read_text() == "keep me"


def test_debug_shows_the_traceback(tmp_path, no_model_load):
    with pytest.raises(ValueError, match="--device 'tpu'"):
        main(["audit", "--device", "tpu", "--out", str(tmp_path / "o"), "--debug"])


def test_a_damaged_model_through_the_cli_is_one_line_and_writes_nothing(tiny_dir, tmp_path, capsys):
    d = _copy(tiny_dir, tmp_path / "ckpt")
    _edit_tensors(d, lambda sd: sd.pop("score.weight"))
    assert main(["audit", "--model", str(d), "--out", str(tmp_path / "o")]) == 2
    assert "score.weight" in one_line(capsys.readouterr().err)
    assert (
        not (tmp_path / "o").exists()
        and not list(tmp_path.glob(".o*"))
        and not (tmp_path / "o.lock").exists()
    )


def test_a_broken_pairs_file_through_the_cli_names_line_and_writes_nothing(tmp_path, capsys):
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt":"q","chosen":"a","rejected":"b"}\n{"prompt":"q","chosen":"","rejected":"b"}\n')
    assert main(["audit", "--pairs", str(bad), "--out", str(tmp_path / "o")]) == 2
    message = one_line(capsys.readouterr().err)
    assert "p.jsonl, line 2, column 'chosen'" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.jsonl"]


# ------------------------------------------------------------------------------------ API arguments
API_ERRORS = [
    (
        "lens(model, 42)",
        lambda m: __import__("reward_lens").lens(m, 42),
        TypeError,
        "pairs must be a PreferencePair",
    ),
    (
        "lens(model, [])",
        lambda m: __import__("reward_lens").lens(m, []),
        ValueError,
        "no preference pairs given",
    ),
    ("lens(model, dict)", lambda m: __import__("reward_lens").lens(m, PAIRS[0]), TypeError, "got dict"),
    (
        "patch(mode=[])",
        lambda m: __import__("reward_lens").patch(m, _pairs(), mode=[]),
        ValueError,
        "no patching mode",
    ),
    (
        "patch(mode='nosing')",
        lambda m: __import__("reward_lens").patch(m, _pairs(), mode="nosing"),
        ValueError,
        "unknown patching mode",
    ),
    (
        "concept_vector(test_fraction=1.0)",
        lambda m: __import__("reward_lens").concept_vector(m, _pairs() * 4, test_fraction=1.0),
        ValueError,
        "test_fraction must be in [0, 1)",
    ),
    (
        "train_sae(NaN activations)",
        lambda m: __import__("reward_lens").train_sae(data=torch.full((64, 8), float("nan"))),
        ValueError,
        "NaN/inf",
    ),
    (
        "train_sae(d_sae=0)",
        lambda m: __import__("reward_lens").train_sae(data=torch.randn(64, 8), d_sae=0),
        ValueError,
        "d_sae must be an integer >= 1",
    ),
]


def _pairs():
    return [PreferencePair(**r, id=str(i)) for i, r in enumerate(PAIRS[:2])]


@pytest.mark.parametrize("name,call,exc,words", API_ERRORS, ids=[c[0] for c in API_ERRORS])
def test_api_arguments_are_clear_errors(model, name, call, exc, words):
    with pytest.raises(exc) as info:
        call(model)
    assert words in one_line(str(info.value))


def test_sae_with_nan_weights_is_refused_naming_the_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    from reward_lens import SAEConfig, SparseAutoencoder, load_sae

    sae = SparseAutoencoder(SAEConfig(d_in=8, d_sae=16, architecture="topk", k=2))
    sae.save(tmp_path / "sae")
    f = next((tmp_path / "sae").glob("*.safetensors"))
    sd = load_file(str(f))
    sd["W_dec"][3, 1] = float("nan")
    save_file(sd, str(f))
    with pytest.raises(ValueError, match=r"non-finite.*W_dec"):
        load_sae(tmp_path / "sae")


def test_safe_ratio_is_nan_never_inf():
    assert torch.isnan(safe_ratio(torch.tensor([1.0, -2.0]), torch.tensor([0.0, 0.0]))).all()
    assert safe_ratio(torch.tensor([3.0]), torch.tensor([2.0])).item() == 1.5
    out = safe_ratio(np.array([[1.0, 0.0]]), np.array([[0.0], [4.0]]))
    assert np.isnan(out[0]).all() and out[1].tolist() == [0.25, 0.0]


# ------------------------------------------------------------------------------------ NaN-safe audits
def test_audit_with_a_tie_writes_nan_not_inf_and_builds_the_report(tmp_path, capsys):
    pairs = write_jsonl(tmp_path / "p.jsonl", PAIRS)
    with pytest.warns(UserWarning, match="ties"):
        assert main(["audit", "--pairs", str(pairs), "--out", str(tmp_path / "o")]) == 0
    out = tmp_path / "o"
    assert_clean_outputs(out)
    patching = pd.read_csv(out / "patching.csv")
    tie = patching[patching["pair"].astype(str) == "2"]
    assert len(tie) and tie["normalized_effect"].isna().all() and (tie["clean_gap"] == 0).all()
    others = patching[patching["pair"].astype(str) != "2"]
    assert np.isfinite(others["normalized_effect"]).all()
    np.testing.assert_allclose(others["normalized_effect"], others["effect"] / others["clean_gap"], rtol=1e-6)
    results = json.loads((out / "results.json").read_text())
    assert results["n_ties"] == 1 and results["n_pairs"] == 3
    assert results["pairs_file"]["format"] == "jsonl"
    import hashlib

    assert results["pairs_file"]["sha256"] == hashlib.sha256(pairs.read_bytes()).hexdigest()
    assert results["reward_lens_version"] and results["options"]["max_pairs"] is None and results["model"]
    assert "tied pairs" in (out / "report.html").read_text()


def test_one_pair_says_the_ci_is_not_available_and_all_ties_still_report(tmp_path, capsys):
    pairs = write_jsonl(tmp_path / "p.jsonl", PAIRS[:1])
    assert main(["audit", "--pairs", str(pairs), "--out", str(tmp_path / "one")]) == 0
    results = json.loads((tmp_path / "one" / "results.json").read_text())
    assert results["faithfulness"]["mean_rho_ci"] == [None, None]
    assert "CI not available (n=1)" in (tmp_path / "one" / "report.html").read_text()
    assert "CI not available (n=1)" in capsys.readouterr().out
    tied = write_jsonl(tmp_path / "t.jsonl", [PAIRS[2], {**PAIRS[2], "prompt": "Say hello"}])
    with pytest.warns(UserWarning, match="2 of 2 pairs are ties"):
        assert main(["audit", "--pairs", str(tied), "--out", str(tmp_path / "tied")]) == 0
    assert_clean_outputs(tmp_path / "tied")
    assert (tmp_path / "tied" / "report.html").exists()


# ------------------------------------------------------------------------------------ atomic reports
@pytest.fixture(scope="module")
def computed_audit(model):
    """One real audit of 2 demo pairs, computed once; the tests below re-run only the CLI and the writing."""
    from reward_lens import demo_pairs

    return audit_module.run_audit(model, demo_pairs()[:2], None, echo=lambda line: None)


@pytest.fixture
def fast_audit(monkeypatch, computed_audit):
    """`reward-lens audit` with the steps replaced by the precomputed result (the lock, the checks before
    work and the atomic write are the real ones)."""
    import copy

    def run_audit(model, pairs, out_dir, *, run_info=None, echo=print, **kw):
        audit = copy.copy(computed_audit)
        audit.record = {**(run_info or {}), **computed_audit.record}
        audit_module.write_outputs(audit, out_dir, echo)
        return audit

    monkeypatch.setattr(audit_module, "run_audit", run_audit)


def _fake_old_report(out: Path) -> None:
    out.mkdir()
    (out / MARKER).write_text("")
    (out / "results.json").write_text('{"model": "old"}')
    (out / "report.html").write_text("old report")
    (out / "stale_extra.csv").write_text("a\n1\n")


def test_rerun_replaces_an_earlier_report_as_a_set(tmp_path, capsys, fast_audit):
    out = tmp_path / "o"
    _fake_old_report(out)
    assert main(["audit", "--out", str(out), "--max-pairs", "2"]) == 0
    assert not (out / "stale_extra.csv").exists()
    assert json.loads((out / "results.json").read_text())["n_pairs"] == 2
    assert "old report" not in (out / "report.html").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]  # no temporary dirs, no lock left


@pytest.mark.parametrize("previous", [True, False], ids=["over an earlier report", "fresh"])
def test_interrupt_leaves_the_previous_report_or_none(tmp_path, capsys, monkeypatch, fast_audit, previous):
    out = tmp_path / "o"
    if previous:
        _fake_old_report(out)
    before = {p.name: p.read_text() for p in out.iterdir()} if previous else None
    calls = []

    def interrupted(path, frame):  # Ctrl-C after the first CSV was written into the new report
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt
        frame.to_csv(path, index=False)

    monkeypatch.setattr(audit_module, "write_csv", interrupted)
    assert main(["audit", "--out", str(out), "--max-pairs", "2"]) == 130
    assert "interrupted" in one_line(capsys.readouterr().err)
    if previous:
        assert {p.name: p.read_text() for p in out.iterdir()} == before
    else:
        assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == (["o"] if previous else [])


def test_a_concurrent_writer_is_refused_and_cannot_interleave(tmp_path, capsys, monkeypatch, fast_audit):
    """A second audit into the same --out while the first runs is refused; the first's report is whole."""
    import reward_lens.app.cli as cli

    out = tmp_path / "o"
    second = {}
    real = cli._load_pairs

    def load_pairs_then_start_a_second_run(path, model):
        second["code"] = main(["audit", "--out", str(out), "--max-pairs", "1"])
        second["err"] = capsys.readouterr().err
        return real(path, model)

    monkeypatch.setattr(cli, "_load_pairs", load_pairs_then_start_a_second_run)
    assert main(["audit", "--out", str(out), "--max-pairs", "2"]) == 0
    assert second["code"] == 2 and "another reward-lens run" in one_line(second["err"])
    results = json.loads((out / "results.json").read_text())
    assert results["n_pairs"] == 2 and len(pd.read_csv(out / "lens.csv")["pair"].unique()) == 2
    assert not (tmp_path / "o.lock").exists()


def test_a_lock_left_by_a_dead_process_is_taken_over(tmp_path):
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    (tmp_path / "o.lock").write_text(dead.stdout.strip())
    with ReportDir(tmp_path / "o") as rd:
        rd.commit(lambda d: (d / "x.json").write_text("{}"))
    assert (tmp_path / "o" / "x.json").exists() and not (tmp_path / "o.lock").exists()
    (tmp_path / "o2.lock").write_text(str(os.getpid()))  # a live holder: refused
    with pytest.raises(ValueError, match="another reward-lens run"):
        with ReportDir(tmp_path / "o2"):
            pass


def test_a_real_subprocess_user_error_is_one_line_without_traceback(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "reward_lens.app.cli",
            "audit",
            "--device",
            "meta",
            "--out",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    assert bad.returncode == 2 and "--device meta" in one_line(bad.stderr) and not (tmp_path / "o").exists()


def test_an_interrupt_between_the_two_renames_restores_the_previous_report(tmp_path, monkeypatch):
    import reward_lens.app.output as output

    out = tmp_path / "o"
    _fake_old_report(out)
    before = {p.name: p.read_text() for p in out.iterdir()}
    real, calls = os.replace, []

    def replace(src, dst):
        calls.append((src, dst))
        if len(calls) == 2:  # the old report is aside, the new one not yet in place
            raise KeyboardInterrupt
        real(src, dst)

    monkeypatch.setattr(output.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        with ReportDir(out) as rd:
            rd.commit(lambda d: (d / "results.json").write_text('{"model": "new"}'))
    monkeypatch.setattr(output.os, "replace", real)
    assert {p.name: p.read_text() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]
