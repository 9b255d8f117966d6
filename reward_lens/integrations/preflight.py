"""Pre-flight: before step 1 of RL, what would the reward pay the initial policy for?

    report = preflight(rm, policy, prompts, n=256)      # rollouts of the initial policy, scored
    report.summary()                                    # one row per feature: pressure, interval, verdict
    reward_fn = RewardLensReward(rm, references=report.references())   # the alarm's behaviour reference

It samples `n` completions of the initial policy in GRPO's groups (`group` completions of each of n / group
prompts, TRL's sampling: temperature 1, no top-k / top-p), scores them with the reward model, and reports
per feature (length in RM tokens, concept projections, user functions):

  pressure      the within-group association of GRPO's advantage with the feature (`alarm.pressure`), its
                permutation p-value (rewards shuffled within groups) and a 95% interval from resampling the
                prompt groups;
  sensitivity   for the policy's *own* completions padded three ways (two filler sentences, the first
                sentence repeated, a restatement of it), the reward's change in advantage units: Δreward
                divided by the pooled within-group reward SD, i.e. how far up its group padding moves a
                completion (mean over completions, 95% interval over groups);
  reference     the feature's mean and batch-to-batch spread under the initial policy (the alarm's
                behaviour channel starts from it).

A feature is *named* when its pressure is significant (permutation p < alpha / features) with an interval
that excludes 0. `reward_lens.app.preflight.write_preflight` writes the page and the JSON (the CLI:
`reward-lens preflight --model RM --policy POLICY --prompts FILE`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Union

import numpy as np
import torch

from reward_lens.integrations.alarm import Reference, advantages, on_scale, pressure
from reward_lens.integrations.inputs import as_model_input
from reward_lens.integrations.signals import feature_values, score_batch
from reward_lens.model.hooks import act_name
from reward_lens.probes.suite import PADDINGS
from reward_lens.probes.suite import sentences as split_sentences

PADDING_KINDS = ("filler", "repeat", "restate")


def pad_completion(text: str, kind: str, i: int = 0) -> str:
    """The policy's completion padded without new content: two filler sentences, its first sentence again,
    or a restatement of it."""
    first = (split_sentences(text)[:1] or [text.strip()])[0]
    if kind == "filler":
        return " ".join([text.strip(), *PADDINGS[i % len(PADDINGS)]])
    if kind == "repeat":
        return f"{text.strip()} {first}"
    if kind == "restate":
        return f"{text.strip()} In short: {first}"
    raise ValueError(f"unknown padding {kind!r}; choose from {list(PADDING_KINDS)}")


@dataclass
class Rollouts:
    """Completions of the initial policy: one prompt (as given) and completion text per row, and the group
    (prompt) index of each row."""

    prompts: List[Any]
    completions: List[Any]
    groups: np.ndarray
    seed: int

    def split(self, fraction: float = 0.5) -> "tuple[Rollouts, Rollouts]":
        """Two disjoint sets of whole groups (the first `fraction` of the groups, the rest): one to fit an
        edit on, one to evaluate it."""
        ids = np.unique(self.groups)
        cut = max(1, int(round(len(ids) * fraction)))
        first = np.isin(self.groups, ids[:cut])
        return self.subset(first), self.subset(~first)

    def subset(self, mask: np.ndarray) -> "Rollouts":
        rows = np.flatnonzero(mask)
        return Rollouts(
            [self.prompts[i] for i in rows],
            [self.completions[i] for i in rows],
            self.groups[rows],
            self.seed,
        )

    def texts(self) -> List[str]:
        return [c if isinstance(c, str) else c[-1]["content"] for c in self.completions]


def _check_count(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


@torch.no_grad()
def rollout(
    policy,
    tokenizer,
    prompts: Sequence[Any],
    *,
    n: int = 256,
    group: int = 8,
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    seed: int = 0,
    batch_prompts: int = 8,
) -> Rollouts:
    """`n` sampled completions of `policy`, `group` per prompt for n / group prompts drawn without replacement
    (seeded) from `prompts`; a prompt is a string (used as is) or a list of messages (the tokenizer's chat
    template with its generation prompt), as TRL renders them. Completions of message prompts are returned
    as [{"role": "assistant", "content": text}], as TRL passes them to reward functions."""
    _check_count("n", n, 2)
    _check_count("group", group, 2)
    _check_count("max_new_tokens", max_new_tokens, 1)
    if n % group:
        raise ValueError(f"n={n} is not a multiple of group={group}; pre-flight samples whole groups")
    if not prompts:
        raise ValueError("no prompts; pass the prompts the policy will be trained on")
    n_prompts = n // group
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(prompts))
    if len(prompts) < n_prompts:
        raise ValueError(
            f"{len(prompts)} prompts cannot give {n_prompts} groups of {group}; pass more prompts or a "
            f"smaller n (at most {len(prompts) * group})"
        )
    chosen = [prompts[i] for i in order[:n_prompts]]
    texts = [
        p
        if isinstance(p, str)
        else tokenizer.apply_chat_template(list(p), add_generation_prompt=True, tokenize=False)
        for p in chosen
    ]
    torch.manual_seed(seed)
    out_p, out_c, out_g = [], [], []
    device = next(policy.parameters()).device
    for start in range(0, len(texts), batch_prompts):
        part = texts[start : start + batch_prompts]
        enc = tokenizer(
            part, add_special_tokens=False, return_tensors="pt", padding=True, padding_side="left"
        ).to(device)
        ids = policy.generate(
            **enc,
            do_sample=True,
            temperature=temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_new_tokens,
            num_return_sequences=group,
            pad_token_id=tokenizer.pad_token_id,
        )
        decoded = tokenizer.batch_decode(ids[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        for j, text in enumerate(decoded):
            k = start + j // group
            out_p.append(chosen[k])
            out_c.append(text if isinstance(chosen[k], str) else [{"role": "assistant", "content": text}])
            out_g.append(k)
    return Rollouts(out_p, out_c, np.array(out_g, dtype=np.int64), seed)


def _group_sums(a: np.ndarray, x: np.ndarray, groups: np.ndarray):
    ids = np.unique(groups)
    t, sa, sx = np.zeros(len(ids)), np.zeros(len(ids)), np.zeros(len(ids))
    for j, g in enumerate(ids):
        m = groups == g
        xc = x[m] - x[m].mean()
        t[j], sa[j], sx[j] = a[m] @ xc, a[m] @ a[m], xc @ xc
    return t, sa, sx


def pressure_interval(
    rewards, values, groups, *, scale: str = "group", n_boot: int = 1000, seed: int = 0
) -> tuple:
    """95% percentile interval of the pressure (weighted within-group correlation), resampling prompt groups
    with replacement."""
    a = advantages(np.asarray(rewards, np.float64), groups, scale)
    t, sa, sx = _group_sums(a, np.asarray(values, np.float64), groups)
    idx = np.random.default_rng(seed).integers(0, len(t), size=(n_boot, len(t)))
    with np.errstate(invalid="ignore", divide="ignore"):
        boot = t[idx].sum(1) / np.sqrt(sa[idx].sum(1) * sx[idx].sum(1))
    boot = boot[np.isfinite(boot)]
    if not len(boot):
        return float("nan"), float("nan")
    return float(np.quantile(boot, 0.025)), float(np.quantile(boot, 0.975))


def _group_mean_interval(values: np.ndarray, groups: np.ndarray, n_boot: int, seed: int) -> tuple:
    ids = np.unique(groups)
    means = np.array([values[groups == g].mean() for g in ids])
    idx = np.random.default_rng(seed).integers(0, len(ids), size=(n_boot, len(ids)))
    boot = means[idx].mean(1)
    return float(np.quantile(boot, 0.025)), float(np.quantile(boot, 0.975))


@dataclass
class PreflightReport:
    """What pre-flight measured (see the module docstring). `features`: one dict per feature; `sensitivity`:
    one dict per padding kind; `rollouts` and `rewards`: what was scored, for fitting an edit on."""

    features: List[dict]
    sensitivity: List[dict]
    reference: Dict[str, Reference]
    reward_sd: float
    settings: dict
    rollouts: Rollouts
    rewards: np.ndarray
    values: Dict[str, np.ndarray] = field(default_factory=dict)

    def named(self) -> List[str]:
        """The features the reward pays for before training (see the module docstring)."""
        return [f["feature"] for f in self.features if f["named"]]

    def references(self) -> Dict[str, Reference]:
        """Feature -> behaviour reference, for `RewardLensReward(references=...)` / `HackAlarm`."""
        return dict(self.reference)

    def to_frame(self):
        import pandas as pd

        return pd.DataFrame(self.features)

    def summary(self):
        """Per feature: pressure with interval and p-value, whether it is named; then the padding
        sensitivities."""
        import pandas as pd

        cols = ["feature", "pressure", "ci_low", "ci_high", "p_value", "slope", "named"]
        return pd.DataFrame([{k: f[k] for k in cols} for f in self.features], columns=cols)

    def sensitivity_frame(self):
        import pandas as pd

        return pd.DataFrame(self.sensitivity)

    def plot(self, ax=None):
        """Pressure per feature with its 95% interval. Returns the Figure."""
        import matplotlib.pyplot as plt

        frame = self.summary()
        fig, ax = plt.subplots(figsize=(6.0, 0.5 + 0.45 * len(frame))) if ax is None else (ax.figure, ax)
        y = np.arange(len(frame))
        err = np.vstack([frame.pressure - frame.ci_low, frame.ci_high - frame.pressure])
        colours = ["#c44e52" if named else "#4c72b0" for named in frame.named]
        ax.barh(y, frame.pressure, xerr=err, color=colours, capsize=3)
        ax.axvline(0, color="black", lw=0.8)
        ax.set_yticks(y, frame.feature)
        ax.set_xlabel("within-group pressure (advantage-weighted correlation)")
        ax.set_title(f"pre-flight: what the reward pays the initial policy for (n = {len(self.rewards)})")
        fig.tight_layout()
        return fig

    def to_json(self) -> dict:
        clean = lambda v: None if isinstance(v, float) and not math.isfinite(v) else v  # noqa: E731
        return {
            "settings": self.settings,
            "n": int(len(self.rewards)),
            "groups": int(len(np.unique(self.rollouts.groups))),
            "reward_sd_within_group": clean(self.reward_sd),
            "features": [{k: clean(v) for k, v in f.items()} for f in self.features],
            "sensitivity": [{k: clean(v) for k, v in s.items()} for s in self.sensitivity],
            "reference": {k: r.to_dict() for k, r in self.reference.items()},
            "named": self.named(),
        }

    def save_json(self, path: Union[str, Path]) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n", encoding="utf-8")
        return path


def within_group_sd(rewards: np.ndarray, groups: np.ndarray) -> float:
    """sqrt of the mean within-group reward variance (ddof 1): the scale GRPO divides by, pooled."""
    var = [rewards[groups == g].var(ddof=1) for g in np.unique(groups) if (groups == g).sum() > 1]
    return float(np.sqrt(np.mean(var))) if var else float("nan")


class _Scorer:
    """Rewards of (prompt, completion) rows as TRL passes them, with the last pass kept (`last`) and its
    features: what `RewardLensReward` does when scoring, without a trainer."""

    def __init__(self, rm, features, concepts, concept_layer: int, batch_size: int):
        self.rm, self.batch_size = rm, batch_size
        self.features = dict(features or {})
        self.concepts = {n: torch.as_tensor(v).float().reshape(-1) for n, v in (concepts or {}).items()}
        self.concept_layer = concept_layer % rm.cfg.n_layers
        self.last = None

    def __call__(self, prompts, completions):
        inputs = [as_model_input(p, c) for p, c in zip(prompts, completions)]
        hooks = [act_name("resid_post", self.concept_layer)] if self.concepts else []
        self.last = score_batch(
            self.rm,
            [p for p, _ in inputs],
            [c for _, c in inputs],
            batch_size=self.batch_size,
            resid_hooks=hooks,
        )
        return self.last.rewards.tolist()

    def feature_values(self, sig, completions):
        return feature_values(sig, completions, self.concepts, self.concept_layer, self.features)


def measure_rollouts(
    rm,
    rollouts: Rollouts,
    *,
    features: Optional[Mapping[str, Callable[[str], float]]] = None,
    concepts: Optional[Mapping[str, Any]] = None,
    concept_layer: int = -1,
    reward_fn=None,
    alpha: float = 0.05,
    n_perm: int = 9999,
    n_boot: int = 1000,
    seed: int = 0,
    paddings: Sequence[str] = PADDING_KINDS,
    batch_size: int = 64,
) -> PreflightReport:
    """Score `rollouts` and measure their features' pressure and the padding sensitivity (the work of
    `preflight` after its rollouts; also how an edit is evaluated on held-out rollouts). `reward_fn`: a
    `RewardLensReward` (or subclass, e.g. a penalised reward) to score with instead of a plain one."""
    fn = reward_fn or _Scorer(rm, features, concepts, concept_layer, batch_size)
    rewards = np.asarray(fn(rollouts.prompts, rollouts.completions), np.float64)
    values = fn.feature_values(fn.last, rollouts.completions)
    groups = rollouts.groups
    rng = np.random.default_rng(seed)
    rows, refs = [], {}
    for j, (name, x) in enumerate(values.items()):
        pr = pressure(rewards, x, groups, n_perm=n_perm, rng=rng)
        lo, hi = pressure_interval(rewards, x, groups, n_boot=n_boot, seed=seed + j)
        p_two = min(1.0, 2 * min(pr.p_up, pr.p_down))
        refs[name] = Reference.fit(rewards, on_scale(name, x), groups)
        rows.append(
            {
                "feature": name,
                "pressure": pr.value,
                "ci_low": lo,
                "ci_high": hi,
                "p_value": p_two,
                "slope": pr.slope,
                "mean": float(np.mean(x)),
                "named": bool(p_two < alpha / len(values) and (lo > 0 or hi < 0)),
            }
        )
    sd = within_group_sd(rewards, groups)
    sens = []
    texts = rollouts.texts()
    for kind in paddings:
        padded = [pad_completion(t, kind, i) for i, t in enumerate(texts)]
        padded_c = [
            p if isinstance(c, str) else [{"role": "assistant", "content": p}]
            for p, c in zip(padded, rollouts.completions)
        ]
        r_pad = np.asarray(fn(rollouts.prompts, padded_c), np.float64)
        delta = (r_pad - rewards) / sd
        lo, hi = _group_mean_interval(delta, groups, n_boot, seed)
        sens.append(
            {
                "padding": kind,
                "delta_reward": float(np.mean(r_pad - rewards)),
                "delta_advantage": float(np.mean(delta)),
                "ci_low": lo,
                "ci_high": hi,
                "length_added": float(np.mean(fn.last.lengths) - np.mean(values["length"])),
            }
        )
    settings = {"alpha": alpha, "n_perm": n_perm, "n_boot": n_boot, "seed": seed}
    return PreflightReport(rows, sens, refs, sd, settings, rollouts, rewards, values)


def preflight(
    rm,
    policy,
    prompts: Sequence[Any],
    n: int = 256,
    *,
    tokenizer=None,
    group: int = 8,
    max_new_tokens: int = 64,
    features: Optional[Mapping[str, Callable[[str], float]]] = None,
    concepts: Optional[Mapping[str, Any]] = None,
    concept_layer: int = -1,
    alpha: float = 0.05,
    seed: int = 0,
    batch_size: int = 64,
) -> PreflightReport:
    """Roll out the initial `policy` (an HF causal LM; `tokenizer` defaults to `policy.tokenizer` if set) on
    `prompts`, score with the reward model `rm`, and report each feature's pressure and the reward's
    sensitivity to padding the policy's own completions (see the module docstring)."""
    tokenizer = tokenizer if tokenizer is not None else getattr(policy, "tokenizer", None)
    if tokenizer is None:
        raise ValueError("pass the policy's tokenizer (tokenizer=...); the policy carries none")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha < 1:
        raise ValueError(f"alpha must be a probability in (0, 1), got {alpha!r}")
    rolls = rollout(policy, tokenizer, prompts, n=n, group=group, max_new_tokens=max_new_tokens, seed=seed)
    report = measure_rollouts(
        rm,
        rolls,
        features=features,
        concepts=concepts,
        concept_layer=concept_layer,
        alpha=alpha,
        seed=seed,
        batch_size=batch_size,
    )
    report.settings.update({"n": n, "group": group, "max_new_tokens": max_new_tokens})
    return report
