"""The pre-flight page and JSON, and `reward-lens preflight --model RM --policy POLICY --prompts FILE`.

The measurement itself is `reward_lens.integrations.preflight.preflight`; this writes what it found into a
report directory (`preflight.html`, `preflight.json`, `rollouts.jsonl`), under the report-directory rules
of every writing command (checked and locked before any work, swapped in whole).
"""

from __future__ import annotations

import json
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
