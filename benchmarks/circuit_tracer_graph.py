"""circuit-tracer's own attribution against reward-lens's feature graph: the demo RM's trunk as a causal LM
with the demo transcoders (JumpReLU export), `attribute(ids, model, attribution_targets=[CustomTarget(
"reward", 1.0, w_r)])`, compared edge by edge with `attribution_graph(model, input_ids=ids, transcoders=tc)`.

    # 1. reward-lens's venv: the trunk, w_r, the text and our graph (and the JumpReLU export if missing)
    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/circuit_tracer_graph.py export /tmp/tc_formats
    # 2. circuit-tracer's venv (see benchmarks/circuit_tracer_transcoders.py for the install)
    OMP_NUM_THREADS=1 /work/venvs/circuit-tracer/bin/python benchmarks/circuit_tracer_graph.py compare \
        /tmp/tc_formats

circuit-tracer's model is built from a HookedTransformerConfig with the trunk's weights (the RM's
TransformerLens-named state dict; RMSPre norms, so `unembed.hook_pre`, where circuit-tracer injects the
target vector, is resid / scale and the target is w_r = model.reward_direction); its unembedding is zero and
unused (the custom target carries the direction).
circuit-tracer treats the first (BOS) position's MLP as a constant: it zeroes that position's features and its
error (`zero_positions`), so none of its nodes carries what the MLPs write there, while reward-lens keeps
them as nodes. The check compares every edge between the nodes both graphs have (features at positions > 0,
errors at positions > 0, every token, the reward; our position-0 features are never sources there) and checks
that circuit-tracer's position-0 error columns are all zero. Goal: max |difference| <= 1e-5 (absolute, and
relative to the largest edge).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def export(out: Path) -> None:
    import torch
    from safetensors.torch import save_file

    import reward_lens as rl
    from reward_lens.demo import synthetic

    torch.manual_seed(0)
    model = rl.load_demo_model(device="cpu")
    if not (out / "circuit_tracer" / "config.yaml").exists():
        calibration = synthetic.training_pairs(1000, 41, exclude=synthetic.held_out_pairs(1))
        rl.jumprelu_from_topk(rl.load_transcoders("demo"), model, calibration).save(
            out / "circuit_tracer", format="circuit-tracer"
        )
    tc = rl.load_transcoders(out / "circuit_tracer")  # the very files circuit-tracer loads
    pair = rl.demo_pairs()[0]
    ids = model.to_tokens(pair.prompt, pair.chosen)["input_ids"][0]
    g = rl.attribution_graph(model, input_ids=ids, transcoders=tc)
    sd = {k: v for k, v in model.state_dict().items() if not k.startswith(("reward_head", "rotary"))}
    inv_freq = model.state_dict()["rotary.inv_freq"]
    kinds = {"feature": 0, "error": 1, "embed": 2, "constant": 3, "reward": 4}
    nodes = g.nodes
    tensors = {
        **{f"trunk.{k}": v.float().contiguous() for k, v in sd.items()},
        "input_ids": ids,
        "w_r": model.reward_direction.float(),
        "rows": g.rows.float(),
        "row_nodes": g.row_nodes,
        "node_kind": torch.tensor([kinds[k] for k in nodes.kind]),
        "node_layer": torch.tensor(nodes.layer.to_numpy()),
        "node_position": torch.tensor(nodes.position.to_numpy()),
        "node_feature": torch.tensor(nodes.feature.to_numpy()),
    }
    save_file(tensors, str(out / "graph.safetensors"))
    c = model.cfg
    cfg = {
        k: getattr(c, k)
        for k in (
            "n_layers",
            "d_model",
            "n_heads",
            "d_head",
            "d_mlp",
            "d_vocab",
            "n_ctx",
            "n_key_value_heads",
            "act_fn",
            "normalization_type",
            "eps",
            "positional_embedding_type",
            "rotary_dim",
        )
    }
    # inv_freq[i] = base^(-2i / rotary_dim)
    base = float(inv_freq[1].double().log().div(-2.0 / c.rotary_dim).exp())
    cfg["rotary_base"] = round(base) if abs(base - round(base)) < 1e-6 * base else base  # float32 inv_freq
    cfg["gated_mlp"] = True
    info = {
        "cfg": cfg,
        "reward": g.reward,
        "bias": g.bias,
        "scores": g.scores(),
        "n_nodes": int(g.rows.shape[1]),
    }
    (out / "graph.json").write_text(json.dumps(info, indent=1))
    print(json.dumps(info, indent=1))


def compare(out: Path) -> int:
    import torch
    from circuit_tracer import attribute
    from circuit_tracer.attribution.targets import CustomTarget
    from circuit_tracer.replacement_model.replacement_model_transformerlens import (
        TransformerLensReplacementModel,
    )
    from circuit_tracer.utils.caching import load_transcoders_from_cache
    from safetensors.torch import load_file
    from transformer_lens import HookedTransformerConfig
    from transformers import PreTrainedTokenizerFast

    torch.set_grad_enabled(True)
    info = json.loads((out / "graph.json").read_text())
    t = load_file(str(out / "graph.safetensors"))
    cfg = HookedTransformerConfig(
        **info["cfg"], device="cpu", dtype=torch.float32, original_architecture="LlamaForCausalLM"
    )
    model = TransformerLensReplacementModel(cfg)
    sd = {k[len("trunk.") :]: v for k, v in t.items() if k.startswith("trunk.")}
    for k in list(sd):  # grouped-query attention: TransformerLens stores K and V per KV head as _W_K ...
        if k.endswith((".attn.W_K", ".attn.W_V", ".attn.b_K", ".attn.b_V")):
            head, name = k.rsplit(".", 1)
            sd[f"{head}._{name}"] = sd.pop(k)
    sd["unembed.W_U"] = torch.zeros(cfg.d_model, cfg.d_vocab)
    sd["unembed.b_U"] = torch.zeros(cfg.d_vocab)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not k.endswith(("IGNORE", "mask", "rotary_sin", "rotary_cos"))]
    assert not missing and not unexpected, (missing, unexpected)
    tokenizer_file = Path(__file__).resolve().parents[1] / "reward_lens" / "demo" / "tokenizer.json"
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(tokenizer_file), bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    model.tokenizer = tokenizer  # set_tokenizer would reload it by name from the hub
    assert int(t["input_ids"][0]) == tokenizer.bos_token_id  # so circuit-tracer prepends nothing
    ct_dir = out / "circuit_tracer"
    transcoders, _ = load_transcoders_from_cache(
        ct_dir.name, cache_dir=ct_dir.parent, device=torch.device("cpu"), dtype=torch.float32
    )
    model._configure_replacement_model(transcoders)
    ids = t["input_ids"]
    target = CustomTarget(token_str="reward", prob=1.0, vec=t["w_r"])
    graph = attribute(ids, model, attribution_targets=[target], batch_size=64)
    A = graph.adjacency_matrix.double()
    L, T = cfg.n_layers, len(ids)
    feats = graph.active_features[graph.selected_features]  # (layer, pos, feature) of each feature row/col
    n_f = len(feats)
    ct_index = {("feature", int(a), int(b), int(c)): i for i, (a, b, c) in enumerate(feats.tolist())}
    for l in range(L):
        for p in range(T):
            ct_index[("error", l, p, -1)] = n_f + l * T + p
    for p in range(T):
        ct_index[("embed", -1, p, -1)] = n_f + L * T + p
    ct_index[("reward", -1, -1, -1)] = A.shape[0] - 1

    names = {0: "feature", 1: "error", 2: "embed", 3: "constant", 4: "reward"}
    kind, layer, pos, feat = (
        t[k].tolist() for k in ("node_kind", "node_layer", "node_position", "node_feature")
    )
    ours_key = []
    for k, l, p, f in zip(kind, layer, pos, feat):
        k = names[k]
        ours_key.append((k, l if k in ("feature", "error") else -1, p if k != "reward" else -1, f))
    rows, row_nodes = t["rows"].double(), t["row_nodes"].tolist()
    only_ours = {k for k in ours_key if k[0] == "feature" and k[2] > 0} - set(ct_index)
    only_theirs = {k for k in ct_index if k[0] == "feature"} - set(ours_key)
    if only_ours or only_theirs:
        print(
            f"features only in ours: {sorted(only_ours)[:10]} ({len(only_ours)}); only in circuit-tracer: "
            f"{sorted(only_theirs)[:10]} ({len(only_theirs)})"
        )
    bos_feature = torch.tensor([k[0] == "feature" and k[2] == 0 for k in ours_key])
    ct_feats_pos = {k for k in ct_index if k[0] == "feature"}
    ours_feats = {k for k in ours_key if k[0] == "feature" and k[2] > 0}
    # Our columns folded onto circuit-tracer's: each of our sources adds into its circuit-tracer column
    # (our features at position 0 into the error node (l, 0)); the constant has no column there.
    fold = torch.zeros(len(ours_key), A.shape[1], dtype=torch.float64)
    for j, src in enumerate(ours_key):
        if src[0] == "constant" or src[0] == "reward":
            continue
        key = ("error", src[1], 0, -1) if bos_feature[j] else src
        fold[j, ct_index[key]] = 1.0
    keep = [r for r, node in enumerate(row_nodes) if not bool(bos_feature[node])]
    ours = rows[keep] @ fold  # [targets, circuit-tracer columns]
    theirs = A[[ct_index[ours_key[row_nodes[r]]] for r in keep]]
    if os.environ.get("DUMP"):
        col_keys = [None] * A.shape[1]
        for k, i in ct_index.items():
            col_keys[i] = k
        row_keys = [ours_key[row_nodes[r]] for r in keep]
        torch.save({"ours": ours, "theirs": theirs, "rows": row_keys, "cols": col_keys}, out / "dump.pt")
    # circuit-tracer zeroes the MLP error at position 0 as well (its error_vectors[:, 0] = 0): the BOS
    # position's MLP writes enter no node there, so those columns are compared as "all zero there"
    bos_err = [ct_index[("error", l, 0, -1)] for l in range(L)]
    other = [c for c in range(A.shape[1]) if c not in set(bos_err)]
    bos_zero = bool((theirs[:, bos_err] == 0).all())
    bos_ours = float(ours[:, bos_err].abs().max())
    n_edges = int(ours[:, other].numel())
    n_bos = int(bos_feature.sum())
    diff = float((ours[:, other] - theirs[:, other]).abs().max())
    scale = float(ours[:, other].abs().max())
    reward_diff = float((ours[-1, other] - theirs[-1, other]).abs().max())
    result = {
        "text_tokens": T,
        "features_ours": int(sum(1 for k in ours_key if k[0] == "feature")),
        "features_circuit_tracer": n_f,
        "same_feature_set_beyond_position_0": ours_feats == ct_feats_pos,
        "edges_compared": n_edges,
        "position_0_features_ours": n_bos,
        "circuit_tracer_position_0_error_columns_all_zero": bos_zero,
        "ours_position_0_mlp_columns_max_abs": bos_ours,
        "max_abs_diff_reward_row": reward_diff,
        "target_rows_compared": len(keep),
        "max_abs_diff": diff,
        "max_abs_edge": scale,
        "max_rel_diff": diff / scale,
        "reward_minus_bias_ours": info["reward"] - info["bias"],
    }
    print(json.dumps(result, indent=1))
    ok = result["same_feature_set_beyond_position_0"] and bos_zero and diff <= 1e-5 and diff / scale <= 1e-5
    print(
        f"circuit-tracer's adjacency equals reward-lens's: max |diff| {diff:.2e} (goal <= 1e-5): "
        f"{'met' if ok else 'MISSED'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("export", "compare"):
        sys.exit(__doc__)
    if sys.argv[1] == "export":
        export(Path(sys.argv[2]))
    else:
        sys.exit(compare(Path(sys.argv[2])))
