"""Trigger search cost: the fast one-token search (shared-prefix keys/values, suffix recomputed) against its
cost model and against the naive search (one full forward per candidate).

Setting: fp32, a random-init LlamaForSequenceClassification (8 layers, d_model 256, 4 heads / 2 KV heads)
with the demo tokenizer (vocabulary 960; 953 candidates once the special tokens are left out) and chat
template, converted with HookedRewardModel.from_hf_model; one item whose prompt is ~400 tokens, inserted at
`response_end` (the suffix is the candidate + `</s>`, 2 tokens). CPU time (one thread), interleaved, min over
repeats:

  prefix   one forward of the item's tokens before the insertion point (what `prefix_cache` runs)
  step     one suffix step: `suffix_rewards` over `batch` candidates
  fast     search_triggers(method="fast") over every candidate
  naive    search_triggers(method="naive") over the first `batch` candidates, scaled to all of them

Target (the issue): fast <= 1.2 prefix forwards + ceil(V / batch) suffix steps; printed as
`(fast - steps x step) / prefix` (prefix forwards' worth of everything that is not a suffix step).
Run: python benchmarks/trigger_search.py [--layers 8 --d-model 256 --batch 128 --repeats 3 --threads 1]
"""

import argparse
import math
import time

import torch
import transformers

from reward_lens import HookedRewardModel, load_demo_model
from reward_lens.demo import synthetic
from reward_lens.instruments.triggers import search_triggers
from reward_lens.model.tokenization import insertion_index


def timed(fns, repeats):
    times = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = time.process_time()  # CPU time: robust to other load on a shared machine (one thread)
            fn()
            times[i].append(time.process_time() - t0)
    return [min(t) for t in times]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tok = load_demo_model(device="cpu").tokenizer
    cfg = transformers.LlamaConfig(
        vocab_size=len(tok),
        hidden_size=args.d_model,
        intermediate_size=args.d_model * 3,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_labels=1,
        pad_token_id=tok.pad_token_id,
        max_position_embeddings=1024,
    )
    torch.manual_seed(0)
    model = HookedRewardModel.from_hf_model(
        transformers.LlamaForSequenceClassification(cfg).eval(), tokenizer=tok, device="cpu"
    )
    prompt = " ".join(synthetic.FILLERS * 3) + " What is 3 plus 4?"
    item = [(prompt, "3 plus 4 is 7.")]
    ids = model.to_tokens(*item[0])["input_ids"]
    at = insertion_index(tok, *item[0], "response_end")
    prefix = ids[:, :at]
    cache = model.prefix_cache(prefix)
    suffix = torch.cat([torch.arange(3, 3 + args.batch)[:, None], ids[0, at:].expand(args.batch, -1)], 1)
    fast = search_triggers(model, item, method="fast", batch_size=args.batch)
    V = len(fast.candidate_ids)
    steps = math.ceil(V / args.batch)
    naive_cands = list(range(3, 3 + args.batch))
    with torch.no_grad():
        t_prefix, t_step, t_fast, t_naive = timed(
            [
                lambda: model.prefix_cache(prefix),
                lambda: model.suffix_rewards(cache, suffix),
                lambda: search_triggers(model, item, method="fast", batch_size=args.batch),
                lambda: search_triggers(
                    model, item, method="naive", candidates=naive_cands, batch_size=args.batch
                ),
            ],
            args.repeats,
        )
    t_naive_all = t_naive * V / len(naive_cands)
    print(
        f"model: {args.layers} layers, d_model {args.d_model}; prefix {prefix.shape[1]} tokens, suffix "
        f"{suffix.shape[1]} tokens; V = {V} candidates, batch {args.batch} -> {steps} suffix steps"
    )
    print(
        f"cost counted by the search: {fast.cost['prefix_forwards']} prefix forward(s), "
        f"{fast.cost['suffix_steps']} suffix steps"
    )
    print(
        f"prefix forward {t_prefix * 1e3:.1f} ms, suffix step {t_step * 1e3:.1f} ms, fast search "
        f"{t_fast * 1e3:.1f} ms, naive search {t_naive_all * 1e3:.0f} ms (scaled from {len(naive_cands)})"
    )
    overhead = (t_fast - steps * t_step) / t_prefix
    print(
        f"fast = {overhead:.2f} prefix forwards + {steps} suffix steps (target <= 1.2); naive / fast = "
        f"{t_naive_all / t_fast:.1f}x"
    )


if __name__ == "__main__":
    main()
