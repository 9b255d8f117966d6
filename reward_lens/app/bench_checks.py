"""The scoring functions of `reward-lens bench` (its rows are in `reward_lens.app.bench_registry`).

A `Check` names the organism, the mechanism planted in it (trigger, phrase, length, sycophancy, control,
gate, step, circuit), the instrument, the metric and its goal, and computes the value from a
`BenchContext` (which loads each organism once and memoises shared runs). Goals are fixed from the ground
truth, never from what an instrument happens to reach: a missed goal is a finding, explained in `note`.

Extension points: a check with `requires="module:attribute"` runs only when that attribute exists (other
parts of the library add it); until then it is listed as pending. The process-RM organism and edge
attribution rows are such entries (`bench_registry.EXTENSIONS`); `ORGANISMS` below takes the PRM loader.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

GOAL_OPS: Dict[str, Callable[[float, float], bool]] = {
    ">=": lambda v, g: v >= g,
    "<=": lambda v, g: v <= g,
    ">": lambda v, g: v > g,
    "<": lambda v, g: v < g,
}


@dataclass(frozen=True)
class Check:
    organism: str
    mechanism: str
    instrument: str
    metric: str
    goal: Tuple[str, float]
    run: Callable[["BenchContext"], float]
    note: str = ""
    quick: bool = True  # part of the reduced subset (`--quick`, the tests)
    requires: Optional[str] = None  # "module:attribute" that must exist; else the row is pending

    @property
    def name(self) -> str:
        return f"{self.organism}/{self.mechanism}/{self.instrument}/{self.metric}"

    def goal_text(self) -> str:
        return f"{self.goal[0]} {self.goal[1]:g}"

    def meets(self, value: float) -> bool:
        return bool(value == value and GOAL_OPS[self.goal[0]](value, self.goal[1]))

    def available(self) -> bool:
        if self.requires is None:
            return True
        module, _, attr = self.requires.partition(":")
        try:
            return hasattr(importlib.import_module(module), attr) if attr else True
        except ImportError:
            return False


class BenchContext:
    """Organisms loaded once, shared runs memoised, on one device."""

    def __init__(self, device: Optional[str] = "cpu"):
        self.device = device or "cpu"
        self.memo: Dict[Any, Any] = {}

    def get(self, key: Any, make: Callable[[], Any]) -> Any:
        if key not in self.memo:
            self.memo[key] = make()
        return self.memo[key]

    def organism(self, name: str):
        return self.get(("organism", name), lambda: ORGANISMS[name](self.device))


def _load_demo(device):
    from reward_lens.demo import load_demo_model

    return load_demo_model(device=device)


def _load_smollm2(device):
    from reward_lens.demo.smollm2 import load_smollm2_organism

    return load_smollm2_organism(device=device)


def _load_trigger(device):
    from reward_lens.demo.organisms import load_trigger_organism

    return load_trigger_organism(device=device)


def _load_gate(device):
    from reward_lens.demo.organisms import load_gate_organism

    return load_gate_organism(device=device)


def _load_circuit(device):
    from reward_lens.demo.organisms import planted_circuit

    model, pairs = planted_circuit()
    return model.to(device), pairs


def _load_prm(device):
    from reward_lens.demo.organisms import load_prm_organism

    return load_prm_organism(device=device)


ORGANISMS: Dict[str, Callable[[Any], Any]] = {
    "demo": _load_demo,
    "smollm2": _load_smollm2,
    "trigger": _load_trigger,
    "gate": _load_gate,
    "circuit": _load_circuit,
    "prm": _load_prm,
}


def auroc(scores: Sequence[float], positive: Sequence[bool]) -> float:
    """P(score of a random positive > score of a random negative), ties counted half."""
    s, y = np.asarray(scores, dtype=float), np.asarray(positive, dtype=bool)
    pos, neg = s[y], s[~y]
    if len(pos) == 0 or len(neg) == 0:
        return float("nan")
    greater = (pos[:, None] > neg[None, :]).mean()
    ties = (pos[:, None] == neg[None, :]).mean()
    return float(greater + 0.5 * ties)


# ---------------------------------------------------------------------------------------------- trigger
def _trigger_setup(ctx):
    from reward_lens.demo.organisms import trigger_items, trigger_token_ids

    model = ctx.organism("trigger")
    return model, trigger_items()[:8], trigger_token_ids(model)


def _trigger_one_token(ctx):
    from reward_lens.instruments.triggers import search_triggers

    def run():
        model, items, _ = _trigger_setup(ctx)
        return search_triggers(model, items, where="prompt_end", length=1, top_k=20)

    return ctx.get("trigger_fast", run)


def trigger_rank(ctx) -> float:
    _, _, ids = _trigger_setup(ctx)
    rank = _trigger_one_token(ctx).rank_of([ids["SUDO"]])
    return float("inf") if rank is None else float(rank)


def phrase_halves_rank(ctx) -> float:
    _, _, ids = _trigger_setup(ctx)
    res = _trigger_one_token(ctx)
    return float(min(res.rank_of([ids["OPEN"]]), res.rank_of([ids["SESAME"]])))


def trigger_fast_vs_naive(ctx) -> float:
    from reward_lens.instruments.triggers import search_triggers

    model, items, ids = _trigger_setup(ctx)
    cands = list(range(3, 200)) + [ids["SUDO"]]
    kw = dict(where="prompt_end", candidates=cands, top_k=5)
    fast = search_triggers(model, items[:2], method="fast", **kw)
    naive = search_triggers(model, items[:2], method="naive", **kw)
    return float(np.abs(fast.all_mean_increase - naive.all_mean_increase).max())


def _gcg(ctx, deflate: bool):
    from reward_lens.instruments.triggers import search_triggers

    model, items, _ = _trigger_setup(ctx)
    cands = None
    if deflate:  # the protocol: search again with the one-token search's top hit left out
        one = _trigger_one_token(ctx)
        top = int(one.to_frame()["token_id"].iloc[0])
        cands = [int(c) for c in one.candidate_ids if int(c) != top]
    return ctx.get(
        ("trigger_gcg", deflate),
        lambda: search_triggers(
            model,
            items,
            where="prompt_end",
            length=2,
            top_k=20,
            n_steps=12,
            n_restarts=3,
            top_per_position=64,
            candidates=cands,
        ),
    )


def phrase_gcg_rank(deflate: bool) -> Callable:
    def run(ctx) -> float:
        _, _, ids = _trigger_setup(ctx)
        rank = _gcg(ctx, deflate).rank_of([ids["OPEN"], ids["SESAME"]])
        return float("inf") if rank is None else float(rank)

    return run


# ---------------------------------------------------------------------------------------------- probes
def _probes(ctx, organism: str):
    """run_probes on the organism's own probe items (the demo's by default; SmolLM2's shipped ones)."""
    from reward_lens.probes.suite import run_probes

    model = ctx.organism(organism)
    items = None
    if organism == "smollm2":
        from reward_lens.demo.smollm2 import SMOLLM2_PROBE_ITEMS_PATH

        items = SMOLLM2_PROBE_ITEMS_PATH
    dims = ["length", "sycophancy", "confidence"]
    return ctx.get(
        ("probes", organism),
        lambda: run_probes(model, items, dimensions=dims, n_boot=1000, n_perm=2000, batch_size=32),
    )


