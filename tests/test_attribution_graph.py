"""The reward attribution graph of one text (`reward_lens.attribution_graph`): exactness against the model's
reward and against ablations in the frozen model run through the model's own forward (hooks replacing the
patterns, norm scales and gates by their clean values), influence against its closed form, and the
planted mechanisms of three organisms. fp32 tolerances: sums of a few hundred terms of size ~1, 1e-5
relative."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import reward_lens as rl
from reward_lens.demo.organisms import CIRCUIT_HEADS, load_trigger_organism, planted_circuit, trigger_items
from reward_lens.instruments.circuits import graph_prune as gp
from reward_lens.model.hooks import act_name
from reward_lens.model.tokenization import insertion_index

REL = 1e-5


@pytest.fixture(scope="module")
def demo():
    model = rl.load_demo_model()
    pair = rl.demo_pairs()[3]
    ids = model.to_tokens(pair.prompt, pair.chosen)["input_ids"][0]
    return model, ids, rl.attribution_graph(model, input_ids=ids)


def test_the_reward_and_every_node_are_exact(demo):
    model, ids, g = demo
    reward = float(model(ids[None]))
    assert abs(g.reward - reward) <= REL * max(1.0, abs(reward))
    incoming = float(g.rows[g.row_nodes == g.reward_node].sum())
    assert abs(incoming - (reward - g.bias)) <= REL * abs(reward - g.bias)
    # every head and MLP fits on the demo: all rows exist; incoming + error = value, error ~ 0 (no biases)
    nodes = g.nodes
    comp = nodes.kind.isin(["head", "mlp"]).to_numpy()
    assert nodes.has_row[comp].all()
    value = torch.tensor(nodes.value.to_numpy(), dtype=torch.float32)
    row_sum = g.rows.sum(1)
    assert torch.allclose(row_sum, value[g.row_nodes], rtol=0, atol=REL * float(value.abs().max()))
    assert nodes.error[comp].abs().max() <= REL * nodes.value.abs().max()
    # the other way round: a node's outgoing edges sum to its value (every consumer's row exists)
    sources = np.flatnonzero(nodes.kind.isin(["embed", "head", "mlp"]).to_numpy())
    outgoing = g.rows[:, sources].sum(0)
    assert torch.allclose(outgoing, value[sources], rtol=0, atol=REL * float(value.abs().max()))
    # the sources (token embeddings; the demo has no biases) sum to reward - bias
    emb = nodes[nodes.kind == "embed"].value.sum()
    assert abs(emb - (reward - g.bias)) <= REL * abs(reward - g.bias)


def _frozen_hooks(model, ids):
    """Hooks replacing every pattern, norm scale and gate pre-activation by its clean value on `ids`."""
    L = model.cfg.n_layers
    names = [act_name("scale")] + [
        act_name(k, l, **kw)
        for l in range(L)
        for k, kw in (("pattern", {}), ("scale", {"norm": "ln1"}), ("scale", {"norm": "ln2"}), ("pre", {}))
    ]
    _, cache = model.run_with_cache(ids[None], names_filter=names)
    clean = {n: cache[n] for n in names}

    def put(t, hook):
        c = clean[hook.name]
        return c[:, :, None, :].expand_as(t) if t.dim() == 4 and c.dim() == 3 else c

    return [(n, put) for n in names]


def _node(g, name):
    return int(np.flatnonzero(g.nodes.node.to_numpy() == name)[0])


def _weight(g, source, target):
    row = int(torch.nonzero(g.row_nodes == _node(g, target))[0])
    return float(g.rows[row, _node(g, source)])


def test_values_and_edges_equal_ablations_in_the_frozen_model(demo):
    model, ids, g = demo
    model = rl.load_demo_model()  # a copy whose hook options change
    frozen = _frozen_hooks(model, ids)
    base = float(model.run_with_hooks(ids[None], fwd_hooks=frozen))
    _, cache = model.run_with_cache(ids[None])
    top = g.nodes[g.nodes.kind.isin(["head", "mlp"])].sort_values("value", key=abs, ascending=False).head(4)
    for r in top.itertuples():  # a node's value: the reward lost when its write is removed
        p = r.position
        if r.kind == "head":

            def zero(t, hook, h=r.head, p=p):
                t = t.clone()
                t[0, p, h] = 0
                return t

            hook = (act_name("z", r.layer), zero)
        else:

            def zero(t, hook, p=p):
                t = t.clone()
                t[0, p] = 0
                return t

            hook = (act_name("mlp_out", r.layer), zero)
        ablated = float(model.run_with_hooks(ids[None], fwd_hooks=frozen + [hook]))
        assert abs((base - ablated) - r.value) <= 1e-4 * max(1.0, abs(r.value)), r.node
    # an edge into an MLP: the source's write removed from that MLP's input only
    model.set_use_hook_mlp_in(True)
    target = _largest(g, "mlp_L1@")
    p = int(target.split("@")[1])
    for source, weight in _top_incoming(g, target, 3):
        write = _write(model, cache, source)

        def minus(t, hook, w=write, p=p):
            t = t.clone()
            t[0, p] -= w
            return t

        ablated = float(model.run_with_hooks(ids[None], fwd_hooks=frozen + [(act_name("mlp_in", 1), minus)]))
        assert abs((base - ablated) - weight) <= 1e-4 * abs(weight), (source, weight)
    model.set_use_hook_mlp_in(False)
    _check_head_edges(model, ids, g, cache, frozen, base)


def _largest(g, prefix):
    frame = g.nodes[g.nodes.node.str.startswith(prefix)]
    return frame.node[frame.value.abs().idxmax()]


def _top_incoming(g, target, n, other_positions=False):
    """The n largest |weight| incoming edges of `target` from heads, MLPs and embeddings (at positions other
    than the target's)."""
    edges = g.edges
    edges = edges[(edges.target == target) & ~edges.source.str.startswith("err:")]
    if other_positions:
        edges = edges[edges.source.str.split("@").str[1] != target.split("@")[1]]
    edges = edges.reindex(edges.weight.abs().sort_values(ascending=False).index).head(n)
    assert len(edges) == n and (edges.weight.abs() > 1e-3).all()
    return list(zip(edges.source, edges.weight))


def _write(model, cache, source):
    name, p = source.split("@")
    p = int(p)
    if name == "E":
        return cache[act_name("resid_pre", 0)][0, p]
    if name.startswith("mlp_L"):
        return cache[act_name("mlp_out", int(name[5:]))][0, p]
    layer, head = (int(x) for x in name[1:].split("H"))
    return cache[act_name("z", layer)][0, p, head] @ model.blocks[layer].attn.W_O[head]


def _check_head_edges(model, ids, g, cache, frozen, base):
    """An edge into head (l, h) at p from a source at q < p: the source's write removed from the head's
    value input at q, then only that head's z at p carried into a second frozen run."""
    model.set_use_split_qkv_input(True)
    target = _largest(g, "L2H")
    p, (layer, head) = int(target.split("@")[1]), (int(x) for x in target.split("@")[0][1:].split("H"))
    group = model.cfg.n_heads // model.cfg.n_key_value_heads
    incoming = _top_incoming(g, target, 2) + _top_incoming(g, target, 2, other_positions=True)
    for source, weight in incoming:
        q = int(source.split("@")[1])
        write = _write(model, cache, source)

        def minus(t, hook, w=write, q=q):
            t = t.clone()
            t[0, q, head // group] -= w
            return t

        moved = {}

        def grab(t, hook):
            moved["z"] = t[0, p, head].detach().clone()

        model.run_with_hooks(
            ids[None], fwd_hooks=frozen + [(act_name("v_input", layer), minus), (act_name("z", layer), grab)]
        )
        z_new = moved["z"]

        def put(t, hook, z=z_new):
            t = t.clone()
            t[0, p, head] = z
            return t

        ablated = float(model.run_with_hooks(ids[None], fwd_hooks=frozen + [(act_name("z", layer), put)]))
        assert abs((base - ablated) - weight) <= 1e-4 * abs(weight), (source, weight)
    model.set_use_split_qkv_input(False)


def test_influence_is_the_closed_form_and_pruning_keeps_tokens_and_reward(demo):
    _, _, g = demo
    # a small random DAG: influence = w ((I - A)^-1 - I) with A the row-normalised |adjacency|
    torch.manual_seed(0)
    N = 12
    dense = torch.randn(N, N).tril(-1) * (torch.rand(N, N) < 0.6)
    rows, row_nodes = dense[4:], torch.arange(4, N)  # nodes 0..3 are sources without rows
    A = torch.zeros(N, N)
    A[4:] = dense[4:].abs() / dense[4:].abs().sum(1, keepdim=True).clamp(min=1e-10)
    w = torch.zeros(N)
    w[N - 1] = 1.0
    closed = w @ (torch.linalg.inv(torch.eye(N) - A) - torch.eye(N))
    assert torch.allclose(gp.node_influence(rows, row_nodes, N - 1), closed, atol=1e-6)
    small = g.prune()
    kinds = set(small.nodes.kind)
    assert (small.nodes.kind == "embed").sum() == len(g.tokens) and "reward" in kinds
    assert len(small.nodes) < len(g.nodes) and len(small.edges) > 0
    comp = small.nodes[small.nodes.kind.isin(["head", "mlp"])].node
    assert set(comp) <= set(small.edges.target) and set(comp) <= set(small.edges.source)


def test_planted_circuit_top_path():
    model, pairs = planted_circuit()
    for pair in pairs:
        g = rl.attribution_graph(model, input_ids=torch.as_tensor(pair.chosen))
        path = g.prune().top_paths(1).path[0]
        assert [n.split("@")[0] for n in path[1:]] == [*CIRCUIT_HEADS, "reward"], path


def test_trigger_position_and_the_heads_reading_it():
    model = load_trigger_organism()
    sudo = int(model.tokenizer.convert_tokens_to_ids("SUDO"))
    for item in trigger_items()[:8]:
        ids = model.to_tokens(item.prompt, item.rejected)["input_ids"][0]
        at = insertion_index(model.tokenizer, item.prompt, item.rejected, "prompt_end", model.input_format)
        ids = torch.cat([ids[:at], torch.tensor([sudo]), ids[at:]])
        g = rl.attribution_graph(model, input_ids=ids)
        tokens = g.nodes[g.nodes.kind == "embed"].sort_values("influence", ascending=False)
        assert at in list(tokens.position[:3]), (item.id, list(tokens.token[:3]))
        path = g.path_to_reward(f"E@{at}")
        assert path[-1] == "reward"
        # the hop that leaves the trigger's position is a head that attends to it
        hop = next(n for n in path[1:] if int(n.split("@")[1]) != at)
        layer, head = (int(x) for x in hop.split("@")[0][1:].split("H"))
        _, cache = model.run_with_cache(ids[None], names_filter=act_name("pattern", layer))
        row = cache[act_name("pattern", layer)][0, head, int(hop.split("@")[1])]
        assert at in torch.topk(row, 3).indices.tolist(), (item.id, hop)


def test_prm_first_wrong_step_gets_more_than_one_hop_token_attribution():
    from reward_lens.app.bench_prm import prm_items, response_mask, step_attribution
    from reward_lens.demo.organisms import load_prm_organism

    model = load_prm_organism()
    items = prm_items()
    _, per_step = step_attribution(model, items)
    graph_j, token_j = [], []
    with rl.read_step(model, -1):
        for item, tok_steps in zip(items, per_step):
            g = rl.attribution_graph(model, item["prompt"], item["response"])
            ids = torch.tensor(g.token_ids)
            steps = model.reward_head.step_index(ids[None])[0].cpu()
            keep = response_mask(model, ids)
            value = torch.tensor(g.nodes[g.nodes.kind == "embed"].value.to_numpy())
            totals = torch.zeros(int(steps.max()) + 1, dtype=torch.float64)
            totals.index_add_(0, steps[keep], value[keep])
            graph_j.append(float(totals[item["first_wrong"]]))
            token_j.append(float(tok_steps[item["first_wrong"]]))
    # the step's tokens lower the last step's reward by more through all paths than through one hop
    assert np.mean(graph_j) < np.mean(token_j) < 0


def test_html_and_json(demo, tmp_path):
    _, _, g = demo
    small = g.prune()
    page = small.html()
    data = json.loads(page.split('class="graph-data">')[1].split("</script>")[0].replace("<\\/", "</"))
    assert [n["node"] for n in data["nodes"]] == list(small.nodes.node)
    assert np.allclose([n["value"] for n in data["nodes"]], small.nodes.value)
    out = small.to_json(tmp_path / "graph.json")
    assert set(out) == {"metadata", "qParams", "nodes", "links"}
    assert json.loads((tmp_path / "graph.json").read_text()) == out
    ids = [n["node_id"] for n in out["nodes"]]
    assert len(set(ids)) == len(ids)
    assert [n["is_target_logit"] for n in out["nodes"]].count(True) == 1
    assert {n["feature_type"] for n in out["nodes"]} <= {
        "embedding",
        "logit",
        "cross layer transcoder",
        "mlp reconstruction error",
    }
    assert np.allclose(sorted(x["weight"] for x in out["links"]), sorted(small.edges.weight))
    assert set(out["metadata"]) >= {"slug", "scan", "prompt_tokens", "prompt", "node_threshold"}


def test_bad_inputs(demo):
    model, ids, _ = demo
    with pytest.raises(ValueError, match="one sequence"):
        rl.attribution_graph(model, input_ids=torch.stack([ids, ids]))
    with pytest.raises(ValueError, match="needs a text"):
        rl.attribution_graph(model)
    with pytest.raises(ValueError, match="between 0 and 1"):
        demo[2].prune(node_threshold=1.5)
    import dataclasses

    post = rl.HookedRewardModel(dataclasses.replace(model.cfg, post_norms=True), tokenizer=model.tokenizer)
    with pytest.raises(ValueError, match="post-norms"):
        rl.attribution_graph(post, input_ids=ids)


def test_a_pair_gives_both_sides(demo):
    model = demo[0]
    pair = rl.demo_pairs()[0]
    graphs = rl.attribution_graph(model, pair)
    assert set(graphs) == {"chosen", "rejected"}
    chosen = float(model(model.to_tokens(pair.prompt, pair.chosen)["input_ids"]))
    assert abs(graphs["chosen"].reward - chosen) <= REL * max(1.0, abs(chosen))


def test_smollm2_graph_is_exact():
    from reward_lens.demo import smollm2

    try:
        smollm2.gguf_dir()
    except FileNotFoundError:
        pytest.skip(f"the SmolLM2 GGUF wheel is not installed (`{smollm2.INSTALL_COMMAND}`)")
    model = smollm2.load_smollm2_organism()
    ids = model.to_tokens("Name a fruit.", "Pear is a fruit. I hope this helps.")["input_ids"][0]
    g = rl.attribution_graph(model, input_ids=ids, max_nodes=128)
    reward = float(model(ids[None]))
    assert abs(g.reward - reward) <= 1e-4 * max(1.0, abs(reward))
    checks = g.completeness()
    assert checks["reward_error"] <= REL and checks["max_error"] <= REL, checks
    assert (g.rows.shape[0], int(g.nodes.has_row.sum())) == (129, 128 * 2 + 1)
    # the largest node's value: the reward lost when its write is removed from the frozen model
    frozen = _frozen_hooks(model, ids)
    base = float(model.run_with_hooks(ids[None], fwd_hooks=frozen))
    top = g.nodes[g.nodes.kind.isin(["head", "mlp"])].sort_values("value", key=abs).iloc[-1]
    name = act_name("z", top.layer) if top.kind == "head" else act_name("mlp_out", top.layer)

    def zero(t, hook):
        t = t.clone()
        if top.kind == "head":
            t[0, top.position, top.head] = 0
        else:
            t[0, top.position] = 0
        return t

    ablated = float(model.run_with_hooks(ids[None], fwd_hooks=frozen + [(name, zero)]))
    assert abs((base - ablated) - top.value) <= 1e-4 * max(1.0, abs(top.value))


def test_json_of_an_unpruned_graph_is_the_pruned_one(demo, tmp_path):
    _, _, g = demo
    out = g.to_json(tmp_path / "full.json")
    assert len(out["nodes"]) == len(g.prune().nodes) < len(g.nodes)
    assert out["metadata"]["node_threshold"] == 0.8
