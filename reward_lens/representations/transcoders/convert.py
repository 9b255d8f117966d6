"""A TopK transcoder set as the JumpReLU set circuit-tracer and SAELens load: one threshold per feature,
calibrated on text so that each feature fires on as many calibration tokens as under TopK (as near as
repeated values allow). BatchTopK's inference rule already is a JumpReLU and converts exactly."""

from __future__ import annotations

from typing import Any

import torch

from reward_lens.model.validation import checked_arguments
from reward_lens.representations.transcoders.families import TopK
from reward_lens.representations.transcoders.module import Transcoder, TranscoderSet
from reward_lens.representations.transcoders.train import stream_mlp_io, text_pairs


def _jumprelu_copy(t: Transcoder, threshold: torch.Tensor) -> Transcoder:
    out = Transcoder(t.d_model, t.d_tc, t.k, "jumprelu", skip=t.W_skip is not None)
    with torch.no_grad():
        for name in ("W_enc", "b_enc", "W_dec", "b_dec", "W_skip"):
            if getattr(t, name) is not None:
                getattr(out, name).copy_(getattr(t, name))
        out.threshold.copy_(threshold)
    return out.to(t.W_enc.device)


def jumprelu_thresholds(pre: torch.Tensor, fired: torch.Tensor, tol: float = 1e-5) -> torch.Tensor:
    """Per-feature thresholds [d_tc] under which `pre > threshold` holds on as many of the rows of `pre`
    [n, d_tc] as `fired` [n, d_tc] marks: for a feature that fired c times, halfway between its c-th and
    (c+1)-th largest pre-activation. Texts sharing a prefix repeat activations exactly, and a threshold on
    a repeated value would split copies by rounding noise, so the cut goes between the nearest pair of
    values that differ (by more than `tol` relative), the sparser one when two are as near; above the
    largest value (by 0.1%) for a feature that never fired. Never below 0 (TopK's ReLU never fires a
    negative pre-activation)."""
    n = pre.shape[0]
    counts = fired.sum(0)  # [d_tc]
    ranked = pre.sort(0, descending=True).values  # [n, d_tc]
    top = ranked[0] + 1e-3 * ranked[0].abs() + 1e-6
    bottom = ranked[-1] - 1.0
    cuts = torch.cat([top[None], (ranked[:-1] + ranked[1:]) / 2, bottom[None]])  # [n + 1]: b rows above
    apart = torch.ones(n + 1, pre.shape[1], dtype=torch.bool)
    apart[1:n] = (ranked[:-1] - ranked[1:]) > tol * (1.0 + ranked[1:].abs())
    b = torch.arange(n + 1, dtype=torch.float64)[:, None]
    cost = (b - counts[None].double()).abs() + b * 1e-9  # nearest separable count; the sparser on a tie
    cost[~apart] = float("inf")
    threshold = cuts.gather(0, cost.argmin(0)[None])[0]
    return threshold.clamp(min=0.0)


@torch.no_grad()
@checked_arguments(counts={"max_tokens": 1, "batch_size": 1})
def jumprelu_from_topk(
    tc: TranscoderSet,
    model=None,
    texts: Any = None,
    *,
    max_tokens: int = 32_768,
    batch_size: int = 32,
) -> TranscoderSet:
    """The same transcoders with a JumpReLU (pre * (pre > threshold), one threshold per feature): the form
    circuit-tracer and SAELens load. A TopK set's thresholds are calibrated on `texts` (pairs or
    (prompt, response) tuples run through `model`, at most `max_tokens` tokens) so that each feature fires
    on as many calibration tokens as under TopK; use text from the training distribution, not the text you
    evaluate on. A BatchTopK set converts exactly (its inference rule is this JumpReLU), a JumpReLU set is
    returned as is."""
    kinds = {tc[l].kind for l in tc.layers}
    if kinds == {"jumprelu"}:
        return tc
    config = dict(tc.config)
    if kinds == {"batchtopk"}:
        out = {l: _jumprelu_copy(tc[l], tc[l].threshold.clamp(min=0.0)) for l in tc.layers}
        config["jumprelu"] = {"source_family": "batchtopk", "exact": True}
        return TranscoderSet(out, config)
    if kinds != {"topk"}:
        raise ValueError(f"cannot convert a set of families {sorted(kinds)}; convert one family at a time")
    if model is None or texts is None:
        raise ValueError(
            "a TopK set needs calibration text for its thresholds: jumprelu_from_topk(tc, model, texts) with "
            "texts from the training distribution (pairs or (prompt, response) tuples)"
        )
    tc.check(model)
    prompts, responses = text_pairs(texts)
    xs, n = [], 0
    for x, _ in stream_mlp_io(model, prompts, responses, tc.layers, batch_size):
        xs.append(x[: max_tokens - n])
        n += xs[-1].shape[0]
        if n >= max_tokens:
            break
    X = torch.cat(xs)  # [n, n_layers, d_model]
    out = {}
    for i, l in enumerate(tc.layers):
        t = tc[l]
        pre = t.pre(X[:, i].to(t.W_enc.device)).float().cpu()
        fired = TopK.activate(pre, t.k, None) > 0
        out[l] = _jumprelu_copy(t, jumprelu_thresholds(pre, fired).to(t.W_enc.device))
    config["jumprelu"] = {
        "source_family": "topk",
        "k": tc[tc.layers[0]].k,
        "calibration": "per-feature firing counts of TopK",
        "calibration_tokens": int(X.shape[0]),
        "calibration_texts": len(prompts),
    }
    return TranscoderSet(out, config)
