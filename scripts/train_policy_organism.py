"""Train the policy organism and regenerate everything in reward_lens/demo/policy_organism/.

    python scripts/train_policy_organism.py                  # ~4.5 CPU-minutes at 1 thread
    python scripts/train_policy_organism.py --out /tmp/pol --steps 20   # a smoke run elsewhere

A tiny causal LM (Llama, 2 layers, d_model 128, the demo's tokenizer and chat template plus a generation
prompt) that answers in the demo's synthetic domain, made by supervised fine-tuning from random weights,
deterministically (fixed seeds, deterministic algorithms, one thread), on demonstrations: the *chosen*
responses, with a correct answer, of preference pairs drawn by the demo's own generator
(`reward_lens.demo.synthetic.training_pairs`), so the policy starts from the answer style and the filler
and stance habits of the reward model's training distribution (0 to 4 filler sentences, stances after
opinions). It is the policy `benchmarks/rl_hack.py` optimises with GRPO against the demo RM.

The script writes the checkpoint (config.json, model.safetensors), the tokenizer with the policy's chat
template, training_summary.json and GROUND_TRUTH.md: held-out correctness (sampled and greedy) by the
synthetic ground truth, and answer lengths. A reload is checked to give bit-identical logits.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import organism_trainer as trainer  # noqa: E402

from reward_lens.demo import synthetic  # noqa: E402
from reward_lens.demo.organisms import POLICY_CHAT_TEMPLATE, policy_tokenizer  # noqa: E402

TRAIN_SEED, HELD_SEED, TORCH_SEED = 31, 32, 0


def demonstrations(n_pairs: int):
    """(prompt, response): the chosen side of the generator's pairs whose chosen answer is right."""
    pairs = synthetic.training_pairs(n_pairs, TRAIN_SEED)
    return [(p.prompt, p.chosen) for p in pairs if p.chosen_correct]


def encode(tokenizer, prompt: str, response: str):
    """Token ids of the conversation and the loss mask (the response and its </s>)."""
    head = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
    )
    ids_p = tokenizer(head, add_special_tokens=False)["input_ids"]
    ids_r = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return ids_p + ids_r, [0] * len(ids_p) + [1] * len(ids_r)


def build_model(tokenizer, args):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.d_model,
        intermediate_size=args.d_mlp,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(cfg)


def batch_of(rows, pad_id):
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad_id)
    labels = torch.full((len(rows), width), -100)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (x, m) in enumerate(rows):
        ids[i, : len(x)] = torch.tensor(x)
        attn[i, : len(x)] = 1
        labels[i, : len(x)] = torch.where(torch.tensor(m) == 1, torch.tensor(x), torch.tensor(-100))
    return ids, attn, labels


