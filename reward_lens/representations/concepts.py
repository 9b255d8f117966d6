"""Concept vectors from contrast sets, their alignment with the reward direction, and their causal
dose-response on the reward.

A contrast set is a list of `ContrastPair(prompt, positive, negative)`: two responses to one prompt that
differ (as far as possible) only in a concept, e.g. agreeing with the user's stated belief vs not. The
concept vector at layer l is read from the residual `blocks.{l}.hook_resid_post` at each response's
readout position (where the reward is read):

  * `method="mean_diff"`: v_l = mean(positive) − mean(negative);
  * `method="probe"`: the weight of an L2-regularised logistic regression positive-vs-negative.

`cosine` compares v_l with the norm-aware reward direction w (`model.reward_direction`, which acts on
resid / ln_final scale: the final norm's weight is inside w). For ArmoRM the gated score has a
prompt-dependent direction; `cosine` then uses its mean over the set's prompts and `objective_cosines`
gives each objective's.

`dose_response` adds α·ρ·v̂_l to the residual at layer l (ρ the median residual norm at the readout over
the evaluated items, so α is in units of a typical residual) for α on a grid, and fits reward ≈ a + b·α
to the mean over items: slope b (reward per typical-norm step), R² (how linear). For ArmoRM the slope is
also reported per objective (objective rewards read at `reward_head.hook_pooled`).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple, Union

import torch
from jaxtyping import Float

from reward_lens.core.readout import batches, readout_run, tokenize
from reward_lens.model.heads.base import read_objective
from reward_lens.model.hooks import act_name
from reward_lens.model.validation import check_model
from reward_lens.plotting import figure_axes, finish

CONTRAST_SETS_DIR = Path(__file__).resolve().parents[1] / "data" / "contrast_sets"
CONTRAST_SET_ALIASES = {"sycophancy": "agreement", "length": "verbosity", "hedging": "confidence"}
RESID_HOOKS = ("resid_pre", "resid_mid", "resid_post")


@dataclass(frozen=True)
class ContrastPair:
    """One prompt with a response that expresses a concept (`positive`) and one that does not (`negative`)."""

    prompt: str
    positive: str
    negative: str
    concept: Optional[str] = None
    id: Optional[str] = None


# ---------------------------------------------------------------------------------------------- data
def list_contrast_sets() -> List[str]:
    """Names of the bundled contrast sets: agreement (sycophancy: agreeing with the user's stated belief),
    confidence (assertive vs hedged), formatting (markdown vs plain prose), refusal (refusing a benign
    request vs answering it), verbosity (padded vs concise). Each row: prompt, positive (shows the concept),
    negative (the same content without it); ≥ 20 natural-language pairs per set."""
    return sorted(p.stem for p in CONTRAST_SETS_DIR.glob("*.jsonl"))


def load_contrast_set(name_or_path: Union[str, Path]) -> List[ContrastPair]:
    """A bundled set by name (see `list_contrast_sets`) or a .jsonl file with prompt, positive, negative."""
    path = Path(name_or_path)
    if not path.suffix and not path.exists():
        name = CONTRAST_SET_ALIASES.get(str(name_or_path), str(name_or_path))
        path = CONTRAST_SETS_DIR / f"{name}.jsonl"
        if not path.exists():
            raise ValueError(
                f"no bundled contrast set {str(name_or_path)!r}; bundled: {', '.join(list_contrast_sets())}"
            )
    if not path.exists():
        raise FileNotFoundError(f"no contrast-set file at {str(path)!r}")
    items = []
    for i, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        row = json.loads(line)
        missing = [c for c in ("prompt", "positive", "negative") if c not in row]
        if missing:
            raise ValueError(
                f"{path} line {i + 1} lacks {missing}; contrast sets need prompt, positive, negative"
            )
        items.append(
            ContrastPair(
                row["prompt"],
                row["positive"],
                row["negative"],
                row.get("concept", path.stem),
                str(row.get("id", i)),
            )
        )
    if not items:
        raise ValueError(f"{path} holds no contrast pairs")
    return items


def _as_contrast(contrast: Any) -> Tuple[str, List[ContrastPair]]:
    if isinstance(contrast, (str, Path)):
        items = load_contrast_set(contrast)
        return items[0].concept or Path(str(contrast)).stem, items
    if not hasattr(contrast, "__iter__") or isinstance(contrast, (bytes, dict)):
        raise TypeError(
            f"the contrast set is {type(contrast).__name__} {contrast!r:.40}; give a bundled set name "
            "(e.g. 'verbosity'), a .jsonl path, or a list of ContrastPair(prompt, positive, negative)"
        )
    items = list(contrast)
    if not items:
        raise ValueError("the contrast set is empty; pass ContrastPairs or a bundled set name")
    converted = []
    for it in items:
        if isinstance(it, ContrastPair):
            converted.append(it)
        elif hasattr(it, "chosen") and hasattr(it, "rejected"):  # a PreferencePair: chosen plays positive
            converted.append(
                ContrastPair(
                    it.prompt, it.chosen, it.rejected, getattr(it, "subset", None), getattr(it, "id", None)
                )
            )
        elif isinstance(it, (tuple, list)) and len(it) == 3:
            converted.append(ContrastPair(*map(str, it)))
        else:
            raise ValueError(
                f"cannot read a contrast pair from {type(it).__name__}; use ContrastPair(prompt, "
                "positive, negative)"
            )
    return (converted[0].concept or "concept"), converted


def _responses(items: Any) -> Tuple[List[str], List[str]]:
    """(prompts, responses) for every response of contrast/preference pairs, or a (prompts, responses)
    pair."""
    if isinstance(items, tuple) and len(items) == 2 and all(isinstance(x, (list, tuple)) for x in items):
        return list(items[0]), list(items[1])
    prompts, responses = [], []
    for it in items:
        sides = ("positive", "negative") if hasattr(it, "positive") else ("chosen", "rejected")
        for s in sides:
            prompts.append(it.prompt)
            responses.append(getattr(it, s))
    if not prompts:
        raise ValueError("no items to evaluate; pass ContrastPairs, PreferencePairs or (prompts, responses)")
    return prompts, responses


# ---------------------------------------------------------------------------------------------- directions
def objective_directions(model) -> Optional[Tuple[List[str], torch.Tensor]]:
    """(names, [n_obj, d_model]) norm-aware objective directions of a multi-objective (ArmoRM) head, else
    None."""
    head = model.reward_head
    if not head.n_objectives:
        return None
    dirs = model.through_final_norm(head.objective_directions().detach().float())
    return list(head.objective_names), dirs.float()


def is_gated(model) -> bool:
    """True when the model's output is ArmoRM's gated score (no single reward direction)."""
    return model.reward_head.is_gated


@torch.no_grad()
def mean_reward_direction(
    model, prompts: Sequence[str], responses: Sequence[str], batch_size: int = 8
) -> torch.Tensor:
    """The norm-aware reward direction; for ArmoRM's gated score its mean over the given sequences."""
    if not is_gated(model):
        return model.reward_direction.detach().float()
    total, n = None, 0
    for sl in batches(len(prompts), batch_size):
        tok = tokenize(model, prompts[sl], responses[sl])
        d = model.reward_direction_for(tok.input_ids, tok.attention_mask).detach().float().sum(0)
        total = d if total is None else total + d
        n += sl.stop - sl.start
    return total / n


# Within the block an ArmoRM model reads one objective as its reward (no-op for objective=None): the one
# objective context manager, `read_objective`, under the name this module used.
objective_context = read_objective


# ---------------------------------------------------------------------------------------------- vectors
def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1))


