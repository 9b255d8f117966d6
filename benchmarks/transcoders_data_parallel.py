"""Data-parallel transcoder training against one process on the same batches: how far apart the parameters
end (the tolerance `tests/test_transcoders_distributed.py` states), and the wall time of each.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/transcoders_data_parallel.py

Runs `tests/torchrun_transcoders.py` under `torchrun --nproc_per_node 2` (gloo, CPU) and the same settings in
this process (TopK and BatchTopK, AuxK active; seed 0), then prints per parameter the largest |difference|
in units of the learning rate, relative to the tensor's largest |entry|, the median, and the share of
entries more than 1e-6 apart. On 2 shared cores the two ranks compete for the same CPUs: the times are no
speed-up measurement."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import torchrun_transcoders as script  # noqa: E402

import reward_lens as rl  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "dp.pt"
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
        start = time.perf_counter()
        subprocess.run(
            [*cmd, str(ROOT / "tests" / "torchrun_transcoders.py"), str(path)], env=env, check=True
        )
        print(f"2 ranks (both settings, with start-up): {time.perf_counter() - start:.1f} s")
        ranked = torch.load(path, weights_only=False)
    model = rl.load_demo_model(device="cpu")
    print(f"text batches run by each rank: {ranked['model_batches']}")
    for kind in ("topk", "batchtopk"):
        start = time.perf_counter()
        one = script.train(model, kind)
        print(f"{kind}: one process {time.perf_counter() - start:.1f} s")
        lr = one.config["training"]["lr"]
        a, b = script.state(one), ranked[kind]["state"]
        worst = 0.0
        for key in a:
            d = (a[key] - b[key]).abs()
            worst = max(worst, float(d.max()) / lr)
            scale = float(a[key].abs().max().clamp(min=1e-12))
            print(
                f"  {key:10s} max {float(d.max()) / lr:.2e} lr, {float(d.max()) / scale:.1e} of max |entry|, "
                f"median {float(d.median()):.1e}, > 1e-6: {float((d > 1e-6).float().mean()):.4%}"
            )
        print(f"  {kind}: largest difference {worst:.2e} x lr (lr {lr:.2e})")


if __name__ == "__main__":
    main()
