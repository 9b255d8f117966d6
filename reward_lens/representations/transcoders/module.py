"""Per-layer skip transcoders of a reward model: each maps its MLP's input (`blocks.{l}.ln2.hook_normalized`)
to the MLP's output (`blocks.{l}.hook_mlp_out`) through sparse features,

    pre = x @ W_enc.T + b_enc                 [..., d_tc]
    f   = activate(pre)                       the family's sparse rule (`families`): TopK, BatchTopK, JumpReLU
    tc(x) = f @ W_dec + b_dec + x @ W_skip.T  decode(f) plus the linear skip

so an MLP's output is  sum_i f_i W_dec[i] + b_dec + x W_skip.T + error, the split the feature attribution
graph (`reward_lens.instruments.circuits.feature_graph`) builds on.

Disk format: a directory with `transcoders.json` (family, sizes, layers, hook names, training settings and
metrics) and `transcoders.safetensors` (`{layer}.W_enc`, `{layer}.b_enc`, `{layer}.W_dec`, `{layer}.b_dec`,
`{layer}.W_skip`, `{layer}.threshold`). circuit-tracer's and SAELens's formats: `formats`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Union

import torch
import torch.nn as nn

from reward_lens.core.batching import first_token
from reward_lens.model.hooks import mlp_input_name, mlp_output_name
from reward_lens.model.validation import checked_arguments
from reward_lens.representations.transcoders import formats
from reward_lens.representations.transcoders.families import family

CONFIG_FILENAME = "transcoders.json"
WEIGHTS_FILENAME = "transcoders.safetensors"
PARAMS = ("W_enc", "b_enc", "W_dec", "b_dec", "W_skip", "threshold")


input_hook, output_hook = mlp_input_name, mlp_output_name  # blocks.{l}.ln2.hook_normalized, hook_mlp_out


class Transcoder(nn.Module):
    """One layer's skip transcoder: `W_enc [d_tc, d_model]`, `b_enc [d_tc]`, `W_dec [d_tc, d_model]`,
    `b_dec [d_model]`, `W_skip [d_model, d_model]` (None without a skip), `threshold [d_tc]` (the inference
    threshold of BatchTopK and JumpReLU; unused by TopK)."""

    def __init__(self, d_model: int, d_tc: int, k: int, kind: str = "topk", skip: bool = True):
        super().__init__()
        self.family = family(kind)
        self.kind, self.k, self.d_model, self.d_tc = kind, int(k), int(d_model), int(d_tc)
        self.W_enc = nn.Parameter(torch.zeros(d_tc, d_model))
        self.b_enc = nn.Parameter(torch.zeros(d_tc))
        self.W_dec = nn.Parameter(torch.zeros(d_tc, d_model))
        self.b_dec = nn.Parameter(torch.zeros(d_model))
        self.W_skip = nn.Parameter(torch.zeros(d_model, d_model)) if skip else None
        self.threshold = nn.Parameter(torch.zeros(d_tc))
        self.requires_grad_(False)

    def pre(self, x: torch.Tensor) -> torch.Tensor:
        """The features' pre-activations [..., d_tc]."""
        self._check_width(x)
        return x.to(self.W_enc.dtype) @ self.W_enc.T + self.b_enc

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Feature activations [..., d_tc]: non-negative, sparse."""
        return self.family.activate(self.pre(x), self.k, self.threshold)

    def decode(self, f: torch.Tensor) -> torch.Tensor:
        """f @ W_dec + b_dec, without the skip."""
        return f.to(self.W_dec.dtype) @ self.W_dec + self.b_dec

    def skip(self, x: torch.Tensor) -> torch.Tensor:
        """The linear skip x @ W_skip.T (zeros without one)."""
        if self.W_skip is None:
            return torch.zeros_like(x, dtype=self.W_dec.dtype)
        return x.to(self.W_skip.dtype) @ self.W_skip.T

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decode(self.encode(x)) + self.skip(x)

    def _check_width(self, x: torch.Tensor) -> None:
        if x.shape[-1] != self.d_model:
            raise ValueError(
                f"activation width {x.shape[-1]} does not match this transcoder's d_model={self.d_model}; "
                "use transcoders trained on this model"
            )

    def __repr__(self) -> str:
        skip = "skip" if self.W_skip is not None else "no skip"
        return f"Transcoder({self.kind}, d_model={self.d_model}, d_tc={self.d_tc}, k={self.k}, {skip})"


@dataclass
class TranscoderMetrics:
    """How well a set of transcoders stands in for the MLPs on held-out text: per layer FVU (fraction of
    the MLP output's variance unexplained), L0 (active features per token) and dead fraction (features
    that never fired on it); and, with every MLP replaced and no error terms, the reward's Pearson
    correlation with the original and the share of chosen/rejected decisions kept (NaN when not measured)."""

    layers: Any  # pandas DataFrame: layer, fvu, l0, dead_fraction, n_tokens
    reward_pearson: float = float("nan")
    decision_agreement: float = float("nan")
    n_pairs: int = 0
    history: Optional[Any] = None  # pandas DataFrame of training curves (step, layer, fvu, aux_loss, dead)

    def to_frame(self):
        """The per-layer rows (layer, fvu, l0, dead_fraction, n_tokens)."""
        return self.layers.copy()

    def summary(self):
        """One row: mean and worst FVU, mean L0, worst dead fraction, reward Pearson, decisions kept."""
        import pandas as pd

        f = self.layers
        return pd.DataFrame(
            [
                {
                    "mean_fvu": float(f.fvu.mean()),
                    "max_fvu": float(f.fvu.max()),
                    "mean_l0": float(f.l0.mean()),
                    "max_dead_fraction": float(f.dead_fraction.max()),
                    "reward_pearson": self.reward_pearson,
                    "decision_agreement": self.decision_agreement,
                    "n_pairs": self.n_pairs,
                }
            ]
        )

    def plot(self, ax=None):
        """FVU per layer (bars), L0 on the title."""
        from reward_lens.plotting import figure_axes, finish

        created = ax is None
        fig, ax = figure_axes(ax, figsize=(5, 3))
        ax.bar(self.layers.layer, self.layers.fvu)
        ax.set_xlabel("layer")
        ax.set_ylabel("FVU (held out)")
        ax.set_title(f"mean L0 {self.layers.l0.mean():.1f} · reward r {self.reward_pearson:.3f}", fontsize=9)
        return finish(fig, created)


@dataclass
class TranscoderSet:
    """The transcoders of a model's layers: `tc[l]` is layer l's `Transcoder`. `config` records the
    family, sizes, model and training settings; `metrics` the held-out evaluation (when known)."""

    transcoders: Dict[int, Transcoder]
    config: Dict[str, Any] = field(default_factory=dict)
    metrics: Optional[TranscoderMetrics] = None

    def __getitem__(self, layer: int) -> Transcoder:
        if layer not in self.transcoders:
            raise KeyError(f"no transcoder for layer {layer}; this set covers layers {self.layers}")
        return self.transcoders[layer]

    def __len__(self) -> int:
        return len(self.transcoders)

    def __iter__(self):
        return iter(self.layers)

    def __contains__(self, layer: int) -> bool:
        return layer in self.transcoders

    @property
    def layers(self) -> List[int]:
        return sorted(self.transcoders)

    @property
    def exclude_first_token(self) -> bool:
        """Trained without each text's first token: that token's MLP outputs stay the model's own (in the
        replacement model) or the error node's (in the feature graph), and no feature is read there."""
        return bool(self.config.get("exclude_first_token", False))

    def to(self, device) -> "TranscoderSet":
        for t in self.transcoders.values():
            t.to(device)
        return self

    @checked_arguments(flags=("every_layer",))
    def check(self, model, every_layer: bool = False) -> None:
        """A clear error when these transcoders do not fit `model` (width, layers; all layers if asked)."""
        cfg = model.cfg
        bad = [l for l in self.layers if not 0 <= l < cfg.n_layers]
        if bad:
            raise ValueError(f"transcoders for layers {bad}, but the model has {cfg.n_layers} layers")
        widths = {t.d_model for t in self.transcoders.values()}
        if widths != {cfg.d_model}:
            raise ValueError(
                f"transcoders of width {sorted(widths)} do not fit this model (d_model={cfg.d_model}); "
                "train them on this model (reward_lens.train_transcoders)"
            )
        missing = sorted(set(range(cfg.n_layers)) - set(self.layers))
        if every_layer and missing:
            raise ValueError(
                f"the feature graph replaces every MLP, but layers {missing} have no transcoder; train "
                "transcoders for all layers"
            )

    def save(self, path: Union[str, Path], format: str = "reward-lens") -> Path:
        """Write the set into the directory `path`: `format="reward-lens"` (transcoders.json +
        transcoders.safetensors), "circuit-tracer" (config.yaml + layer_{l}.safetensors) or "saelens"
        (layer_{l}/cfg.json + sae_weights.safetensors); the last two hold JumpReLU transcoders (`formats`)."""
        from safetensors.torch import save_file

        if format != "reward-lens":
            if format not in formats.WRITERS:
                known = ", ".join(repr(f) for f in ["reward-lens", *formats.WRITERS])
                raise ValueError(f"unknown transcoder format {format!r}; use one of {known}")
            return formats.WRITERS[format](self, path)
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for l, t in self.transcoders.items():
            for name in PARAMS:
                value = getattr(t, name)
                if value is not None:
                    tensors[f"{l}.{name}"] = value.detach().float().cpu().contiguous()
        save_file(tensors, str(path / WEIGHTS_FILENAME))
        first = self.transcoders[self.layers[0]]
        info = dict(self.config)
        info.update(
            family=first.kind,
            d_model=first.d_model,
            d_tc=first.d_tc,
            k=first.k,
            skip=first.W_skip is not None,
            layers=self.layers,
            input_hooks=[input_hook(l) for l in self.layers],
            output_hooks=[output_hook(l) for l in self.layers],
        )
        if self.metrics is not None:
            info["metrics"] = {
                "layers": self.metrics.layers.to_dict(orient="records"),
                "reward_pearson": self.metrics.reward_pearson,
                "decision_agreement": self.metrics.decision_agreement,
                "n_pairs": self.metrics.n_pairs,
            }
        (path / CONFIG_FILENAME).write_text(json.dumps(info, indent=1, default=float) + "\n")
        return path

    def __repr__(self) -> str:
        first = self.transcoders[self.layers[0]] if self.transcoders else None
        return f"TranscoderSet(layers={self.layers}, {first!r})"


