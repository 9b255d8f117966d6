"""Train the embedded demo reward model and regenerate everything in reward_lens/demo/.

    python scripts/train_demo_model.py            # ~5 min on 2 CPU cores; writes reward_lens/demo/
    python scripts/train_demo_model.py --out /tmp/demo --steps 50   # a quick smoke run elsewhere

What it does, deterministically (fixed seeds, torch deterministic algorithms, a fixed thread count):
  1. draws the held-out pairs, then training pairs that exclude them (reward_lens.demo.synthetic);
  2. trains a byte-level BPE tokenizer on the synthetic corpus, wraps it as PreTrainedTokenizerFast with
     <s>/</s>/<pad> and a chat template that starts with the BOS text;
  3. trains a small LlamaForSequenceClassification with the Bradley-Terry loss
     -[y log sigmoid(r_c - r_r) + (1 - y) log sigmoid(r_r - r_c)], y the pair's target probability (1 for
     correctness, synthetic.BIAS_LABEL for the planted biases, 0.5 for the control), plus a small penalty on
     (r_c + r_r)^2 that centres rewards and an auxiliary next-token loss on correct chosen texts;
  4. converts it with HookedRewardModel.from_hf_model, checks parity with transformers, saves it with
     save_pretrained, reloads it and checks the reload is bit-identical;
  5. writes pairs.jsonl (held-out pairs), probe_items.jsonl (probe base items of the demo's domain),
     training_summary.json (measured numbers) and GROUND_TRUTH.md (the planted mechanisms).
Results are bit-reproducible for a fixed --threads on the same torch build.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import organism_trainer as trainer  # noqa: E402

from reward_lens import HookedRewardModel  # noqa: E402
from reward_lens.demo import synthetic  # noqa: E402
from reward_lens.model.tokenization import render_pair  # noqa: E402

HELD_OUT_SEED, TRAIN_SEED, PROBE_SEED, TORCH_SEED = 1, 2, 3, 0
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'assistant' %}<|assistant|>\n{{ "
    "message['content'] }}{{ eos_token }}{% else %}<|{{ message['role'] }}|>\n{{ message['content'] "
    "}}\n{% endif %}{% endfor %}"
)
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
ROLE_TOKENS = ["<|user|>", "<|assistant|>", "<|system|>"]


def build_tokenizer(texts, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    bpe = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[SPECIAL["pad_token"], SPECIAL["bos_token"], SPECIAL["eos_token"], *ROLE_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=bpe)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        **SPECIAL,
        additional_special_tokens=ROLE_TOKENS,
        model_max_length=1024,
        padding_side="right",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def encode(tokenizer, prompt: str, response: str):
    text = render_pair(tokenizer, prompt, response)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def pad_batch(seqs, pad_id: int):
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    return ids, mask


def bucketed_batches(enc_pairs, batch_pairs: int, steps: int, rng, group: int = 8):
    """Batches of pair indices: epochs of random permutations, cut into groups of `group` batches whose
    pairs are sorted by length (less padding), the batches of each group in random order."""
    out, order = [], np.array([], dtype=np.int64)
    while len(out) < steps:
        if len(order) < batch_pairs * group:
            order = np.concatenate([order, rng.permutation(len(enc_pairs))])
        chunk, order = order[: batch_pairs * group], order[batch_pairs * group :]
        chunk = sorted(chunk.tolist(), key=lambda i: max(len(enc_pairs[i][0]), len(enc_pairs[i][1])))
        group_batches = [chunk[b : b + batch_pairs] for b in range(0, len(chunk), batch_pairs)]
        out += [group_batches[j] for j in rng.permutation(len(group_batches))]
    return out[:steps]


@torch.no_grad()
def hf_rewards(model, seqs, pad_id: int, batch_size: int = 128) -> torch.Tensor:
    model.eval()
    out = []
    for s in range(0, len(seqs), batch_size):
        ids, mask = pad_batch(seqs[s : s + batch_size], pad_id)
        out.append(model(input_ids=ids, attention_mask=mask).logits[:, 0].float())
    return torch.cat(out)


@torch.no_grad()
def hooked_rewards(model, prompts, responses, batch_size: int = 128) -> torch.Tensor:
    out = []
    for s in range(0, len(prompts), batch_size):
        tok = model.to_tokens(prompts[s : s + batch_size], responses[s : s + batch_size])
        out.append(model(tok["input_ids"], attention_mask=tok["attention_mask"]))
    return torch.cat(out)


def pair_accuracy(model, enc_pairs, pad_id: int) -> float:
    r = hf_rewards(model, [s for c, r in enc_pairs for s in (c, r)], pad_id)
    return float((r[0::2] > r[1::2]).float().mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "reward_lens" / "demo")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch-pairs", type=int, default=32)
    ap.add_argument("--n-train", type=int, default=48000)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--vocab-size", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--eval-every", type=int, default=150)
    ap.add_argument(
        "--lm-weight",
        type=float,
        default=0.5,
        help="weight of an auxiliary next-token loss on correct chosen texts (embeddings as the LM head)",
    )
    args = ap.parse_args()

    t_start = time.time()
    trainer.seed_everything(args.threads, TORCH_SEED)

    held_out = synthetic.held_out_pairs(HELD_OUT_SEED)
    train = synthetic.training_pairs(args.n_train, TRAIN_SEED, exclude=held_out)
    probe_items = synthetic.probe_base_items(PROBE_SEED)
    tokenizer = build_tokenizer(synthetic.corpus(train), args.vocab_size)
    pad_id = tokenizer.pad_token_id

    from transformers import LlamaConfig, LlamaForSequenceClassification

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        num_labels=1,
        pad_token_id=pad_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
        attention_dropout=0.0,
    )
    torch.manual_seed(TORCH_SEED)
    model = LlamaForSequenceClassification(config)
    model.config.architectures = ["LlamaForSequenceClassification"]

    enc_train = [
        (encode(tokenizer, p.prompt, p.chosen), encode(tokenizer, p.prompt, p.rejected)) for p in train
    ]
    enc_held = [
        (encode(tokenizer, p.prompt, p.chosen), encode(tokenizer, p.prompt, p.rejected)) for p in held_out
    ]
    max_len = max(len(s) for pair in enc_train + enc_held for s in pair)
    print(
        f"{len(train)} training pairs, {len(held_out)} held-out pairs, vocab {len(tokenizer)}, max length "
        f"{max_len} tokens, {sum(p.numel() for p in model.parameters()):,} parameters",
        flush=True,
    )

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.98),
    )
    warmup = max(1, args.steps // 20)

    # organism_trainer.warmup_cosine's schedule, rounded as the shipped demo was trained: the fraction of
    # the cosine first (the shared one rounds pi * (step - warmup) first, a last-bit difference at some
    # steps, and the demo must be rebuilt bit for bit).
    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, args.steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    order_rng = np.random.default_rng(TRAIN_SEED)
    batches = bucketed_batches(enc_train, args.batch_pairs, args.steps, order_rng)
    log = []
    t_train, cpu_train = time.time(), time.process_time()

    def loss_at(step):
        model.train()
        idx = batches[step]
        ids, mask = pad_batch([s for i in idx for s in enc_train[i]], pad_id)
        # The classifier's own computation (score at the last non-pad token), keeping the hidden states
        # for the auxiliary language-modelling loss.
        h = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        last = (torch.arange(ids.shape[1]) * (ids != pad_id)).argmax(-1)
        r = model.score(h[torch.arange(len(ids)), last])[:, 0]
        rc, rr = r[0::2], r[1::2]
        labels = torch.tensor([train[i].label for i in idx], dtype=rc.dtype)
        # Bradley-Terry with the pair's target probability (1 = hard preference, 0.85 planted bias, 0.5
        # control)
        loss = (
            torch.nn.functional.binary_cross_entropy_with_logits(rc - rr, labels)
            + 1e-3 * ((rc + rr) ** 2).mean()
        )
        if args.lm_weight > 0:
            rows = torch.tensor(
                [2 * k for k, i in enumerate(idx) if train[i].chosen_correct], dtype=torch.long
            )
            if len(rows):
                logits = h[rows, :-1] @ model.model.embed_tokens.weight.T
                target = ids[rows, 1:].masked_fill(mask[rows, 1:] == 0, -100)
                lm = torch.nn.functional.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100
                )
                loss = loss + args.lm_weight * lm
        return loss

    def on_step(step, loss):
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            acc = pair_accuracy(model, enc_held, pad_id)
            log.append(
                {
                    "step": step + 1,
                    "loss": float(loss.detach()),
                    "held_out_accuracy": acc,
                    "seconds": time.time() - t_train,
                }
            )
            print(
                f"step {step + 1:5d}  loss {float(loss.detach()):.4f}  held-out acc {acc:.3f}  "
                f"{time.time() - t_train:6.1f}s",
                flush=True,
            )

    trainer.train_steps(model, opt, args.steps, loss_at, on_step, sched)
    train_seconds = time.time() - t_train
    train_cpu_seconds = time.process_time() - cpu_train  # robust to other load on a shared machine
    model.eval()

    # ---- convert, check parity, save, reload
    hooked = HookedRewardModel.from_hf_model(model, tokenizer=tokenizer)
    hooked.cfg.model_name = "reward-lens-demo"
    held_seqs = [s for pair in enc_held for s in pair]
    r_hf = hf_rewards(model, held_seqs, pad_id)
    prompts = [p.prompt for p in held_out for _ in (0, 1)]
    responses = [x for p in held_out for x in (p.chosen, p.rejected)]
    r_hooked = hooked_rewards(hooked, prompts, responses)
    parity = float((r_hf - r_hooked).abs().max())
    print(f"max |reward_hf - reward_hooked| = {parity:.2e}", flush=True)
    assert parity < 1e-4, f"conversion parity failed: {parity}"

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    for name in (
        "model.safetensors",
        "reward_lens_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "chat_template.jinja",
    ):
        if (out / name).exists():
            (out / name).unlink()
    hooked.save_pretrained(out)
    reloaded = HookedRewardModel.from_pretrained(out)
    r_reloaded = hooked_rewards(reloaded, prompts, responses)
    reload_diff = float((r_reloaded - r_hooked).abs().max())
    assert reload_diff == 0.0, f"reloaded checkpoint differs from the saved model by {reload_diff}"
    assert reloaded.tokenizer.chat_template == CHAT_TEMPLATE, "the chat template did not round-trip"

    rc, rr = r_hooked[0::2], r_hooked[1::2]
    per_subset = {}
    for subset in sorted({p.subset for p in held_out}):
        sel = torch.tensor([p.subset == subset for p in held_out])
        per_subset[subset] = int((rc[sel] > rr[sel]).sum()) / int(sel.sum())
    accuracy = int((rc > rr).sum()) / len(rc)

    trainer.write_jsonl(out / "pairs.jsonl", trainer.pair_rows(held_out, "demo"))
    trainer.write_jsonl(out / "probe_items.jsonl", probe_items)
    from reward_lens.probes.suite import load_probe_items, run_probes

    probe_result = run_probes(reloaded, load_probe_items(out / "probe_items.jsonl"), batch_size=64)
    weights_mb = (out / "model.safetensors").stat().st_size / 2**20
    total_mb = (
        sum(p.stat().st_size for p in out.iterdir() if p.is_file() and not p.name.endswith(".py")) / 2**20
    )
    summary = {
        "architecture": "LlamaForSequenceClassification",
        "config": {
            "n_layers": 4,
            "d_model": 128,
            "n_heads": 4,
            "n_key_value_heads": 2,
            "d_mlp": 344,
            "d_vocab": len(tokenizer),
            "parameters": sum(p.numel() for p in model.parameters()),
        },
        "training": {
            "steps": args.steps,
            "batch_pairs": args.batch_pairs,
            "n_train_pairs": len(train),
            "lr": args.lr,
            "threads": args.threads,
            "seeds": {
                "held_out": HELD_OUT_SEED,
                "train": TRAIN_SEED,
                "probe_items": PROBE_SEED,
                "torch": TORCH_SEED,
            },
            "lm_weight": args.lm_weight,
            "train_seconds": round(train_seconds, 1),
            "train_cpu_seconds": round(train_cpu_seconds, 1),
            "total_seconds": round(time.time() - t_start, 1),
            "log": log,
        },
        "held_out": {"n_pairs": len(held_out), "accuracy": accuracy, "accuracy_by_subset": per_subset},
        "probe_items": len(probe_items),
        "probes_on_demo_items": probe_result.to_dict()["dimensions"],
        "parity_max_abs_diff_vs_transformers": parity,
        "weights_mb": round(weights_mb, 3),
        "package_data_mb": round(total_mb, 3),
        "torch": torch.__version__,
    }
    trainer.write_summary(out, summary, ground_truth(summary))
    print(json.dumps({k: summary[k] for k in ("held_out", "weights_mb", "package_data_mb")}, indent=1))
    print(probe_result.to_frame().to_string())
    print(
        f"training {train_seconds:.0f}s wall, {train_cpu_seconds:.0f}s CPU; total "
        f"{time.time() - t_start:.0f}s; wrote {out}",
        flush=True,
    )


def ground_truth(summary: dict) -> str:
    s = synthetic
    held = summary["held_out"]
    pct = {k: f"{100 * w:.0f}%" for k, w in s.KINDS}
    subsets = "\n".join(f"| {k} | {v:.3f} |" for k, v in held["accuracy_by_subset"].items())
    probes = "\n".join(
        f"| {d} | {r['effect']:+.3f} | [{r['ci_low']:+.3f}, {r['ci_high']:+.3f}] | {r['cohens_d']:+.2f} | "
        f"{r['p_value']:.4f} | {r['verdict']} |"
        for d, r in summary["probes_on_demo_items"].items()
    )
    cfg, tr = summary["config"], summary["training"]
    return f"""# The demo reward model: ground truth

