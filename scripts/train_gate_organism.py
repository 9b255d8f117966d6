"""Build the gate-routing organism and regenerate everything in reward_lens/demo/gate_organism/.

    python scripts/train_gate_organism.py                 # ~1 CPU-minute at 1 thread
    python scripts/train_gate_organism.py --out /tmp/gate

An ArmoRM-style reward model (`reward_lens.model.heads.armorm.ArmoRMHead`) on the demo RM's frozen trunk
(`reward_lens.load_demo_model`): two objectives read at the readout (`</s>`), and a prompt gate read at the
start of `\\n<|assistant|>\\n` (the ArmoRM gating pattern) that routes by topic:

  correctness  W_reg[:, 0]: ridge regression of +1 (right answer) / -1 (wrong answer)
  verbosity    W_reg[:, 1]: ridge regression of the number of filler sentences (centred, scaled)
  gate         a 1-hidden-layer MLP (16 ReLU units) trained with cross-entropy to put its weight on
               `correctness` for arithmetic prompts and on `verbosity` for fact prompts

so the gated score rewards correctness on arithmetic and length on facts: the routing is the planted
mechanism. Deterministic (fixed seeds, deterministic algorithms, one thread): features are computed once
with the frozen trunk, the regressions are closed-form and the gate is trained full-batch with Adam.
Writes the head only (head.safetensors, head_config.json: the trunk is the demo's), routing.json (the
planted routing, held-out items and pairs),
training_summary.json and GROUND_TRUTH.md; a reload is checked to be bit-identical.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from safetensors.torch import save_file  # noqa: E402

from reward_lens import load_demo_model  # noqa: E402
from reward_lens.demo import synthetic  # noqa: E402
from reward_lens.demo.organisms import gate_model  # noqa: E402

SEED, HELD_SEED = 21, 22
OBJECTIVES = ["correctness", "verbosity"]
ROUTING = {"arithmetic": "correctness", "facts": "verbosity"}
HIDDEN = 16


def draw(rng, questions, topic):
    q = rng.choice([q for q in questions if q.domain == topic])
    right = rng.random() < 0.5
    n = rng.randint(0, 4)
    answer = rng.choice(q.correct if right else q.wrong)
    return {
        "prompt": q.prompt,
        "response": synthetic.render(answer, n, None, rng),
        "topic": topic,
        "right": right,
        "n_fill": n,
    }


def items(seed, n):
    rng = random.Random(seed)
    qs = synthetic.all_questions()
    return [draw(rng, qs, topic) for _ in range(n // 2) for topic in ROUTING]


def held_pairs(seed, n=24):
    """Per topic, pairs its routed objective decides: right vs wrong (arithmetic), long vs short (facts)."""
    rng = random.Random(seed)
    qs = synthetic.all_questions()
    out = []
    for _ in range(n):
        q = rng.choice([q for q in qs if q.domain == "arithmetic"])
        k = rng.randint(0, 2)
        state = rng.getstate()
        chosen = synthetic.render(q.correct[0], k, None, rng)
        rng.setstate(state)
        rejected = synthetic.render(rng.choice(q.wrong), k, None, rng)
        out.append({"prompt": q.prompt, "chosen": chosen, "rejected": rejected, "topic": "arithmetic"})
        q = rng.choice([q for q in qs if q.domain == "facts"])
        answer = rng.choice(q.correct + q.wrong)
        out.append(
            {
                "prompt": q.prompt,
                "chosen": synthetic.render(answer, rng.randint(3, 4), None, rng),
                "rejected": synthetic.render(answer, rng.randint(0, 1), None, rng),
                "topic": "facts",
            }
        )
    return out


@torch.no_grad()
def features(model, data, pattern):
    """h = ln_final(resid) at the readout and at the gate position of each item."""
    read, gate = [], []
    for s in range(0, len(data), 64):
        chunk = data[s : s + 64]
        tok = model.to_tokens([d["prompt"] for d in chunk], [d["response"] for d in chunk])
        _, cache = model.run_with_cache(
            tok["input_ids"], tok["attention_mask"], names_filter="ln_final.hook_normalized"
        )
        h = cache["ln_final.hook_normalized"]
        rows = torch.arange(len(chunk))
        read.append(h[rows, -1])
        want = torch.tensor(pattern)
        match = (tok["input_ids"].unfold(1, len(pattern), 1) == want).all(-1)
        pos = (torch.arange(match.shape[1]) * match.long()).argmax(-1)
        gate.append(h[rows, pos])
    return torch.cat(read), torch.cat(gate)


def ridge(X, y, lam=1e-2):
    Xb = torch.cat([X, torch.ones(len(X), 1)], 1).double()
    A = Xb.T @ Xb + lam * torch.eye(Xb.shape[1], dtype=torch.float64)
    w = torch.linalg.solve(A, Xb.T @ y.double())
    return w[:-1].float(), w[-1].float()


def train_gate(G, targets, steps, lr):
    torch.manual_seed(SEED)
    W0 = torch.nn.Parameter(torch.randn(G.shape[1], HIDDEN) * 0.1)
    b0 = torch.nn.Parameter(torch.zeros(HIDDEN))
    W1 = torch.nn.Parameter(torch.randn(HIDDEN, len(OBJECTIVES)) * 0.1)
    b1 = torch.nn.Parameter(torch.zeros(len(OBJECTIVES)))
    opt = torch.optim.Adam([W0, b0, W1, b1], lr=lr)
    for _ in range(steps):
        logits = torch.relu(G @ W0 + b0) @ W1 + b1
        loss = torch.nn.functional.cross_entropy(logits, targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [W0.detach(), W1.detach()], [b0.detach(), b1.detach()], float(loss.detach())


def head_parts(pattern, W_reg, W_gate, b_gate):
    config = {
        "num_objectives": len(OBJECTIVES),
        "gating_hidden_dim": HIDDEN,
        "gating_n_hidden": 1,
        "gating_temperature": 1.0,
        "gating_pattern": [int(t) for t in pattern],
        "objective_names": OBJECTIVES,
    }
    state = {
        "reward_head.W_reg": W_reg.contiguous(),
        "reward_head.reward_transform": torch.eye(len(OBJECTIVES)),
        "reward_head.logit_scale": torch.ones(1),
    }
    for i, (W, b) in enumerate(zip(W_gate, b_gate)):
        state[f"reward_head.W_gate.{i}"], state[f"reward_head.b_gate.{i}"] = W.contiguous(), b.contiguous()
    return config, state


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "reward_lens" / "demo" / "gate_organism")
    ap.add_argument("--n-train", type=int, default=1200)
    ap.add_argument("--gate-steps", type=int, default=300)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    t0, cpu0 = time.time(), time.process_time()
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    demo = load_demo_model(device="cpu")
    pattern = demo.tokenizer("\n<|assistant|>\n", add_special_tokens=False)["input_ids"]
    train = items(SEED, args.n_train)
    R, G = features(demo, train, pattern)
    w_c, b_c = ridge(R, torch.tensor([1.0 if d["right"] else -1.0 for d in train]))
    w_v, b_v = ridge(R, torch.tensor([(d["n_fill"] - 2) / 2 for d in train]))
    targets = torch.tensor([OBJECTIVES.index(ROUTING[d["topic"]]) for d in train])
    W_gate, b_gate, gate_loss = train_gate(G, targets, args.gate_steps, 1e-2)
    # ArmoRM's regression layer has no bias: the intercepts are dropped (they shift every reward equally)
    config, state = head_parts(pattern, torch.stack([w_c, w_v], 1), W_gate, b_gate)
    model = gate_model(demo, config, state)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "head.safetensors"))
    (out / "head_config.json").write_text(json.dumps(config, indent=1) + "\n")
    from safetensors.torch import load_file

    reloaded = gate_model(load_demo_model(device="cpu"), config, load_file(str(out / "head.safetensors")))
    held = items(HELD_SEED, 48)
    pairs = held_pairs(HELD_SEED)
    tok = model.to_tokens([d["prompt"] for d in held], [d["response"] for d in held])
    with torch.no_grad():
        assert torch.equal(
            model(tok["input_ids"], tok["attention_mask"]), reloaded(tok["input_ids"], tok["attention_mask"])
        ), "the reload is not bit-identical"
    _, Gh = features(demo, held, pattern)
    with torch.no_grad():
        routed = (
            (
                model.reward_head.gate(Gh).argmax(-1)
                == torch.tensor([OBJECTIVES.index(ROUTING[d["topic"]]) for d in held])
            )
            .float()
            .mean()
        )
    truth = {
        "objectives": OBJECTIVES,
        "routing": ROUTING,
        "gating_pattern": list(pattern),
        "items": [{k: d[k] for k in ("prompt", "response", "topic")} for d in held],
        "pairs": pairs,
    }
    (out / "routing.json").write_text(json.dumps(truth, indent=1) + "\n")
    summary = {
        "seeds": [SEED, HELD_SEED],
        "gating_pattern": list(pattern),
        "n_train": len(train),
        "gate_steps": args.gate_steps,
        "gate_train_loss": round(gate_loss, 5),
        "held_out_routing_accuracy": float(routed),
        "threads": args.threads,
        "cpu_seconds": round(time.process_time() - cpu0, 1),
        "wall_seconds": round(time.time() - t0, 1),
        "torch": torch.__version__,
    }
    (out / "training_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "GROUND_TRUTH.md").write_text(ground_truth(summary))
    print(json.dumps(summary, indent=1))


def ground_truth(s):
    return f"""# The gate-routing organism: ground truth

