"""What a reward model does with a batch of policy outputs, measured cheaply enough to run inside RL training.

`score_batch` scores (prompt, response) texts with one forward per chunk that keeps only the readout
position of the residual components (`run_with_cache(..., readout_only=True)`) and splits each reward
exactly over them (the identity of `reward_lens.instruments.attribution`):

    reward = Σ_c w · x_c / s + b,   c ∈ {embed, attn_L0, mlp_L0, ...},  s = ln_final scale at the readout

`measure` turns a fixed sample of texts into tracked quantities, each an estimate with a 95% interval:

  reward                 mean reward (bootstrap CI)
  share/<component>      mean of term_c / Σ_c' |term_c'| (the component's signed share of the reward)
  reward_length_corr     Pearson r(reward, response length in RM tokens) (Fisher-z CI)
  concept/<name>         mean projection v̂ · resid_post[layer] at the readout (bootstrap CI)
  probe/<dimension>      hacking-probe effect, mean Δreward on the sample's own responses (`run_probes`)

`drift_flags` compares a measurement with the baseline's: a quantity drifts when its interval and the
baseline's are disjoint (a conservative two-sample criterion: for equal-width normal intervals it is a
test at about p < 0.006, so ~20 tracked quantities give few false flags); the reward-length correlation
is flagged only when it rises.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from jaxtyping import Float

from reward_lens.core.directions import readout_direction
from reward_lens.core.readout import Tokenized, batches, readout_cache
from reward_lens.instruments.sites import component_sites
from reward_lens.model.hooks import act_name
from reward_lens.probes.suite import DIMENSIONS, probe_pairs, run_probes
from reward_lens.representations.concepts import concept_vector
from reward_lens.stats import bootstrap_indices, fisher_ci, percentile_ci

RISING_ONLY = ("reward_length_corr",)  # quantities flagged only when they rise above the baseline


def encode(model, prompts: Sequence[str], responses: Sequence[str]) -> Tokenized:
    """(prompt, response) texts as the reward model's tokens: the one place an input format plugs in."""
    batch = model.to_tokens(list(prompts), list(responses))
    ids, mask = batch["input_ids"], batch["attention_mask"]
    return Tokenized(ids, mask, model.readout_positions(ids, mask))


def component_hooks(cfg) -> Dict[str, str]:
    """Component name (embed, attn_L{l}, mlp_L{l}) -> the hook holding what it adds to the residual."""
    return {
        s.name: act_name(s.name) if s.kind == "embed" else act_name(f"{s.kind}_out", s.layer)
        for s in component_sites(cfg)
    }


def response_lengths(model, responses: Sequence[str]) -> np.ndarray:
    """Each response's length in the reward model's tokens (no special tokens)."""
    if not responses:
        return np.zeros(0)
    # a multi-message completion: the text of its messages
    texts = [r if isinstance(r, str) else "".join(str(m["content"]) for m in r) for r in responses]
    ids = model.tokenizer(texts, add_special_tokens=False)["input_ids"]
    return np.array([len(x) for x in ids], dtype=np.float64)