def _logistic_direction(X: torch.Tensor, y: torch.Tensor, l2: float, iters: int = 100) -> torch.Tensor:
    """Weight (in raw activation coordinates) of an L2-regularised logistic regression, fitted by L-BFGS."""
    X = X.double()
    # Centre, and rescale by one global factor only: a per-feature rescaling would tilt the direction.
    mu = X.mean(0)
    sd = (X - mu).pow(2).sum(-1).mean().sqrt().clamp(min=1e-12) / X.shape[1] ** 0.5
    Z = (X - mu) / sd
    w = torch.zeros(Z.shape[1], dtype=torch.float64, requires_grad=True)
    b = torch.zeros((), dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=iters, line_search_fn="strong_wolfe")
    target = y.double()

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(Z @ w + b, target) + l2 * w.pow(2).sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)
    return (w.detach() / sd).float()


@dataclass
class ConceptVector:
    """Concept directions per layer, read at the readout position; see the module docstring.

    vectors: [n_layers, d_model] raw directions (mean_diff: in residual units, so its norm is the concept's
    size); cosine: [n_layers] cos(v_l, reward direction); accuracy: [n_layers] fraction of held-out pairs
    with v̂_l·(x_pos − x_neg) > 0; typical_norm: [n_layers] median residual norm at the readout.
    """

    name: str
    method: str
    hook_template: str
    layers: List[int]
    vectors: torch.Tensor
    cosine: torch.Tensor
    accuracy: torch.Tensor
    typical_norm: torch.Tensor
    n_train: int
    test_items: List[ContrastPair] = field(default_factory=list)
    objective_names: Optional[List[str]] = None
    objective_cosines: Optional[torch.Tensor] = None  # [n_layers, n_obj] (ArmoRM)

    def _index(self, layer: Optional[int]) -> int:
        if layer is None:
            if len(self.layers) != 1:
                raise ValueError(f"this concept vector covers layers {self.layers}; pass layer=<one of them>")
            return 0
        if layer < 0:
            layer += max(self.layers) + 1 if self.layers else 0
        if layer not in self.layers:
            raise ValueError(
                f"layer {layer} was not computed; this concept vector covers layers {self.layers}"
            )
        return self.layers.index(layer)

    def vector(self, layer: Optional[int] = None) -> Float[torch.Tensor, " d_model"]:
        """The unit concept direction v̂ at `layer`."""
        v = self.vectors[self._index(layer)]
        return v / v.norm()

    def hook_name(self, layer: int) -> str:
        return self.hook_template.format(layer=layer)

    def to_frame(self):
        import pandas as pd

        rows = []
        for i, l in enumerate(self.layers):
            row = {
                "concept": self.name,
                "method": self.method,
                "layer": l,
                "cosine": float(self.cosine[i]),
                "accuracy": float(self.accuracy[i]),
                "norm": float(self.vectors[i].norm()),
                "typical_norm": float(self.typical_norm[i]),
            }
            if self.objective_cosines is not None:
                for j, name in enumerate(self.objective_names or []):
                    row[f"cosine[{name}]"] = float(self.objective_cosines[i, j])
            rows.append(row)
        return pd.DataFrame(rows)

    def summary(self):
        """One row: the layer with the best held-out accuracy, its accuracy and cosine, the largest
        |cosine|."""
        import pandas as pd

        best = int(self.accuracy.argmax())
        return pd.DataFrame(
            [
                {
                    "concept": self.name,
                    "method": self.method,
                    "n_layers": len(self.layers),
                    "n_train": self.n_train,
                    "best_layer": self.layers[best],
                    "best_accuracy": float(self.accuracy[best]),
                    "cosine_at_best": float(self.cosine[best]),
                    "max_abs_cosine": float(self.cosine.abs().max()),
                }
            ]
        )

    def plot(self, ax=None):
        """Cosine with the reward direction and held-out accuracy per layer."""
        created = ax is None
        fig, ax = figure_axes(ax, (6.5, 3.2))
        ax.plot(self.layers, self.cosine.numpy(), marker="o", label="cos(v, w_r)")
        ax.plot(self.layers, self.accuracy.numpy(), marker="s", ls="--", label="held-out accuracy")
        ax.axhline(0, color="grey", lw=0.5)
        ax.set_xlabel("layer")
        ax.set_ylim(-1.05, 1.05)
        ax.set_title(f"concept '{self.name}' ({self.method})")
        ax.legend(loc="best", fontsize=8)
        return finish(fig, created)


