"""Peak host memory of loading a sharded checkpoint: reward-lens's streaming loader next to transformers'.

Builds a randomly initialised Llama reward model (`LlamaForSequenceClassification`, default 24 layers,
d_model 1024, saved in fp32 as 4 safetensors shards by transformers' `save_pretrained(max_shard_size=...)`),
then loads it in a fresh subprocess per case (fp32 -> fp32 and fp32 -> bf16, ours and transformers'),
each measuring its peak resident memory (VmHWM, reset after the imports via /proc/self/clear_refs) minus
its resident memory after the imports. Printed: that peak, the loaded model's parameter bytes, and the
ratio peak / parameter bytes (the streaming target: <= 1.3).

    python benchmarks/load_memory.py                        # 24 layers, d_model 1024, 4 shards
    python benchmarks/load_memory.py --layers 8 --d-model 512 # quicker
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CASES = [
    ("reward-lens", "float32"),
    ("reward-lens", "bfloat16"),
    ("transformers", "float32"),
    ("transformers", "bfloat16"),
]


def rss_kb(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status (Linux only)")


def load(loader: str, directory: str, dtype):
    import transformers

    import reward_lens

    if loader == "reward-lens":
        return reward_lens.HookedRewardModel.from_pretrained(directory, device="cpu", dtype=dtype)
    return transformers.AutoModelForSequenceClassification.from_pretrained(directory, dtype=dtype)


def child(loader: str, directory: str, dtype_name: str) -> None:
    """Load once and print {"peak": bytes, "params": bytes} (runs in a fresh interpreter). A tiny checkpoint
    of the same architecture is loaded first, so the modules either loader imports lazily are not counted."""
    import gc

    import torch

    torch.set_num_threads(1)
    dtype = getattr(torch, dtype_name)
    load(loader, str(Path(directory) / "warmup"), dtype)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:  # reset VmHWM to the current RSS
        f.write("5")
    base = rss_kb("VmRSS")
    model = load(loader, str(Path(directory) / "model"), dtype)
    peak = rss_kb("VmHWM") - base
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    print(json.dumps({"peak": peak * 1024, "params": params}))


def build(directory: Path, layers: int, d_model: int, shards: int, vocab: int) -> int:
    """A random fp32 Llama reward model saved in `shards` safetensors shards; returns its bytes."""
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    heads = max(1, d_model // 64)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=d_model,
        intermediate_size=int(d_model * 2.75) // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 4),
        num_labels=1,
        pad_token_id=0,
    )
    model = LlamaForSequenceClassification(config).float()
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(str(directory), max_shard_size=int(size / shards * 1.05))  # tensors are never split
    return size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--child", nargs=3, metavar=("LOADER", "DIR", "DTYPE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(*args.child)
    with tempfile.TemporaryDirectory() as tmp:
        size = build(Path(tmp) / "model", args.layers, args.d_model, args.shards, args.vocab)
        build(Path(tmp) / "warmup", 1, 64, 1, 128)
        n_files = len(list((Path(tmp) / "model").glob("*.safetensors")))
        print(
            f"checkpoint: {args.layers} layers, d_model {args.d_model}, vocab {args.vocab}, fp32, "
            f"{size / 2**20:.0f} MiB in {n_files} shard(s)"
        )
        print(f"{'loader':<14}{'dtype':<10}{'peak MiB':>10}{'params MiB':>12}{'peak/params':>13}")
        # The children import reward_lens from this checkout (their sys.path[0] would be benchmarks/).
        root = str(Path(__file__).resolve().parents[1])
        env = dict(
            os.environ,
            OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
        )
        for loader, dtype in CASES:
            out = subprocess.run(
                [sys.executable, __file__, "--child", loader, tmp, dtype],
                capture_output=True,
                text=True,
                env=env,
                check=True,
            )
            r = json.loads(out.stdout.strip().splitlines()[-1])
            print(
                f"{loader:<14}{'fp32->' + ('bf16' if dtype == 'bfloat16' else 'fp32'):<10}"
                f"{r['peak'] / 2**20:>10.0f}{r['params'] / 2**20:>12.0f}{r['peak'] / r['params']:>13.2f}"
            )


if __name__ == "__main__":
    main()
