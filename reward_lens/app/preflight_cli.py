"""`reward-lens preflight --model RM --policy POLICY --prompts FILE`: its options and command (module-level
imports torch-free, as for every command module the CLI imports)."""

from __future__ import annotations

import sys
from pathlib import Path

from reward_lens.app.options import load_model
from reward_lens.app.output import ReportDir


def add_preflight_command(sub) -> None:
    pre = sub.add_parser(
        "preflight",
        help="before RL: roll out the initial policy, score it, report what the reward pays it for",
    )
    pre.add_argument("--model", default=None, help="reward model: checkpoint or hub id (default: the demo)")
    pre.add_argument(
        "--policy",
        required=True,
        help="the policy: a causal-LM checkpoint directory, or 'organism' (the demo's)",
    )
    pre.add_argument(
        "--prompts",
        required=True,
        help="prompts: .jsonl with a 'prompt' field (text or messages), or .txt lines",
    )
    pre.add_argument("--n", type=int, default=256, help="completions to sample (default 256)")
    pre.add_argument("--group", type=int, default=8, help="completions per prompt, GRPO's group (default 8)")
    pre.add_argument("--max-new-tokens", type=int, default=64, help="completion length limit (default 64)")
    pre.add_argument("--seed", type=int, default=0)
    pre.add_argument("--out", default="reward-lens-preflight", help="output directory")
    pre.add_argument("--device", default=None, help="cpu or cuda[:i]")
    pre.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    pre.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    pre.set_defaults(func=cmd_preflight)


def cmd_preflight(args) -> int:
    """Load the RM and the policy, roll out, measure, write (`reward_lens.app.preflight`)."""
    from reward_lens.app.preflight import read_prompts, write_preflight

    prompts = read_prompts(args.prompts)  # checked before any work
    for name, low in (("n", 2), ("group", 2), ("max_new_tokens", 1)):
        if getattr(args, name) < low:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(args, name)}")
    if args.n % args.group:
        raise ValueError(
            f"--n {args.n} is not a multiple of --group {args.group}; pre-flight samples whole groups"
        )
    if args.n // args.group > len(prompts):
        raise ValueError(
            f"--n {args.n} needs {args.n // args.group} prompts for groups of {args.group}; "
            f"{args.prompts} has "
            f"{len(prompts)}: pass more prompts or a smaller --n"
        )
    if args.policy != "organism" and not Path(args.policy).is_dir():
        raise FileNotFoundError(
            f"no policy checkpoint at {args.policy!r}; give a causal-LM directory or 'organism' (the demo's)"
        )
    with ReportDir(args.out) as out:  # checked and locked before any work
        import torch

        from reward_lens.integrations.preflight import preflight

        model, _ = load_model(args.model, args.device)
        torch.set_num_threads(args.threads or 1)  # small models: one thread (see `reward-lens audit`)
        if args.policy == "organism":
            from reward_lens.demo.organisms import load_policy_organism

            policy, tokenizer = load_policy_organism()
        else:
            from transformers import AutoModelForCausalLM, AutoTokenizer

            policy, tokenizer = (
                AutoModelForCausalLM.from_pretrained(args.policy),
                AutoTokenizer.from_pretrained(args.policy),
            )
        report = preflight(
            model,
            policy,
            prompts,
            n=args.n,
            tokenizer=tokenizer,
            group=args.group,
            max_new_tokens=args.max_new_tokens,
            seed=args.seed,
        )
        out.commit(lambda tmp: write_preflight(report, tmp))
        names = report.named()
        print(
            "[reward-lens] pre-flight: the reward pays for "
            f"{', '.join(names) if names else 'nothing tracked'}; wrote {out.path}",
            file=sys.stderr,
        )
    return 0
