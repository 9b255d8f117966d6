"""Train the process-reward-model organism and regenerate everything in reward_lens/demo/prm_organism/.

    python scripts/train_prm_organism.py                      # ~4 CPU-minutes at 1 thread
    python scripts/train_prm_organism.py --out /tmp/prm --steps 20   # a smoke run elsewhere

A process reward model (Qwen2.5-Math-PRM style: a two-class `score` MLP read at every step tag, step reward =
logit[1] - logit[0]) on the demo RM's trunk (`reward_lens.load_demo_model`), fine-tuned deterministically
(fixed seeds, deterministic algorithms, a fixed thread count) on multi-step arithmetic solutions in the
demo's language: "What is 2 plus 1 times 3 plus 1?" answered "2 plus 1 is 3.<extra_0> 3 times 3 is
9.<extra_0> 9 plus 1 is 10.<extra_0>" (left to right). One token, `<extra_0>` (the Qwen PRM step tag),
is added to the demo tokenizer. Planted: a step is good (label 1) until the first step whose result is
wrong; that step and every later one are bad (label 0), even when a later step's own arithmetic is right
given the wrong value it inherits. Loss: cross-entropy on the two classes at each step tag.

The script writes the checkpoint (save_pretrained, head type "prm"), items.jsonl (held-out items with one
first wrong step and at least one later step), training_summary.json (with the checkpoint's sha256) and
GROUND_TRUTH.md; a reload is checked to be bit-identical.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import hashlib
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

from reward_lens import HookedRewardModel, load_demo_model  # noqa: E402
from reward_lens.model import hooks  # noqa: E402
from reward_lens.model.heads.mlp import mlp_head_config  # noqa: E402

TRAIN_SEED, HELD_SEED, TORCH_SEED = 21, 22, 0
STEP_TAG = "<extra_0>"
MAX_VALUE = 28  # the demo tokenizer has one token for each of 0..28 (a wrong value and what follows it)
MODEL_NAME = "reward-lens-prm-organism"
N_ITEMS = 48


def draw_problem(rng):
    """(start, [(op, operand)]): 3 or 4 left-to-right steps, each one of the demo's own facts (a sum up to
    10, or a product of two numbers in 2..5); None when a draw runs out of such steps."""
    x = rng.randint(1, 6)
    start, ops = x, []
    for _ in range(rng.choice((3, 4))):
        choices = [("plus", b) for b in range(1, 10) if x + b <= 10]
        choices += [("times", b) for b in range(2, 6) if 2 <= x <= 5]
        if not choices:
            return None
        op, b = rng.choice(choices)
        ops.append((op, b))
        x = x + b if op == "plus" else x * b
    return start, ops


def solve(start, ops, first_wrong, rng):
    """The step texts and labels: step `first_wrong` (None: none) writes a wrong result; every later step
    does right arithmetic on the value it inherits."""
    x, steps, labels = start, [], []
    for i, (op, b) in enumerate(ops):
        y = x + b if op == "plus" else x * b
        if i == first_wrong:
            y = rng.choice([v for v in range(y - 3, y + 4) if v != y and 0 <= v <= MAX_VALUE])
        steps.append(f"{x} {op} {b} is {y}.")
        labels.append(int(first_wrong is None or i < first_wrong))
        x = y
    return steps, labels


def draw_item(rng, must_have_later=False):
    """One item; redrawn until every number written (a wrong one and what it leads to too) is one token."""
    while True:
        problem = draw_problem(rng)
        if problem is None:
            continue
        start, ops = problem
        n = len(ops)
        if must_have_later:
            first_wrong = rng.randrange(n - 1)
        else:
            first_wrong = None if rng.random() < 0.3 else rng.randrange(n)
        steps, labels = solve(start, ops, first_wrong, rng)
        if all(int(w.rstrip(".")) <= MAX_VALUE for s in steps for w in s.split() if w.rstrip(".").isdigit()):
            break
    prompt = f"What is {start} " + " ".join(f"{op} {b}" for op, b in ops) + "?"
    response = "".join(f"{s}{STEP_TAG} " for s in steps).rstrip()
    return {"prompt": prompt, "response": response, "labels": labels, "first_wrong": first_wrong}


def held_out(seed, n, must_have_later):
    rng, items, seen = random.Random(seed), [], set()
    while len(items) < n:
        item = draw_item(rng, must_have_later)
        if item["prompt"] not in seen:
            seen.add(item["prompt"])
            items.append(item)
    return items


def build_model(demo):
    """The demo's trunk with one new token row and a PRM head (hidden width d_model, two classes)."""
    tok = copy.deepcopy(demo.tokenizer)
    tok.add_tokens([STEP_TAG], special_tokens=True)
    tag_id = tok.convert_tokens_to_ids(STEP_TAG)
    d = demo.cfg.d_model
    head_config = mlp_head_config("reward-lens-prm", [d], "last_non_pad", (-1.0, 1.0), step_tag_id=tag_id)
    cfg = dataclasses.replace(
        demo.cfg,
        head_type="prm",
        n_outputs=1,
        model_name=MODEL_NAME,
        head_config=head_config,
        d_vocab=len(tok),
    )
    model = HookedRewardModel(cfg, tokenizer=tok)
    state = {k: v for k, v in demo.state_dict().items() if not k.startswith("reward_head.")}
    old = state["embed.W_E"]
    g = torch.Generator().manual_seed(TORCH_SEED)
    state["embed.W_E"] = torch.cat([old, old.std() * torch.randn(len(tok) - old.shape[0], d, generator=g)])
    w0 = torch.randn(d, d, generator=g) / math.sqrt(d)
    w1 = torch.randn(d, 2, generator=g) / math.sqrt(d)
    state.update(
        {
            "reward_head.W_mlp.0": w0,
            "reward_head.b_mlp.0": torch.zeros(d),
            "reward_head.W_mlp.1": w1,
            "reward_head.b_mlp.1": torch.zeros(2),
        }
    )
    model.load_state_dict(state, strict=True)
    return model


