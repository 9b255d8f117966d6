"""The feature attribution graph's arithmetic: one text, the model with every MLP replaced by its skip
transcoder, linearised at that text (circuit-tracer's local replacement model, with the reward as the one
logit).

Frozen at their clean values on the text: every attention pattern, every norm's scale (ln1, ln2, the final
norm) and the readout (`readout_direction`: an ArmoRM gate or an MLP head's ReLU masks). Each MLP's output
becomes  skip(x) + (mlp_out - skip(x)).detach()  with x its normalised input: the detached part is what
the sources write there, sum_i a_i W_dec[i] (the active features) + b_dec + error (the MLP output the
transcoder misses). The map from sources (token embeddings, feature writes, error writes) to every
feature's pre-activation and to the reward is then affine; its constant holds b_dec, the attention's
biases and the readout's. The model runs itself through its hooks (patterns, scales replaced by their clean
values; nothing here computes attention or norms).

- edges: into each feature's pre-activation minus b_enc, and into the reward minus its bias; the targets
  sorted by position into bands, one forward of the text up to a band's last position (the frozen map is
  causal), then one batched backward per `chunk` targets of a layer;
- constants: the same forward with every source zeroed;
- values: each node's exact total effect on the reward in the local replacement model, where features
  downstream are recomputed from their pre-activations with the active set frozen (a = pre on it), so
  their activations move linearly with their inputs: one backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Dict, List, Optional, Tuple

import torch

from reward_lens.core.batching import Tokenized, first_token
from reward_lens.core.directions import readout_direction
from reward_lens.model.hooks import act_name, final_resid_name
from reward_lens.model.hooks import mlp_input_name as input_hook
from reward_lens.model.hooks import mlp_output_name as output_hook


@dataclass
class CleanRun:
    """The text's clean run, float32, batch axis dropped: the hooks to freeze (`frozen`), per layer the
    transcoder's input x [T, d], the MLP output y [T, d], pre-activations [T, d_tc], activations, errors
    (y - tc(x)) and the sources' writes (y - skip(x)); the token writes (resid_pre 0) and the readout.
    `causal`: every pattern is zero above its diagonal (a position reads only positions up to itself)."""

    tok: Tokenized
    frozen: Dict[str, torch.Tensor]
    x: List[torch.Tensor]
    pre: List[torch.Tensor]
    act: List[torch.Tensor]
    err: List[torch.Tensor]
    write: List[torch.Tensor]
    embed: torch.Tensor
    readout_map: torch.Tensor
    readout: int
    reward: float
    bias: float
    causal: bool = True

    @property
    def n_layers(self) -> int:
        return len(self.x)


def frozen_names(model) -> List[str]:
    """The hooks whose clean values the linearisation keeps: patterns and the norms' scales."""
    names = [act_name("scale")]
    for l in range(model.cfg.n_layers):
        names += [act_name("pattern", l), act_name("scale", l, norm="ln1"), act_name("scale", l, norm="ln2")]
    return names


@torch.no_grad()
def clean_run(model, tok: Tokenized, tc) -> CleanRun:
    """One hooked forward of the text and the transcoders on its MLP inputs."""
    L = model.cfg.n_layers
    names = frozen_names(model) + [act_name("resid_pre", 0), final_resid_name(L)]
    names += [input_hook(l) for l in range(L)] + [output_hook(l) for l in range(L)]
    got: Dict[str, torch.Tensor] = {}

    def grab(t, hook):
        got[hook.name] = t.detach()

    model.run_with_hooks(tok.input_ids, tok.attention_mask, fwd_hooks=[(n, grab) for n in names])
    direction, bias = readout_direction(model, tok)
    readout = int(tok.readout[0])
    scale_f = got[act_name("scale")][0, readout].float()
    readout_map = direction[0].float().to(scale_f.device) / scale_f
    reward = float(got[final_resid_name(L)][0, readout].float() @ readout_map + bias[0].float())
    x = [got[input_hook(l)][0].float() for l in range(L)]
    y = [got[output_hook(l)][0].float() for l in range(L)]
    pre = [tc[l].pre(x[l]) for l in range(L)]
    act = [tc[l].encode(x[l]) for l in range(L)]
    if getattr(tc, "exclude_first_token", False):  # trained without it: that token's MLP is all error
        first = int(first_token(tok)[0])
        for a in act:
            a[first] = 0
    skip = [tc[l].skip(x[l]) for l in range(L)]
    return CleanRun(
        tok=tok,
        frozen={n: got[n] for n in frozen_names(model)},
        x=x,
        pre=pre,
        act=act,
        err=[y[l] - tc[l].decode(act[l]) - skip[l] for l in range(L)],
        write=[y[l] - skip[l] for l in range(L)],
        embed=got[act_name("resid_pre", 0)][0].float(),
        readout_map=readout_map,
        readout=readout,
        reward=reward,
        bias=float(bias[0]),
        causal=all(bool((got[act_name("pattern", l)].triu(1) == 0).all()) for l in range(L)),
    )


