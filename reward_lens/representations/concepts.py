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
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple, Union

import torch
from jaxtyping import Float

from reward_lens.core.readout import batches, readout_run, tokenize
from reward_lens.data.pairs import side_texts
from reward_lens.model.frozen import gradients_on
from reward_lens.model.validation import check_model, checked_arguments
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


def as_contrast(contrast: Any) -> Tuple[str, List[ContrastPair]]:
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


def response_texts(items: Any) -> Tuple[List[str], List[str]]:
    """(prompts, responses) for every response of contrast/preference pairs, or a (prompts, responses)
    pair."""
    if isinstance(items, tuple) and len(items) == 2 and all(isinstance(x, (list, tuple)) for x in items):
        return list(items[0]), list(items[1])
    prompts, responses = side_texts(items, "ContrastPairs, PreferencePairs or (prompts, responses)")
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

    with gradients_on("concept_vector"):
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

    def index_of(self, layer: Optional[int]) -> int:
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
        v = self.vectors[self.index_of(layer)]
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
def _checked_layers(n_layers: int, layers: Optional[Sequence[int]]) -> List[int]:
    """The layers asked for (negative ones from the end), each checked against the model's."""
    layers = list(range(n_layers)) if layers is None else [l + n_layers if l < 0 else l for l in layers]
    bad = [l for l in layers if not 0 <= l < n_layers]
    if bad:
        raise ValueError(f"layers {bad} out of range: the model has {n_layers} layers")
    return layers


def _split(n: int, test_fraction: float, seed: int) -> Tuple[List[int], List[int]]:
    """(train, test) indices of n contrast pairs: a `test_fraction` held out after a seeded shuffle."""
    if not 0.0 <= test_fraction < 1.0:
        raise ValueError(
            f"test_fraction must be in [0, 1) (the rest trains the vector), got {test_fraction!r}"
        )
    order = list(range(n))
    random.Random(seed).shuffle(order)
    n_test = int(round(n * test_fraction)) if n >= 4 else 0
    if n - n_test < 2:
        raise ValueError(f"got {n} contrast pairs; need at least 2 for training (and more to hold some out)")
    return order[n_test:], order[:n_test]


@checked_arguments(counts={"seed": 0, "batch_size": 1})
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
    name, items = as_contrast(contrast)
    layers = _checked_layers(model.cfg.n_layers, layers)
    train_idx, test_idx = _split(len(items), test_fraction, seed)
    n_test = len(test_idx)
    template = "blocks.{layer}.hook_" + hook
    names = [template.format(layer=l) for l in layers]
    prompts = [it.prompt for it in items]
    pos, neg = (
        readout_run(
            model,
            prompts,
            [getattr(it, side) for it in items],
            names,
            batch_size=batch_size,
            progress=f"concept {sign}" if progress else False,
        )
        for side, sign in (("positive", "+"), ("negative", "-"))
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