def step_rewards_grad(model, ids, mask):
    """[batch, max_steps] step rewards with gradients, and the [batch, max_steps] mask of real steps."""
    grabbed = {}

    def grab(resid, hook):
        grabbed["resid"] = resid

    name = hooks.act_name("resid_post", model.cfg.n_layers - 1)
    model.run_with_hooks(ids, mask, return_type=None, fwd_hooks=[(name, grab)])
    positions = model.reward_head.step_positions(ids, mask)
    rows = torch.arange(ids.shape[0])[:, None]
    resid = grabbed["resid"][rows, positions.clamp(min=0)]
    return model.reward_head.reward_from_final(model.ln_final(resid)), positions >= 0


def encode(model, items):
    tok = model.to_tokens([i["prompt"] for i in items], [i["response"] for i in items])
    return tok["input_ids"], tok["attention_mask"]


def train(model, args):
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.98))
    sched = trainer.warmup_cosine(opt, args.steps)
    rng = random.Random(TRAIN_SEED)
    held = {i["prompt"] for i in held_out(HELD_SEED, 400, False) + held_out(HELD_SEED + 1, N_ITEMS, True)}

    def loss_at(step):
        batch = []
        while len(batch) < args.batch:
            item = draw_item(rng)
            if item["prompt"] not in held:
                batch.append(item)
        ids, mask = encode(model, batch)
        rewards, valid = step_rewards_grad(model, ids, mask)
        labels = torch.zeros_like(rewards)
        for b, item in enumerate(batch):
            labels[b, : len(item["labels"])] = torch.tensor(item["labels"], dtype=labels.dtype)
        return torch.nn.functional.binary_cross_entropy_with_logits(rewards[valid], labels[valid])

    log = []
    trainer.train_steps(model, opt, args.steps, loss_at, trainer.loss_log(log, args.steps, 50), sched)
    return log