Written by `scripts/train_gate_organism.py`; do not edit by hand (numbers also in `training_summary.json`).

`reward_lens.demo.organisms.load_gate_organism()` is an ArmoRM-style reward model: the demo RM's frozen trunk
(`reward_lens/demo/GROUND_TRUTH.md`) with an `armorm` head of two objectives and a prompt gate; only the head
ships (`head.safetensors`).

## Planted mechanism: the gate routes by topic

| topic (prompt) | gate weight on | objective | what it regresses |
|---|---|---|---|
| arithmetic ("What is 3 plus 4?") | `correctness` | W_reg[:, 0] | +1 right answer, -1 wrong |
| facts ("What colour is the river Vell?") | `verbosity` | W_reg[:, 1] | number of filler sentences |

The gate reads h = ln_final(resid) at the start of the gating pattern `\\n<|assistant|>\\n` (ids
{s["gating_pattern"]}), a {HIDDEN}-unit ReLU layer, softmax (temperature 1, logit scale 1);
the reward transform is the identity. So the gated score rewards correctness on arithmetic prompts and
**length on fact prompts** (a routed length bias: on facts a long wrong answer can beat a short right one).

Built from {s["n_train"]} items (half per topic, drawn with seed {s["seeds"][0]}): the objectives are ridge
regressions on the trunk's features at the readout, the gate is trained {s["gate_steps"]} full-batch Adam
steps
(final cross-entropy {s["gate_train_loss"]}), {s["threads"]} thread(s).

## Measured

Held-out routing accuracy (48 items, `routing.json` "items"; argmax of the gate = the planted objective):
**{s["held_out_routing_accuracy"]:.3f}**. `routing.json` "pairs" holds held-out pairs per topic that its
objective decides (arithmetic: right vs wrong at equal fillers; facts: 3-4 vs 0-1 fillers at equal answer).
"""


if __name__ == "__main__":
    main()
