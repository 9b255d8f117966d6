"""TransformerLens's gradient tools and the Head Detector, run unchanged straight after loading: the
Attribution Patching Demo's gradient cells (`value.backward()` with forward and backward caching hooks),
TL 4.3's `tools.analysis.attribution_patch` (node and edge granularity) and `faithfulness` on its top edges,
and `head_detector.detect_head` on a bare string. Only the model, the tokens and the metric (a reward) are
swapped.

Every number is checked against a hand computation: gradients by `torch.autograd.grad` on the activations a
plain forward passes on (no backward hooks), edge scores as writer delta . reader gradient per position with
each head's write rebuilt as z @ W_O, faithfulness by rebuilding every reader's input from the writers'
contributions (kept ones live, the others the corrupt run's, plus the biases), attention patterns by softmax
of the cached rotated queries and keys. fp32; tolerance 1e-5 (gradient products 1e-5 relative to the
largest).
"""

from __future__ import annotations

import einops
import pytest
import torch
from helpers import tiny_hf_model
from transformer_lens import ActivationCache
from transformer_lens.head_detector import detect_head
from transformer_lens.tools.analysis import EdgeAttributionConfig, attribution_patch, faithfulness

from reward_lens import HookedRewardModel
from reward_lens.demo import demo_pairs, load_demo_model
from reward_lens.model.hooks import act_name

TOL = 1e-5