def load_transcoders(path: Union[str, Path] = "demo", device: Union[str, torch.device, None] = None):
    """A saved set of transcoders: "demo" for the demo RM's shipped set, "trigger" for the trigger
    organism's (`scripts/train_trigger_transcoders.py`), else a directory written by
    `TranscoderSet.save` / `train_transcoders(..., out=)` / `reward-lens train-transcoders`, or one in
    circuit-tracer's layout or SAELens's transcoder format (read as JumpReLU sets; `formats`)."""
    import pandas as pd
    from safetensors.torch import load_file

    if str(path) == "demo":
        from reward_lens.demo import DEMO_TRANSCODERS_DIR

        path = DEMO_TRANSCODERS_DIR
    elif str(path) == "trigger":
        from reward_lens.demo.organisms import TRIGGER_TRANSCODERS_DIR

        path = TRIGGER_TRANSCODERS_DIR
    path = Path(path)
    cfg_file, weights_file = path / CONFIG_FILENAME, path / WEIGHTS_FILENAME
    if not (cfg_file.exists() and weights_file.exists()):
        for holds, read in formats.READERS:
            if holds(path):
                return _from_layer_weights(*read(path), device)
        raise FileNotFoundError(
            f"{path} holds no transcoders (needs {CONFIG_FILENAME} and {WEIGHTS_FILENAME}, circuit-tracer's "
            "config.yaml + layer_{l}.safetensors, or SAELens's cfg.json + sae_weights.safetensors); train "
            "a set with `reward-lens train-transcoders` or pass 'demo'"
        )
    info = json.loads(cfg_file.read_text())
    tensors = load_file(str(weights_file))
    out: Dict[int, Transcoder] = {}
    for l in info["layers"]:
        t = Transcoder(info["d_model"], info["d_tc"], info["k"], info["family"], skip=info["skip"])
        with torch.no_grad():
            for name in PARAMS:
                if getattr(t, name) is not None:
                    getattr(t, name).copy_(tensors[f"{l}.{name}"])
        out[int(l)] = t.to(device) if device is not None else t
    metrics = None
    if "metrics" in info:
        m = info.pop("metrics")
        metrics = TranscoderMetrics(
            pd.DataFrame(m["layers"]), m["reward_pearson"], m["decision_agreement"], m["n_pairs"]
        )
    return TranscoderSet(out, info, metrics)


