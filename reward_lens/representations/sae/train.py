"""TopK SAE training on reward-model activations (Gao et al. 2024, "Scaling and evaluating sparse
autoencoders"): TopK activation, decoder rows kept at unit norm (their gradient's radial part removed),
b_dec initialised at the data mean, inputs rescaled to unit mean squared norm per dimension during
training (folded back at the end, so the SAE acts on raw activations), and the AuxK loss: the top `aux_k`
*dead* latents (no firing for `dead_after` tokens) reconstruct the main reconstruction's error."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from reward_lens.core.readout import stream_activations
from reward_lens.data.pairs import side_texts
from reward_lens.model import hooks
from reward_lens.model.frozen import gradients_on
from reward_lens.model.validation import checked_arguments
from reward_lens.representations.sae.module import SAEConfig, SparseAutoencoder, hook_width


def gather_activations(
    model,
    data: Any,
    hook_name: str,
    *,
    positions: str = "all",
    batch_size: int = 8,
    max_tokens: Optional[int] = None,
    progress: Union[bool, str] = False,
) -> torch.Tensor:
    """Activations [n, width] at `hook_name` for texts (pairs, (prompts, responses)) or token ids, on CPU."""
    kwargs: Dict[str, Any] = dict(positions=positions, batch_size=batch_size, progress=progress, device="cpu")
    if isinstance(data, dict):
        if "input_ids" not in data:
            raise ValueError("a token dict needs 'input_ids' (and optionally 'attention_mask')")
        stream = stream_activations(
            model,
            hook_name=hook_name,
            input_ids=data["input_ids"],
            attention_mask=data.get("attention_mask"),
            **kwargs,
        )
    elif isinstance(data, torch.Tensor) and not data.is_floating_point():
        mask = None if model.cfg.pad_token_id is None else (data != model.cfg.pad_token_id).long()
        stream = stream_activations(model, hook_name=hook_name, input_ids=data, attention_mask=mask, **kwargs)
    else:
        if (
            isinstance(data, tuple)
            and len(data) == 2
            and all(isinstance(d, (list, tuple)) for d in data)
            and (not data[0] or isinstance(data[0][0], str))
        ):
            prompts, responses = list(data[0]), list(data[1])
        else:
            prompts, responses = side_texts(
                data,
                "PreferencePairs, ContrastPairs, (prompts, responses), a token dict, or an activation tensor "
                "[n, d_in]",
            )
        stream = stream_activations(model, prompts, responses, hook_name, **kwargs)
    chunks: List[torch.Tensor] = []
    total = 0
    for chunk in stream:
        chunks.append(chunk.float())
        total += chunk.shape[0]
        if max_tokens is not None and total >= max_tokens:
            break
    if not chunks:
        raise ValueError("no activations gathered: the data is empty")
    acts = torch.cat(chunks)
    return acts[:max_tokens] if max_tokens is not None else acts


def topk_losses(
    params: Dict[str, torch.Tensor], x: torch.Tensor, k: int, dead: Optional[torch.Tensor], aux_k: int
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(reconstruction loss, AuxK loss, [d_sae] which latents fired) of a TopK SAE on inputs x scaled so that
    E‖x − μ‖² = d_in (both are
    then FVU-like). AuxK (Gao et al. 2024): the top `aux_k` pre-activations among `dead` latents, un-ReLU'd
    so that latents whose inputs all fall below zero still get a gradient, reconstruct the detached error."""
    d_in = x.shape[-1]
    W_enc, W_dec, b_enc, b_dec = params["W_enc"], params["W_dec"], params["b_enc"], params["b_dec"]
    pre = (x - b_dec) @ W_enc + b_enc
    values, indices = pre.topk(k, dim=-1)
    f = torch.zeros_like(pre).scatter(-1, indices, values.relu())
    err = x - (f @ W_dec + b_dec)
    mse = err.pow(2).sum(-1).mean() / d_in
    aux = torch.zeros((), device=x.device)
    n_dead = 0 if dead is None else int(dead.sum())
    if n_dead:
        ka = min(aux_k, n_dead)
        aux_values, aux_idx = pre.masked_fill(~dead, float("-inf")).topk(ka, dim=-1)
        f_aux = torch.zeros_like(pre).scatter(-1, aux_idx, aux_values)
        aux = (err.detach() - f_aux @ W_dec).pow(2).sum(-1).mean() / d_in
    return mse, aux, (f > 0).any(0).detach()


