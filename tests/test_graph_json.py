"""The feature graph as Neuronpedia's graph file, and its view with each feature's top activating texts.

- The JSON validates (jsonschema, draft-07 as the viewer's Ajv) against Neuronpedia's own graph schema,
  vendored in tests/data/neuronpedia/ (source and commit in its README).
- The viewer's replacement and completeness, computed here from the file's nodes and links alone as the
  viewer's score worker computes them (`apps/webapp/app/[modelId]/graph/score.worker.ts`: nodes sorted by
  kind, layer, position and feature; the adjacency rebuilt from the links; the logits weighted by
  `token_prob`), reimplemented in float64 without the graph code, equal `graph.scores()` (fp32 graph:
  1e-5 absolute).
- The view's texts equal each feature's largest activation per text computed here from plain caches of
  each text alone and the transcoder's encode (1e-4 relative: batched, left-padded runs against single
  ones)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace
from html import escape
from pathlib import Path

import numpy as np
import pytest
import torch

import reward_lens as rl
from reward_lens.instruments.circuits.graph_json import process_token
from reward_lens.model.hooks import act_name

SCHEMA = json.loads((Path(__file__).parent / "data" / "neuronpedia" / "graph-schema.json").read_text())
ORDER = ["cross layer transcoder", "lorsa", "mlp reconstruction error", "lorsa error", "embedding", "logit"]


@pytest.fixture(scope="module")
def model():
    return rl.load_demo_model(device="cpu")


@pytest.fixture(scope="module")
def tc():
    return rl.load_transcoders("demo")


@pytest.fixture(scope="module")
def graph(model, tc):
    pair = rl.demo_pairs()[5]
    ids = model.to_tokens(pair.prompt, pair.chosen)["input_ids"][0][-12:]  # ends at the readout
    return rl.attribution_graph(model, input_ids=ids, transcoders=tc)


def validate(doc) -> None:
    import jsonschema

    jsonschema.Draft7Validator.check_schema(SCHEMA)
    errors = sorted(jsonschema.Draft7Validator(SCHEMA).iter_errors(doc), key=lambda e: list(e.path))
    assert not errors, [f"{list(e.path)}: {e.message}" for e in errors[:5]]


def _parse_int(text: str) -> float:
    m = re.match(r"\s*[+-]?\d+", str(text))  # JavaScript's parseInt(text, 10)
    return int(m.group()) if m else math.nan


def viewer_scores(doc) -> dict:
    """The viewer's computeGraphScoresFromGraphData(graph, pinnedIds=[]), from nodes and links alone."""

    def key(n):
        kind = ORDER.index(n["feature_type"]) if n["feature_type"] in ORDER else len(ORDER)
        layer = 0 if n["layer"] == "E" else _parse_int(n["layer"])
        return (kind, 999 if math.isnan(layer) else layer, n["ctx_idx"], n["feature"] or 0)

    nodes = sorted(doc["nodes"], key=key)  # Array.prototype.sort is stable
    index = {n["node_id"]: i for i, n in enumerate(nodes)}
    N = len(nodes)
    A = np.zeros((N, N))
    for link in doc["links"]:
        if link["source"] in index and link["target"] in index:
            A[index[link["target"]], index[link["source"]]] = link["weight"]
    count = {k: sum(n["feature_type"] == k for n in nodes) for k in ORDER}
    error_start = count["cross layer transcoder"]
    error_end = error_start + count["mlp reconstruction error"]
    token_end = error_end + count["embedding"]
    w = np.zeros(N)
    probs = [n["token_prob"] for n in nodes if n["feature_type"] == "logit"]
    w[N - len(probs) :] = probs
    norm = np.abs(A) / np.maximum(np.abs(A).sum(1, keepdims=True), 1e-10)
    current = w @ norm
    influence = current.copy()
    for _ in range(1000):
        if not (current != 0).any():
            break
        current = current @ norm
        influence += current
    else:
        raise AssertionError("the viewer's influence does not converge")
    tok, err = influence[error_end:token_end].sum(), influence[error_start:error_end].sum()
    non_error = 1 - norm[:, error_start:error_end].sum(1)
    out = influence + w
    return {"replacement": tok / (tok + err), "completeness": (non_error * out).sum() / out.sum()}


