"""The pre-flight page and JSON, and `reward-lens preflight --model RM --policy POLICY --prompts FILE`.

The measurement itself is `reward_lens.integrations.preflight.preflight`; this writes what it found into a
report directory (`preflight.html`, `preflight.json`, `rollouts.jsonl`), under the report-directory rules
of every writing command (checked and locked before any work, swapped in whole).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, List, Union

from reward_lens.app.output import write_json
from reward_lens.app.report import Report


def read_prompts(path: Union[str, Path]) -> List[Any]:
    """Prompts from a file: JSONL rows with a "prompt" (a string, or a list of role/content messages), or
    plain text with one prompt per line. Errors name the file and line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"no prompts file at {str(path)!r}; give a .jsonl with a 'prompt' field or a .txt"
        )
    text = path.read_text(encoding="utf-8-sig")
    prompts: List[Any] = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if path.suffix in (".jsonl", ".json"):
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path} line {i} is not JSON ({exc.msg})") from None
            prompt = row.get("prompt") if isinstance(row, dict) else None
            ok = isinstance(prompt, str) and prompt.strip()
            ok = ok or (
                isinstance(prompt, list)
                and prompt
                and all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in prompt)
            )
            if not ok:
                raise ValueError(
                    f"{path} line {i}: 'prompt' must be a non-empty string or a list of role/content messages"
                )
            prompts.append(prompt)
        else:
            prompts.append(line.strip())
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts


def write_preflight(report, out: Path) -> None:
    """Write the page, the JSON and the rollouts of a `PreflightReport` into the directory `out`."""
    write_json(out / "preflight.json", report.to_json())
    with (out / "rollouts.jsonl").open("w", encoding="utf-8") as f:
        for p, c, g, r in zip(
            report.rollouts.prompts, report.rollouts.completions, report.rollouts.groups, report.rewards
        ):
            f.write(json.dumps({"group": int(g), "prompt": p, "completion": c, "reward": float(r)}) + "\n")
    page = Report("reward-lens pre-flight: what the reward pays the initial policy for")
    named = report.named()
    sec = page.section("Summary")
    sec.text(
        (
            f"Before any training the reward pays for {', '.join(named)} inside the prompt groups: GRPO will "
            "climb it."
            if named
            else "No tracked feature is paid for inside the prompt groups (every pressure is within chance "
            "or its interval holds 0)."
        )
        + f" {len(report.rewards)} completions of the initial policy in "
        f"{len(set(report.rollouts.groups.tolist()))} groups."
    )
    sec.text(
        "Pressure: the within-group association of GRPO's advantage with the feature (−1 to 1), its "
        "permutation p-value (rewards shuffled within groups) and a 95% interval over prompt groups. A "
        "feature is named when p < alpha / features and the interval excludes 0.",
        note=True,
    )
    sec.table(report.summary())
    sec.figure(report.plot(), alt="pressure per feature")
    sens = page.section("Padding the policy's own completions")
    sens.text(
        "Δreward of each completion padded without new content, in advantage units (Δreward / pooled "
        "within-group reward SD): how far up its group padding moves a completion.",
        note=True,
    )
    sens.table(report.sensitivity_frame())
    page.save(out / "preflight.html")


def cmd_preflight(args) -> int:
    """The CLI command: load the RM and the policy, roll out, measure, write."""
    from reward_lens.app.cli import _load_model, _report_dir, _set_threads
    from reward_lens.distributed import Ranks

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
    with _report_dir(args.out, Ranks.from_env()) as out:
        from reward_lens.integrations.preflight import preflight

        model, _ = _load_model(args.model, args.device, None)
        _set_threads(args.threads, model)
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