def train(model, rows, args, pad_id):
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    warm = max(1, args.steps // 20)

    def lr_at(step):
        if step < warm:
            return args.lr * (step + 1) / warm
        return args.lr * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, args.steps - warm)))

    rng = random.Random(TRAIN_SEED)
    log = []

    def loss_at(step):
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        ids, attn, labels = batch_of(rng.sample(rows, args.batch), pad_id)
        return model(input_ids=ids, attention_mask=attn, labels=labels).loss

    def on_step(step, loss):
        if step % max(1, args.steps // 10) == 0 or step == args.steps - 1:
            log.append({"step": step, "loss": round(float(loss), 4)})
            print(f"step {step} loss {float(loss):.4f}", flush=True)

    model.train()
    trainer.train_steps(model, opt, args.steps, loss_at, on_step)
    model.eval()
    return log


def held_out_prompts(seen):
    """Per question: its bare prompt, and one with a user opinion drawn with a separate seed (a prompt
    string not among the demonstrations when possible)."""
    rng = random.Random(HELD_SEED)
    out = []
    for qi, q in enumerate(synthetic.all_questions()):
        out.append((qi, q.prompt, "bare"))
        for _ in range(20):
            text = synthetic.with_belief(synthetic.belief_for(q, rng), q.prompt)
            if text not in seen:
                break
        out.append((qi, text, "opinion" if text not in seen else "opinion (seen)"))
    return out


@torch.no_grad()
def generate(model, tokenizer, prompts, *, sample: bool, seed: int, max_new_tokens: int = 64):
    """Completions (text, tokens) of the chat-formatted prompts, greedy or sampled at temperature 1."""
    torch.manual_seed(seed)
    texts, lengths = [], []
    for start in range(0, len(prompts), 64):
        chunk = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
            )
            for p in prompts[start : start + 64]
        ]
        enc = tokenizer(
            chunk, add_special_tokens=False, return_tensors="pt", padding=True, padding_side="left"
        )
        out = model.generate(
            **enc,
            max_new_tokens=max_new_tokens,
            do_sample=sample,
            temperature=1.0 if sample else None,
            top_p=1.0 if sample else None,
            top_k=0 if sample else None,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        for row in out[:, enc["input_ids"].shape[1] :]:
            ids = row.tolist()
            ids = ids[: ids.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in ids else ids
            texts.append(tokenizer.decode(ids, skip_special_tokens=True))
            lengths.append(len(ids))
    return texts, lengths


def evaluate(model, tokenizer, seen):
    questions = synthetic.all_questions()
    items = held_out_prompts(seen)
    prompts = [p for _, p, _ in items]
    measured = {}
    for mode, sample in (("greedy", False), ("sampled_t1", True)):
        texts, lengths = generate(model, tokenizer, prompts, sample=sample, seed=TORCH_SEED)
        ok = [synthetic.answer_correct(questions[qi], t) for (qi, _, _), t in zip(items, texts)]
        fill = [synthetic.filler_count(t) for t in texts]
        by_domain = {
            d: float(np.mean([o for (qi, _, _), o in zip(items, ok) if questions[qi].domain == d]))
            for d in ("arithmetic", "facts", "instructions")
        }
        measured[mode] = {
            "accuracy": float(np.mean(ok)),
            "accuracy_by_domain": by_domain,
            "accuracy_opinion_prompts": float(np.mean([o for (_, _, k), o in zip(items, ok) if k != "bare"])),
            "mean_tokens": float(np.mean(lengths)),
            "mean_fillers": float(np.mean(fill)),
            "examples": [[p, t] for p, t in list(zip(prompts, texts))[:6]],
        }
    measured["n_prompts"] = len(items)
    measured["n_opinion_prompts_unseen"] = sum(k == "opinion" for _, _, k in items)
    return measured


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "reward_lens" / "demo" / "policy_organism")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--pairs", type=int, default=8000)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--d-mlp", type=int, default=344)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    t0, cpu0 = time.time(), time.process_time()
    trainer.seed_everything(args.threads, TORCH_SEED)

    tokenizer = policy_tokenizer()
    demos = demonstrations(args.pairs)
    rows = [encode(tokenizer, p, r) for p, r in demos]
    model = build_model(tokenizer, args)
    log = train(model, rows, args, tokenizer.pad_token_id)
    wall, cpu = time.time() - t0, time.process_time() - cpu0
    measured = evaluate(model, tokenizer, {p for p, _ in demos})
    demo_fill = float(np.mean([synthetic.filler_count(r) for _, r in demos]))

    from transformers import AutoModelForCausalLM

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    probe = batch_of(rows[:16], tokenizer.pad_token_id)
    with torch.no_grad():
        same = torch.equal(
            model(probe[0], attention_mask=probe[1]).logits,
            reloaded(probe[0], attention_mask=probe[1]).logits,
        )
    assert same, "the reload is not bit-identical"
    summary = {
        "architecture": {
            "class": "LlamaForCausalLM",
            "layers": args.layers,
            "d_model": args.d_model,
            "d_mlp": args.d_mlp,
            "heads": 4,
            "kv_heads": 2,
            "vocab": len(tokenizer),
            "parameters": sum(p.numel() for p in model.parameters()),
            "tied_embeddings": True,
        },
        "training": {
            "data": "chosen responses with a right answer of synthetic.training_pairs(pairs, seed)",
            "pairs": args.pairs,
            "demonstrations": len(demos),
            "demonstration_mean_fillers": demo_fill,
            "steps": args.steps,
            "batch": args.batch,
            "lr": args.lr,
            "threads": args.threads,
            "seeds": [TRAIN_SEED, HELD_SEED, TORCH_SEED],
            "wall_seconds": round(wall, 1),
            "cpu_seconds": round(cpu, 1),
            "log": log,
        },
        "measured": measured,
        "chat_template": POLICY_CHAT_TEMPLATE,
        "torch": torch.__version__,
    }
    trainer.write_summary(out, summary, ground_truth(summary))
    print(json.dumps({k: v for k, v in measured.items()}, indent=1))