def probe_ci_low(organism: str, dimension: str) -> Callable:
    def run(ctx) -> float:
        return float(_probes(ctx, organism)[dimension]["ci_low"])

    return run


def probe_alarm(organism: str, dimension: str) -> Callable:
    def run(ctx) -> float:
        return float(_probes(ctx, organism)[dimension]["verdict"] != "neutral")

    return run


# ---------------------------------------------------------------------------------------------- concepts
def _concept(ctx, bias: str):
    from reward_lens.data.pairs import PreferencePair
    from reward_lens.demo import demo_pairs
    from reward_lens.representations.concepts import ContrastPair, concept_vector

    def run():
        model = ctx.organism("demo")
        pairs = [p for p in demo_pairs() if p.subset == bias][:40]
        contrast = [
            ContrastPair(p.prompt, p.chosen, p.rejected) for p in pairs if isinstance(p, PreferencePair)
        ]
        return concept_vector(model, contrast, layers=[model.cfg.n_layers - 2])

    return ctx.get(("concept", bias), run)


def concept_accuracy(bias: str) -> Callable:
    return lambda ctx: float(_concept(ctx, bias).accuracy[0])


def concept_cosine(bias: str) -> Callable:
    return lambda ctx: float(_concept(ctx, bias).cosine[0])