@pytest.fixture(scope="module")
def model():
    return load_demo_model(device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def tokens(model):
    """Clean / corrupt batches of equal width (the Attribution Patching Demo's IOI prompts: chosen /
    rejected responses), left-padded, passed without a mask."""
    ps = demo_pairs()[:4]
    clean = model.to_tokens([p.prompt for p in ps], [p.chosen for p in ps])["input_ids"]
    corrupt = model.to_tokens([p.prompt for p in ps], [p.rejected for p in ps])["input_ids"]
    T = min(clean.shape[1], corrupt.shape[1])
    return clean[:, -T:], corrupt[:, -T:]


def test_loaded_models_keep_gradients(model):
    assert all(p.requires_grad for p in model.parameters())  # as TransformerLens's models
    hf = tiny_hf_model("llama", num_key_value_heads=4)
    assert all(p.requires_grad for p in HookedRewardModel.from_hf_model(hf, device="cpu").parameters())


def test_the_librarys_instruments_take_no_weight_gradients(model):
    """While an instrument runs, no weight requires a gradient where autograd records (activation-only
    gradients: no weight-gradient graph is built); after, the weights are as loaded and hold no .grad."""
    import reward_lens as rl

    params = list(model.parameters())
    recorded = []
    handle = model.embed.register_forward_hook(
        lambda *a: recorded.append(torch.is_grad_enabled() and any(p.requires_grad for p in params))
    )
    pairs = demo_pairs()[:2]
    try:
        results = [
            rl.patch(model, pairs, progress=False),
            rl.attribution_patch(model, pairs, level=["component", "head"], progress=False),
            rl.attribute(model, pairs, progress=False),
            rl.edge_attribution(model, pairs, method="eap"),
            rl.path_patch(model, pairs, ["L0H0"], ["readout"]),
        ]
    finally:
        handle.remove()
    assert recorded and not any(recorded)
    assert all(p.requires_grad and p.grad is None for p in params)
    for res in results:
        assert not any(v.requires_grad for v in vars(res).values() if isinstance(v, torch.Tensor)), res


# ------------------------------------------------------------------ the Attribution Patching Demo's cells
def filter_not_qkv_input(name):
    return "_input" not in name


def get_cache_fwd_and_bwd(model, tokens, metric):
    """The demo's cell, unchanged."""
    model.reset_hooks()
    cache = {}

    def forward_cache_hook(act, hook):
        cache[hook.name] = act.detach()

    model.add_hook(filter_not_qkv_input, forward_cache_hook, "fwd")

    grad_cache = {}

    def backward_cache_hook(act, hook):
        grad_cache[hook.name] = act.detach()

    model.add_hook(filter_not_qkv_input, backward_cache_hook, "bwd")

    value = metric(model(tokens))
    value.backward()
    model.reset_hooks()
    return (
        value.item(),
        ActivationCache(cache, model),
        ActivationCache(grad_cache, model),
    )


def hand_gradients(model, tokens, metric, names):
    """d metric / d activation at each hook, by autograd.grad on the tensors the forward passes on."""
    kept = {}

    def keep(act, hook):
        kept[hook.name] = act

    value = metric(model.run_with_hooks(tokens, fwd_hooks=[(n, keep) for n in names]))
    grads = torch.autograd.grad(value, [kept[n] for n in names])
    return {n: g for n, g in zip(names, grads)}, {n: kept[n].detach() for n in names}


def test_attribution_patching_demo_gradient_cells(model, tokens):
    clean_tokens, corrupted_tokens = tokens
    with torch.no_grad():
        CLEAN_BASELINE = model(clean_tokens).mean().item()
        CORRUPTED_BASELINE = model(corrupted_tokens).mean().item()

    def reward_metric(rewards):  # the demo's ioi_metric with the reward in place of the logit difference
        return (rewards.mean() - CORRUPTED_BASELINE) / (CLEAN_BASELINE - CORRUPTED_BASELINE)

    model.zero_grad(set_to_none=True)
    clean_value, clean_cache, clean_grad_cache = get_cache_fwd_and_bwd(model, clean_tokens, reward_metric)
    corrupted_value, corrupted_cache, corrupted_grad_cache = get_cache_fwd_and_bwd(
        model, corrupted_tokens, reward_metric
    )
    assert abs(clean_value - 1.0) < TOL and abs(corrupted_value) < TOL
    # the demo's backward fills the weights' .grad, as in TransformerLens: the clean and corrupt runs summed
    W_R = model.reward_head.W_R
    assert W_R.grad is not None
    direct = [torch.autograd.grad(reward_metric(model(t)), W_R)[0] for t in (clean_tokens, corrupted_tokens)]
    assert torch.allclose(W_R.grad, direct[0] + direct[1], atol=TOL)
    model.zero_grad(set_to_none=True)

    # cache keys: the hooks TL enumerates, without the split inputs the filter drops
    assert set(corrupted_grad_cache.cache_dict) <= set(corrupted_cache.cache_dict)
    names = [act_name("resid_pre", l) for l in range(model.cfg.n_layers)]
    names += [act_name("z", l) for l in range(model.cfg.n_layers)] + [act_name("mlp_out", 1)]
    grads, acts = hand_gradients(model, corrupted_tokens, reward_metric, names)
    for n in names:
        assert torch.allclose(corrupted_grad_cache[n], grads[n], atol=TOL), n
        assert torch.allclose(corrupted_cache[n], acts[n], atol=TOL), n

    # attr_patch_residual: accumulated residual, (clean - corrupt) . corrupt gradient, per component and pos
    clean_residual, labels = clean_cache.accumulated_resid(-1, incl_mid=True, return_labels=True)
    corrupted_residual = corrupted_cache.accumulated_resid(-1, incl_mid=True)
    corrupted_grad_residual = corrupted_grad_cache.accumulated_resid(-1, incl_mid=True)
    residual_attr = einops.reduce(
        corrupted_grad_residual * (clean_residual - corrupted_residual),
        "component batch pos d_model -> component pos",
        "sum",
    )
    for i, label in enumerate(labels[::2][: model.cfg.n_layers]):
        n = act_name("resid_pre", i)
        expected = ((clean_cache[n] - acts[n]) * grads[n]).sum(dim=(0, 2))
        assert torch.allclose(residual_attr[2 * i], expected, atol=TOL), label

    # attr_patch_head_out: stack_head_results needs hook_result (use_attn_result), as in the demo
    model.set_use_attn_result(True)
    try:
        clean_value, clean_cache, _ = get_cache_fwd_and_bwd(model, clean_tokens, reward_metric)
        _, corrupted_cache, corrupted_grad_cache = get_cache_fwd_and_bwd(
            model, corrupted_tokens, reward_metric
        )
    finally:
        model.set_use_attn_result(False)
        model.zero_grad(set_to_none=True)
    clean_head_out, head_labels = clean_cache.stack_head_results(-1, return_labels=True)
    corrupted_head_out = corrupted_cache.stack_head_results(-1)
    corrupted_grad_head_out = corrupted_grad_cache.stack_head_results(-1)
    head_out_attr = einops.reduce(
        corrupted_grad_head_out * (clean_head_out - corrupted_head_out),
        "component batch pos d_model -> component pos",
        "sum",
    )
    n_heads = model.cfg.n_heads
    scale = float(head_out_attr.abs().max())
    for l in range(model.cfg.n_layers):
        z = act_name("z", l)
        for h in range(n_heads):
            dz = clean_cache[z][:, :, h] - corrupted_cache[z][:, :, h]
            # head h writes z_h @ W_O[h]: (its write's delta) . (d metric / d attn_out) = delta z_h . grad z_h
            expected = (dz * grads[z][:, :, h]).sum()
            got = head_out_attr[l * n_heads + h].sum()
            assert abs(float(got) - float(expected)) <= TOL * max(scale, 1.0), head_labels[l * n_heads + h]


# ------------------------------------------------------------------ the Head Detector on a bare string
def hand_patterns(model, ids):
    """[layer, head, q, k] attention patterns of one sequence, softmax of the cached rotated q . k."""
    _, cache = model.run_with_cache(ids)
    cfg = model.cfg
    group = cfg.n_heads // cfg.n_key_value_heads
    T = ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    out = []
    for l in range(cfg.n_layers):
        q = cache[act_name("rot_q", l)][0]  # [pos, head, d_head]
        k = cache[act_name("rot_k", l)][0].repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
        out.append(scores.masked_fill(~causal, float("-inf")).softmax(-1))
    return torch.stack(out)


def mul_score(pattern, detection):
    return float((pattern * detection).sum() / pattern.sum())


def test_head_detector_runs_on_a_bare_string(model):
    text = "The cat sat on the mat. The cat sat on the mat."
    tok = model.tokenizer
    ids = torch.tensor([[tok.bos_token_id] + tok(text, add_special_tokens=False)["input_ids"]])
    assert torch.equal(model.to_tokens(text), ids)  # TL's meaning: BOS + the text's ids
    assert model.to_str_tokens(text) == [tok.decode([t]) for t in ids[0].tolist()]  # one length, one BOS
    assert torch.equal(model.to_tokens(text, prepend_bos=False), ids[:, 1:])
    _, cache = model.run_with_cache(text)  # run_with_cache(text) sees the same ids
    patterns = hand_patterns(model, ids)
    assert torch.allclose(cache["pattern", 0], patterns[0][None], atol=TOL)
    T = ids.shape[1]
    prev = torch.zeros(T, T)
    prev[1:, :-1] = torch.eye(T - 1)
    same = (ids[0][:, None] == ids[0][None, :]).float().tril(-1)
    induction = torch.zeros(T, T)
    induction[:, 1:] = same[:, :-1]
    for name, detection in (
        ("previous_token_head", prev),
        ("duplicate_token_head", same),
        ("induction_head", induction),
    ):
        scores = detect_head(model, text, name)
        assert scores.shape == (model.cfg.n_layers, model.cfg.n_heads)
        for l in range(model.cfg.n_layers):
            for h in range(model.cfg.n_heads):
                assert abs(float(scores[l, h]) - mul_score(patterns[l, h], detection)) < TOL, (name, l, h)
    custom = detect_head(model, text, prev, exclude_bos=True, error_measure="abs")
    p = patterns.clone()
    diff = (p - prev).abs()
    diff[..., 0] = 0
    expected = 1 - (diff.mean(dim=(-2, -1)) * T * 1000).round() / 1000
    assert torch.allclose(custom, expected, atol=1e-3)


# ------------------------------------------------------------------ tools.analysis: EAP and faithfulness
@pytest.fixture(scope="module")
def mha():
    """A tiny non-grouped-query Llama reward model (TL refuses grouped-query edges by design)."""
    hf = tiny_hf_model("llama", num_key_value_heads=4)
    return HookedRewardModel.from_hf_model(hf, device="cpu")


@pytest.fixture(scope="module")
def mha_tokens():
    g = torch.Generator().manual_seed(0)
    clean = torch.randint(3, 97, (2, 6), generator=g)
    corrupt = clean.clone()
    corrupt[:, 1:4] = torch.randint(3, 97, (2, 3), generator=g)
    return clean, corrupt


def metric(rewards):
    return rewards.sum()


def writer_contributions(model, ids):
    """(writer name, layer, head) -> [pos, d_model]: embed, each head's z @ W_O[h], each MLP's output."""
    L = model.cfg.n_layers
    names = ["hook_embed"] + [act_name(k, l) for l in range(L) for k in ("z", "mlp_out")]
    with torch.no_grad():
        _, cache = model.run_with_cache(ids, names_filter=names)
    out = {("embed", None, None): cache["hook_embed"][0]}
    for l in range(L):
        W_O = model.blocks[l].attn.W_O.detach()
        for h in range(model.cfg.n_heads):
            out[("attn_head_out", l, h)] = cache[act_name("z", l)][0, :, h] @ W_O[h]
        out[("mlp_out", l, None)] = cache[act_name("mlp_out", l)][0]
    return out


def reader_gradients(model, ids):
    """(reader kind, layer, head) -> [pos, d_model]: d metric / d each reader's input (autograd.grad)."""
    L = model.cfg.n_layers
    names = [act_name(k, l) for l in range(L) for k in ("q_input", "k_input", "v_input", "mlp_in")]
    names.append(act_name("resid_post", L - 1))
    model.set_use_split_qkv_input(True)
    model.set_use_hook_mlp_in(True)
    try:
        grads, _ = hand_gradients(model, ids, metric, names)
    finally:
        model.set_use_split_qkv_input(False)
        model.set_use_hook_mlp_in(False)
    out = {("logits", L - 1, None): grads[names[-1]][0]}
    for l in range(L):
        for kind in ("q_input", "k_input", "v_input"):
            for h in range(model.cfg.n_heads):
                out[(kind, l, h)] = grads[act_name(kind, l)][0, :, h]
        out[("mlp_in", l, None)] = grads[act_name("mlp_in", l)][0]
    return out


def key(node):
    return (node.kind, node.layer, node.head)


def test_tl_edge_attribution_patch_is_per_position_eap(mha, mha_tokens):
    clean, corrupt = mha_tokens
    result = attribution_patch(mha, clean, corrupt, metric, EdgeAttributionConfig(granularity="edge"))
    L, n, T = mha.cfg.n_layers, mha.cfg.n_heads, clean.shape[1]
    per_position_readers = L * (3 * n + 1) + 1
    assert len(result.edge_scores) == T * sum(
        (1 + l * (n + 1)) * 3 * n + (1 + l * (n + 1) + n) for l in range(L)
    ) + T * (1 + L * (n + 1))
    assert per_position_readers == len({key(r) for _, r in result.edge_scores})
    expected = {}
    for b in range(clean.shape[0]):
        clean_w = writer_contributions(mha, clean[b : b + 1])
        deltas = {k: clean_w[k] - v for k, v in writer_contributions(mha, corrupt[b : b + 1]).items()}
        grads = reader_gradients(mha, corrupt[b : b + 1])
        for (writer, reader), _ in result.edge_scores.items():
            value = float(deltas[key(writer)][writer.position] @ grads[key(reader)][reader.position])
            expected[(writer, reader)] = expected.get((writer, reader), 0.0) + value / clean.shape[0]
    scale = max(abs(v) for v in expected.values())
    worst = max(abs(result.edge_scores[e] - v) for e, v in expected.items())
    assert worst <= TOL * scale, (worst, scale)
    # each writer's aggregate over its edges is its node score (TL's identity, through the logits reader)
    node = attribution_patch(mha, clean, corrupt, metric)
    for k, v in node.node_scores.items():
        assert abs(result.node_scores[k] - v) <= TOL * scale, k
    assert all(p.grad is None for p in mha.parameters())  # autograd.grad: no weight gradient kept
    assert not (mha.cfg.use_split_qkv_input or mha.cfg.use_attn_result or mha.cfg.use_hook_mlp_in)


def ablated_metric(model, clean, corrupt, kept):
    """The metric with every edge outside `kept` ablated: each reader's input rebuilt from the writers' live
    contributions (kept edges) or the corrupt run's (the others), plus the attention output biases."""
    L, n = model.cfg.n_layers, model.cfg.n_heads
    corrupt_w = writer_contributions(model, corrupt)
    live = {}
    kept = {(key(w), w.position, key(r), r.position) for w, r, *_ in kept}

    def rebuilt(reader, pos, layer_limit, with_own_heads):
        total = torch.zeros(model.cfg.d_model)
        writers = [("embed", None, None)]
        for l in range(layer_limit + (1 if with_own_heads else 0)):
            writers += [("attn_head_out", l, h) for h in range(n)]
            if l < layer_limit:
                writers.append(("mlp_out", l, None))
        for l in range(layer_limit + (1 if with_own_heads else 0)):
            total = total + model.blocks[l].attn.b_O.detach()
        for w in writers:
            source = live if (w, pos, reader, pos) in kept else corrupt_w
            total = total + source[w][pos]
        return total

    def on_embed(act, hook):
        live[("embed", None, None)] = act[0].detach()

    def on_z(act, hook):
        l = int(hook.name.split(".")[1])
        for h in range(n):
            live[("attn_head_out", l, h)] = act[0, :, h].detach() @ model.blocks[l].attn.W_O[h].detach()

    def on_mlp_out(act, hook):
        live[("mlp_out", int(hook.name.split(".")[1]), None)] = act[0].detach()

    def on_reader(kind):
        def hook_fn(act, hook):
            l = int(hook.name.split(".")[1])
            out = act.clone()
            for pos in range(act.shape[1]):
                if kind in ("q_input", "k_input", "v_input"):
                    for h in range(n):
                        out[0, pos, h] = rebuilt((kind, l, h), pos, l, False)
                elif kind == "mlp_in":
                    out[0, pos] = rebuilt(("mlp_in", l, None), pos, l, True)
                else:
                    out[0, pos] = rebuilt(("logits", L - 1, None), pos, L, False)
            return out

        return hook_fn

    fwd = [("hook_embed", on_embed)]
    for l in range(L):
        fwd += [(act_name(k, l), on_reader(k)) for k in ("q_input", "k_input", "v_input")]
        fwd += [(act_name("z", l), on_z), (act_name("mlp_in", l), on_reader("mlp_in"))]
        fwd += [(act_name("mlp_out", l), on_mlp_out)]
    fwd.append((act_name("resid_post", L - 1), on_reader("logits")))
    model.set_use_split_qkv_input(True)
    model.set_use_hook_mlp_in(True)
    try:
        with torch.no_grad():
            return float(metric(model.run_with_hooks(clean, fwd_hooks=fwd)))
    finally:
        model.set_use_split_qkv_input(False)
        model.set_use_hook_mlp_in(False)


@pytest.mark.parametrize("k", [0, 40, 400])
def test_tl_faithfulness_on_the_top_edges_equals_rebuilt_readers(mha, mha_tokens, k):
    clean, corrupt = (t[:1] for t in mha_tokens)
    ranked = attribution_patch(mha, clean, corrupt, metric, EdgeAttributionConfig(granularity="edge"))
    top = ranked.top_edges(k)
    result = faithfulness(mha, clean, corrupt, metric, top)
    with torch.no_grad():
        m_clean, m_corrupt = float(metric(mha(clean))), float(metric(mha(corrupt)))
    assert abs(result.full_metric - m_clean) < TOL and abs(result.corrupt_metric - m_corrupt) < TOL
    expected = (ablated_metric(mha, clean[0:1], corrupt[0:1], top) - m_corrupt) / (m_clean - m_corrupt)
    assert abs(result.recovered - expected) < 1e-4, (result.recovered, expected)
    if k == 0:
        assert abs(result.recovered) < 1e-4  # every edge ablated: the corrupt metric


def test_tl_faithfulness_of_the_whole_graph_is_one(mha, mha_tokens):
    clean, corrupt = (t[:1] for t in mha_tokens)
    ranked = attribution_patch(mha, clean, corrupt, metric, EdgeAttributionConfig(granularity="edge"))
    result = faithfulness(mha, clean, corrupt, metric, list(ranked.edge_scores))
    assert abs(result.recovered - 1.0) < 1e-4


def test_tl_node_attribution_runs_on_the_grouped_query_demo_and_edges_are_refused(model, tokens):
    clean, corrupt = tokens
    with torch.no_grad():
        base = model(corrupt)

    def reward_gap(rewards):
        return rewards.sum() - base.sum()

    result = attribution_patch(model, clean[:1], corrupt[:1], reward_gap)
    grads, acts = hand_gradients(model, corrupt[:1], reward_gap, [act_name("z", 2), act_name("mlp_out", 1)])
    _, clean_cache = model.run_with_cache(clean[:1])
    for node, score in result.node_scores.items():
        if node.kind == "attn_head_out" and node.layer == 2:
            n = act_name("z", 2)
            d = clean_cache[n][0, node.position, node.head] - acts[n][0, node.position, node.head]
            assert abs(score - float(d @ grads[n][0, node.position, node.head])) < TOL, node
        if node.kind == "mlp_out" and node.layer == 1:
            n = act_name("mlp_out", 1)
            d = clean_cache[n][0, node.position] - acts[n][0, node.position]
            assert abs(score - float(d @ grads[n][0, node.position])) < TOL, node
    with pytest.raises(ValueError, match="GQA"):
        edges = EdgeAttributionConfig(granularity="edge")
        attribution_patch(model, clean[:1], corrupt[:1], reward_gap, edges)