@dataclass
class _Plan:
    """The optimisation schedule of one training run (defaults resolved)."""

    k: int
    batch_size: int
    total_steps: int
    lr: float
    aux_k: int
    aux_coef: float
    dead_after: int


def _checked_sizes(
    acts: torch.Tensor, d_sae: Optional[int], expansion: int, k: int, val_fraction: float
) -> int:
    """The SAE width (d_sae, or expansion * d_in), every size and the activations checked first."""
    n, d_in = acts.shape
    finite = torch.isfinite(acts).all(-1)
    if not bool(finite.all()):
        raise ValueError(
            f"{int((~finite).sum())} of {n} activation rows hold NaN/inf (first: row "
            f"{int((~finite).nonzero()[0])}); an SAE trained on them is NaN: check the model and inputs"
        )
    if d_sae is not None and (isinstance(d_sae, bool) or int(d_sae) != d_sae or d_sae < 1):
        raise ValueError(
            f"d_sae must be a positive number of latents, got {d_sae!r} (or leave it None: expansion * d_in)"
        )
    if expansion is None or expansion < 1:
        raise ValueError(f"expansion must be >= 1, got {expansion!r}")
    d_sae = int(d_sae if d_sae is not None else expansion * d_in)
    if not 1 <= k <= d_sae:
        raise ValueError(f"k must be in [1, d_sae={d_sae}], got {k}")
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    return d_sae


