"""The feature attribution graph (`attribution_graph(..., transcoders=tc)`), each number against an
independent computation: the model run through its own forward with TransformerLens hooks written here
(patterns and norm scales replaced by their clean values, every MLP output replaced by the transcoder's
skip plus what its sources write), never the graph code. Exactness does not need good transcoders: tiny ones
trained in the test for a few steps. fp32 tolerances: reward 1e-5 relative; pre-activations 5e-4; single
edges 1e-5 absolute + 1e-3 relative; total effects 1e-4."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import reward_lens as rl
from reward_lens.demo import synthetic
from reward_lens.instruments.circuits import graph_prune as gp
from reward_lens.model.hooks import act_name

L = 4


@pytest.fixture(scope="module")
def model():
    return rl.load_demo_model(device="cpu")


@pytest.fixture(scope="module")
def tc(model):
    texts = synthetic.training_pairs(80, 5, exclude=synthetic.held_out_pairs(1))
    return rl.train_transcoders(
        model, texts, d_tc=48, k=6, steps=25, batch_size=256, buffer_tokens=1024, progress=False
    )


@pytest.fixture(scope="module")
def graph(model, tc):
    pair = rl.demo_pairs()[7]
    ids = model.to_tokens(pair.prompt, pair.rejected)["input_ids"][0]
    return ids, rl.attribution_graph(model, input_ids=ids, transcoders=tc)


class Frozen:
    """The text's clean cache and the frozen model run on B copies through the model's own forward."""

    def __init__(self, model, tc, ids):
        self.model, self.tc, self.ids = model, tc, ids
        names = [act_name("scale")] + [
            act_name(k, l, **kw)
            for l in range(L)
            for k, kw in (("pattern", {}), ("scale", {"norm": "ln1"}), ("scale", {"norm": "ln2"}))
        ]
        _, cache = model.run_with_cache(ids[None])
        self.freeze = {n: cache[n] for n in names}
        self.x = [cache[act_name("normalized", l, norm="ln2")][0] for l in range(L)]
        self.y = [cache[act_name("mlp_out", l)][0] for l in range(L)]
        self.embed = cache[act_name("resid_pre", 0)][0]
        self.act = [tc[l].encode(self.x[l]) for l in range(L)]
        self.err = [self.y[l] - tc[l](self.x[l]) for l in range(L)]
        self.reward = float(model(ids[None]).detach())

    def run(self, B, mlp, embed=None):
        """(rewards [B], normalised MLP inputs per layer [B, T, d]): MLP l's output := skip(x) + mlp(l, x)."""
        xs = {}
        hooks = [(n, lambda t, hook, c=c: c.expand_as(t)) for n, c in self.freeze.items()]
        if embed is not None:
            hooks.append((act_name("resid_pre", 0), lambda t, hook: embed))
        for l in range(L):
            hooks.append((act_name("normalized", l, norm="ln2"), lambda t, hook, l=l: xs.__setitem__(l, t)))
            hooks.append(
                (act_name("mlp_out", l), lambda t, hook, l=l: xs[l] @ self.tc[l].W_skip.T + mlp(l, xs[l]))
            )
        r = self.model.run_with_hooks(self.ids[None].expand(B, -1), fwd_hooks=hooks)
        return r.detach(), xs

    def frozen(self, acts, errs, embed=None):
        """Every source frozen: MLP l writes acts[l] W_dec + b_dec + errs[l] beside its skip."""
        return self.run(
            acts[0].shape[0], lambda l, x: acts[l] @ self.tc[l].W_dec + self.tc[l].b_dec + errs[l], embed
        )

    def local(self, shift, errs, embed=None):
        """The local replacement model: features recomputed from x on the clean active set, plus shift."""

        def mlp(l, x):
            t = self.tc[l]
            a = (self.act[l] > 0).float() * (x @ t.W_enc.T + t.b_enc) + shift[l]
            return a @ t.W_dec + t.b_dec + errs[l]

        return self.run(shift[0].shape[0], mlp, embed)

    def copies(self, B):
        return (
            [a[None].repeat(B, 1, 1) for a in self.act],
            [e[None].repeat(B, 1, 1) for e in self.err],
            self.embed[None].repeat(B, 1, 1),
        )