def test_the_json_validates_against_neuronpedias_schema(graph, model, tmp_path):
    out = graph.to_json(tmp_path / "a reward: graph.json")
    assert json.loads((tmp_path / "a reward: graph.json").read_text()) == out
    validate(out)
    validate(graph.to_json(prune=False))
    # the upload route's own check besides the schema: scan (a model id) and slug in [a-zA-Z0-9_.-]
    assert (out["metadata"]["slug"], out["metadata"]["scan"]) == ("a-reward-graph", "reward-lens-demo")
    assert out["metadata"]["node_threshold"] == 0.8
    assert out["metadata"]["pruning_settings"] == {"node_threshold": 0.8, "edge_threshold": 0.98}
    # the component graph's file validates too
    pair = rl.demo_pairs()[5]
    component = rl.attribution_graph(model, pair.prompt, pair.chosen).to_json(tmp_path / "components.json")
    validate(component)
    assert [n["clerp"] for n in component["nodes"] if n["feature_type"] == "logit"] == [
        'Output "reward" (p=1.000)'
    ]
    # into a directory: {slug}.json and the listing circuit-tracer's local frontend reads
    graph.to_json(tmp_path, slug="first")
    again = graph.to_json(tmp_path, slug="first")
    assert json.loads((tmp_path / "first.json").read_text()) == again
    listing = json.loads((tmp_path / "graph-metadata.json").read_text())["graphs"]
    assert [g["slug"] for g in listing] == ["first"] and listing[0] == again["metadata"]
    bad = json.loads(json.dumps(out))
    bad["nodes"][0]["ctx_idx"] = "3"  # the check can fail
    with pytest.raises(AssertionError):
        validate(bad)


def test_the_reward_is_the_one_logit_with_probability_one(graph):
    out = graph.to_json()
    logits = [n for n in out["nodes"] if n["feature_type"] == "logit"]
    assert len(logits) == 1 and [n["is_target_logit"] for n in out["nodes"]].count(True) == 1
    (reward,) = logits
    assert reward["token_prob"] == 1.0 and reward["ctx_idx"] == graph.readout
    assert float(reward["clerp"].split("(p=")[1].split(")")[0]) == 1.0  # how the viewer reads it
    # every edge into the reward is there (the constant's aside), with its weight
    edges = graph.prune().edges
    into = edges[(edges.target == "reward") & (edges.source != "constant")]
    links = [x for x in out["links"] if x["target"] == reward["node_id"]]
    assert len(links) == len(into) > 0
    assert np.allclose(sorted(x["weight"] for x in links), sorted(into.weight), rtol=0, atol=0)
    # unpruned, the links into the reward plus the constant the description names give reward - bias
    full = graph.to_json(prune=False)
    total = sum(x["weight"] for x in full["links"] if x["target"] == reward["node_id"])
    constant = float(re.search(r"constant (\S+) ", full["metadata"]["info"]["description"]).group(1))
    assert abs(total + constant - (graph.reward - graph.bias)) <= 1e-5 * abs(graph.reward - graph.bias)


def test_the_viewers_scores_are_the_graphs(graph, model, tc):
    full = graph.to_json(prune=False)
    assert len(full["nodes"]) == len(graph.nodes) - 1  # all but the constant
    pruned = graph.to_json()
    small = graph.prune()
    capped = rl.attribution_graph(
        model, input_ids=torch.tensor(graph.token_ids), transcoders=tc, max_features=40
    )
    for doc, g in ((full, graph), (pruned, small), (capped.to_json(prune=False), capped)):
        want, got = g.scores(), viewer_scores(doc)
        for k in ("replacement", "completeness"):
            assert abs(got[k] - want[k]) <= 1e-5, (k, got[k], want[k])
            assert doc["metadata"][f"{k}_score"] == want[k]
    assert abs(viewer_scores(full)["replacement"] - viewer_scores(pruned)["replacement"]) > 1e-4


def test_features_carry_layer_position_id_activation_and_influence(graph):
    small = graph.prune()
    out = graph.to_json()
    ids = [n["node_id"] for n in out["nodes"]]
    assert len(set(ids)) == len(ids)
    assert all(x["source"] in set(ids) and x["target"] in set(ids) for x in out["links"])
    feats = [n for n in out["nodes"] if n["feature_type"] == "cross layer transcoder"]
    frame = small.nodes.set_index("node")
    assert len(feats) == (small.nodes.kind == "feature").sum() > 0
    for n in feats:
        layer, feature, position = map(int, n["node_id"].split("_"))
        row = frame.loc[f"L{layer}F{feature}@{position}"]
        # the viewer's inverse Cantor pairing (schema_version 1) gives the layer and feature back
        w = math.floor((math.sqrt(8 * n["feature"] + 1) - 1) / 2)
        index = n["feature"] - (w * w + w) // 2
        assert (w - index, index) == (layer, feature) and n["layer"] == str(layer)
        assert n["ctx_idx"] == position == row.position
        assert n["activation"] == row.activation > 0 and n["influence"] == row.cumulative_influence
    errors = [n for n in out["nodes"] if n["feature_type"] == "mlp reconstruction error"]
    tokens = [n for n in out["nodes"] if n["feature_type"] == "embedding"]
    assert len(tokens) == len(graph.tokens) and all(n["layer"] == "E" for n in tokens)
    assert len(errors) == (small.nodes.kind == "error").sum()
    assert {n["feature_type"] for n in out["nodes"]} == {
        "cross layer transcoder",
        "mlp reconstruction error",
        "embedding",
        "logit",
    }
    weights = {(x["source"], x["target"]): x["weight"] for x in out["links"]}
    by_name = dict(zip(small.nodes.node[small.nodes.kind != "constant"], out["nodes"]))  # node order kept
    for e in small.edges.itertuples():
        if e.source != "constant":
            assert weights[(by_name[e.source]["node_id"], by_name[e.target]["node_id"])] == e.weight