def _freeze_hooks(run: CleanRun) -> list:
    """Hooks that put the clean patterns and scales in, cut to the run's length (a prefix of the text)."""

    def put(t, hook):
        c = run.frozen[hook.name]
        if c.dim() == 4:  # a pattern [1, H, T, T]
            c = c[..., : t.shape[-2], : t.shape[-1]]
        else:  # a scale [1, T, 1]
            c = c[:, : t.shape[1]]
            if t.dim() == c.dim() + 1:  # per-head copies of a norm's input: one scale per position
                c = c[:, :, None]
        return c.to(t.dtype).expand_as(t)

    return [(n, put) for n in run.frozen]


def frozen_forward(model, run: CleanRun, tc, embed, mlp_out, stop: Optional[int] = None) -> Dict:
    """The frozen model on B copies of the text, or of its first P positions: resid_pre 0 := `embed`
    [B, P, d], each MLP output := skip(x) + mlp_out(l, x) (mlp_out: layer, normalised input [B, P, d] ->
    the rest [B, P, d]). The frozen patterns are causal, so a prefix's values are the text's at those
    positions. Returns the normalised MLP inputs ("x", per layer) and the final residual ("final", full
    length only), in the graph."""
    B, P = embed.shape[0], embed.shape[1]
    L = model.cfg.n_layers
    caps: Dict = {"x": {}}

    def put_embed(t, hook):
        return embed.to(t.dtype)

    def keep_x(t, hook, l):
        caps["x"][l] = t
        return t.detach()  # the model's own MLP, whose output is replaced, records no graph

    def replace(t, hook, l):
        x = caps["x"][l].float()
        return (tc[l].skip(x) + mlp_out(l, x)).to(t.dtype)

    def keep_final(t, hook):
        caps["final"] = t

    hooks = _freeze_hooks(run) + [(act_name("resid_pre", 0), put_embed)]
    for l in range(L if stop is None else stop):
        hooks += [(input_hook(l), partial(keep_x, l=l)), (output_hook(l), partial(replace, l=l))]
    ids = run.tok.input_ids[:, :P].expand(B, -1)
    mask = run.tok.attention_mask[:, :P].expand(B, -1)
    extra = {"stop_at_layer": stop} if stop is not None else {}
    hooks += [] if stop is not None else [(final_resid_name(L), keep_final)]
    model.run_with_hooks(ids, mask, return_type=None, fwd_hooks=hooks, **extra)
    return caps


def reward_of(run: CleanRun, caps: Dict) -> torch.Tensor:
    """[B] the reward minus its bias, read from the frozen final residual."""
    return caps["final"][:, run.readout].float() @ run.readout_map.to(caps["final"].device)


# ---------------------------------------------------------------------------------------------------
# Columns: the sources, in circuit-tracer's order (features, errors, tokens), then the constant and reward.


@dataclass
class Columns:
    """Where each source lives: the active features (layer, position, feature) in `features` [n, 3],
    `offsets[l]` the first column of layer l's features; errors at n + l * T + p, tokens after them."""

    features: torch.Tensor
    offsets: List[int]
    T: int
    L: int

    @property
    def n_features(self) -> int:
        return int(self.features.shape[0])

    @property
    def error_start(self) -> int:
        return self.n_features

    @property
    def token_start(self) -> int:
        return self.n_features + self.L * self.T

    @property
    def constant(self) -> int:
        return self.token_start + self.T

    @property
    def reward(self) -> int:
        return self.constant + 1

    @property
    def n(self) -> int:
        return self.reward + 1


def columns(run: CleanRun) -> Columns:
    feats, offsets = [], []
    n = 0
    for l, a in enumerate(run.act):
        offsets.append(n)
        pos, feat = torch.nonzero(a > 0, as_tuple=True)
        feats.append(torch.stack([torch.full_like(pos, l), pos, feat], 1))
        n += len(pos)
    return Columns(torch.cat(feats).cpu(), offsets, run.embed.shape[0], run.n_layers)