def _col(g, name):
    return int(np.flatnonzero(g.nodes.node.to_numpy() == name)[0])


def _targets(g):
    """(layer, position, feature) of each feature row."""
    rows = g.nodes.iloc[g.row_nodes[:-1].numpy()]
    return rows.layer.to_numpy(), rows.position.to_numpy(), rows.feature.to_numpy()


def _pre(fz, xs, g):
    """[B, n_rows - 1] every feature target's pre-activation minus b_enc in a run."""
    lay, pos, feat = _targets(g)
    return torch.stack([xs[l][:, p] @ fz.tc[l].W_enc[i] for l, p, i in zip(lay, pos, feat)], 1).detach()


def test_reward_and_feature_conservation(model, tc, graph):
    ids, g = graph
    fz = Frozen(model, tc, ids)
    assert isinstance(g, rl.FeatureGraph) and g.meta["n_targets"] == g.meta["n_features"]
    assert abs(g.reward - fz.reward) <= 1e-5 * abs(fz.reward)
    incoming = float(g.rows[-1].sum())  # the reward's row: every source and the constant
    assert abs(incoming - (fz.reward - g.bias)) <= 1e-5 * abs(fz.reward - g.bias)
    lay, pos, feat = _targets(g)
    pre = np.array([float(fz.x[l][p] @ tc[l].W_enc[i]) for l, p, i in zip(lay, pos, feat)])
    got = g.rows[:-1].sum(1).numpy()
    assert np.all(np.abs(got - pre) <= 5e-4 * np.maximum(1.0, np.abs(pre)))
    nodes = g.nodes[g.nodes.kind == "feature"]
    assert len(nodes) == sum(int((a > 0).sum()) for a in fz.act)  # every active feature, every position
    assert np.allclose(nodes.activation, [float(fz.act[l][p, i]) for l, p, i in zip(*_targets(g))])
    assert g.completeness()["reward_error"] <= 1e-5 and g.completeness()["feature_error"] <= 5e-4


def test_direct_edges_are_interventions_with_everything_frozen(model, tc, graph):
    """Zeroing (or doubling) a source changes the reward and every downstream pre-activation by its
    edge: 100 random features, every error node and every token node, each in its own batch row."""
    ids, g = graph
    fz = Frozen(model, tc, ids)
    T = ids.shape[0]
    rng = np.random.default_rng(0)
    feats = g.nodes[g.nodes.kind == "feature"]
    assert len(feats) >= 100
    pick = feats.iloc[rng.choice(len(feats), 100, replace=False)]
    cases = [("f", r.layer, r.position, r.feature, s) for r in pick.itertuples() for s in (0.0, 2.0)]
    cases += [("e", l, p, -1, 0.0) for l in range(L) for p in range(T)]
    cases += [("t", -1, p, -1, s) for p in range(T) for s in (0.0, 2.0)]
    acts, errs, embed = fz.copies(len(cases))
    names = []
    for b, (what, l, p, i, s) in enumerate(cases):
        if what == "f":
            acts[l][b, p, i] *= s
            names.append(f"L{l}F{i}@{p}")
        elif what == "e":
            errs[l][b, p] *= s
            names.append(f"err:mlp_L{l}@{p}")
        else:
            embed[b, p] *= s
            names.append(f"E@{p}")
    base, base_xs = fz.frozen(*fz.copies(1)[:2])
    r, xs = fz.frozen(acts, errs, embed)
    d_reward = (r - base).numpy()
    d_pre = (_pre(fz, xs, g) - _pre(fz, base_xs, g)).numpy()
    for b, (name, case) in enumerate(zip(names, cases)):
        sign = case[4] - 1.0  # zeroing: -1 edge, doubling: +1 edge
        c = _col(g, name)
        w_reward, w_rows = float(g.rows[-1, c]), g.rows[:-1, c].numpy()
        assert abs(d_reward[b] - sign * w_reward) <= 1e-5 + 1e-3 * abs(w_reward), name
        assert np.all(np.abs(d_pre[b] - sign * w_rows) <= 1e-5 + 1e-3 * np.abs(w_rows)), name
    assert np.abs(g.rows[:-1, _col(g, "E@0")].numpy()).max() > 0  # the check moved something