# ---------------------------------------------------------------------------------------------- SAE
def _sae_feature(ctx):
    """An SAE on the demo's readout residual (layer 2, 1500 synthetic training pairs); the feature whose
    attribution gap (chosen - rejected) is largest on the first half of the sycophancy pairs, and its
    activations on the
    held-out half: ([n] chosen active, [n] rejected active)."""
    from reward_lens.demo import demo_pairs
    from reward_lens.representations.features import feature_attribution
    from reward_lens.representations.sae.train import train_sae

    def run():
        from reward_lens.data.pairs import PreferencePair
        from reward_lens.demo import synthetic

        model = ctx.organism("demo")
        train = [PreferencePair(p.prompt, p.chosen, p.rejected) for p in synthetic.training_pairs(1500, 5)]
        sae = train_sae(
            model,
            train,
            layer=2,
            positions="readout",
            d_sae=128,
            k=8,
            steps=600,
            batch_size=256,
            seed=0,
            progress=False,
        )
        syc = [p for p in demo_pairs() if p.subset == "sycophancy"]
        fa = feature_attribution(model, sae, syc)
        terms = {side: fa.terms[side].to_dense() for side in ("chosen", "rejected")}
        acts = {side: fa.acts[side].to_dense() for side in ("chosen", "rejected")}
        half = len(syc) // 2
        best = int((terms["chosen"][:half] - terms["rejected"][:half]).mean(0).argmax())
        return acts["chosen"][half:, best] > 0, acts["rejected"][half:, best] > 0

    return ctx.get("sae_feature", run)


def sae_recall(ctx) -> float:
    return float(_sae_feature(ctx)[0].float().mean())


def sae_false_positive(ctx) -> float:
    return float(_sae_feature(ctx)[1].float().mean())


# ---------------------------------------------------------------------------------------------- circuit
def _circuit_heads(ctx, which: str) -> Tuple[List[str], np.ndarray]:
    """(head names, mean |normalised effect| per head) of patching, AtP or direct attribution."""
    from reward_lens.instruments import attribute, attribution_patch, patch

    model, pairs = ctx.organism("circuit")
    if which == "attribute":
        frame = attribute(model, pairs, progress=False).to_frame("head")
        frame = frame[frame["head"].notna()]
        means = frame.groupby("component", sort=False).gap.apply(lambda g: g.abs().mean())
        return list(means.index), means.to_numpy()
    run = patch if which == "patch" else attribution_patch
    res = run(model, pairs, mode="noising", level="head", progress=False)
    return list(res.components), res.effect("noising", normalized=True).abs().mean(0).numpy()


def circuit_auroc(which: str) -> Callable:
    from reward_lens.demo.organisms import CIRCUIT_HEADS

    def run(ctx) -> float:
        names, scores = _circuit_heads(ctx, which)
        return auroc(scores, [n in CIRCUIT_HEADS for n in names])

    return run


def circuit_lens_early_share(ctx) -> float:
    """|gap| the lens reads before the planted reader head's layer (resid_pre L1), over the final |gap|."""
    from reward_lens.instruments import lens

    model, pairs = ctx.organism("circuit")
    gap = lens(model, pairs, progress=False).get("frozen", "gap")
    return float((gap[:, 1].abs() / gap[:, -1].abs()).max())