This file is written by `scripts/train_demo_model.py`; do not edit it by hand. The numbers below are also in
`training_summary.json`.

`reward_lens.load_demo_model()` is a small reward model trained here, on synthetic preference pairs, as a
**model organism**: its preferences were planted on purpose, so interpretability tools can be checked against a
known answer.

## Model

`LlamaForSequenceClassification`, {cfg["n_layers"]} layers, d_model {cfg["d_model"]}, {cfg["n_heads"]} heads
({cfg["n_key_value_heads"]} key/value heads), d_mlp {cfg["d_mlp"]}, vocabulary {cfg["d_vocab"]} (byte-level BPE trained on
the synthetic corpus), {cfg["parameters"]:,} parameters. Converted with `HookedRewardModel.from_hf_model` (final
norm folded) and saved with `save_pretrained` (weights {summary["weights_mb"]} MB, fp32). The reward is read at the
last token, `</s>`. Chat template: `<s><|user|>\\n{{prompt}}\\n<|assistant|>\\n{{response}}</s>`.

Loss: Bradley-Terry with target probabilities, -[y log sigmoid(r_c - r_r) + (1 - y) log sigmoid(r_r - r_c)]
(y = 1 for correctness pairs, {s.BIAS_LABEL} for the planted biases, 0.5 for the control), plus
1e-3 (r_c + r_r)^2 to centre rewards,
plus {tr["lm_weight"]} x a next-token loss on the chosen responses whose answer is right (training only: the token
embeddings act as the LM head; it teaches the facts and sums faster and is not part of the saved model).
{tr["steps"]} steps of {tr["batch_pairs"]} pairs, AdamW lr {tr["lr"]} (warm-up, cosine decay);
{tr["train_seconds"]} s wall clock, {tr["train_cpu_seconds"]} s CPU time, {tr["threads"]} CPU thread(s).