def pearson(x: np.ndarray, y: np.ndarray) -> float:
    """Pearson r; NaN when either side is constant (or fewer than 2 values)."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if len(x) < 2 or x.std() == 0 or y.std() == 0:
        return float("nan")
    return float(np.corrcoef(x, y)[0, 1])


@dataclass
class BatchSignals:
    """One scoring pass. rewards [n] are the model's outputs; terms [n, n_components] split them exactly:
    rewards = terms.sum(-1) + bias. lengths [n]: response lengths in RM tokens. resid: hook -> [n, d_model]
    residual at each readout."""

    rewards: Float[torch.Tensor, " n"]
    terms: Float[torch.Tensor, "n component"]
    bias: Float[torch.Tensor, " n"]
    components: List[str]
    lengths: np.ndarray
    resid: Dict[str, torch.Tensor]

    def max_relative_error(self) -> float:
        """max |Σ terms + bias - reward| / max(1, |reward|): fp32 rounding when the split is exact."""
        err = (self.terms.sum(-1) + self.bias - self.rewards).abs() / self.rewards.abs().clamp(min=1.0)
        return float(err.max()) if len(err) else 0.0

    def shares(self) -> Float[torch.Tensor, "n component"]:
        """term_c / Σ_c' |term_c'| per sequence: each component's signed share of the reward."""
        return self.terms / self.terms.abs().sum(-1, keepdim=True).clamp(min=1e-12)

    def length_correlation(self) -> float:
        return pearson(self.rewards.numpy(), self.lengths)

    def metrics(self) -> Dict[str, float]:
        """Flat scalars for a training logger: reward mean/std, reward-length correlation, per component the
        attribution's mean and spread (std, ddof=0) over the batch."""
        out = {
            "reward/mean": float(self.rewards.mean()),
            "reward/std": float(self.rewards.std(unbiased=False)),
            "reward_length_corr": self.length_correlation(),
            "length/mean": float(self.lengths.mean()),
        }
        for j, c in enumerate(self.components):
            out[f"attr/{c}/mean"] = float(self.terms[:, j].mean())
            out[f"attr/{c}/std"] = float(self.terms[:, j].std(unbiased=False))
        return out

    def to_frame(self):
        """Tidy: one row per (sequence, component) with its term, the sequence's reward and length."""
        import pandas as pd

        n, k = self.terms.shape
        return pd.DataFrame(
            {
                "item": np.repeat(np.arange(n), k),
                "component": self.components * n,
                "term": self.terms.reshape(-1).numpy(),
                "reward": np.repeat(self.rewards.numpy(), k),
                "length": np.repeat(self.lengths, k),
            }
        )

    def summary(self):
        """Per component: mean and std of its term over the batch."""
        import pandas as pd

        return pd.DataFrame(
            {
                "component": self.components,
                "mean": self.terms.mean(0).numpy(),
                "std": self.terms.std(0, unbiased=False).numpy(),
            }
        )

    def plot(self, ax=None):
        """Mean attribution per component with its spread over the batch. Returns the Figure."""
        import matplotlib.pyplot as plt

        frame = self.summary()
        fig, ax = plt.subplots(figsize=(6.5, 3.2)) if ax is None else (ax.figure, ax)
        ax.bar(frame.component, frame["mean"], yerr=frame["std"], color="#4c72b0", capsize=3)
        ax.axhline(0, color="black", lw=0.8)
        ax.set_ylabel("reward attribution")
        ax.tick_params(axis="x", rotation=60)
        ax.set_title(f"reward split over components ({len(self.rewards)} responses)")
        fig.tight_layout()
        return fig


@torch.no_grad()
def score_batch(
    model,
    prompts: Sequence[str],
    responses: Sequence[str],
    *,
    batch_size: int = 16,
    resid_hooks: Sequence[str] = (),
) -> BatchSignals:
    """Rewards of the texts and, from the same forward, their exact split over components (and the
    residuals at `resid_hooks`, at each readout). One readout-only cache per chunk of `batch_size`."""
    if len(prompts) != len(responses):
        raise ValueError(
            f"got {len(prompts)} prompts but {len(responses)} responses; pass one response per prompt"
        )
    if not prompts:
        raise ValueError("no texts to score; pass at least one (prompt, response)")
    comps = component_hooks(model.cfg)
    scale_name = act_name("final_scale")
    names = list(dict.fromkeys([*comps.values(), scale_name, *resid_hooks]))
    rewards, terms, biases = [], [], []
    resid: Dict[str, List[torch.Tensor]] = {h: [] for h in resid_hooks}
    for sl in batches(len(prompts), batch_size):
        tok = encode(model, prompts[sl], responses[sl])
        out, cache = readout_cache(model, tok, names)
        direction, bias = readout_direction(model, tok)
        w = direction / cache[scale_name].reshape(-1, 1).float()  # the map each residual term goes through
        terms.append(torch.stack([(cache[h][:, 0].float() * w).sum(-1) for h in comps.values()], -1).cpu())
        rewards.append(out.detach().float().reshape(-1).cpu())
        biases.append(bias.cpu())
        for h in resid_hooks:
            resid[h].append(cache[h][:, 0].float().cpu())
    return BatchSignals(
        torch.cat(rewards),
        torch.cat(terms),
        torch.cat(biases),
        list(comps),
        response_lengths(model, responses),
        {h: torch.cat(v) for h, v in resid.items()},
    )


def feature_values(
    sig: "BatchSignals",
    completions: Sequence,
    concepts: Mapping[str, torch.Tensor],
    concept_layer: int,
    features: Mapping[str, object],
) -> Dict[str, np.ndarray]:
    """Per completion, every tracked feature of one scoring pass: `length` in RM tokens, `concept/<name>` the
    projection v̂ · resid_post[concept_layer] at the readout (the pass must have kept that hook), and each
    user function of the completion's text."""
    from reward_lens.integrations.inputs import message_text

    values = {"length": sig.lengths}
    hook = act_name("resid_post", concept_layer)
    for name, v in concepts.items():
        values[f"concept/{name}"] = (sig.resid[hook] @ v).numpy()
    texts = [message_text(c, "assistant") for c in completions]
    for name, fn in features.items():
        out = np.array([float(fn(t)) for t in texts], dtype=np.float64)
        if not np.isfinite(out).all():
            raise ValueError(f"feature {name!r} returned a non-finite value; it must map text to a number")
        values[name] = out
    return values