def test_values_are_ablations_in_the_local_replacement_model(model, tc, graph):
    ids, g = graph
    fz = Frozen(model, tc, ids)
    T = ids.shape[0]
    feats = g.nodes[g.nodes.kind == "feature"].sort_values("value", key=abs, ascending=False).head(10)
    cases = [(r.node, "f", r.layer, r.position, r.feature) for r in feats.itertuples()]
    cases += [(f"err:mlp_L{l}@{p}", "e", l, p, -1) for l in range(L) for p in range(0, T, 5)]
    cases += [(f"E@{p}", "t", -1, p, -1) for p in range(0, T, 3)]
    B = len(cases) + 1
    shift = [torch.zeros(B, *a.shape) for a in fz.act]
    _, errs, embed = fz.copies(B)
    for b, (_, what, l, p, i) in enumerate(cases):
        if what == "f":
            shift[l][b, p, i] = -fz.act[l][p, i]  # the feature zeroed, downstream recomputed
        elif what == "e":
            errs[l][b, p] = 0
        else:
            embed[b, p] = 0
    for l in range(L):  # the last row: every source zeroed, the constant's total effect left
        errs[l][-1] = 0
    embed[-1] = 0
    r, _ = fz.local(shift, errs, embed)
    clean, _ = fz.local([torch.zeros(1, *a.shape) for a in fz.act], [e[None] for e in fz.err])
    assert abs(float(clean[0]) - fz.reward) <= 1e-5 * abs(fz.reward)  # the local model is exact here
    for b, (name, *_rest) in enumerate(cases):
        value = float(g.nodes.value[_col(g, name)])
        assert abs((fz.reward - float(r[b])) - value) <= 1e-4 * max(1.0, abs(value)), name
    constant = float(g.nodes.value[_col(g, "constant")])
    assert abs((float(r[-1]) - g.bias) - constant) <= 1e-4 * max(1.0, abs(constant))


def test_the_frozen_map_is_linear(model, tc, graph):
    """Hessian 0: the reward's second difference along two random source directions is zero, in the
    frozen model and in the local replacement model."""
    ids, _ = graph
    fz = Frozen(model, tc, ids)
    gen = torch.Generator().manual_seed(1)
    u, v = (torch.randn(fz.embed.shape, generator=gen) for _ in range(2))
    embed = torch.stack([fz.embed, fz.embed + u, fz.embed + v, fz.embed + u + v])
    acts, errs, _ = fz.copies(4)
    r, _ = fz.frozen(acts, errs, embed)
    assert abs(float(r[3] - r[1] - r[2] + r[0])) <= 1e-4 * float(r.abs().max())
    shift = [torch.zeros(4, *a.shape) for a in fz.act]
    r, _ = fz.local(shift, errs, embed)
    assert abs(float(r[3] - r[1] - r[2] + r[0])) <= 1e-4 * float(r.abs().max())
    assert abs(float(r[1] - r[0])) > 1e-2  # the directions move the reward


def _dense_scores(g):
    """circuit-tracer's replacement / completeness from the edge list, by the closed form of influence."""
    names = list(g.nodes.node)
    keep = [n for n in names if n != "constant"]
    index = {n: i for i, n in enumerate(keep)}
    N = len(keep)
    A = np.zeros((N, N))
    for s, t, w in zip(g.edges.source, g.edges.target, g.edges.weight):
        if s != "constant":
            A[index[t], index[s]] = w
    A = np.abs(A)
    A = A / np.maximum(A.sum(1, keepdims=True), 1e-10)
    w = np.zeros(N)
    w[index["reward"]] = 1
    influence = w @ (np.linalg.inv(np.eye(N) - A) - np.eye(N))
    kinds = g.nodes.set_index("node").loc[keep].kind.to_numpy()
    tok, err = influence[kinds == "embed"].sum(), influence[kinds == "error"].sum()
    non_error = 1 - A[:, kinds == "error"].sum(1)
    out = influence + w
    return {"replacement": tok / (tok + err), "completeness": (non_error * out).sum() / out.sum()}