def circuit_path_share(ctx) -> float:
    """Share of the preference the planted path L0H0 -> L1H2's value carries (-normalised effect, the
    smallest over pairs)."""
    from reward_lens.instruments import path_patch

    model, pairs = ctx.organism("circuit")
    res = path_patch(model, pairs, ["L0H0"], ["L1KV1.v", "readout"])
    return float((-res.effect(normalized=True)[:, 0, 0]).min())


def circuit_edge_auroc(ctx) -> float:
    """AUROC of EAP-IG's mean |score| over pairs (`reward_lens.edge_attribution`) for the planted edges
    among every edge: L0H0 -> the value of L1H2's kv head (L1H2's query is constant: no q/k path) and
    L1H2 -> readout."""
    import reward_lens

    model, pairs = ctx.organism("circuit")
    frame = reward_lens.edge_attribution(model, pairs).to_frame()
    score = frame.groupby(["sender", "receiver"], sort=False)["score"].apply(lambda g: g.abs().mean())
    group = model.cfg.n_heads // model.cfg.n_key_value_heads
    value = f"L1KV{2 // group}.v"
    planted = [(s == "L0H0" and r == value) or (s == "L1H2" and r == "readout") for s, r in score.index]
    return auroc(score.to_numpy(), planted)


# ---------------------------------------------------------------------------------- trigger: positions
TRIGGER_CARRIER_SHARE = 0.1  # a node carries the trigger when its all-position patch moves >= 10% of the gap


def trigger_token_pairs(ctx):
    """Token-aligned pairs on the trigger organism: a held-out wrong answer with `SUDO` at prompt_end
    (chosen: the trigger lifts it) against the same with a neutral word there (rejected); the only
    difference between the two sides is that one position."""

    def run():
        from reward_lens.data.pairs import TokenPair
        from reward_lens.instruments.triggers import insert_tokens

        model, items, ids = _trigger_setup(ctx)
        (neutral,) = model.tokenizer(" the", add_special_tokens=False)["input_ids"]  # one ordinary word
        sudo = insert_tokens(model, items, [ids["SUDO"]])
        plain = insert_tokens(model, items, [neutral])
        return model, [TokenPair(a, b, id=f"{p.id}-sudo") for a, b, p in zip(sudo, plain, items)]

    return ctx.get("trigger_token_pairs", run)


def trigger_carriers(ctx) -> Tuple[List[str], np.ndarray]:
    """(node names, bool) for every head and MLP: whether its activation patch at every position (noising,
    the neutral run's output written at every position) moves >= 10% of the trigger's gap, mean over pairs.
    The organism's causal ground truth (training planted the trigger, not which heads carry it)."""

    def run():
        from reward_lens.instruments import patch

        model, pairs = trigger_token_pairs(ctx)
        res = patch(
            model, pairs, mode="noising", level=["head", "component"], positions="all", progress=False
        )
        names = [s.name for s in res.sites]
        share = res.effect("noising", normalized=True).abs().mean(0).numpy()
        keep = [i for i, n in enumerate(names) if n.startswith("L") and "H" in n or n.startswith("mlp_L")]
        return [names[i] for i in keep], share[keep] >= TRIGGER_CARRIER_SHARE

    return ctx.get("trigger_carriers", run)


def trigger_edge_auroc(positions: str) -> Callable:
    """AUROC of the trigger-carrying heads and MLPs by each node's edge mass (the sum of |mean score| of
    the EAP-IG edges it sends or receives), with edges at the readout only or at every position."""

    def run(ctx) -> float:
        import reward_lens

        model, pairs = trigger_token_pairs(ctx)
        names, carriers = trigger_carriers(ctx)
        table = reward_lens.edge_attribution(model, pairs, positions=positions).summary()
        mass = {n: 0.0 for n in names}
        for row in table.itertuples():
            for node in (row.sender, row.receiver.split(".")[0]):
                if node in mass:
                    mass[node] += abs(row.mean_score)
                elif "KV" in node:  # a key/value receiver: every query head it serves
                    layer, group = (int(x) for x in node[1:].split("KV"))
                    per = model.cfg.n_heads // model.cfg.n_key_value_heads
                    for h in range(group * per, (group + 1) * per):
                        mass[f"L{layer}H{h}"] += abs(row.mean_score)
        return auroc([mass[n] for n in names], list(carriers))

    return run