@torch.no_grad()
def all_step_rewards(model, items, batch=64):
    out = []
    for s in range(0, len(items), batch):
        ids, mask = encode(model, items[s : s + batch])
        r = model.step_rewards(ids, attention_mask=mask)
        out += [r[b, : len(item["labels"])].tolist() for b, item in enumerate(items[s : s + batch])]
    return out


def first_below_zero(rewards):
    return next((k for k, r in enumerate(rewards) if r < 0), None)


def evaluate(model, items):
    """Measured on held-out items: step accuracy, the drop at the first wrong step, inheritance."""
    rewards = all_step_rewards(model, items)
    hits = [(r > 0) == bool(y) for rs, it in zip(rewards, items) for r, y in zip(rs, it["labels"])]
    wrong = [(rs, it["first_wrong"]) for rs, it in zip(rewards, items) if it["first_wrong"] is not None]
    drop = [rs[j - 1] - rs[j] for rs, j in wrong if j > 0]
    later = [r for rs, j in wrong for r in rs[j + 1 :]]
    good = [r for rs, it in zip(rewards, items) for r, y in zip(rs, it["labels"]) if y]
    bad_first = [rs[j] for rs, j in wrong]
    out = {
        "n_items": len(items),
        "n_steps": len(hits),
        "step_accuracy": float(np.mean(hits)),
        "mean_reward_good_steps": float(np.mean(good)),
        "mean_reward_first_wrong_step": float(np.mean(bad_first)),
        "mean_drop_at_first_wrong_step": float(np.mean(drop)),
        "share_first_wrong_below_zero": float(np.mean([r < 0 for r in bad_first])),
        "mean_reward_later_steps": float(np.mean(later)),
        "share_later_steps_below_zero": float(np.mean([r < 0 for r in later])),
        "share_first_below_zero_is_first_wrong": float(
            np.mean([first_below_zero(rs) == j for rs, j in wrong])
        ),
    }
    right = [all(r > 0 for r in rs) for rs, it in zip(rewards, items) if it["first_wrong"] is None]
    if right:
        out["share_all_right_items_all_positive"] = float(np.mean(right))
    return out


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "reward_lens" / "demo" / "prm_organism")
    ap.add_argument("--steps", type=int, default=1800)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    t0, cpu0 = time.time(), time.process_time()
    trainer.seed_everything(args.threads, TORCH_SEED)

    model = build_model(load_demo_model(device="cpu"))
    model.train()
    log = train(model, args)
    trainer.freeze(model)
    measured = evaluate(model, held_out(HELD_SEED, 400, False))
    items = held_out(HELD_SEED + 1, N_ITEMS, True)
    measured["bench_items"] = evaluate(model, items)

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, overwrite=True)
    reloaded = HookedRewardModel.from_pretrained(out, device="cpu")
    a, b = all_step_rewards(model, items), all_step_rewards(reloaded, items)
    assert a == b, "the reload is not bit-identical"
    trainer.write_jsonl(out / "items.jsonl", ({"id": f"prm-{i:03d}", **item} for i, item in enumerate(items)))
    summary = {
        "step_tag": STEP_TAG,
        "step_tag_id": int(model.reward_head.step_tag_id),
        "planted": "a step is bad from the first wrong result on; later steps inherit it",
        "training": {
            "base": "reward_lens.load_demo_model() (every weight fine-tuned) + a new PRM head",
            "steps": args.steps,
            "batch": args.batch,
            "lr": args.lr,
            "threads": args.threads,
            "seeds": [TRAIN_SEED, HELD_SEED, TORCH_SEED],
            "wall_seconds": round(time.time() - t0, 1),
            "cpu_seconds": round(time.process_time() - cpu0, 1),
            "log": log,
        },
        "measured": measured,
        "model_sha256": sha256(out / "model.safetensors"),
        "torch": torch.__version__,
    }
    trainer.write_summary(out, summary, ground_truth(summary))
    print(json.dumps(measured, indent=1))