def test_scores_and_pruning(graph):
    _, g = graph
    for graph_ in (g, g.prune(0.8, 0.98)):
        got, want = graph_.scores(), _dense_scores(graph_)
        for key in ("replacement", "completeness"):
            assert 0 <= got[key] <= 1 and abs(got[key] - want[key]) <= 1e-4, key
    small = g.prune(0.8, 0.98)
    assert len(small.nodes) < len(g.nodes)
    kinds = set(small.nodes.kind)
    assert {"embed", "reward", "constant"} <= kinds
    assert (small.nodes.kind == "embed").sum() == (g.nodes.kind == "embed").sum()
    edges, full = small.edges, g.edges.set_index(["source", "target"]).weight
    assert np.allclose(edges.weight, full.loc[list(zip(edges.source, edges.target))].to_numpy())
    assert float(small.rows[-1].sum()) != 0
    # every node reports its signed push on the reward: direct = its edge into the reward
    reward_row = g.rows[-1].numpy()
    assert np.allclose(g.nodes.direct, reward_row) and (g.nodes.value < 0).any() and (g.nodes.value > 0).any()
    # the influence is circuit-tracer's (the constant outside the normalised adjacency)
    rows = g.rows.clone()
    rows[:, _col(g, "constant")] = 0
    assert np.allclose(g.nodes.influence, gp.node_influence(rows, g.row_nodes, g.reward_node).numpy())


def test_html_view(graph):
    _, g = graph
    small = g.prune(0.8, 0.98)
    import re

    def same(html):  # each view has its own element id
        return re.sub(r"rl-graph-[0-9a-f]+", "rl-graph-id", html)

    page = g.html()  # pruned first: the graph has more than 600 nodes
    assert len(g.nodes) > 600 and same(page) == same(small.html())
    top = small.nodes[small.nodes.kind == "feature"].sort_values("influence").node.iloc[-1]
    assert top in page and "constant" not in page and "<svg" in page


def test_values_decompose_over_the_rows(graph):
    """A node's total effect is its direct edge plus, through each feature it feeds, edge / activation
    times that feature's total effect (active features move one for one with their pre-activation)."""
    _, g = graph
    nodes = g.nodes
    value = torch.tensor(nodes.value.to_numpy()).float()
    act = torch.tensor(nodes.activation.to_numpy()).float()
    targets = g.row_nodes[:-1]
    through = (g.rows[:-1] * (value[targets] / act[targets])[:, None]).sum(0)
    sources = torch.tensor(nodes.kind.isin(["feature", "error", "embed"]).to_numpy())
    want = (g.rows[-1] + through)[sources]
    assert torch.allclose(want, value[sources], atol=1e-4 * float(value.abs().max()))


def _influence_ordered(g, m):
    """The rows circuit-tracer would choose, written out from the rule with the full graph's rows: the
    reward's row first, then rounds of max(64, rows so far) features (at most 1,024, at most what is
    left), each the not-yet-chosen features of largest influence (power series over the row-normalised
    |rows| chosen so far, the constant outside; ties: the lower column)."""
    full = {int(n): g.rows[i] for i, n in enumerate(g.row_nodes)}
    n_features, reward, constant = g.meta["n_features"], g.reward_node, g.constant_node
    chosen = []
    while len(chosen) < m:
        nodes = torch.tensor(chosen + [reward])
        rows = torch.stack([full[n] for n in nodes.tolist()])
        rows[:, constant] = 0
        influence = gp.node_influence(rows, nodes, reward)
        rank = sorted((j for j in range(n_features) if j not in chosen), key=lambda j: (-influence[j], j))
        chosen += rank[: min(m - len(chosen), 1024, max(64, len(chosen)))]
    return chosen