@torch.no_grad()
def concept_vector(
    model,
    contrast: Any,
    *,
    layers: Optional[Sequence[int]] = None,
    method: str = "mean_diff",
    hook: str = "resid_post",
    test_fraction: float = 0.25,
    l2: float = 1e-3,
    seed: int = 0,
    batch_size: int = 8,
    progress: bool = False,
) -> ConceptVector:
    """Concept vectors per layer from a contrast set (bundled name, .jsonl path, or ContrastPairs).

    A `test_fraction` of the pairs (shuffled with `seed`) is held out for `accuracy` and kept as
    `test_items` (the default probes of `dose_response` / `edit_reward`).
    """
    check_model(model, "concept_vector")
    if method not in ("mean_diff", "probe"):
        raise ValueError(f"method must be 'mean_diff' or 'probe', got {method!r}")
    if hook not in RESID_HOOKS:
        raise ValueError(f"hook must be one of {RESID_HOOKS}, got {hook!r}")
    name, items = _as_contrast(contrast)
    n_layers = model.cfg.n_layers
    layers = list(range(n_layers)) if layers is None else [l + n_layers if l < 0 else l for l in layers]
    bad = [l for l in layers if not 0 <= l < n_layers]
    if bad:
        raise ValueError(f"layers {bad} out of range: the model has {n_layers} layers")
    if not 0.0 <= test_fraction < 1.0:
        raise ValueError(
            f"test_fraction must be in [0, 1) (the rest trains the vector), got {test_fraction!r}"
        )
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    n_test = int(round(len(items) * test_fraction)) if len(items) >= 4 else 0
    test_idx, train_idx = order[:n_test], order[n_test:]
    if len(train_idx) < 2:
        raise ValueError(
            f"got {len(items)} contrast pairs; need at least 2 for training (and more to hold some out)"
        )
    template = "blocks.{layer}.hook_" + hook
    names = [template.format(layer=l) for l in layers]
    prompts = [it.prompt for it in items]
    pos = readout_run(
        model,
        prompts,
        [it.positive for it in items],
        names,
        batch_size=batch_size,
        progress="concept +" if progress else False,
    )
    neg = readout_run(
        model,
        prompts,
        [it.negative for it in items],
        names,
        batch_size=batch_size,
        progress="concept -" if progress else False,
    )
    gated = is_gated(model)
    w = (
        mean_reward_direction(model, prompts, [it.positive for it in items], batch_size)
        if gated
        else model.reward_direction.detach().float()
    )
    objectives = objective_directions(model)
    vectors, cosines, accs, norms, obj_cos = [], [], [], [], []
    tr, te = torch.tensor(train_idx), torch.tensor(test_idx, dtype=torch.long)
    for hook_name in names:
        xp, xn = pos.acts[hook_name].float(), neg.acts[hook_name].float()
        if method == "mean_diff":
            v = xp[tr].mean(0) - xn[tr].mean(0)
        else:
            X = torch.cat([xp[tr], xn[tr]])
            y = torch.cat([torch.ones(len(tr)), torch.zeros(len(tr))])
            v = _logistic_direction(X, y, l2)
        v_hat = v / v.norm().clamp(min=1e-30)
        eval_idx = te if n_test else tr
        accs.append(float(((xp[eval_idx] - xn[eval_idx]) @ v_hat > 0).float().mean()))
        vectors.append(v)
        cosines.append(_cos(v, w))
        norms.append(float(torch.cat([xp, xn]).norm(dim=-1).median()))
        if objectives is not None:
            obj_cos.append(
                torch.nn.functional.cosine_similarity(
                    v[None].double(), objectives[1].double(), dim=-1
                ).float()
            )
    return ConceptVector(
        name=name,
        method=method,
        hook_template=template,
        layers=layers,
        vectors=torch.stack(vectors),
        cosine=torch.tensor(cosines),
        accuracy=torch.tensor(accs),
        typical_norm=torch.tensor(norms),
        n_train=len(train_idx),
        test_items=[items[i] for i in test_idx],
        objective_names=objectives[0] if objectives is not None else None,
        objective_cosines=torch.stack(obj_cos) if objectives is not None else None,
    )


