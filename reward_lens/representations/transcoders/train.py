"""Training per-layer skip transcoders on a reward model, from activations streamed on the fly.

Text batches run through the model once each (stopping after the last trained layer); every trained
layer's MLP input and output at every non-pad token go into an in-memory buffer (`buffer_tokens` rows, all
layers together; nothing is written to disk), which is shuffled and read `reuse` times before it is
refilled from the next texts. Per layer: the target is scaled to E||y - mean||^2 = d_model during training
(folded back at the end), the skip and b_dec start at the least-squares fit on the first buffer, and the
loss is the reconstruction's FVU-like MSE plus the AuxK term (Gao et al. 2024): the `aux_k` largest
pre-activations among dead features (no firing in the last `dead_after` tokens) reconstruct the detached
error. Adam; the learning rate decays linearly over the last 20% of the steps.

Under `torchrun` (any initialised process group with several ranks) the training is data-parallel: the same
buffer slots and rows as one process, each rank computing the forwards of its share of the text batches,
gradients and dead-latent statistics reduced over ranks (`parallel.TrainingGroup`).
"""

from __future__ import annotations

import math
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from reward_lens.core.batching import first_token, tokenize
from reward_lens.data.pairs import side_texts
from reward_lens.model.validation import checked_arguments
from reward_lens.representations.transcoders.families import family
from reward_lens.representations.transcoders.module import (
    Transcoder,
    TranscoderMetrics,
    TranscoderSet,
    input_hook,
    output_hook,
    replacement_hooks,
)
from reward_lens.representations.transcoders.parallel import TrainingGroup


def text_pairs(texts: Any) -> Tuple[List[str], List[str]]:
    """(prompts, responses) of every response in `texts`: preference pairs (both sides), contrast pairs,
    or (prompt, response) tuples."""
    prompts, responses = side_texts(
        texts,
        "preference pairs (prompt, chosen, rejected), contrast pairs, or (prompt, response) tuples",
        tuples=True,
    )
    if not prompts:
        raise ValueError("no texts to train transcoders on: pass pairs or (prompt, response) tuples")
    return prompts, responses


def token_rows(tok, exclude_first: bool = False) -> torch.Tensor:
    """[batch, pos] bool: the tokens transcoders train and are measured on: every non-pad token, less each
    row's first one when `exclude_first` (the template's BOS, where some layers write an attention sink's
    output, an outlier the features would spend themselves on; circuit-tracer leaves BOS features out)."""
    keep = tok.attention_mask.bool().clone()
    if exclude_first:
        keep[torch.arange(len(keep)), first_token(tok)] = False
    return keep


