"""benchmarks/gpu_audit.py runs end to end at a tiny size on CPU (the full size is for a GPU session)."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGES = [
    "reward lens",
    "exact attribution (components + heads)",
    "component patching, 4 modes",
    "head patching, 4 modes",
    "AtP (components + heads), 4 modes",
    "faithfulness",
]


def test_gpu_audit_benchmark_tiny_on_cpu():
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "gpu_audit.py"),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--layers",
        "2",
        "--d-model",
        "64",
        "--heads",
        "4",
        "--kv-heads",
        "2",
        "--d-mlp",
        "128",
        "--vocab",
        "512",
        "--pairs",
        "6",
        "--max-len",
        "48",
        "--batch-size",
        "4",
    ]
    out = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout
    for stage in STAGES:
        row = re.search(rf"^\| {re.escape(stage)} \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$", text, re.M)
        assert row and float(row.group(1)) > 0, stage
    assert "6 pairs" in text and "on CPU" in text
    ratio = re.search(r"pipeline / bare forward = ([\d.]+)", text)
    assert ratio and float(ratio.group(1)) > 1  # the pipeline does more than one forward
    error = float(re.search(r"attribution max relative error ([\d.e+-]+)", text).group(1))
    assert error < 1e-4  # fp32: the exact attribution reproduces the reward


def test_the_gpu_session_script_runs_its_parts_at_tiny_sizes_on_cpu(tmp_path):
    """benchmarks/gpu_session.sh --smoke: the device check a GPU session runs, each part at a tiny size on the
    CPU, so the one prepared script stays runnable without a GPU (its CUDA tests are the GPU's part alone)."""
    env = {
        **os.environ,
        "OUT": str(tmp_path),
        "PYTHON": sys.executable,
        "OMP_NUM_THREADS": "1",
        "GPU_SESSION_SITE": str(tmp_path / "site"),
        "GPU_SESSION_PARTS": str(tmp_path / "parts"),
    }
    out = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_session.sh"), "--smoke"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "device cpu" in (tmp_path / "device.txt").read_text()
    assert "pipeline / bare forward" in (tmp_path / "gpu_audit.log").read_text()
    import json

    run = json.loads((tmp_path / "smollm2_transcoders.json").read_text())
    assert run["args"]["device"] == "cpu" and run["summary"]["n_pairs"] == 4
    assert set(run["verdicts"]) >= {"mean_fvu", "max_fvu", "reward_pearson"}