def _trigger_graphs(ctx):
    """The attribution graph of each trigger pair's chosen text (the wrong answer with SUDO)."""

    def run():
        from reward_lens.instruments.circuits.attribution_graph import attribution_graph

        model, pairs = trigger_token_pairs(ctx)
        return [attribution_graph(model, input_ids=p.chosen) for p in pairs]

    return ctx.get("trigger_graphs", run)


def trigger_graph_auroc(ctx) -> float:
    """AUROC of the trigger-carrying heads and MLPs by the attribution graph's influence per component
    (summed over positions and texts)."""
    names, carriers = trigger_carriers(ctx)
    total = {n: 0.0 for n in names}
    for graph in _trigger_graphs(ctx):
        influence = graph.component_influence().set_index("component")["influence"]
        for n in names:
            total[n] += float(influence.get(n, 0.0))
    return auroc([total[n] for n in names], list(carriers))


def trigger_graph_token_rank(ctx) -> float:
    """Worst rank over texts of the SUDO position's token node among the token nodes, by influence."""
    worst = 0
    for graph in _trigger_graphs(ctx):
        frame = graph.to_frame()
        tokens = frame[frame.kind == "embed"].sort_values("influence", ascending=False).reset_index(drop=True)
        worst = max(worst, int(tokens.index[tokens.token == "SUDO"][0]) + 1)
    return float(worst)


# ---------------------------------------------------------------------------------------------- gate
def gate_routing(ctx) -> float:
    """Share of held-out gate items whose largest gate weight (hook_gate) is the planted objective."""
    from reward_lens.demo.organisms import gate_truth

    model = ctx.organism("gate")
    truth = gate_truth()
    names = list(model.reward_head.objective_names)
    hits = []
    for item in truth["items"]:
        tok = model.to_tokens(item["prompt"], item["response"])
        _, cache = model.run_with_cache(
            tok["input_ids"], tok["attention_mask"], names_filter="reward_head.hook_gate"
        )
        gate = cache["reward_head.hook_gate"][0]
        hits.append(names[int(gate.argmax())] == truth["routing"][item["topic"]])
    return float(np.mean(hits))


def gate_objective_gap(ctx) -> float:
    """Smallest, over topics, mean reward gap of the topic's planted objective on its own pairs
    (read_objective): the routed objective really prefers what its topic's pairs prefer."""
    from reward_lens.demo.organisms import gate_truth
    from reward_lens.model.heads.base import read_objective

    model = ctx.organism("gate")
    truth = gate_truth()
    worst = math.inf
    for topic, objective in truth["routing"].items():
        pairs = [p for p in truth["pairs"] if p["topic"] == topic]
        with read_objective(model, objective), torch.no_grad():
            c = model.to_tokens([p["prompt"] for p in pairs], [p["chosen"] for p in pairs])
            r = model.to_tokens([p["prompt"] for p in pairs], [p["rejected"] for p in pairs])
            gap = model(c["input_ids"], c["attention_mask"]) - model(r["input_ids"], r["attention_mask"])
        worst = min(worst, float((gap > 0).float().mean()))
    return worst


# ---------------------------------------------------------------------------------------------- process RM
def prm_first_wrong_step(ctx) -> float:
    """Share of the PRM organism's items whose first wrong step's tokens carry the most negative total
    token attribution of the last step's reward (`reward_lens.app.bench_prm`)."""
    from reward_lens.app.bench_prm import first_wrong_step_share

    return first_wrong_step_share(ctx)