def test_max_features_chooses_rows_by_influence(model, tc, graph):
    """max_features rows: the features circuit-tracer's influence-ordered rounds choose, each row equal to
    the full graph's row of that feature (fp32: 1e-6 of the largest edge), the reward's row unchanged;
    at least every active feature: the full graph."""
    ids, g = graph
    m = 150  # three rounds: 64, 64, 22
    small = rl.attribution_graph(model, input_ids=ids, transcoders=tc, max_features=m)
    assert small.meta["n_targets"] == m and len(small.rows) == m + 1
    assert small.row_nodes[:-1].tolist() == _influence_ordered(g, m)
    where = {int(n): i for i, n in enumerate(g.row_nodes)}
    want = g.rows[[where[int(n)] for n in small.row_nodes]]
    scale = float(want.abs().max())
    assert torch.allclose(small.rows, want, rtol=0, atol=1e-6 * scale)
    assert torch.allclose(small.rows[-1], g.rows[-1])
    # its influence is that of its own rows (the one-pass order equals the power series)
    rows = small.rows.clone()
    rows[:, small.constant_node] = 0
    series = gp.node_influence(rows, small.row_nodes, small.reward_node).numpy()
    assert np.allclose(small.nodes.influence, series, rtol=1e-5, atol=1e-7)
    # the chosen rows hold more of the full graph's feature influence than the same number by |value|
    feats = g.nodes.kind.to_numpy() == "feature"
    inf = g.nodes.influence.to_numpy()
    by_value = g.nodes[feats].value.abs().sort_values(ascending=False).index[:m]
    assert inf[small.row_nodes[:-1].numpy()].sum() > inf[by_value.to_numpy()].sum()
    n = g.meta["n_features"]
    every = rl.attribution_graph(model, input_ids=ids, transcoders=tc, max_features=n + 5)
    assert torch.equal(every.row_nodes, g.row_nodes) and torch.equal(every.rows, g.rows)
    plain = rl.attribution_graph(model, input_ids=ids)
    assert type(plain) is rl.AttributionGraph and "head" in set(plain.nodes.kind)


def test_ordered_influence_is_the_power_series(graph):
    """The one pass in decreasing layer equals circuit-tracer's power series, on every row and on a
    subset (fp32: 1e-5 relative)."""
    _, g = graph
    rows = g.rows.clone()
    rows[:, g.constant_node] = 0
    level = torch.tensor(g.nodes.layer.to_numpy()[g.row_nodes.numpy()]).long()
    use = torch.cat([torch.arange(0, len(g.row_nodes) - 1, 3), torch.tensor([len(g.row_nodes) - 1])])
    for subset in (None, use):
        got = gp.ordered_influence(g.rows, g.row_nodes, g.reward_node, level, subset, g.constant_node)
        sub = slice(None) if subset is None else subset
        want = gp.node_influence(rows[sub], g.row_nodes[sub], g.reward_node)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-7 * float(want.max()))


def test_rows_do_not_depend_on_how_targets_share_a_backward(model, tc, graph):
    """One forward serves many rows: 40 random targets (several layers, shuffled) one per backward, 64
    per batched backward, in one band over the whole text or in bands of 3 over prefixes, give the
    graph's own rows (fp32: 1e-6 of the largest edge; the constant's column is filled by the graph
    afterwards)."""
    from reward_lens.instruments.circuits import feature_build as fb
    from reward_lens.instruments.circuits.attribution_graph import _single

    ids, g = graph
    run = fb.clean_run(model, _single(model, ids), tc)
    cols = fb.columns(run)
    pick = torch.randperm(len(g.row_nodes) - 1, generator=torch.Generator().manual_seed(0))[:40]
    targets = cols.features[g.row_nodes[pick]]
    assert len(set(targets[:, 0].tolist())) > 1
    want = g.rows[pick].clone()
    want[:, g.constant_node] = 0
    scale = float(want.abs().max())
    assert scale > 0 and run.causal
    for kw in ({"chunk": 1}, {"chunk": 64}, {"chunk": 64, "bands": 1}, {"chunk": 1, "bands": 40}):
        got = fb.target_rows(model, run, tc, cols, targets, **kw)
        assert torch.allclose(got, want, rtol=0, atol=1e-6 * scale), kw
    cut = fb.target_rows(model, run, tc, cols, targets, grad_bytes=1)  # one row per backward
    assert torch.allclose(cut, want, rtol=0, atol=1e-6 * scale)