def edges_from_grads(run: CleanRun, tc, cols: Columns, g_embed, g_mlp: Dict[int, torch.Tensor]):
    """[B, n_cols] the direct effects of every source on B targets whose gradients at the token writes
    (g_embed [B, P, d]) and at each layer's MLP-output write (g_mlp[l] [B, P, d]) are given, over the
    text's first P positions (the sources after them have no edge into these targets). A feature's edge is
    a * (g at its position . its decoder row): one batched product per position over the features active
    there (never the gradient against every decoder row)."""
    B, P = g_embed.shape[0], g_embed.shape[1]
    out = torch.zeros(B, cols.n)
    T = cols.T
    out[:, cols.token_start : cols.token_start + P] = (g_embed * run.embed[:P]).sum(-1).cpu()
    for l, g in g_mlp.items():
        start = cols.offsets[l]
        edges = _feature_edges(run, tc, cols, l, g)
        out[:, start : start + edges.shape[1]] = edges.cpu()
        e = cols.error_start + l * T
        out[:, e : e + P] = (g * run.err[l][:P]).sum(-1).cpu()
    return out


def _feature_edges(run: CleanRun, tc, cols: Columns, l: int, g: torch.Tensor) -> torch.Tensor:
    """[B, n] a * (g[:, p] . W_dec[i]) for layer l's active features (p, i) at the P positions of g, in
    column order (by position, then feature: `columns`' order), so the first n of the layer's columns."""
    P = g.shape[1]
    sel = cols.features[cols.offsets[l] : cols.offsets[l + 1] if l + 1 < cols.L else cols.n_features]
    sel = sel[sel[:, 1] < P]
    if not len(sel):
        return torch.zeros(g.shape[0], 0, device=g.device)
    pos, feat = sel[:, 1].to(g.device), sel[:, 2].to(g.device)
    counts = torch.bincount(pos, minlength=P)
    width = int(counts.max())
    slot = torch.arange(len(pos), device=g.device) - (torch.cumsum(counts, 0) - counts)[pos]
    rows = torch.zeros(P, width, g.shape[-1], dtype=torch.float32, device=g.device)
    rows[pos, slot] = tc[l].W_dec.float()[feat]
    per = torch.bmm(g.float().transpose(0, 1), rows.transpose(1, 2))  # [P, B, width]
    return per[pos, :, slot].T * run.act[l][pos, feat]


def _leaves(run: CleanRun, B: int, layers, P: Optional[int] = None) -> Tuple[torch.Tensor, Dict]:
    """Leaf copies of the token writes and of the MLP writes of `layers`, B of them, the first P
    positions (None: all)."""
    embed = run.embed[None, :P].expand(B, -1, -1).clone().requires_grad_(True)
    writes = {l: run.write[l][None, :P].expand(B, -1, -1).clone().requires_grad_(True) for l in layers}
    return embed, writes


