"""Careless and hostile checkpoints, saving over a checkpoint, GGUF files, PEFT adapters. Each case is tagged
with its class:

- ``data-loss``: saving never replaces a checkpoint the user did not ask to replace;
- ``security``: a hostile file runs no code and gives one clear line;
- ``traceback``: a damaged input gives one clear line, never a traceback.
"""

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch

from reward_lens import HookedRewardModel
from reward_lens.app.cli import main


def one_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    assert len(lines) == 1, text
    assert "Traceback" not in text
    return lines[0]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from helpers import tiny_hf_model

    d = tmp_path_factory.mktemp("ckpt") / "tiny"
    tiny_hf_model("llama").save_pretrained(d)
    return d


@pytest.fixture
def ckpt(tiny_dir, tmp_path):
    return Path(shutil.copytree(tiny_dir, tmp_path / "ckpt"))


# ------------------------------------------------------------------------------- saving (data-loss)
def test_save_pretrained_into_the_checkpoint_it_came_from_is_refused(ckpt):
    import transformers

    model = HookedRewardModel.from_pretrained(ckpt)
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    with pytest.raises(ValueError) as info:
        model.save_pretrained(ckpt)
    message = one_line(str(info.value))
    assert "holds another checkpoint" in message and "config.json" in message and "overwrite=True" in message
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(ckpt)  # still the real weights
    ids = torch.tensor([[1, 5, 7, 9]])
    torch.testing.assert_close(hf(ids).logits[:, 0], model(ids), rtol=1e-4, atol=1e-4)


def test_save_pretrained_beside_or_over_an_earlier_hooked_save_or_when_asked(ckpt, tmp_path):
    model = HookedRewardModel.from_pretrained(ckpt)
    model.save_pretrained(tmp_path / "hooked")
    model.save_pretrained(tmp_path / "hooked")  # an earlier hooked save: replaced
    ids = torch.tensor([[1, 5, 7, 9]])
    torch.testing.assert_close(HookedRewardModel.from_pretrained(tmp_path / "hooked")(ids), model(ids))
    model.save_pretrained(ckpt, overwrite=True)  # asked for
    torch.testing.assert_close(HookedRewardModel.from_pretrained(ckpt)(ids), model(ids))


# ------------------------------------------------------------------------------- hostile files (security)
class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.mkdir, (Path(self.marker),))


def _pickle_with_payload(d: Path) -> None:
    (d / "model.safetensors").unlink()
    torch.save({"score.weight": torch.zeros(1, 64), "x": _Payload(str(d / "PWNED"))}, d / "pytorch_model.bin")


def _huge_header(d: Path) -> None:
    header = json.dumps({"score.weight": {"dtype": "F32", "shape": [2**40], "data_offsets": [0, 4]}}).encode()
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 4)


def _bin_garbage(d: Path) -> None:
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"PK\x03\x04 not really a zip" * 20)


HOSTILE = [  # (class, name, damage, words)
    (
        "security",
        "pytorch_model.bin with a payload",
        _pickle_with_payload,
        ["pytorch_model.bin", "refused", "pickle"],
    ),
    ("security", "safetensors header claiming 4 TiB", _huge_header, ["model.safetensors", "does not match"]),
    ("traceback", "garbage pytorch_model.bin", _bin_garbage, ["pytorch_model.bin", "corrupt or truncated"]),
]


@pytest.mark.parametrize("cls,name,damage,words", HOSTILE, ids=[c[1] for c in HOSTILE])
def test_hostile_weight_files_run_no_code_and_are_one_line(ckpt, tmp_path, capsys, cls, name, damage, words):
    damage(ckpt)
    with pytest.raises(ValueError) as info:
        HookedRewardModel.from_pretrained(ckpt)
    message = one_line(str(info.value))
    assert all(w in message for w in words), message
    assert main(["audit", "--model", str(ckpt), "--out", str(tmp_path / "o")]) == 2
    assert words[0] in one_line(capsys.readouterr().err)
    assert not (ckpt / "PWNED").exists() and not (tmp_path / "o").exists()


def test_a_hostile_chat_template_is_a_one_line_error(tmp_path):
    from reward_lens import load_demo_model

    model = load_demo_model()
    model.tokenizer.chat_template = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    model.input_format = "chat"
    with pytest.raises(ValueError) as info:
        model.to_tokens(["q"], ["a"])
    message = one_line(str(info.value))
    assert "chat template failed (SecurityError" in message and "tokenizer.chat_template" in message