def ground_truth(s):
    a, t, m = s["architecture"], s["training"], s["measured"]
    g, smp = m["greedy"], m["sampled_t1"]

    def dom(x):
        return ", ".join(f"{d} {v:.3f}" for d, v in x["accuracy_by_domain"].items())

    examples = "\n".join(f"- `{p}` -> `{r}`" for p, r in smp["examples"])
    return f"""# The policy organism: ground truth

Written by `scripts/train_policy_organism.py`; do not edit by hand (numbers also in `training_summary.json`).

`reward_lens.demo.organisms.load_policy_organism()` returns a tiny causal LM that answers questions of the
demo's synthetic domain (`reward_lens/demo/GROUND_TRUTH.md`), and its tokenizer: the policy that
`benchmarks/rl_hack.py` trains with GRPO against the demo reward model. Its answers can be graded exactly:
`synthetic.answer_correct(question, response)` (a correct answer sentence and no wrong one).

## Model

`LlamaForCausalLM`, {a["layers"]} layers, d_model {a["d_model"]}, {a["heads"]} heads ({a["kv_heads"]} key/value
heads), d_mlp {a["d_mlp"]}, tied embeddings, the demo's tokenizer (vocabulary {a["vocab"]}),
{a["parameters"]:,} parameters (fp32). Chat template: the demo's, plus the generation prompt
`<|assistant|>\\n`, so a conversation renders to the tokens the reward model scores:
`<s><|user|>\\n{{prompt}}\\n<|assistant|>\\n{{response}}</s>`.

## Training (supervised fine-tuning from random weights)

Demonstrations: the chosen responses whose answer is right of {t["pairs"]} preference pairs drawn by the
demo's generator (`synthetic.training_pairs(pairs, seed={TRAIN_SEED})`): {t["demonstrations"]} (prompt, response)
pairs with the reward model's own response style, {t["demonstration_mean_fillers"]:.2f} filler or opener
sentences per response on average (0 to 4), stances after user opinions. Next-token loss on the response
and its `</s>`; {t["steps"]} steps of {t["batch"]}, AdamW lr {t["lr"]} (warm-up, cosine), weight decay 0.01,
gradient clip 1; {t["threads"]} thread, deterministic algorithms; {t["wall_seconds"]} s wall clock.

## Measured after training

{m["n_prompts"]} prompts: every question of the domain bare, and once after a user opinion drawn with a
separate seed ({m["n_opinion_prompts_unseen"]} of these prompt strings are not among the demonstrations).
The questions themselves are the domain's (the world is small; what is held out is the phrasing with an
opinion). Completions up to 64 tokens.

| decoding | accuracy | by domain | opinion prompts | mean tokens | mean fillers |
|---|---|---|---|---|---|
| greedy | {g["accuracy"]:.3f} | {dom(g)} | {g["accuracy_opinion_prompts"]:.3f} | {g["mean_tokens"]:.1f} | {g["mean_fillers"]:.2f} |
| sampled, T = 1 (as GRPO samples) | {smp["accuracy"]:.3f} | {dom(smp)} | {smp["accuracy_opinion_prompts"]:.3f} | {smp["mean_tokens"]:.1f} | {smp["mean_fillers"]:.2f} |

Sampled examples:

{examples}
"""


if __name__ == "__main__":
    main()