@checked_arguments(
    counts={
        "d_sae": 1,
        "expansion": 1,
        "k": 1,
        "batch_size": 1,
        "steps": 1,
        "aux_k": 1,
        "dead_after": 1,
        "max_tokens": 1,
        "model_batch_size": 1,
        "seed": 0,
    }
)
def train_sae(
    model=None,
    data: Any = None,
    *,
    hook_name: Optional[str] = None,
    layer: Optional[int] = None,
    positions: str = "all",
    d_sae: Optional[int] = None,
    expansion: int = 8,
    k: int = 32,
    lr: Optional[float] = None,
    batch_size: int = 4096,
    epochs: float = 10.0,
    steps: Optional[int] = None,
    aux_k: Optional[int] = None,
    aux_coef: float = 1.0 / 32,
    dead_after: Optional[int] = None,
    val_fraction: float = 0.1,
    max_tokens: Optional[int] = 2_000_000,
    model_batch_size: int = 8,
    seed: int = 0,
    device: Union[str, torch.device, None] = None,
    progress: bool = True,
) -> SparseAutoencoder:
    """Train a TopK SAE on activations of `model` at `hook_name`; returns it with `.metrics` (held-out
    FVU, L0, dead fraction, training curves).

    data: PreferencePairs or ContrastPairs (every response), `(prompts, responses)`, token ids (a tensor
    or {"input_ids", "attention_mask"}), or a float tensor of activations [n, d_in] (then `model` is
    optional and only checks the width). Activations are streamed from the model once (at every non-pad
    token, or only at readout positions with `positions="readout"`), kept on CPU (at most `max_tokens`
    rows) and shuffled; `epochs` passes over them (or `steps` batches).
    hook_name defaults to `blocks.{layer}.hook_resid_post`, layer to the middle of the model.
    d_sae defaults to `expansion · d_in`; lr to 2e-4 / sqrt(d_sae / 16384) (Gao et al.'s scaling law).
    """
    import pandas as pd

    hook_name, acts = _training_activations(
        model, data, hook_name, layer, positions, max_tokens, model_batch_size, progress
    )
    n, d_in = acts.shape
    d_sae = _checked_sizes(acts, d_sae, expansion, k, val_fraction)
    device = (
        torch.device(device)
        if device is not None
        else (model.cfg.device if model is not None else torch.device("cpu"))
    )
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(n, generator=g)
    n_val = int(round(n * val_fraction)) if n >= 20 else 0
    val, train = acts[perm[:n_val]], acts[perm[n_val:]]
    n_train = train.shape[0]
    batch_size = min(batch_size, n_train)
    plan = _Plan(
        k=k,
        batch_size=batch_size,
        total_steps=int(steps) if steps is not None else max(1, math.ceil(epochs * n_train / batch_size)),
        lr=lr if lr is not None else 2e-4 / math.sqrt(d_sae / 16384),
        aux_k=int(aux_k) if aux_k is not None else max(1, d_in // 2),
        aux_coef=aux_coef,
        dead_after=int(dead_after) if dead_after is not None else min(n_train, 10_000_000),
    )
    # Train on mean-centred-scale-normalised inputs (E‖x − μ‖² = d_in), so lr means the same at any scale.
    X = train.to(device)
    mu = X.mean(0)
    c = math.sqrt(d_in / max(float((X - mu).pow(2).sum(-1).mean()), 1e-30))
    params = _init_params(d_in, d_sae, mu * c, g, device)
    with gradients_on("train_sae"):
        history = _optimise(params, X * c, plan, g, progress)
    cfg = SAEConfig(
        d_in=d_in,
        d_sae=d_sae,
        architecture="topk",
        k=k,
        hook_name=hook_name,
        model_name=getattr(getattr(model, "cfg", None), "model_name", None),
        metadata={"context_size": None, "dataset_path": None},
    )
    sae = SparseAutoencoder(cfg).to(device)
    with torch.no_grad():  # fold the input scale c back: f_raw = f / c, biases / c, rows unchanged
        sae.W_enc.copy_(params["W_enc"])
        sae.W_dec.copy_(params["W_dec"])
        sae.b_enc.copy_(params["b_enc"] / c)
        sae.b_dec.copy_(params["b_dec"] / c)
    sae.training_config = dict(
        hook_name=hook_name,
        positions=positions,
        d_sae=d_sae,
        k=k,
        lr=plan.lr,
        batch_size=batch_size,
        steps=plan.total_steps,
        aux_k=plan.aux_k,
        aux_coef=aux_coef,
        dead_after=plan.dead_after,
        n_train_tokens=n_train,
        n_val_tokens=n_val,
        seed=seed,
    )
    metrics = sae.evaluate(val if n_val else train)
    metrics.history = pd.DataFrame(history)
    sae.metrics = metrics
    return sae


def _training_activations(
    model,
    data: Any,
    hook_name: Optional[str],
    layer: Optional[int],
    positions: str,
    max_tokens: Optional[int],
    model_batch_size: int,
    progress: bool,
) -> Tuple[Optional[str], torch.Tensor]:
    """(hook name, activations [n, d_in] on CPU) with the checks train_sae documents."""
    if model is not None:
        if hook_name is None:
            layer = model.cfg.n_layers // 2 if layer is None else layer
            if not 0 <= layer < model.cfg.n_layers:
                raise ValueError(f"layer {layer} out of range: the model has {model.cfg.n_layers} layers")
            hook_name = hooks.act_name("resid_post", layer)
        if hook_name not in model.hook_dict:
            raise ValueError(f"the model has no hook {hook_name!r}; e.g. 'blocks.0.hook_resid_post'")
    if data is None:
        raise ValueError(
            "train_sae needs data: pairs, (prompts, responses), token ids, or activations [n, d_in]"
        )
    if isinstance(data, torch.Tensor) and data.is_floating_point():
        acts = data.detach().reshape(-1, data.shape[-1]).float().cpu()
    else:
        if model is None:
            raise ValueError(
                "training from texts or tokens needs the model to stream activations from; pass model="
            )
        acts = gather_activations(
            model,
            data,
            hook_name,
            positions=positions,
            batch_size=model_batch_size,
            max_tokens=max_tokens,
            progress="activations" if progress else False,
        )
    if acts.dim() != 2:
        raise ValueError(
            f"{hook_name} gives {tuple(acts.shape[1:])} per token; SAEs here read one vector per token "
            "(e.g. hook_resid_post, hook_mlp_out, mlp.hook_post)"
        )
    if model is not None:
        width = hook_width(model, hook_name)
        if width is not None and width != acts.shape[-1]:
            raise ValueError(
                f"activations have width {acts.shape[-1]} but {hook_name} on this model is {width} wide"
            )
    if acts.shape[0] < 2:
        raise ValueError(
            f"got {acts.shape[0]} activation row(s); an SAE needs many tokens (thousands or more)"
        )
    return hook_name, acts


def _init_params(
    d_in: int, d_sae: int, b_dec: torch.Tensor, g: torch.Generator, device
) -> Dict[str, torch.Tensor]:
    """Unit-norm random decoder rows, the encoder its transpose, b_dec at the (scaled) data mean."""
    W_dec = torch.randn(d_sae, d_in, generator=g).to(device)
    W_dec = W_dec / W_dec.norm(dim=-1, keepdim=True)
    return {
        "W_enc": W_dec.T.clone().contiguous().requires_grad_(True),
        "W_dec": W_dec.requires_grad_(True),
        "b_enc": torch.zeros(d_sae, device=device, requires_grad=True),
        "b_dec": b_dec.clone().requires_grad_(True),
    }


def _optimise(
    params: Dict[str, torch.Tensor], X: torch.Tensor, plan: _Plan, g: torch.Generator, progress: bool
) -> List[Dict[str, float]]:
    """Adam over shuffled batches of X (lr decayed linearly over the last 20% of steps); the curves."""
    from tqdm.auto import tqdm

    n_train, d_sae, device = X.shape[0], params["W_dec"].shape[0], X.device
    opt = torch.optim.Adam(params.values(), lr=plan.lr, betas=(0.9, 0.999), eps=6.25e-10)
    decay_from = int(0.8 * plan.total_steps)
    since_fired = torch.zeros(d_sae, dtype=torch.long, device=device)
    history: List[Dict[str, float]] = []
    log_every = max(1, plan.total_steps // 200)
    order = torch.randperm(n_train, generator=g)
    cursor = 0
    bar = tqdm(range(plan.total_steps), desc="SAE", leave=False, disable=not progress)
    for step in bar:
        if cursor + plan.batch_size > n_train:
            order, cursor = torch.randperm(n_train, generator=g), 0
        xb = X[order[cursor : cursor + plan.batch_size].to(device)]
        cursor += plan.batch_size
        dead = since_fired >= plan.dead_after  # no firing in the last `dead_after` training tokens
        n_dead = int(dead.sum())
        mse, aux, fired = topk_losses(params, xb, plan.k, dead if plan.aux_coef > 0 else None, plan.aux_k)
        with torch.no_grad():
            since_fired += xb.shape[0]
            since_fired[fired] = 0
        W_d = params["W_dec"]
        opt.zero_grad(set_to_none=True)
        (mse + plan.aux_coef * aux).backward()
        with torch.no_grad():  # keep rows unit-norm: drop the radial part of their gradient, then renormalise
            W_d.grad -= (W_d.grad * W_d).sum(-1, keepdim=True) * W_d
        if step >= decay_from:
            for group in opt.param_groups:
                group["lr"] = plan.lr * (plan.total_steps - step) / max(1, plan.total_steps - decay_from)
        opt.step()
        with torch.no_grad():
            W_d /= W_d.norm(dim=-1, keepdim=True)
        if step % log_every == 0 or step == plan.total_steps - 1:
            history.append(
                {
                    "step": step,
                    "fvu": float(mse.detach()),
                    "aux_loss": float(aux.detach()),
                    "dead_fraction": n_dead / d_sae,
                }
            )
            bar.set_postfix(fvu=f"{float(mse.detach()):.4f}", dead=f"{n_dead / d_sae:.1%}", refresh=False)
    bar.close()
    return history