# --------------------------------------------------------------------------------------- estimates, drift
def estimate(value: float, ci_low: float, ci_high: float) -> Dict[str, Optional[float]]:
    """A JSON-ready estimate; NaN becomes None (JSON has no NaN)."""
    clean = lambda x: None if x is None or not np.isfinite(x) else float(x)  # noqa: E731
    return {"value": clean(value), "ci_low": clean(ci_low), "ci_high": clean(ci_high)}


def mean_estimate(x: np.ndarray, n_boot: int = 1000, seed: int = 0) -> Dict[str, Optional[float]]:
    """Mean with its percentile-bootstrap 95% interval."""
    x = np.asarray(x, dtype=np.float64)
    means = x[bootstrap_indices(len(x), n_boot, seed)].mean(axis=1)
    lo, hi = percentile_ci(means, 0.95)
    return estimate(x.mean(), float(lo), float(hi))


def correlation_estimate(x: np.ndarray, y: np.ndarray) -> Dict[str, Optional[float]]:
    """Pearson r with its Fisher-z 95% interval."""
    r = pearson(x, y)
    lo, hi = fisher_ci(np.array(r), len(x))
    return estimate(r, float(lo), float(hi))


def drift_flags(current: Mapping[str, dict], baseline: Mapping[str, dict]) -> List[str]:
    """Quantities whose interval lies entirely beyond the baseline's (for RISING_ONLY ones: above it)."""
    flags = []
    for key, cur in current.items():
        base = baseline.get(key)
        if base is None or None in (cur["ci_low"], cur["ci_high"], base["ci_low"], base["ci_high"]):
            continue
        above = cur["ci_low"] > base["ci_high"]
        below = cur["ci_high"] < base["ci_low"]
        if above or (below and key not in RISING_ONLY):
            flags.append(key)
    return flags


# --------------------------------------------------------------------------------------- concepts, measure
ConceptSpec = Union[None, Sequence[str], Mapping[str, object]]


def build_concepts(
    model,
    spec: ConceptSpec,
    prompts: Sequence[str],
    responses: Sequence[str],
    layer: int,
    *,
    batch_size: int = 16,
) -> Tuple[Dict[str, torch.Tensor], Dict[str, float]]:
    """Unit concept directions at `layer` (resid_post) and their cosine with the reward direction.

    `spec`: names or name -> contrast. A hacking-probe dimension name without a contrast gets its contrast
    set from the given (baseline) texts: the probe pairs of that dimension (with property vs control), so
    the direction lives in the policy's own distribution. Anything else goes to `concept_vector` (a bundled
    contrast set name, a .jsonl path, ContrastPairs or PreferencePairs).
    """
    items = spec.items() if isinstance(spec, Mapping) else [(name, None) for name in (spec or [])]
    vectors, cosines = {}, {}
    for name, contrast in items:
        if contrast is None:
            contrast = probe_pairs(list(zip(prompts, responses)), name) if name in DIMENSIONS else name
        cv = concept_vector(model, contrast, layers=[layer], test_fraction=0.0, batch_size=batch_size)
        vectors[name], cosines[name] = cv.vector(layer).cpu(), float(cv.cosine[0])
    return vectors, cosines


def measure(
    model,
    prompts: Sequence[str],
    responses: Sequence[str],
    *,
    probes: Optional[Sequence[str]] = None,
    concepts: Optional[Mapping[str, torch.Tensor]] = None,
    concept_layer: int = -1,
    n_boot: int = 1000,
    seed: int = 0,
    batch_size: int = 16,
) -> Dict[str, Dict[str, Optional[float]]]:
    """The tracked quantities of one sample of texts (see the module docstring), each an estimate dict.

    probes: hacking-probe dimensions to run on the sample's responses (None: none; they cost about
    2 forwards per item and dimension). concepts: name -> unit direction at resid_post[`concept_layer`].
    """
    layer = concept_layer % model.cfg.n_layers
    hook = act_name("resid_post", layer)
    sig = score_batch(
        model, prompts, responses, batch_size=batch_size, resid_hooks=[hook] if concepts else []
    )
    out = {"reward": mean_estimate(sig.rewards.numpy(), n_boot, seed)}
    shares = sig.shares().numpy()
    for j, c in enumerate(sig.components):
        out[f"share/{c}"] = mean_estimate(shares[:, j], n_boot, seed)
    out["reward_length_corr"] = correlation_estimate(sig.rewards.numpy(), sig.lengths)
    for name, v in (concepts or {}).items():
        out[f"concept/{name}"] = mean_estimate((sig.resid[hook] @ v.float()).numpy(), n_boot, seed)
    if probes:
        res = run_probes(
            model,
            items=list(zip(prompts, responses)),
            dimensions=list(probes),
            batch_size=batch_size,
            n_boot=max(n_boot, 100),
            seed=seed,
        )
        for row in res.rows:
            out[f"probe/{row['dimension']}"] = estimate(row["effect"], row["ci_low"], row["ci_high"])
    return out