# ---------------------------------------------------------------------------------------------- causal
def _fit(alphas: torch.Tensor, y: torch.Tensor) -> Tuple[float, float, float]:
    """Least-squares y ≈ a + b·α: (slope b, intercept a, R²)."""
    a, y = alphas.double(), y.double()
    am, ym = a.mean(), y.mean()
    sxx = ((a - am) ** 2).sum()
    slope = ((a - am) * (y - ym)).sum() / sxx
    intercept = ym - slope * am
    ss_res = ((y - intercept - slope * a) ** 2).sum()
    ss_tot = ((y - ym) ** 2).sum()
    # R² needs a varying response and more points than the line's two parameters; otherwise it is undefined.
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 and a.unique().numel() > 2 else torch.tensor(float("nan"))
    return float(slope), float(intercept), float(r2)


@dataclass
class DoseResponse:
    """Rewards after adding α·scale·v̂ at `hook_name`, per item and α; fit on the mean over items.

    rewards: [n_rows, n_alpha], one row per evaluated response (for pairs: each pair's positive/chosen,
    then its negative/rejected), the model's output (reward, or ArmoRM's gated score / set objective);
    objectives: [n_rows, n_alpha, n_obj] for ArmoRM. slope is in reward per α (α in units of `scale`).
    """

    concept: str
    hook_name: str
    alphas: torch.Tensor
    scale: float
    positions: str
    rewards: torch.Tensor
    slope: float
    intercept: float
    r2: float
    item_slopes: torch.Tensor
    objective_names: Optional[List[str]] = None
    objectives: Optional[torch.Tensor] = None

    def objective_fits(self):
        """Per objective: slope, intercept, R² of the mean objective reward vs α (ArmoRM; else empty)."""
        import pandas as pd

        if self.objectives is None:
            return pd.DataFrame(columns=["objective", "slope", "intercept", "r2"])
        rows = []
        for j, name in enumerate(self.objective_names):
            s, i, r2 = _fit(self.alphas, self.objectives[:, :, j].mean(0))
            rows.append({"objective": name, "slope": s, "intercept": i, "r2": r2})
        return pd.DataFrame(rows)

    def to_frame(self):
        import pandas as pd

        n_items, n_alpha = self.rewards.shape
        frame = pd.DataFrame(
            {
                "item": torch.arange(n_items).repeat_interleave(n_alpha).numpy(),
                "alpha": self.alphas.repeat(n_items).numpy(),
                "reward": self.rewards.reshape(-1).numpy(),
            }
        )
        frame.insert(0, "concept", self.concept)
        frame.insert(1, "hook", self.hook_name)
        return frame

    def summary(self):
        """One row: the fit of the mean reward against α (slope, intercept, R²) and the spread of item
        slopes."""
        import pandas as pd

        return pd.DataFrame(
            [
                {
                    "concept": self.concept,
                    "hook": self.hook_name,
                    "n_items": self.rewards.shape[0],
                    "n_alphas": self.rewards.shape[1],
                    "scale": self.scale,
                    "slope": self.slope,
                    "intercept": self.intercept,
                    "r2": self.r2,
                    "item_slope_median": float(self.item_slopes.median()),
                    "frac_items_positive_slope": float((self.item_slopes > 0).float().mean()),
                }
            ]
        )

    def plot(self, ax=None):
        """Mean reward vs α with the 10–90% band over items and the linear fit."""
        created = ax is None
        fig, ax = figure_axes(ax, (5.5, 3.6))
        a = self.alphas.numpy()
        mean = self.rewards.mean(0).numpy()
        lo, hi = (
            torch.quantile(self.rewards, 0.1, dim=0).numpy(),
            torch.quantile(self.rewards, 0.9, dim=0).numpy(),
        )
        ax.fill_between(a, lo, hi, alpha=0.2, label="items 10–90%")
        ax.plot(a, mean, marker="o", label="mean reward")
        ax.plot(
            a,
            self.intercept + self.slope * a,
            ls="--",
            color="k",
            label=f"fit: slope {self.slope:.3g}, R² {self.r2:.3f}",
        )
        ax.set_xlabel(f"α  (added α·{self.scale:.3g}·v̂ at {self.hook_name})")
        ax.set_ylabel("reward")
        ax.set_title(f"dose-response: {self.concept}")
        ax.legend(fontsize=8)
        return finish(fig, created)


