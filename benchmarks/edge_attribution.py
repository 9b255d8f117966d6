"""Edge attribution's cost: full forwards per pair and wall time in forward-pass equivalents, for EAP,
EAP-IG (sender lines, the default), EAP-IG on the joint line, and exact path patching of the same edges.

Setting: fp32, a random-init LlamaForSequenceClassification (default 6 layers, d_model 256: 4 heads of 64,
2 KV heads) converted with HookedRewardModel.from_hf_model; one pair of random token ids, chosen T=256 and
rejected T=240 sharing a 128-token prompt; every edge of the graph (senders embed + heads + MLPs, every
receiver). Full forwards are counted by wrapping the model's forward entry points; the rest is the
one-token readout pass (forward + backward) over all edges and steps. One forward = the 256-token chosen
sequence, timed interleaved with each method.
`--positions all`: the same at every position (a token-aligned pair: rejected = chosen with its last
`--differ` tokens replaced, default 16; gradients and path patches over the whole sequence), and EAP-IG
interpolating the input embeddings (eap-ig-inputs). EAP and eap-ig-inputs run only the columns from the
first differing one on (the shared columns once, without gradients): `--differ` = `--seq` is their worst
case. They call neither `forward` nor `run_with_hooks` (their passes are the blocks' own steps), so their
"full forwards" count is 0; the forward-pass equivalents are the measure.
Run: python benchmarks/edge_attribution.py [--layers 6 --d-model 256 --seq 256 --steps 16 --repeats 3]
     [--positions readout|all] [--differ 16] [--methods eap,eap-ig,...]
"""

import argparse

import torch
from harness import no_grad_forward, random_llama, random_pair, size_args, timed

from reward_lens import HookedRewardModel, edge_attribution, path_patch
from reward_lens.data.pairs import TokenPair


def counting(model):
    """Wrap run_with_hooks / forward so that full forwards are counted (the outermost call only)."""
    count = {"n": 0, "depth": 0}
    for name in ("run_with_hooks", "forward"):
        inner = getattr(model, name)

        def wrapped(*a, _inner=inner, **k):
            count["n"] += count["depth"] == 0
            count["depth"] += 1
            try:
                return _inner(*a, **k)
            finally:
                count["depth"] -= 1

        setattr(model, name, wrapped)
    return count


def main():
    ap = argparse.ArgumentParser()
    size_args(ap, layers=6, d_model=256, seq=256, repeats=3)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--positions", choices=("readout", "all"), default="readout")
    ap.add_argument("--differ", type=int, default=16, help="positions='all': rejected's last N tokens differ")
    ap.add_argument("--methods", default=None, help="comma-separated subset of the rows (default: all)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    hf = random_llama(args.layers, args.d_model)
    model = HookedRewardModel.from_hf_model(hf)
    chosen, rejected = random_pair(hf.config.vocab_size, args.seq, aligned=args.positions == "all")
    if args.positions == "all" and args.differ != 16:
        if not 1 <= args.differ <= args.seq:
            raise SystemExit(f"--differ must be in 1..--seq ({args.seq}), got {args.differ}")
        tail = torch.randint(1, hf.config.vocab_size, (args.differ,))
        rejected = torch.cat([chosen[: args.seq - args.differ], tail])
    del hf
    pair = [TokenPair(chosen, rejected)]
    at = {"positions": args.positions}
    runs = {
        "eap": lambda: edge_attribution(model, pair, method="eap", **at),
        "eap-ig": lambda: edge_attribution(model, pair, steps=args.steps, **at),
        "eap-ig-joint": lambda: edge_attribution(model, pair, method="eap-ig-joint", steps=args.steps, **at),
    }
    if args.positions == "all":
        runs["eap-ig-inputs"] = lambda: edge_attribution(
            model, pair, method="eap-ig-inputs", steps=args.steps, **at
        )
    senders = runs["eap"]().senders[1:]
    runs["path_patch (exact)"] = lambda: path_patch(model, pair, senders, **at)
    if args.methods:
        keep = args.methods.split(",")
        unknown = sorted(set(keep) - set(runs) - {"path_patch"})
        if unknown:
            raise SystemExit(f"--methods: unknown {unknown}; choose from {sorted(runs)}")
        runs = {k: v for k, v in runs.items() if k in keep or k.split(" ")[0] in keep}
    count = counting(model)
    forward = no_grad_forward(model, chosen[None])

    print(
        f"setting: {args.layers} layers, d_model {args.d_model}, T={len(chosen)}/{len(rejected)}, fp32, "
        f"steps {args.steps}, torch threads {torch.get_num_threads()}, positions={args.positions}"
        + (f", last {args.differ} tokens differ" if args.positions == "all" else "")
    )
    for name, fn in runs.items():
        count["n"] = 0
        res = fn()
        n_forwards = count["n"]
        (fw, _), (t, median) = timed([forward, fn], args.repeats)
        n_edges = int(torch.isfinite(getattr(res, "scores", getattr(res, "patched", None))[0]).sum())
        print(
            f"{name:20s} {n_edges} edges: {n_forwards} full forwards, {t * 1e3:8.1f} ms (median "
            f"{median * 1e3:.1f}) = {t / fw:6.2f} forward-pass equivalents"
        )


if __name__ == "__main__":
    main()