def target_rows(
    model,
    run: CleanRun,
    tc,
    cols: Columns,
    targets: torch.Tensor,
    chunk: int = 32,
    out=None,
    bands: int = 16,
    grad_bytes: int = 2**26,
) -> torch.Tensor:
    """[n, n_cols] the incoming edges of feature targets [n, 3] (layer, position, feature): the direct
    effect of each source on the target's pre-activation, everything else frozen. The frozen map is
    linear, so one forward serves many targets: up to `chunk` targets of one layer share one batched
    backward (their gradients at that layer's normalised input are the one-hot position times the encoder
    row). It is causal too, so the targets are sorted by position and cut into up to `bands` bands (of at
    least 2 * chunk targets): each band's forward and backwards run over the text up to its last
    position alone. A backward holds its gradients at every layer below the target's, so a chunk is cut
    to keep them under `grad_bytes`. `out`: a [n, n_cols] tensor to fill instead."""
    rows = torch.zeros(len(targets), cols.n) if out is None else out
    if not len(targets):
        return rows
    order = torch.sort(targets[:, 1], stable=True).indices
    size = max(2 * chunk, -(-len(targets) // max(bands, 1))) if run.causal else len(targets)
    d = run.embed.shape[-1]
    for band in order.split(size):
        sub = targets[band]
        P = int(sub[:, 1].max()) + 1 if run.causal else cols.T
        top = int(sub[:, 0].max())
        with torch.enable_grad():
            embed, writes = _leaves(run, 1, range(top + 1), P)
            caps = frozen_forward(model, run, tc, embed, lambda m, x: writes[m], stop=top + 1)
            for l in sorted(set(sub[:, 0].tolist())):
                where = band[sub[:, 0] == l]
                x = caps["x"][l]  # [1, P, d]
                W_enc = tc[l].W_enc.to(x.dtype)
                leaves = [embed] + [writes[m] for m in range(l)]
                per_row = 4 * P * d * (l + 1)
                for idx in where.split(max(1, min(chunk, grad_bytes // per_row))):
                    pos, feat = targets[idx, 1].to(x.device), targets[idx, 2].to(W_enc.device)
                    seed = torch.zeros(len(idx), *x.shape, dtype=x.dtype, device=x.device)
                    seed[torch.arange(len(idx), device=x.device), 0, pos] = W_enc[feat].to(x.device)
                    grads = torch.autograd.grad(
                        x, leaves, seed, retain_graph=True, allow_unused=True, is_grads_batched=True
                    )
                    like = [leaf[None].expand(len(idx), -1, -1, -1) for leaf in leaves]
                    grads = [_or_zeros(g, w)[:, 0] for g, w in zip(grads, like)]
                    g_mlp = dict(zip(range(l), grads[1:]))
                    rows[idx] = edges_from_grads(run, tc, cols, grads[0], g_mlp)
                    del grads, g_mlp
    return rows


def _or_zeros(g, like):
    return torch.zeros_like(like) if g is None else g.detach().float()


def reward_row(model, run: CleanRun, tc, cols: Columns) -> torch.Tensor:
    """[n_cols] the reward's incoming edges (everything frozen)."""
    L = run.n_layers
    with torch.enable_grad():
        embed, writes = _leaves(run, 1, range(L))
        caps = frozen_forward(model, run, tc, embed, lambda m, x: writes[m])
        grads = torch.autograd.grad(reward_of(run, caps).sum(), [embed, *writes.values()], allow_unused=True)
    g_mlp = {m: _or_zeros(g, writes[m]) for m, g in zip(writes, grads[1:])}
    return edges_from_grads(run, tc, cols, _or_zeros(grads[0], embed), g_mlp)[0]


@torch.no_grad()
def constants(model, run: CleanRun, tc, targets: torch.Tensor) -> Tuple[torch.Tensor, float]:
    """(each target's constant [n], the reward's): the frozen model with every source zeroed (no token
    writes, each MLP writing b_dec alone), read at the targets' pre-activations minus b_enc and at the
    reward minus its bias."""
    embed = torch.zeros_like(run.embed)[None]
    caps = frozen_forward(model, run, tc, embed, lambda l, x: tc[l].b_dec.float().expand_as(x))
    out = torch.zeros(len(targets))
    for l in sorted(set(targets[:, 0].tolist())):
        where = torch.nonzero(targets[:, 0] == l).flatten()
        x = caps["x"][l][0].float()
        W = tc[l].W_enc.float()
        out[where] = (x[targets[where, 1]] * W[targets[where, 2]]).sum(-1).cpu()
    return out, float(reward_of(run, caps)[0])


def local_forward(model, run: CleanRun, tc, embed, shift: Dict, err: Dict) -> Dict:
    """The local replacement model: each MLP output := skip(x) + (mask * pre(x) + shift[l]) W_dec + b_dec
    + err[l], the clean active set `mask` frozen (so downstream features move with their inputs)."""

    def mlp_out(l, x):
        t = tc[l]
        a = (run.act[l] > 0).to(x.dtype) * t.pre(x) + shift[l]
        return t.decode(a) + err[l]

    return frozen_forward(model, run, tc, embed, mlp_out)


def total_effects(model, run: CleanRun, tc, cols: Columns) -> Tuple[torch.Tensor, float]:
    """([n_cols] each source's exact total effect on the reward in the local replacement model (features:
    a * d reward / d a; errors and tokens: write . gradient), the constant's total effect)."""
    L = run.n_layers
    with torch.enable_grad():
        embed = run.embed[None].clone().requires_grad_(True)
        shift = {l: torch.zeros_like(run.act[l])[None].requires_grad_(True) for l in range(L)}
        err = {l: run.err[l][None].clone().requires_grad_(True) for l in range(L)}
        caps = local_forward(model, run, tc, embed, shift, err)
        leaves = [embed, *shift.values(), *err.values()]
        grads = torch.autograd.grad(reward_of(run, caps).sum(), leaves, allow_unused=True)
    grads = [_or_zeros(g, v)[0] for g, v in zip(grads, leaves)]
    g_embed, g_shift, g_err = grads[0], grads[1 : 1 + L], grads[1 + L :]
    out = torch.zeros(cols.n)
    f = cols.features
    for l in range(L):
        sel = f[f[:, 0] == l]
        start = cols.offsets[l]
        out[start : start + len(sel)] = (run.act[l] * g_shift[l])[sel[:, 1], sel[:, 2]].cpu()
        e = cols.error_start + l * cols.T
        out[e : e + cols.T] = (g_err[l] * run.err[l]).sum(-1).cpu()
    out[cols.token_start : cols.token_start + cols.T] = (g_embed * run.embed).sum(-1).cpu()
    with torch.no_grad():
        zeros = {l: torch.zeros_like(run.err[l])[None] for l in range(L)}
        zero_shift = {l: torch.zeros_like(run.act[l])[None] for l in range(L)}
        caps = local_forward(model, run, tc, torch.zeros_like(embed), zero_shift, zeros)
        constant = float(reward_of(run, caps)[0])
    return out, constant