def mlp_io(
    model, tok, layers: Sequence[int], device: Any = "cpu", exclude_first: bool = False
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(x, y) [n_tokens, n_layers, d_model] float32 on `device` of one tokenized batch: each layer's MLP
    input (`ln2.hook_normalized`) and output (`hook_mlp_out`) at every non-pad token (`token_rows`)."""
    names = [input_hook(l) for l in layers] + [output_hook(l) for l in layers]
    got: Dict[str, torch.Tensor] = {}

    def grab(t, hook):
        got[hook.name] = t.detach()

    with torch.no_grad():
        model.run_with_hooks(
            tok.input_ids,
            tok.attention_mask,
            fwd_hooks=[(n, grab) for n in names],
            stop_at_layer=max(layers) + 1,
        )
    keep = token_rows(tok, exclude_first).to(got[names[0]].device)
    x = torch.stack([got[input_hook(l)][keep] for l in layers], 1).float().to(device)
    y = torch.stack([got[output_hook(l)][keep] for l in layers], 1).float().to(device)
    return x, y


def stream_mlp_io(
    model,
    prompts: Sequence[str],
    responses: Sequence[str],
    layers: Sequence[int],
    batch_size: int,
    device: Any = "cpu",
    exclude_first: bool = False,
) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
    """`mlp_io` of each text batch of `batch_size` texts, in order."""
    for s in range(0, len(prompts), batch_size):
        tok = tokenize(model, prompts[s : s + batch_size], responses[s : s + batch_size])
        yield mlp_io(model, tok, layers, device, exclude_first)


class _Buffer:
    """Rows of (x, y) from the text stream (cycled in a seeded order), shuffled, read `reuse` times.

    Data-parallel (`group`): every rank walks the same text batches and draws the same permutation; it
    runs the model on its own batches only (`group.owns`) and keeps the buffer slots whose rows it
    computed (`slot_rows[slot]`: its row there, -1 for another rank's), so the ranks' slots together
    are the one-process buffer. The rows live on `device` (where the training runs); the random draws
    come from the CPU generator `g` on every device, so a run's batches do not depend on where it runs."""

    def __init__(
        self, model, texts, layers, size, model_batch_size, g, group=None, device="cpu", exclude_first=False
    ):
        self.model, self.layers, self.size, self.mbs, self.g = model, layers, size, model_batch_size, g
        self.exclude_first = exclude_first
        prompts, responses = texts
        self.device = torch.device(device)
        self.prompts, self.responses = list(prompts), list(responses)
        self.group, self.tokens_drawn, self.n_chunks, self.n_slots = group, 0, 0, 0
        self.slot_rows: Optional[torch.Tensor] = None
        self._texts = self._cycle()

    def _cycle(self):
        while True:
            order = torch.randperm(len(self.prompts), generator=self.g).tolist()
            p = [self.prompts[i] for i in order]
            r = [self.responses[i] for i in order]
            for s in range(0, len(p), self.mbs):
                yield p[s : s + self.mbs], r[s : s + self.mbs]

    def fill(self) -> Tuple[torch.Tensor, torch.Tensor]:
        xs, ys, starts, n = [], [], [], 0
        while n < self.size:
            tok = tokenize(self.model, *next(self._texts))
            if self.group is None or self.group.owns(self.n_chunks):
                x, y = mlp_io(self.model, tok, self.layers, self.device, self.exclude_first)
                xs.append(x)
                ys.append(y)
                starts.append(n)
            self.n_chunks += 1
            n += int(token_rows(tok, self.exclude_first).sum())
        self.tokens_drawn += n
        perm = torch.randperm(n, generator=self.g)[: self.size]
        self.n_slots = len(perm)
        if self.group is None:
            perm = perm.to(self.device)
            return torch.cat(xs)[perm], torch.cat(ys)[perm]
        local = torch.full((n,), -1, dtype=torch.long)  # stream row -> this rank's row
        offset = 0
        for start, x in zip(starts, xs):
            local[start : start + len(x)] = torch.arange(offset, offset + len(x))
            offset += len(x)
        slot_local = local[perm]
        mine = slot_local >= 0
        self.slot_rows = torch.full((len(perm),), -1, dtype=torch.long)
        self.slot_rows[mine] = torch.arange(int(mine.sum()))
        if not xs:  # none of this fill's batches was this rank's
            empty = torch.zeros(0, len(self.layers), self.model.cfg.d_model, device=self.device)
            return empty, empty.clone()
        rows = slot_local[mine].to(self.device)
        return torch.cat(xs)[rows], torch.cat(ys)[rows]

    def rows(self, batch_size: int) -> torch.Tensor:
        """A step's rows: `batch_size` slots drawn with replacement (the same on every rank), as this
        rank's buffer rows (data-parallel: only the slots it holds)."""
        slots = torch.randint(0, self.n_slots, (batch_size,), generator=self.g)
        if self.group is None:
            return slots.to(self.device)
        local = self.slot_rows[slots]
        return local[local >= 0].to(self.device)


def _init(x: torch.Tensor, y: torch.Tensor, d_tc: int, skip: bool, g: torch.Generator):
    """Parameters of one layer on the scaled target, on x's device: the skip and b_dec by least squares on
    (x, y), random unit-norm encoder rows, small decoder rows (drawn on the CPU from `g`)."""
    n, d = x.shape
    if skip:
        design = torch.cat([x, torch.ones(n, 1, device=x.device)], 1).double()
        sol = torch.linalg.lstsq(design, y.double()).solution.float()  # [d + 1, d]
        W_skip, b_dec = sol[:d].T.contiguous(), sol[d].clone()
    else:
        W_skip, b_dec = None, y.mean(0)
    W_enc = torch.randn(d_tc, d, generator=g)
    W_enc /= W_enc.norm(dim=-1, keepdim=True)
    W_dec = torch.randn(d_tc, d, generator=g)
    W_dec *= 0.1 / W_dec.norm(dim=-1, keepdim=True)
    params = {"W_enc": W_enc, "b_enc": torch.zeros(d_tc), "W_dec": W_dec, "b_dec": b_dec, "W_skip": W_skip}
    return {k: v.to(x.device).requires_grad_(True) for k, v in params.items() if v is not None}


def _first_fit(buf: _Buffer, X: torch.Tensor, Y: torch.Tensor, d_tc: int, skip: bool):
    """(target scale [L], per-layer parameters) from the first buffer, whole on every rank."""
    if buf.group is not None:
        X, Y = buf.group.assemble(X, buf.slot_rows), buf.group.assemble(Y, buf.slot_rows)
    d = X.shape[-1]
    mu = Y.mean(0)  # [L, d]
    scale = torch.sqrt(d / (Y - mu).pow(2).sum(-1).mean(0).clamp(min=1e-30))  # [L]
    return scale, [_init(X[:, i], Y[:, i] * scale[i], d_tc, skip, buf.g) for i in range(len(buf.layers))]


def transcoder_losses(
    p: Dict[str, torch.Tensor], x, y, k: int, kind: str, dead, aux_k: int, n_total=None, group=None
):
    """(MSE / d_model, AuxK loss, which features fired [d_tc], the activations) of one layer's batch.
    Data-parallel (`group`, this rank's rows of a global batch of `n_total`): the losses are this rank's
    share (sums over its rows / n_total; summed over ranks they are the global ones) and BatchTopK
    selects over the global batch."""
    d = y.shape[-1]
    pre = x @ p["W_enc"].T + p["b_enc"]
    if group is not None and kind == "batchtopk":
        f = family(kind).select(pre, group.batch_threshold(pre, k * n_total))
    else:
        f = family(kind).train_activate(pre, k)
    out = f @ p["W_dec"] + p["b_dec"]
    if "W_skip" in p:
        out = out + x @ p["W_skip"].T

    def mean(sq):  # over rows: the batch's mean, or this rank's share of the global one
        return sq.sum(-1).mean() / d if group is None else sq.sum() / (n_total * d)

    err = y - out
    mse = mean(err.pow(2))
    aux = torch.zeros((), device=y.device)
    if dead is not None and int(dead.sum()):
        values, idx = pre.masked_fill(~dead, float("-inf")).topk(min(aux_k, int(dead.sum())), dim=-1)
        f_aux = torch.zeros_like(pre).scatter(-1, idx, values.relu())
        aux = mean((err.detach() - f_aux @ p["W_dec"]).pow(2))
    return mse, aux, (f > 0).any(0).detach(), f.detach()


def _step_layers(params, batch, since, thresholds, history, step: int, steps: int, o: Dict[str, Any]):
    """One batch's summed loss over the layers; updates the dead-feature counters, BatchTopK's running
    threshold (the mean smallest selected activation) and the curves. Data-parallel (`o["group"]`): the
    fired features, the smallest selected activation and the curves' numbers are reduced over ranks
    first, so every rank keeps the same counters."""
    X, Y, rows, scale = batch
    group, n_total = o["group"], o["batch_size"]
    total, fired, lows, stats, dead_fractions = 0.0, [], [], [], []
    for i in range(len(o["layers"])):
        dead = since[i] >= o["dead_after"]
        xb, yb = X[rows, i], Y[rows, i] * scale[i]  # contiguous per layer (the matmuls' rounding)
        mse, aux, fired_i, f = transcoder_losses(
            params[i],
            xb,
            yb,
            o["k"],
            o["kind"],
            dead if o["aux_coef"] > 0 else None,
            o["aux_k"],
            n_total,
            group,
        )
        total = total + mse + o["aux_coef"] * aux
        fired.append(fired_i)
        lows.append(float(f[f > 0].min()) if bool((f > 0).any()) else math.inf)
        stats.append([float(mse.detach()), float(aux.detach())])
        dead_fractions.append(float(dead.float().mean()))
    fired_all, low_all, stats_all = torch.stack(fired), torch.tensor(lows), torch.tensor(stats)
    if group is not None:
        fired_all = group.all_reduce(fired_all.to(torch.int32), "max").bool()
        low_all = group.all_reduce(low_all, "min")
        stats_all = group.all_reduce(stats_all.double()).float()
    for i in range(len(o["layers"])):
        since[i] += n_total if group is not None else len(rows)
        since[i][fired_all[i]] = 0
        if o["kind"] == "batchtopk" and math.isfinite(float(low_all[i])):
            low = float(low_all[i])
            thresholds[i] = 0.99 * thresholds[i] + 0.01 * low if step else low
        if step % max(1, steps // 100) == 0 or step == steps - 1:
            history.append(
                {
                    "step": step,
                    "layer": o["layers"][i],
                    "fvu": float(stats_all[i, 0]),
                    "aux_loss": float(stats_all[i, 1]),
                    "dead_fraction": dead_fractions[i],
                }
            )
    return total, stats_all[:, 0].tolist()


def _fingerprint(prompts: Sequence[str], responses: Sequence[str]) -> str:
    """A short digest of the texts, to check every rank was given the same ones."""
    import hashlib

    h = hashlib.sha256()
    for text in (*prompts, *responses):
        h.update(text.encode("utf-8", "surrogatepass") + b"\0")
    return h.hexdigest()[:16]


def _check(model, layers, d_tc, k, kind, steps, batch_size):
    if model is None or not hasattr(model, "cfg"):
        raise ValueError("train_transcoders needs the reward model (a HookedRewardModel) to stream from")
    L = model.cfg.n_layers
    layers = list(range(L)) if layers is None else sorted({int(l) for l in layers})
    if not layers or not all(0 <= l < L for l in layers):
        raise ValueError(f"layers must be in [0, {L}) for this model, got {layers}")
    for name, value in (("d_tc", d_tc), ("k", k), ("steps", steps), ("batch_size", batch_size)):
        if isinstance(value, bool) or int(value) != value or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if k > d_tc:
        raise ValueError(f"k={k} must not exceed d_tc={d_tc}")
    if not family(kind).trainable:
        raise ValueError(
            f"kind={kind!r} is an inference form; train kind='topk' or 'batchtopk' (a TopK set converts "
            "to JumpReLU with jumprelu_from_topk)"
        )
    return layers


@checked_arguments(
    counts={
        "k": 1,
        "steps": 1,
        "batch_size": 1,
        "aux_k": 1,
        "dead_after": 1,
        "model_batch_size": 1,
        "seed": 0,
    },
    flags=("skip", "exclude_first_token"),
)
def train_transcoders(
    model,
    texts: Any,
    *,
    d_tc: int = 512,
    k: int = 16,
    layers: Optional[Sequence[int]] = None,
    kind: str = "topk",
    skip: bool = True,
    steps: int = 1500,
    batch_size: int = 1024,
    lr: Optional[float] = None,
    aux_k: Optional[int] = None,
    aux_coef: float = 1.0 / 32,
    dead_after: int = 50_000,
    buffer_tokens: int = 32_768,
    reuse: int = 4,
    model_batch_size: int = 32,
    eval_texts: Any = None,
    seed: int = 0,
    progress: bool = True,
    device: Any = None,
    exclude_first_token: bool = False,
) -> TranscoderSet:
    """Train one skip transcoder per layer (`layers`, default all) of `model` on activations streamed from
    `texts` (preference pairs, contrast pairs or (prompt, response) tuples); `kind` is "topk" or
    "batchtopk". With `eval_texts` (e.g. held-out pairs) the set's `.metrics` are measured on them
    (`evaluate_transcoders`); the training curves are `.metrics.history` either way.

    Data-parallel when a process group with several ranks is initialised (`torchrun`; give every rank
    the same texts and settings): each rank runs the model on its share of the text batches, the step is
    the one-process step on the same rows (`parallel`), every rank returns the same set; only rank 0
    evaluates `eval_texts` (the others' `.metrics` have the curves only) and should save.

    `device`: where the activation buffer and the optimisation live (default: the model's device, so a
    model on a GPU trains there; the buffer is `buffer_tokens` x layers x 2 x d_model floats). The random
    draws are the CPU generator's on every device: the same batches, equal parameters to float rounding.

    `exclude_first_token`: train without each text's first token (a BOS the model uses as an attention
    sink, whose outlier MLP outputs would take the features); the set records it, so its evaluation,
    replacement model and feature graph leave that token's MLP output to the error term."""
    from tqdm.auto import tqdm

    layers = _check(model, layers, d_tc, k, kind, steps, batch_size)
    prompts, responses = text_pairs(texts)
    group = TrainingGroup.joined()
    if group is not None:
        settings = dict(d_tc=d_tc, k=k, kind=kind, layers=layers, steps=steps, batch_size=batch_size)
        settings["exclude_first_token"] = exclude_first_token
        group.check_same({**settings, "seed": seed, "texts": _fingerprint(prompts, responses)})
    g = torch.Generator().manual_seed(seed)
    device = torch.device(device if device is not None else model.cfg.device)
    sides = (prompts, responses)
    buf = _Buffer(
        model, sides, layers, buffer_tokens, model_batch_size, g, group, device, exclude_first_token
    )
    X, Y = buf.fill()
    scale, params = _first_fit(buf, X, Y, d_tc, skip)
    d = X.shape[-1]
    lr = lr if lr is not None else 2e-4 / math.sqrt(d_tc / 16384)
    aux_k = aux_k if aux_k is not None else max(1, d // 2)
    opt = torch.optim.Adam([v for p in params for v in p.values()], lr=lr)
    since = torch.zeros(len(layers), d_tc, dtype=torch.long, device=device)
    thresholds = torch.zeros(len(layers))
    per_fill = max(1, reuse * buf.n_slots // batch_size)
    history: List[Dict[str, float]] = []
    decay_from = int(0.8 * steps)
    main = group is None or group.is_main
    options = dict(
        k=k,
        kind=kind,
        aux_k=aux_k,
        aux_coef=aux_coef,
        dead_after=dead_after,
        layers=layers,
        group=group,
        batch_size=batch_size,
    )
    bar = tqdm(range(steps), desc="transcoders", leave=False, disable=not (progress and main))
    for step in bar:
        if step and step % per_fill == 0:
            X, Y = buf.fill()
        rows = buf.rows(batch_size)
        total, fvus = _step_layers(
            params, (X, Y, rows, scale), since, thresholds, history, step, steps, options
        )
        if step >= decay_from:
            for param_group in opt.param_groups:
                param_group["lr"] = lr * (steps - step) / max(1, steps - decay_from)
        opt.zero_grad(set_to_none=True)
        total.backward()
        if group is not None:  # the global batch's gradient: every rank's share summed
            group.sum_gradients([v for p in params for v in p.values()])
        opt.step()
        bar.set_postfix(fvu=f"{np.mean(fvus):.4f}", refresh=False)
    bar.close()
    out = _fold(params, scale, thresholds, layers, kind, k, skip, model.cfg.device)
    config = dict(
        model_name=str(getattr(model.cfg, "model_name", "") or ""),
        exclude_first_token=bool(exclude_first_token),
        training=dict(
            steps=steps,
            batch_size=batch_size,
            lr=lr,
            aux_k=aux_k,
            aux_coef=aux_coef,
            dead_after=dead_after,
            buffer_tokens=buffer_tokens,
            reuse=reuse,
            seed=seed,
            n_texts=len(prompts),
            tokens_streamed=buf.tokens_drawn,
            **({"world_size": group.world_size} if group is not None else {}),
        ),
    )
    return _with_metrics(TranscoderSet(out, config), model, eval_texts if main else None, history)


def _with_metrics(tc: TranscoderSet, model, eval_texts, history: List[Dict[str, float]]) -> TranscoderSet:
    """`tc` with its `.metrics`: measured on `eval_texts` (none: empty), the training curves either way."""
    import pandas as pd

    history_frame = pd.DataFrame(history)
    if eval_texts is not None:
        tc.metrics = evaluate_transcoders(model, tc, eval_texts)
        tc.metrics.history = history_frame
    else:
        empty = pd.DataFrame(columns=["layer", "fvu", "l0", "dead_fraction", "n_tokens"])
        tc.metrics = TranscoderMetrics(empty, history=history_frame)
    return tc


def _fold(params, scale, thresholds, layers, kind: str, k: int, skip: bool, device) -> Dict[int, Transcoder]:
    """The trained parameters as transcoders on raw activations: outputs divided by the target scale
    (features unchanged), BatchTopK's running threshold set."""
    out = {}
    for i, l in enumerate(layers):
        d_tc, d = params[i]["W_enc"].shape
        t = Transcoder(d, d_tc, k, kind, skip)
        with torch.no_grad():
            t.W_enc.copy_(params[i]["W_enc"])
            t.b_enc.copy_(params[i]["b_enc"])
            t.W_dec.copy_(params[i]["W_dec"] / scale[i])
            t.b_dec.copy_(params[i]["b_dec"] / scale[i])
            if skip:
                t.W_skip.copy_(params[i]["W_skip"] / scale[i])
            t.threshold.fill_(float(thresholds[i]))
        out[l] = t.to(device)
    return out


@torch.no_grad()
@checked_arguments(counts={"batch_size": 1})
def evaluate_transcoders(model, tc: TranscoderSet, texts: Any, batch_size: int = 32) -> TranscoderMetrics:
    """Per layer FVU, L0 and dead fraction on the texts' tokens (preference pairs: both responses; or
    (prompt, response) tuples; without each text's first token for a set trained without it); with
    preference pairs also the replacement model's reward (every transcoded MLP replaced, no error terms)
    against the original: Pearson r and decisions kept."""
    import pandas as pd

    tc.check(model)
    layers = tc.layers
    prompts, responses = text_pairs(texts)
    dt = torch.float64
    n = 0
    sums = {
        k: torch.zeros(len(layers), *s, dtype=dt)
        for k, s in (("y", (tc[layers[0]].d_model,)), ("yy", ()), ("sse", ()), ("l0", ()))
    }
    fired = torch.zeros(len(layers), tc[layers[0]].d_tc, dtype=torch.bool)
    rows_of = stream_mlp_io(
        model, prompts, responses, layers, batch_size, tc[layers[0]].W_enc.device, tc.exclude_first_token
    )
    for x, y in rows_of:
        n += x.shape[0]
        for i, l in enumerate(layers):
            t = tc[l]
            xi, yi = x[:, i].to(t.W_enc.device), y[:, i].to(t.W_enc.device)
            f = t.encode(xi)
            err = (yi - t.decode(f) - t.skip(xi)).double().cpu()
            sums["y"][i] += yi.double().sum(0).cpu()
            sums["yy"][i] += float(yi.double().pow(2).sum())
            sums["sse"][i] += float(err.pow(2).sum())
            sums["l0"][i] += float((f > 0).sum())
            fired[i] |= (f > 0).any(0).cpu()
    sst = sums["yy"] - sums["y"].pow(2).sum(-1) / max(n, 1)
    frame = pd.DataFrame(
        {
            "layer": layers,
            "fvu": (sums["sse"] / sst.clamp(min=1e-30)).numpy(),
            "l0": (sums["l0"] / max(n, 1)).numpy(),
            "dead_fraction": (~fired).double().mean(1).numpy(),
            "n_tokens": [n] * len(layers),
        }
    )
    metrics = TranscoderMetrics(frame)
    items = list(texts)
    if items and hasattr(items[0], "chosen"):
        original, replaced = _pair_rewards(model, tc, items, batch_size)
        metrics.reward_pearson = float(np.corrcoef(original.flatten(), replaced.flatten())[0, 1])
        keep = np.sign(original[:, 0] - original[:, 1]) == np.sign(replaced[:, 0] - replaced[:, 1])
        metrics.decision_agreement = float(keep.mean())
        metrics.n_pairs = len(items)
    return metrics


def _pair_rewards(model, tc, pairs, batch_size) -> Tuple[np.ndarray, np.ndarray]:
    """[n_pairs, 2] rewards (chosen, rejected) of the model and of its replacement model."""
    original, replaced = [], []
    for s in range(0, len(pairs), batch_size):
        chunk = pairs[s : s + batch_size]
        cols_o, cols_r = [], []
        for side in ("chosen", "rejected"):
            tok = tokenize(model, [p.prompt for p in chunk], [getattr(p, side) for p in chunk])
            cols_o.append(model(tok.input_ids, tok.attention_mask).float().cpu())
            cols_r.append(
                model.run_with_hooks(
                    tok.input_ids, tok.attention_mask, fwd_hooks=replacement_hooks(tc, tok=tok)
                )
                .float()
                .cpu()
            )
        original.append(torch.stack(cols_o, 1))
        replaced.append(torch.stack(cols_r, 1))
    return torch.cat(original).numpy(), torch.cat(replaced).numpy()
