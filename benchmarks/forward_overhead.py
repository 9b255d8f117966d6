"""Hooked forward (no hooks attached) vs the transformers forward of the same weights.

Setting: fp32 CPU, 12 layers, d_model 512, T=256, batch 4, random-init Llama reward model.
Prints median wall time of each, their ratio (target <= 1.10) and each one's peak extra memory.
Run: python benchmarks/forward_overhead.py [--layers 12 --d-model 512 --seq 256 --batch 4 --repeats 7]
"""

import argparse
import gc
import statistics
import time

import torch
from harness import random_llama, size_args

from reward_lens import HookedRewardModel


def median_time(fn, repeats):
    """Median of `repeats` consecutive calls, after one warm-up call."""
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def peak_bytes(fn):
    """Peak extra memory of one call: the CUDA allocator's peak on GPU; on CPU, the running peak of the
    allocations torch.profiler records (tensor memory only, the same accounting for both models)."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        return torch.cuda.max_memory_allocated() - base
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    # Running sum of allocations/frees in event order -> the peak.
    events = sorted((e for e in prof.events() if e.cpu_memory_usage != 0), key=lambda e: e.time_range.start)
    running = peak = 0
    for e in events:
        running += e.cpu_memory_usage
        peak = max(peak, running)
    return peak


def main():
    ap = argparse.ArgumentParser()
    size_args(ap, layers=12, d_model=512, seq=256, repeats=7)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    torch.manual_seed(0)
    hf = random_llama(args.layers, args.d_model).to(args.device)
    cfg = hf.config
    hf.config._attn_implementation = "sdpa"
    hooked = HookedRewardModel.from_hf_model(hf, device=args.device)
    ids = torch.randint(1, cfg.vocab_size, (args.batch, args.seq), device=args.device)
    mask = torch.ones_like(ids)

    def run_hf():
        with torch.no_grad():
            return hf(ids, attention_mask=mask).logits

    def run_hooked():
        with torch.no_grad():
            return hooked(ids, attention_mask=mask)

    err = (run_hf()[:, 0] - run_hooked()).abs().max().item()
    # Interleave to share machine noise fairly.
    t_hf, t_hooked = [], []
    for _ in range(3):
        t_hf.append(median_time(run_hf, args.repeats))
        t_hooked.append(median_time(run_hooked, args.repeats))
    t_hf, t_hooked = min(t_hf), min(t_hooked)
    gc.collect()
    m_hf, m_hooked = peak_bytes(run_hf), peak_bytes(run_hooked)
    print(
        f"setting: {args.layers} layers, d_model {args.d_model}, T={args.seq}, batch {args.batch}, fp32, "
        f"{args.device}, torch threads {torch.get_num_threads()}"
    )
    print(f"max |reward diff| hooked vs transformers: {err:.2e}")
    print(f"transformers forward: {t_hf * 1e3:8.1f} ms   peak extra memory {m_hf / 2**20:8.1f} MiB")
    print(f"hooked forward:       {t_hooked * 1e3:8.1f} ms   peak extra memory {m_hooked / 2**20:8.1f} MiB")
    print(f"time ratio hooked / transformers: {t_hooked / t_hf:.3f}  (target <= 1.10)")
    print(f"memory ratio hooked / transformers: {m_hooked / max(m_hf, 1):.3f}")


if __name__ == "__main__":
    main()