def _independent_maxima(model, tc, texts, layer, feature):
    """Each text's largest activation of (layer, feature) and where, from a plain cache of that text."""
    out = []
    for prompt, response in texts:
        ids = model.to_tokens(prompt, response)["input_ids"]
        _, cache = model.run_with_cache(ids)
        acts = tc[layer].encode(cache[act_name("normalized", layer, norm="ln2")][0])[:, feature]
        out.append((float(acts.max()), acts.detach(), ids[0].tolist()))
    return out


def test_the_view_lists_each_features_top_texts(graph, model, tc):
    pairs = rl.demo_pairs()[:20]
    texts = [(p.prompt, side) for p in pairs for side in (p.chosen, p.rejected)]
    page = graph.html(texts=pairs, k=3)
    data = json.loads(page.split('class="graph-data">')[1].split("</script>")[0].replace("<\\/", "</"))
    shown = graph.prune().nodes
    features = shown[shown.kind == "feature"]
    components = list(dict.fromkeys(f"L{r.layer}F{r.feature}" for r in features.itertuples()))
    examples = data["examples"]
    assert {e["component"] for e in examples} <= set(components)
    top = features.sort_values("influence", ascending=False).iloc[:4]
    for r in top.itertuples():
        rows = [e for e in examples if e["component"] == f"L{r.layer}F{r.feature}"]
        maxima = _independent_maxima(model, tc, texts, r.layer, r.feature)
        want = sorted((m for m, _, _ in maxima if m > 0), reverse=True)[:3]
        assert np.allclose([e["activation"] for e in rows], want, rtol=1e-4, atol=1e-6)
        decode = model.tokenizer.decode
        for e in rows:
            best, acts, ids = maxima[e["text"]]
            assert abs(e["activation"] - best) <= 1e-4 * best
            assert abs(float(acts[e["position"]]) - best) <= 1e-4 * best
            assert e["label"] == f"{pairs[e['text'] // 2].id}, {('chosen', 'rejected')[e['text'] % 2]}"
            p = e["position"]
            assert e["token"] == decode([ids[p]])
            assert e["before"] == "".join(decode([t]) for t in ids[max(0, p - 12) : p])
            # the page holds the text: its most active token marked among its neighbours
            item = page.split(f'<li data-activation="{e["activation"]!r}" data-text="{e["text"]}">')[1]
            shown = [escape(process_token(e[k])) for k in ("before", "token", "after")]
            want = f"{shown[0]}<mark>{shown[1]}</mark>{shown[2]} <small>({escape(e['label'])}"
            assert item.split("</li>")[0].startswith(want)
        panel = page.split(f'<div data-examples="L{r.layer}F{r.feature}"')[1].split("</div>")[0]
        assert panel.count("<li") == len(rows) and "<mark>" in panel
    assert f'data-component="L{top.iloc[0].layer}F{top.iloc[0].feature}"' in page


def test_the_demo_view_uses_the_held_out_pairs_and_others_ask_for_texts(graph):
    page = graph.html()
    data = json.loads(page.split('class="graph-data">')[1].split("</script>")[0].replace("<\\/", "</"))
    n = 2 * len(rl.demo_pairs())
    assert f"of {n} texts (the demo" in page.replace("&#x27;", "'")
    assert data["examples"] and all(e["label"].startswith("demo-pair-") for e in data["examples"])
    other = replace(graph, model_name="some-rm").html()
    assert "pass texts= to html()" in other and "<div data-examples" not in other
    with pytest.raises(ValueError, match="holds no model"):
        replace(graph, model=None).html(texts=["a text"])


def test_feature_examples_bad_inputs_and_result(model, tc):
    ex = rl.feature_examples(model, tc, ["The cat sat.", ("Hi", "Hello there.")], [(0, 75), (1, 3)], k=2)
    frame = ex.to_frame()
    assert set(frame.component) <= {"L0F75", "L1F3"} and ex.n_texts == 2
    assert (frame.activation > 0).all() and list(ex.summary().columns)[:2] == ["component", "activation"]
    ex.plot()
    with pytest.raises(ValueError, match="cannot read a text from int"):
        rl.feature_examples(model, tc, [3], [(0, 1)])
    with pytest.raises(ValueError, match="out of range for layer 0"):
        rl.feature_examples(model, tc, ["x"], [(0, 10**6)])
    with pytest.raises(ValueError, match="no transcoder for layer 9"):
        rl.feature_examples(model, tc, ["x"], [(9, 1)])
    with pytest.raises(ValueError, match="no features given"):
        rl.feature_examples(model, tc, ["x"], [])
    with pytest.raises(ValueError, match="k must be an integer >= 1"):
        rl.feature_examples(model, tc, ["x"], [(0, 1)], k=0)
