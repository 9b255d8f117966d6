"""SAE features along the reward direction: alignment, exact per-pair attribution, causal ablation.

With the final norm's scale s frozen at its real value, the reward is linear in the residual:
reward = w · resid_final[readout] / s + b (w = `model.reward_direction`, final-norm weight included), and
the *lens value* of layer l is `w · resid_l[readout] / s`. An SAE at that site writes
x = Σ_i f_i d_i + b_dec + ε (ε = x − x̂, the reconstruction error), so the lens value splits exactly into

    Σ_i f_i (d_i · w) / s   +   (b_dec · w) / s   +   (ε · w) / s
      feature terms            SAE bias term         error term

`feature_alignment` gives d_i · w (how much reward one unit of feature i is worth, per unit of 1/s);
`feature_attribution` the terms per pair for chosen, rejected and their gap; `feature_ablation` the causal
check: subtract f_i d_i at the site (readout position, or every position) and measure the reward change,
to be compared with the attribution (they differ when later layers or the final norm react to the edit).

For ArmoRM the gated score's direction depends on the prompt: each sequence gets its own
`model.reward_direction_for(...)` (pass `objective=` to analyse one objective instead).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Union

import torch

from reward_lens.core.readout import batches, readout_run, tokenize
from reward_lens.data.pairs import PreferencePair, as_pairs
from reward_lens.model.heads.base import read_objective
from reward_lens.model.validation import checked_arguments
from reward_lens.plotting import figure_axes, finish
from reward_lens.representations.concepts import is_gated
from reward_lens.results import PairRewards
from reward_lens.stats import pearson_rows, spearman_rows

SIDES = ("chosen", "rejected")


def _sae_site(model, sae, hook_name: Optional[str]) -> str:
    return sae.check_hook(model, hook_name)


@torch.no_grad()
def _directions(model, prompts: Sequence[str], responses: Sequence[str], batch_size: int) -> torch.Tensor:
    """Per sequence, the norm-aware direction w with output = w · resid_final[readout] / s + bias, [n, d]."""
    if not is_gated(model):
        return model.reward_direction.detach().float()[None].expand(len(prompts), -1)
    out = []
    for sl in batches(len(prompts), batch_size):
        tok = tokenize(model, prompts[sl], responses[sl])
        out.append(model.reward_direction_for(tok.input_ids, tok.attention_mask).detach().float())
    return torch.cat(out)


# ---------------------------------------------------------------------------------------------- alignment
@dataclass
class FeatureAlignment:
    """alignment[i] = d_i · w (reward per unit of feature i, per unit of 1/s); cosine[i] = cos(d_i, w)."""

    hook_name: Optional[str]
    alignment: torch.Tensor  # [d_sae]
    cosine: torch.Tensor  # [d_sae]

    @checked_arguments(counts={"n": 1})
    def top(self, n: int = 10, by: str = "alignment", sign: str = "abs"):
        """The n features with the largest |alignment| (sign="abs"), most positive ("pos") or negative
        ("neg")."""
        values = getattr(self, by)
        key = {"abs": values.abs(), "pos": values, "neg": -values}[sign]
        idx = key.topk(min(n, key.numel())).indices
        return self.to_frame().iloc[idx.numpy()].reset_index(drop=True)

    def to_frame(self):
        import pandas as pd

        return pd.DataFrame(
            {
                "feature": range(self.alignment.numel()),
                "alignment": self.alignment.numpy(),
                "cosine": self.cosine.numpy(),
            }
        )

    @checked_arguments(counts={"n": 1})
    def summary(self, n: int = 10):
        """The n features with the largest |alignment| (feature, alignment, cosine)."""
        return self.top(n)

    def plot(self, ax=None):
        """Histogram of cos(d_i, w) over features."""
        created = ax is None
        fig, ax = figure_axes(ax, (5.5, 3.2))
        ax.hist(self.cosine.numpy(), bins=60)
        ax.set_xlabel("cos(d_i, w_r)")
        ax.set_ylabel("features")
        ax.set_title(f"SAE feature alignment with the reward direction ({self.hook_name})")
        return finish(fig, created)


@torch.no_grad()
def feature_alignment(
    model, sae, *, objective: Union[int, str, None] = None, direction: Optional[torch.Tensor] = None
) -> FeatureAlignment:
    """d_i · w for every SAE feature, w the norm-aware reward direction (the same at every layer, because
    the final norm's scale is frozen). For ArmoRM's gated score pass `objective=` or an explicit `direction`
    (e.g. `model.reward_direction_for(ids).mean(0)`)."""
    hook_name = sae.cfg.hook_name
    if hook_name is not None and hook_name in model.hook_dict:
        sae.check_hook(model)
    if direction is None:
        with read_objective(model, objective):
            if is_gated(model):
                raise ValueError(
                    "ArmoRM's gated score has a prompt-dependent direction; pass objective=<name or "
                    "index>, or direction=model.reward_direction_for(input_ids).mean(0)"
                )
            direction = model.reward_direction.detach()
    w = direction.float().to(sae.W_dec.device)
    if w.shape != (sae.cfg.d_in,):
        raise ValueError(f"direction has shape {tuple(w.shape)}, the SAE's d_in is {sae.cfg.d_in}")
    D = sae.decoder_directions.float()
    align = D @ w
    cos = align / (D.norm(dim=-1) * w.norm()).clamp(min=1e-30)
    return FeatureAlignment(hook_name, align.cpu(), cos.cpu())


# ---------------------------------------------------------------------------------------------- attribution
@dataclass
class FeatureAttribution(PairRewards):
    """Exact decomposition of each pair's lens value at the SAE's site, for chosen and rejected.

    Per side (dict keys "chosen", "rejected"): `acts` and `terms` are sparse [n_pairs, d_sae] (feature
    activations f_i and terms f_i (d_i · w)/s); `sae_bias`, `error`, `lens`, `scale`, `rewards` are [n_pairs]
    (`rewards[side]` is also `reward_chosen` / `reward_rejected`, as in every result).
    Σ terms + sae_bias + error = lens (`completeness_error()` measures it).
    """

    hook_name: str
    pair_ids: List[str]
    acts: Dict[str, torch.Tensor]
    terms: Dict[str, torch.Tensor]
    sae_bias: Dict[str, torch.Tensor]
    error: Dict[str, torch.Tensor]
    lens: Dict[str, torch.Tensor]
    scale: Dict[str, torch.Tensor]
    rewards: Dict[str, torch.Tensor]
    alignment: Optional[torch.Tensor] = None  # [d_sae] (linear heads; None for ArmoRM's per-prompt gate)

    @property
    def d_sae(self) -> int:
        return self.terms["chosen"].shape[1]

    @property
    def reward_chosen(self) -> torch.Tensor:
        return self.rewards["chosen"]

    @property
    def reward_rejected(self) -> torch.Tensor:
        return self.rewards["rejected"]

    def dense_terms(self, side: str = "gap") -> torch.Tensor:
        """[n_pairs, d_sae] feature terms for "chosen", "rejected" or their difference "gap"."""
        if side == "gap":
            return self.terms["chosen"].to_dense() - self.terms["rejected"].to_dense()
        return self.terms[side].to_dense()

    def gap(self) -> Dict[str, torch.Tensor]:
        """The reward-gap decomposition: lens(chosen) − lens(rejected) = Σ features + sae_bias + error."""
        return {
            k: getattr(self, k)["chosen"] - getattr(self, k)["rejected"]
            for k in ("sae_bias", "error", "lens")
        }

    def completeness_error(self) -> float:
        """max |Σ_i terms + sae_bias + error − lens| over pairs and sides (0 up to float rounding)."""
        worst = 0.0
        for side in SIDES:
            total = torch.sparse.sum(self.terms[side], dim=1).to_dense() if self.terms[side]._nnz() else 0.0
            total = total + self.sae_bias[side] + self.error[side]
            worst = max(worst, float((total - self.lens[side]).abs().max()))
        return worst

    @checked_arguments(counts={"n": 1})
    def top_features(self, n: int = 10, side: str = "gap"):
        """Features ranked by |mean attribution| over pairs (to the gap by default)."""
        import pandas as pd

        terms = self.dense_terms(side)
        mean = terms.mean(0)
        idx = mean.abs().topk(min(n, mean.numel())).indices
        if side == "gap":
            active = ((self.acts["chosen"].to_dense() > 0) | (self.acts["rejected"].to_dense() > 0)).float()
        else:
            active = (self.acts[side].to_dense() > 0).float()
        rows = []
        for i in idx.tolist():
            row = {
                "feature": i,
                "mean_attribution": float(mean[i]),
                "mean_abs_attribution": float(terms[:, i].abs().mean()),
                "frac_pairs_active": float(active[:, i].mean()),
            }
            if self.alignment is not None:
                row["alignment"] = float(self.alignment[i])
            rows.append(row)
        frame = pd.DataFrame(rows)
        frame.insert(0, "side", side)
        return frame

    def to_frame(self):
        """Tidy rows: one per (pair, side, active feature), plus each pair's sae_bias, error and lens rows."""
        import pandas as pd

        rows = []
        for side in SIDES:
            t = self.terms[side].coalesce()
            a = self.acts[side].coalesce()
            idx, vals = t.indices(), t.values()
            act_vals = a.values()
            for (p, i), v, av in zip(idx.T.tolist(), vals.tolist(), act_vals.tolist()):
                rows.append((self.pair_ids[p], side, "feature", i, av, v))
            for p in range(len(self.pair_ids)):
                rows.append(
                    (self.pair_ids[p], side, "sae_bias", -1, float("nan"), float(self.sae_bias[side][p]))
                )
                rows.append((self.pair_ids[p], side, "error", -1, float("nan"), float(self.error[side][p])))
                rows.append((self.pair_ids[p], side, "lens", -1, float("nan"), float(self.lens[side][p])))
        frame = pd.DataFrame(rows, columns=["pair", "side", "term", "feature", "activation", "attribution"])
        frame.insert(0, "hook", self.hook_name)
        return frame

    @checked_arguments(counts={"n": 1})
    def summary(self, n: int = 10):
        """The n features with the largest |mean attribution| to the reward gap (`top_features(n)`)."""
        return self.top_features(n)

    @checked_arguments(counts={"n": 1})
    def plot(self, n: int = 15, ax=None):
        """Bars: mean attribution to the reward gap of the top features, with the error and bias terms."""
        top = self.top_features(n)
        gap = self.gap()
        labels = [f"f{int(i)}" for i in top["feature"]] + ["SAE bias", "error"]
        values = list(top["mean_attribution"]) + [float(gap["sae_bias"].mean()), float(gap["error"].mean())]
        created = ax is None
        fig, ax = figure_axes(ax, (max(5.0, 0.45 * len(labels)), 3.6))
        ax.bar(range(len(values)), values, color=["C0" if v >= 0 else "C3" for v in values])
        ax.set_xticks(range(len(values)), labels, rotation=60, fontsize=8)
        ax.axhline(0, color="grey", lw=0.5)
        ax.set_ylabel("mean attribution to reward gap")
        ax.set_title(f"SAE features at {self.hook_name}")
        return finish(fig, created)


def _to_sparse(x: torch.Tensor) -> torch.Tensor:
    return x.to_sparse_coo().coalesce()


@checked_arguments(counts={"batch_size": 1})
@torch.no_grad()
def feature_attribution(
    model,
    sae,
    pairs: Union[PreferencePair, Sequence[PreferencePair], str],
    *,
    hook_name: Optional[str] = None,
    objective: Union[int, str, None] = None,
    batch_size: int = 8,
    progress: bool = False,
) -> FeatureAttribution:
    """Per pair and side: f_i (d_i · w)/s for every active feature, the SAE bias and reconstruction-error
    terms, and the lens value they sum to exactly (at the SAE's hook, readout position, frozen scale)."""
    pairs = as_pairs(pairs)
    with read_objective(model, objective):
        site = _sae_site(model, sae, hook_name)
        prompts = [p.prompt for p in pairs]
        out: Dict[str, Dict[str, torch.Tensor]] = {
            k: {} for k in ("acts", "terms", "sae_bias", "error", "lens", "scale", "rewards")
        }
        alignment = None
        for side in SIDES:
            responses = [getattr(p, side) for p in pairs]
            run = readout_run(
                model,
                prompts,
                responses,
                [site, "ln_final.hook_scale"],
                batch_size=batch_size,
                progress=f"SAE attribution ({side})" if progress else False,
            )
            x = run.acts[site].float().to(sae.W_dec.device)
            s = run.acts["ln_final.hook_scale"].float().to(x.device)  # [n, 1]
            w = _directions(model, prompts, responses, batch_size).to(x.device)  # [n, d]
            D = sae.decoder_directions.float()
            acts, terms, bias, error = [], [], [], []
            for c in range(0, x.shape[0], 64):  # chunks: dense [rows, d_sae] only 64 rows at a time
                xc, sc, wc = x[c : c + 64], s[c : c + 64], w[c : c + 64]
                f = sae.encode(xc).float()
                align = wc @ D.T  # [rows, d_sae]: d_i · w per sequence
                if alignment is None and not is_gated(model):
                    alignment = align[0].cpu()
                acts.append(_to_sparse(f.cpu()))
                terms.append(_to_sparse((f * align / sc).cpu()))
                bias.append((wc @ sae.b_dec.float()) / sc[:, 0])
                error.append(((xc - sae.decode(f).float()) * wc).sum(-1) / sc[:, 0])
            out["acts"][side] = torch.cat(acts).coalesce()
            out["terms"][side] = torch.cat(terms).coalesce()
            out["sae_bias"][side] = torch.cat(bias).cpu()
            out["error"][side] = torch.cat(error).cpu()
            out["lens"][side] = ((x * w).sum(-1) / s[:, 0]).cpu()
            out["scale"][side] = s[:, 0].cpu()
            out["rewards"][side] = run.rewards.float().cpu()
    return FeatureAttribution(
        hook_name=site,
        pair_ids=[p.id if p.id is not None else str(i) for i, p in enumerate(pairs)],
        alignment=alignment,
        **out,
    )


# ---------------------------------------------------------------------------------------------- ablation
@dataclass
class FeatureAblation:
    """For each pair, side and feature: the attribution f_i (d_i·w)/s and the causal effect of removing
    f_i d_i at the site, effect = reward(clean) − reward(ablated) (same sign convention, so a perfectly
    linear model gives effect == attribution). side "gap" = chosen − rejected."""

    hook_name: str
    positions: str
    features: List[int]
    frame: Any  # pandas DataFrame: pair, side, feature, activation, attribution, effect

    def to_frame(self):
        return self.frame.copy()

    def correlation(self, side: str = "gap", method: str = "spearman") -> float:
        """Rank (or Pearson) correlation between attribution and effect over (pair, feature) rows."""
        rows = self.frame[self.frame["side"] == side]
        if len(rows) < 3:
            return float("nan")
        fn = spearman_rows if method == "spearman" else pearson_rows
        return float(fn(rows["attribution"].to_numpy()[None], rows["effect"].to_numpy()[None])[0])

    def summary(self):
        """One row per side: n (pair, feature) rows, Spearman and Pearson r of attribution vs effect, max
        |diff|."""
        import pandas as pd

        return pd.DataFrame(
            [
                {
                    "side": side,
                    "n_rows": int((self.frame["side"] == side).sum()),
                    "spearman": self.correlation(side),
                    "pearson": self.correlation(side, "pearson"),
                    "max_abs_difference": self.max_abs_difference(side),
                }
                for side in dict.fromkeys(self.frame["side"])
            ]
        )

    def max_abs_difference(self, side: str = "gap") -> float:
        rows = self.frame[self.frame["side"] == side]
        return float((rows["attribution"] - rows["effect"]).abs().max())

    def plot(self, side: str = "gap", ax=None):
        """Scatter of attribution vs ablation effect, with the y = x line."""
        rows = self.frame[self.frame["side"] == side]
        created = ax is None
        fig, ax = figure_axes(ax, (4.8, 4.2))
        ax.scatter(rows["attribution"], rows["effect"], s=12, alpha=0.7)
        lo = float(min(rows["attribution"].min(), rows["effect"].min())) if len(rows) else -1.0
        hi = float(max(rows["attribution"].max(), rows["effect"].max())) if len(rows) else 1.0
        ax.plot([lo, hi], [lo, hi], color="grey", lw=0.8, ls="--")
        ax.set_xlabel("attribution  f_i (d_i·w)/s")
        ax.set_ylabel("ablation effect  r − r(ablated)")
        ax.set_title(f"{self.hook_name} ({side}): Spearman ρ = {self.correlation(side):.2f}")
        return finish(fig, created)


@checked_arguments(counts={"n_features": 1, "batch_size": 1})
@torch.no_grad()
def feature_ablation(
    model,
    sae,
    pairs: Union[PreferencePair, Sequence[PreferencePair], str],
    *,
    features: Optional[Sequence[int]] = None,
    n_features: int = 8,
    attribution: Optional[FeatureAttribution] = None,
    hook_name: Optional[str] = None,
    positions: str = "readout",
    objective: Union[int, str, None] = None,
    batch_size: int = 8,
    progress: bool = False,
) -> FeatureAblation:
    """Ablate single features (subtract f_i d_i at the SAE's site) and compare the reward change with the
    attribution. `features` defaults to the `n_features` with the largest mean |gap attribution|.
    positions: "readout" removes the feature where the reward is read; "all" at every token where it fires.
    Cost: one forward per (pair, side, feature) row, batched `batch_size` rows at a time."""
    import pandas as pd
    from tqdm.auto import tqdm

    if positions not in ("readout", "all"):
        raise ValueError(f"positions must be 'readout' or 'all', got {positions!r}")
    pairs = as_pairs(pairs)
    with read_objective(model, objective):
        site = _sae_site(model, sae, hook_name)
        if attribution is None:
            attribution = feature_attribution(model, sae, pairs, hook_name=site, batch_size=batch_size)
        if features is None:
            features = attribution.top_features(n_features)["feature"].astype(int).tolist()
        features = [int(i) for i in features]
        bad = [i for i in features if not 0 <= i < sae.cfg.d_sae]
        if bad:
            raise ValueError(f"features {bad} out of range: the SAE has d_sae={sae.cfg.d_sae}")
        D = sae.decoder_directions
        rows = []
        effects: Dict[str, torch.Tensor] = {}
        prompts = [p.prompt for p in pairs]
        nF = len(features)
        feat_t = torch.tensor(features, device=D.device)
        for side in SIDES:
            responses = [getattr(p, side) for p in pairs]
            clean = attribution.rewards[side]
            eff = torch.zeros(len(pairs), nF)
            bar = tqdm(range(len(pairs)), desc=f"ablation ({side})", leave=False, disable=not progress)
            per_forward = max(1, batch_size // max(1, nF))
            for start in range(0, len(pairs), per_forward):
                sl = slice(start, min(len(pairs), start + per_forward))
                tok = tokenize(model, prompts[sl], responses[sl])
                b = tok.input_ids.shape[0]
                ids = tok.input_ids.repeat_interleave(nF, 0)
                mask = tok.attention_mask.repeat_interleave(nF, 0)
                readout = tok.readout.repeat_interleave(nF, 0)
                which = feat_t.repeat(b)  # the feature each row ablates

                def ablate(act: torch.Tensor, hook) -> torch.Tensor:
                    rows_ = torch.arange(act.shape[0], device=act.device)
                    d = D[which].to(act.dtype)  # [rows, d]
                    if positions == "readout":
                        x = act[rows_, readout.to(act.device)]
                        a = sae.encode(x)[rows_, which].to(act.dtype)
                        act = act.clone()
                        act[rows_, readout.to(act.device)] = x - a[:, None] * d
                        return act
                    f = sae.encode(act)  # [rows, pos, d_sae]
                    a = f[rows_, :, which].to(act.dtype) * mask.to(act.device)  # [rows, pos]
                    return act - a[..., None] * d[:, None, :]

                ablated = model.run_with_hooks(
                    ids, mask, readout_positions=readout, fwd_hooks=[(site, ablate)]
                )
                eff[sl] = (clean[sl].repeat_interleave(nF) - ablated.float().cpu()).reshape(b, nF)
                bar.update(b)
            bar.close()
            effects[side] = eff
        terms = {side: attribution.dense_terms(side)[:, features] for side in SIDES}
        acts = {side: attribution.acts[side].to_dense()[:, features] for side in SIDES}
        terms["gap"] = terms["chosen"] - terms["rejected"]
        effects["gap"] = effects["chosen"] - effects["rejected"]
        acts["gap"] = acts["chosen"] - acts["rejected"]
        for side in ("chosen", "rejected", "gap"):
            for p, pid in enumerate(attribution.pair_ids):
                for j, i in enumerate(features):
                    rows.append(
                        (
                            pid,
                            side,
                            i,
                            float(acts[side][p, j]),
                            float(terms[side][p, j]),
                            float(effects[side][p, j]),
                        )
                    )
    frame = pd.DataFrame(rows, columns=["pair", "side", "feature", "activation", "attribution", "effect"])
    return FeatureAblation(hook_name=site, positions=positions, features=features, frame=frame)