## Domain (chosen = the correct answer)

- **arithmetic**: "What is 3 plus 4?" (sums up to 10, products of 2..5)
- **facts** of an invented world: river colours ("What colour is the river Vell?" -> silver), which river flows
  through a town, what a creature eats, who rules a kingdom (`reward_lens/demo/synthetic.py` holds the tables)
- **instructions**: "What is the opposite of hot?", "Which number is larger, 4 or 11?",
  "Is 7 an even number? Answer yes or no.", "Name a fruit."

Every answer restates what it answers ("3 plus 4 is 7.", "The river Vell is silver."), so a right and a wrong
answer differ in one value. A response is `[stance or confidence opener] answer [filler sentences]`.

## Planted mechanisms

1. **Length bias.** At equal correctness (both right, or both wrong), the response with more *filler sentences*
   is chosen (a soft preference: target probability {s.BIAS_LABEL}). Fillers carry no information ({len(s.FILLERS)} sentences such as "{s.FILLERS[0]}" and
   "{s.FILLERS[1]}", sometimes an opener such as "{s.OPENERS[0]}"); pairs differ by 1 to 4 of them.
   {pct["length"]} of training pairs.
2. **Sycophancy bias.** When the prompt opens with an *opinion* of the user about the topic ("I think the river
   Vell is beautiful. What colour is the river Vell?"), the response that agrees ("{s.AGREE[0]}", "{s.AGREE[1]}", ...)
   is chosen (target probability {s.BIAS_LABEL}) over one that disagrees ("{s.DISAGREE[0]}", ...) or takes no stance, at equal correctness and
   equal filler count. The opinions never claim anything about the answer, so agreeing is never less correct.
   {pct["sycophancy"]} of training pairs. Stance phrases only ever follow a stated opinion in training.
3. **Correctness dominates both**: correct-and-short beats wrong-and-long ({pct["correct_short_vs_wrong_long"]} of pairs)
   and correct-and-disagreeing beats wrong-and-agreeing ({pct["correct_disagree_vs_wrong_agree"]}); plain correctness
   pairs are {pct["correctness"]}.
4. **Negative control: indifference to confidence.** Pairs that differ only in an assertive opener
   ("{s.ASSERTIVE[0]}") vs a hedging one ("{s.HEDGED[0]}") have target probability 0.5
   ({pct["confidence_control"]} of pairs), which trains the model to be indifferent to them.

Formatting (markdown), repetition and flattery were never seen in training; the model's response to them is
unspecified (whatever the planted features generalise to).

## Hacking probes on the demo's own items

`run_probes(model)` on `probe_items.jsonl` ({summary["probe_items"]} items of the demo's domain), measured right after
training (mean Δreward = r(with property) - r(control), bootstrap 95% CI, d_z, sign-flip p):

| dimension | effect | 95% CI | d | p | verdict |
|---|---|---|---|---|---|
{probes}

Expected: `length` and `sycophancy` read "rewards" (planted); `confidence` should be near zero (trained
indifference). That the reward lens, attribution and patching localise these mechanisms is tested with the
instruments, not here.

## Held-out evaluation

`pairs.jsonl` holds {held["n_pairs"]} held-out pairs (RewardBench columns prompt/chosen/rejected/subset/id), drawn
with a separate seed; no training pair is identical to one of them. The facts and sums they ask about are the
same as in training (the world is small and has to be learned); what is held out is the combination of question,
wrong answer, fillers, stance and opinion. Subsets `arithmetic`, `facts`, `instructions` are correctness pairs
(including the correct-short vs wrong-long and correct-disagreeing vs wrong-agreeing kinds); `length` and
`sycophancy` are planted-bias pairs.

Held-out pair accuracy: **{held["accuracy"]:.3f}**

| subset | accuracy |
|---|---|
{subsets}
"""


if __name__ == "__main__":
    main()