def test_a_set_trained_without_the_first_token_reads_no_feature_there(model, tc, graph):
    """`exclude_first_token`: no feature nodes at position 0 (its MLP output is the error node's, beside
    the skip and b_dec), the rest of the graph's active set as before, and the reward still conserved."""
    ids, g = graph
    flagged = rl.TranscoderSet(tc.transcoders, {**tc.config, "exclude_first_token": True})
    h = rl.attribution_graph(model, input_ids=ids, transcoders=flagged)
    feats, old = h.nodes[h.nodes.kind == "feature"], g.nodes[g.nodes.kind == "feature"]
    assert (old.position == 0).any() and not (feats.position == 0).any()
    assert set(feats.node) == set(old[old.position != 0].node)
    fz = Frozen(model, tc, ids)
    assert abs(float(h.rows[-1].sum()) - (fz.reward - h.bias)) <= 1e-5 * abs(fz.reward - h.bias)
    assert h.completeness()["reward_error"] <= 1e-5 and h.completeness()["feature_error"] <= 5e-4


def test_gate_organism_reward_is_conserved_with_its_gate_frozen(tc):
    """ArmoRM's gate is frozen at the clean text, as in the component graph: the reward's incoming edges
    still sum to the model's own reward minus the (gated) bias."""
    from reward_lens.demo.organisms import load_gate_organism

    model = load_gate_organism()
    pair = rl.demo_pairs()[0]
    ids = model.to_tokens(pair.prompt, pair.chosen)["input_ids"][0]
    g = rl.attribution_graph(model, input_ids=ids, transcoders=tc)
    reward = float(model(ids[None]).detach())
    assert abs(g.reward - reward) <= 1e-5 * abs(reward)
    assert abs(float(g.rows[-1].sum()) - (reward - g.bias)) <= 1e-5 * max(1.0, abs(reward - g.bias))


def test_bad_inputs(model, tc, graph):
    ids, _ = graph
    with pytest.raises(ValueError, match="load it first with reward_lens.load_transcoders"):
        rl.attribution_graph(model, input_ids=ids, transcoders="demo")
    with pytest.raises(ValueError, match="max_features"):
        rl.attribution_graph(model, input_ids=ids, transcoders=tc, max_features=-1)
    part = rl.TranscoderSet({0: tc[0]})
    with pytest.raises(ValueError, match=r"layers \[1, 2, 3\] have no transcoder"):
        rl.attribution_graph(model, input_ids=ids, transcoders=part)


@pytest.mark.parametrize("kind", ["qwen2_rm", "grm"])
def test_mlp_heads_and_attention_biases(kind, tmp_path):
    """An MLP head's ReLU masks are frozen at the clean text (Qwen2's q/k/v biases land in the constant):
    the reward's edges + constant = the model's own reward - its per-text bias, and each feature's rows
    = its pre-activation - b_enc. Random transcoders: exactness needs no training."""
    from mlp_reference import save_tiny

    model = rl.HookedRewardModel.from_pretrained(save_tiny(kind, tmp_path / kind))
    cfg = model.cfg
    gen = torch.Generator().manual_seed(3)
    sets = {}
    for l in range(cfg.n_layers):
        t = rl.Transcoder(cfg.d_model, 24, 4)
        with torch.no_grad():
            for p, scale in (
                (t.W_enc, 0.3),
                (t.b_enc, 0.3),
                (t.W_dec, 0.03),
                (t.b_dec, 0.1),
                (t.W_skip, 0.03),
            ):
                p.copy_(scale * torch.randn(p.shape, generator=gen))
        sets[l] = t
    tc = rl.TranscoderSet(sets)
    ids = torch.randint(3, 60, (11,), generator=gen)
    g = rl.attribution_graph(model, input_ids=ids, transcoders=tc)
    reward = float(model(ids[None]).detach())
    assert abs(g.reward - reward) <= 1e-5 * max(1.0, abs(reward))
    terms = float(g.rows[-1].abs().sum())  # fp32 sums of terms of this size: 1e-5 of it
    assert abs(float(g.rows[-1].sum()) - (reward - g.bias)) <= 1e-5 * max(1.0, terms)
    _, cache = model.run_with_cache(ids[None])
    lay, pos, feat = _targets(g)
    pre = np.array(
        [
            float(cache[act_name("normalized", l, norm="ln2")][0, p] @ tc[l].W_enc[i])
            for l, p, i in zip(lay, pos, feat)
        ]
    )
    assert np.all(np.abs(g.rows[:-1].sum(1).numpy() - pre) <= 5e-4 * np.maximum(1.0, np.abs(pre)))
    assert abs(float(g.rows[-1, _col(g, "constant")])) > 1e-4  # biases do reach the reward