def _steered_rewards(
    model, tok, hook_name: str, shift: torch.Tensor, positions: str, n_alpha: int, track_objectives: bool
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Rewards [b, n_alpha] (and ArmoRM objectives [b, n_alpha, n_obj]) of one tokenized batch, each sequence
    repeated n_alpha times with `shift` [b·n_alpha, d] added at `hook_name` (every position or the
    readout)."""
    b = tok.input_ids.shape[0]
    ids = tok.input_ids.repeat_interleave(n_alpha, 0)
    mask = tok.attention_mask.repeat_interleave(n_alpha, 0)
    readout = tok.readout.repeat_interleave(n_alpha, 0)

    def add(resid: torch.Tensor, hook) -> torch.Tensor:
        if positions == "all":
            return resid + shift[:, None, :]
        resid = resid.clone()
        rows = torch.arange(resid.shape[0], device=resid.device)
        resid[rows, readout.to(resid.device)] += shift
        return resid

    grabbed = {}

    def grab(pooled: torch.Tensor, hook) -> None:
        grabbed["objectives"] = pooled.detach()

    hooks = [(hook_name, add)] + ([("reward_head.hook_pooled", grab)] if track_objectives else [])
    r = model.run_with_hooks(ids, mask, readout_positions=readout, fwd_hooks=hooks)
    if r.dim() != 1:
        raise ValueError(
            f"dose_response needs one reward per sequence; this model outputs {tuple(r.shape[1:])} per "
            "sequence"
        )
    objs = grabbed["objectives"].float().reshape(b, n_alpha, -1) if track_objectives else None
    return r.detach().float().reshape(b, n_alpha), objs


@torch.no_grad()
def dose_response(
    model,
    concept: Union[ConceptVector, torch.Tensor],
    items: Any = None,
    *,
    layer: Optional[int] = None,
    alphas: Optional[Sequence[float]] = None,
    positions: str = "all",
    scale: Optional[float] = None,
    objective: Union[int, str, None] = None,
    batch_size: int = 8,
    progress: bool = False,
) -> DoseResponse:
    """Causal dose-response of the reward to a concept direction added at layer `layer`.

    items: held-out ContrastPairs / PreferencePairs (every response is evaluated) or (prompts, responses);
    default: the concept vector's held-out `test_items`. alphas default to 11 points in [−0.25, 0.25].
    positions: "all" adds the vector at every token (steering; for ArmoRM the gate's input moves too),
    "readout" only where the reward is read.
    scale (ρ) defaults to the median residual norm at the readout over the items at that layer.
    `objective` (ArmoRM) makes one objective the reward; otherwise ArmoRM's gated score is the reward and
    every objective's response is recorded too.
    """
    check_model(model, "dose_response")
    if positions not in ("all", "readout"):
        raise ValueError(f"positions must be 'all' or 'readout', got {positions!r}")
    if isinstance(concept, ConceptVector):
        idx = concept._index(layer)
        layer = concept.layers[idx]
        v_hat = concept.vector(layer)
        hook_name, name = concept.hook_name(layer), concept.name
        if items is None:
            items = concept.test_items
    else:
        if layer is None:
            raise ValueError(
                "with a raw direction, pass layer=<l> (the vector is added at blocks.l.hook_resid_post)"
            )
        if concept.shape != (model.cfg.d_model,):
            raise ValueError(
                f"the direction must have shape [d_model={model.cfg.d_model}], got {tuple(concept.shape)}"
            )
        v_hat = concept.float() / concept.float().norm()
        hook_name, name = act_name("resid_post", layer), "direction"
    if items is None or (not isinstance(items, tuple) and len(items) == 0):
        raise ValueError("no held-out items to evaluate the dose-response on; pass items=")
    prompts, responses = _responses(items)
    alphas_t = (
        torch.linspace(-0.25, 0.25, 11) if alphas is None else torch.tensor(list(alphas), dtype=torch.float32)
    )
    if alphas_t.numel() < 2 or alphas_t.unique().numel() < 2:
        raise ValueError("alphas needs at least two distinct values")
    with objective_context(model, objective):
        if scale is None:
            clean = readout_run(model, prompts, responses, [hook_name], batch_size=batch_size)
            scale = float(clean.acts[hook_name].float().norm(dim=-1).median())
        finite_v = bool(torch.isfinite(v_hat).all()) and bool(v_hat.any())
        if not (math.isfinite(scale) and scale != 0) or not finite_v:
            raise ValueError(
                f"scale={scale} and a direction of norm {float(v_hat.norm()):.3g} add no finite "
                "intervention; give a non-zero, finite scale and direction"
            )
        n_alpha = alphas_t.numel()
        v = v_hat.to(device=model.cfg.device, dtype=model.cfg.dtype)
        track_objectives = (
            bool(model.reward_head.n_objectives) and "reward_head.hook_pooled" in model.hook_dict
        )
        out_rewards, out_objs = [], []
        for sl in batches(len(prompts), max(1, batch_size), "dose-response" if progress else False):
            tok = tokenize(model, prompts[sl], responses[sl])
            shift = (alphas_t.repeat(tok.input_ids.shape[0]).to(v.device, v.dtype) * scale)[:, None] * v
            r, objs = _steered_rewards(model, tok, hook_name, shift, positions, n_alpha, track_objectives)
            out_rewards.append(r)
            if track_objectives:
                out_objs.append(objs)
    rewards = torch.cat(out_rewards)
    slope, intercept, r2 = _fit(alphas_t, rewards.mean(0))
    item_slopes = torch.tensor([_fit(alphas_t, row)[0] for row in rewards])
    objs = objective_directions(model)
    return DoseResponse(
        concept=name,
        hook_name=hook_name,
        alphas=alphas_t,
        scale=float(scale),
        positions=positions,
        rewards=rewards,
        slope=slope,
        intercept=intercept,
        r2=r2,
        item_slopes=item_slopes,
        objective_names=objs[0] if (objs is not None and out_objs) else None,
        objectives=torch.cat(out_objs) if out_objs else None,
    )


@torch.no_grad()
def concept_effect(
    model, items: Any, *, batch_size: int = 8, objective: Union[int, str, None] = None
) -> torch.Tensor:
    """Per contrast pair: reward(positive) − reward(negative) (the concept's behavioural effect), [n]."""
    _, items = _as_contrast(items)
    prompts = [it.prompt for it in items]
    with objective_context(model, objective):
        pos = readout_run(model, prompts, [it.positive for it in items], batch_size=batch_size).rewards
        neg = readout_run(model, prompts, [it.negative for it in items], batch_size=batch_size).rewards
    return (pos - neg).float()