# ------------------------------------------------------------------------------- GGUF (traceback)
def _gguf(path: Path) -> Path:
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_tensor("token_embd.weight", np.ones((16, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _truncated(d: Path) -> None:
    full = _gguf(d / "full.gguf").read_bytes()
    (d / "m.gguf").write_bytes(full[: len(full) // 3])


GGUF_CASES = [  # (class, name, make the directory's m.gguf (or not), the directory given, exc, words)
    (
        "traceback",
        "missing directory",
        lambda d: None,
        "absent",
        FileNotFoundError,
        ["no directory at", "absent"],
    ),
    ("traceback", "missing file", lambda d: None, ".", FileNotFoundError, ["no GGUF file 'm.gguf'"]),
    (
        "traceback",
        "empty file",
        lambda d: (d / "m.gguf").write_bytes(b""),
        ".",
        ValueError,
        ["m.gguf", "is empty"],
    ),
    (
        "traceback",
        "not GGUF",
        lambda d: (d / "m.gguf").write_text("hello"),
        ".",
        ValueError,
        ["is not a GGUF file"],
    ),
    ("traceback", "truncated", _truncated, ".", ValueError, ["m.gguf", "cannot be read as GGUF"]),
    (
        "traceback",
        "header only, no model",
        lambda d: _gguf(d / "m.gguf"),
        ".",
        ValueError,
        ["cannot be read as GGUF"],
    ),
]


@pytest.mark.parametrize("cls,name,make,given,exc,words", GGUF_CASES, ids=[c[1] for c in GGUF_CASES])
def test_damaged_or_missing_gguf_files_are_one_line(tmp_path, cls, name, make, given, exc, words):
    make(tmp_path)
    with pytest.raises(exc) as info:
        HookedRewardModel.from_pretrained(tmp_path / given if given != "." else tmp_path, gguf_file="m.gguf")
    message = one_line(str(info.value))
    assert all(w in message for w in words), message


# ------------------------------------------------------------------------------- PEFT (traceback)
@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    """A LoRA reward-model adapter as PEFT saves it, on a saved tiny base; and a base of another width."""
    import peft
    import transformers
    from helpers import tiny_hf_model

    root = tmp_path_factory.mktemp("lora")
    tiny_hf_model("llama", seed=1).save_pretrained(root / "base")
    base = transformers.LlamaForSequenceClassification.from_pretrained(root / "base")
    lora_config = peft.LoraConfig(task_type="SEQ_CLS", r=4, target_modules=["q_proj", "v_proj"])
    model = peft.get_peft_model(base, lora_config)
    model.save_pretrained(root / "adapter")
    tiny_hf_model("llama", seed=2, hidden_size=96).save_pretrained(root / "wide")
    return root


def _adapter(lora: Path, tmp_path: Path, **config) -> Path:
    d = Path(shutil.copytree(lora / "adapter", tmp_path / "adapter"))
    if config:
        cfg = json.loads((d / "adapter_config.json").read_text())
        (d / "adapter_config.json").write_text(json.dumps({**cfg, **config}))
    return d


PEFT_CASES = [  # (class, name, adapter config changes / damage, from_pretrained kwargs, exc, words)
    (
        "traceback",
        "base missing",
        {"base_model_name_or_path": "/nowhere/base"},
        {},
        FileNotFoundError,
        ["'/nowhere/base'", "base_model_name_or_path in", "base_model="],
    ),
    (
        "traceback",
        "relative base not found",
        {"base_model_name_or_path": "runs/base"},
        {},
        FileNotFoundError,
        ["'runs/base'", "a relative path: tried from", "base_model="],
    ),
    (
        "traceback",
        "base_model= missing",
        {},
        {"base_model": "/nowhere/b2"},
        FileNotFoundError,
        ["'/nowhere/b2'", "(base_model=)"],
    ),
    (
        "traceback",
        "base of another width",
        {},
        {"base_model": "WIDE"},
        ValueError,
        ["does not fit the base", "size mismatch", "base_model="],
    ),
    (
        "traceback",
        "garbage adapter_config.json",
        "config",
        {},
        ValueError,
        ["adapter_config.json", "not valid JSON"],
    ),
    (
        "traceback",
        "garbage adapter weights",
        "weights",
        {},
        ValueError,
        ["adapter_model.safetensors", "corrupt or truncated"],
    ),
]


@pytest.mark.parametrize("cls,name,change,kwargs,exc,words", PEFT_CASES, ids=[c[1] for c in PEFT_CASES])
def test_bad_peft_adapters_are_one_line_naming_what_the_user_gave(
    lora, tmp_path, cls, name, change, kwargs, exc, words
):
    d = _adapter(lora, tmp_path, **(change if isinstance(change, dict) else {}))
    if change == "config":
        (d / "adapter_config.json").write_text('{"base_model_name_or_path": ')
    if change == "weights":
        (d / "adapter_model.safetensors").write_bytes(b"garbage" * 30)
    kwargs = {k: (str(lora / "wide") if v == "WIDE" else v) for k, v in kwargs.items()}
    with pytest.raises(exc) as info:
        HookedRewardModel.from_pretrained(d, **kwargs)
    message = one_line(str(info.value))
    assert all(w in message for w in words), message


def test_a_relative_base_is_found_beside_the_adapter(lora, tmp_path):
    d = _adapter(lora, tmp_path)
    shutil.copytree(lora / "base", d / "base")
    (d / "adapter_config.json").write_text(
        json.dumps({**json.loads((d / "adapter_config.json").read_text()), "base_model_name_or_path": "base"})
    )
    ids = torch.tensor([[1, 5, 7, 9]])
    ref = HookedRewardModel.from_pretrained(_adapter(lora, tmp_path / "x"))
    torch.testing.assert_close(HookedRewardModel.from_pretrained(d)(ids), ref(ids))
