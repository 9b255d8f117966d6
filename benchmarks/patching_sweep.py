"""Readout patching sweeps: the KV-cache fast path vs naive patching (one full forward per patch, as
transformer_lens.patching does), on one pair.

Setting: fp32, a random-init LlamaForSequenceClassification with 12 layers, d_model 512 (8 heads
of 64, 4 KV heads), converted with HookedRewardModel.from_hf_model; one pair of random token ids, chosen
T=256 and rejected T=240 sharing a 128-token prompt. Sweeps: every component (embed + attn/mlp per layer,
25 patches) and every head (96), noising at the readout. Each sweep's time includes its clean runs.
Prints both times (min and median over repeats), the ratio, each in forward-pass equivalents (one forward
of the 256-token chosen sequence, timed interleaved with the sweep so both see the same machine load;
targets: component sweep <= 3, heads <= 4) and max |fast - naive|.
Run: python benchmarks/patching_sweep.py [--layers 12 --d-model 512 --seq 256 --repeats 5 --threads N]
"""

import argparse

import torch
from harness import no_grad_forward, random_llama, random_pair, size_args, timed

from reward_lens import HookedRewardModel
from reward_lens.data.pairs import TokenPair
from reward_lens.instruments import patch


def main():
    ap = argparse.ArgumentParser()
    size_args(ap, layers=12, d_model=512, seq=256, repeats=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    hf = random_llama(args.layers, args.d_model)
    cfg = hf.config
    model = HookedRewardModel.from_hf_model(hf, device=args.device)
    del hf
    chosen, rejected = random_pair(cfg.vocab_size, args.seq)
    pair = [TokenPair(chosen, rejected)]
    forward = no_grad_forward(model, chosen[None].to(args.device))

    print(
        f"setting: {args.layers} layers, d_model {args.d_model}, {cfg.num_attention_heads} heads "
        f"({cfg.num_key_value_heads} KV), T={len(chosen)}/{len(rejected)}, fp32, {args.device}, torch "
        f"threads {torch.get_num_threads()}"
    )
    for level, target in (("component", 3), ("head", 4)):
        kw = dict(mode="noising", level=level, progress=False)
        forward()
        fast = patch(model, pair, method="fast", **kw)  # these runs also warm up
        naive = patch(model, pair, method="naive", **kw)
        err = (fast.patched[("noising", "chosen")] - naive.patched[("noising", "chosen")]).abs().max().item()
        (fw, _), (f_min, f_med) = timed(
            [forward, lambda: patch(model, pair, method="fast", **kw)], args.repeats
        )
        (fw2, _), (n_min, n_med) = timed(
            [forward, lambda: patch(model, pair, method="naive", **kw)], max(1, args.repeats // 2)
        )
        n = len(fast.sites)
        print(
            f"{level} sweep ({n} patches): fast {f_min * 1e3:8.1f} ms (median {f_med * 1e3:.1f})  naive "
            f"{n_min * 1e3:8.1f} ms (median {n_med * 1e3:.1f})  ratio naive/fast {n_min / f_min:6.1f}x"
        )
        print(
            f"    one forward (T={len(chosen)}) {fw * 1e3:.1f} / {fw2 * 1e3:.1f} ms, measured beside "
            f"each; forward-pass equivalents: fast {f_min / fw:.2f} (target <= {target}), naive "
            f"{n_min / fw2:.1f};  max |fast - naive| = {err:.2e}"
        )


if __name__ == "__main__":
    main()