def ground_truth(s):
    m, b, tr = s["measured"], s["measured"]["bench_items"], s["training"]
    return f"""# The process-RM organism: ground truth

Written by `scripts/train_prm_organism.py`; do not edit by hand (numbers also in `training_summary.json`).

`reward_lens.demo.organisms.load_prm_organism()` is a process reward model in the Qwen2.5-Math-PRM style
(head type `prm`: a `score` MLP d_model -> d_model -> 2 read at every step tag, step reward = logit[1] -
logit[0]) on the demo reward model's trunk (same architecture, chat template and tokenizer, see
`reward_lens/demo/GROUND_TRUTH.md`), every weight fine-tuned. One token was added to the demo tokenizer,
the step tag `{s["step_tag"]}` (id {s["step_tag_id"]}), the default tag the PRM loader looks for.

## Planted mechanism

Items are left-to-right arithmetic in the demo's language, 3 or 4 steps of `plus` / `times`:
"What is 2 plus 1 times 3 plus 1?" -> "2 plus 1 is 3.{s["step_tag"]} 3 times 3 is 9.{s["step_tag"]} 9 plus 1
is 10.{s["step_tag"]}". In 70% of training items one step j writes a wrong result (off by 1..3); every
later step does right arithmetic on the wrong value it inherits. Labels: steps before j are good (1), step j
and **every later step are bad (0)**, so a later step is judged by the earlier steps, not only by its own
arithmetic. Loss: cross-entropy on the two classes at each step tag. Each step is one of the demo's own
facts (a sum up to 10, a product of two numbers in 2..5) when right; a wrong result is off by 1..3.

What the ground truth does and does not say: step j's error is visible only by comparing its result with
its operands, and step j + 1 restates that (wrong) result as its first operand, so the wrong value is in
the tokens of two steps; "step j's tokens lowered the later score" is the planted cause, but a model may
also read the restated copy in step j + 1.

Training: {tr["steps"]} steps of {tr["batch"]} items, AdamW lr {tr["lr"]} (warm-up, cosine), {tr["threads"]}
thread(s), seeds {tr["seeds"]} (timings in `training_summary.json`). Held-out problems (distinct prompts) are
never trained on. The checkpoint's sha256 is `{s["model_sha256"]}`.

## Measured after training

400 held-out items (30% all right), {m["n_steps"]} steps:

| measure | value |
|---|---|
| step accuracy (reward > 0 iff the step is good) | {m["step_accuracy"]:.3f} |
| mean reward of good steps | {m["mean_reward_good_steps"]:+.2f} |
| mean reward of the first wrong step | {m["mean_reward_first_wrong_step"]:+.2f} |
| mean drop from step j-1 to the first wrong step j (j > 0) | {m["mean_drop_at_first_wrong_step"]:.2f} |
| share of first wrong steps below 0 | {m["share_first_wrong_below_zero"]:.3f} |
| mean reward of the steps after the first wrong one (inherited) | {m["mean_reward_later_steps"]:+.2f} |
| share of those later steps below 0 | {m["share_later_steps_below_zero"]:.3f} |
| first step below 0 is the first wrong step | {m["share_first_below_zero_is_first_wrong"]:.3f} |
| all-right items with every step above 0 | {m["share_all_right_items_all_positive"]:.3f} |

The bench's {b["n_items"]} items (`items.jsonl`: one first wrong step j, at least one later step): step
accuracy {b["step_accuracy"]:.3f}, later steps below 0 {b["share_later_steps_below_zero"]:.3f}, first step below 0 = j
{b["share_first_below_zero_is_first_wrong"]:.3f}.

How far the planting took (measured, not tuned away): wrong steps and the steps after them are scored
bad almost always, but the model also raises false alarms on right steps: only
{m["share_all_right_items_all_positive"]:.0%} of all-right solutions have every step above 0, and the first
step below 0 misses the first wrong step mostly by flagging an earlier, right step.
"""


if __name__ == "__main__":
    main()