def _from_layer_weights(layers: Dict[int, Dict[str, Any]], info: Dict[str, Any], device) -> TranscoderSet:
    """A JumpReLU set from other tools' per-layer weights (`formats.LayerWeights`)."""
    out: Dict[int, Transcoder] = {}
    for l, w in layers.items():
        t = Transcoder(w["d_model"], w["d_tc"], w["k"], "jumprelu", skip=w["skip"])
        with torch.no_grad():
            for name in PARAMS:
                if getattr(t, name) is not None:
                    getattr(t, name).copy_(w[name])
        out[int(l)] = t.to(device) if device is not None else t
    return TranscoderSet(dict(sorted(out.items())), info)


def replacement_hooks(tc: TranscoderSet, layers: Optional[Sequence[int]] = None, tok: Any = None) -> list:
    """Forward hooks that replace each MLP's output by its transcoder's, with no error term (the
    replacement model; attention and norms recomputed as usual). A set trained without the first token
    (`exclude_first_token`) keeps the MLP's own output at each row's first attended token: pass the
    batch's `tok` (Tokenized) when it is left-padded; without it that token is position 0."""
    seen: Dict[int, torch.Tensor] = {}
    out = []
    first = None
    if tc.exclude_first_token and tok is not None:
        first = first_token(tok)

    def own_first(new: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if not tc.exclude_first_token:
            return new
        rows = torch.arange(y.shape[0], device=y.device)
        cols = first.to(y.device) if first is not None else torch.zeros_like(rows)
        new = new.clone()
        new[rows, cols] = y[rows, cols]
        return new

    for l in tc.layers if layers is None else layers:

        def grab(x, hook, l=l):
            seen[l] = x

        def replace(y, hook, l=l):
            return own_first(tc[l](seen.pop(l)).to(y.dtype), y)

        out += [(input_hook(l), grab), (output_hook(l), replace)]
    return out
