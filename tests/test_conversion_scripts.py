"""The conversion/ tools run on a saved checkpoint (they are scripts, not an importable package)."""

import runpy
import subprocess
import sys
from pathlib import Path

import torch
from helpers import padded_batch, tiny_hf_model

from reward_lens import HookedRewardModel

ROOT = Path(__file__).resolve().parents[1]


def test_parity_harness_reports_small_errors(tmp_path, capsys):
    tiny_hf_model("mistral", seed=5).save_pretrained(tmp_path / "hf")
    mod = runpy.run_path(str(ROOT / "conversion" / "parity.py"))
    reward_err, hidden_err = mod["main"]([str(tmp_path / "hf")])
    out = capsys.readouterr().out
    assert "SUMMARY" in out and reward_err < 1e-4 and hidden_err < 1e-4


def test_convert_script_writes_a_loadable_hooked_checkpoint(tmp_path):
    hf = tiny_hf_model("llama", seed=2)
    hf.save_pretrained(tmp_path / "hf")
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "conversion" / "convert.py"),
            str(tmp_path / "hf"),
            str(tmp_path / "out"),
        ],
        check=True,
        capture_output=True,
    )
    model = HookedRewardModel.from_pretrained(tmp_path / "out")
    ids, mask = padded_batch([6, 4], "right")
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask).logits[:, 0]
    assert (model(ids, attention_mask=mask) - ref).abs().max() < 1e-4
