"""Careless inputs to the circuits at every position, the attribution graph, minimal pairs, frozen weights and
gradients, patch modes, the CLI, the benchmarks' subset and domain names, CSV output and concurrent runs.
Each case of `CASES` is tagged with the class of what the input used to give:

- ``silent``: a silently wrong result (a count read as a slice, a truthy string as a flag, a typo'd domain
  averaged into "all", a CSV that does not read back, two runs holding one lock);
- ``traceback``: a traceback or a misleading message;

and says what it gives now: ``("refused", exception, words)``, one line holding every word, or
``("right", check)``, the result `check` accepts.
"""

import csv
import inspect
import json
import multiprocessing
import subprocess
import sys
import time

import numpy as np
import pandas as pd
import pytest
import torch

import reward_lens as rl
from reward_lens.app.audit import run_audit
from reward_lens.app.cli import main
from reward_lens.app.output import OutputError, take_lock, write_csv
from reward_lens.demo.organisms import minimal_pairs
from reward_lens.evaluation import BenchmarkFormatError, score_texts
from reward_lens.model import validation


def one_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    assert len(lines) == 1, text
    assert "Traceback" not in text
    return lines[0]


@pytest.fixture(scope="module")
def ctx():
    """What the cases share, built once: the demo model, two pairs, a small graph."""
    torch.set_num_threads(1)
    model = rl.load_demo_model()
    pairs = rl.demo_pairs()[:2]
    p = pairs[0]
    return {
        "model": model,
        "pairs": pairs,
        "pair": p,
        "graph": rl.attribution_graph(model, p.prompt, p.chosen, max_nodes=8),
    }


# ------------------------------------------------------------------------------- the benchmarks' rows
def _rb2(subsets):
    ps = rl.demo_pairs()
    return [
        {
            "id": str(i),
            "prompt": ps[i].prompt,
            "chosen": [ps[i].chosen],
            "rejected": [ps[i].rejected],
            "subset": s,
        }
        for i, s in enumerate(subsets)
    ]


def _rmbench(domains):
    ps = rl.demo_pairs()
    return [
        {
            "id": f"r{i}",
            "prompt": ps[i].prompt,
            "domain": d,
            "chosen": [ps[i].chosen, ps[i].chosen + " Indeed.", "**" + ps[i].chosen + "**"],
            "rejected": [ps[i].rejected, ps[i].rejected + " Indeed.", "**" + ps[i].rejected + "**"],
        }
        for i, d in enumerate(domains)
    ]


def _table(result):
    return dict(zip(result.summary().subset, result.summary().accuracy))


def _apart(result, official, apart):
    """`apart` scored on its own row, and "all" the unweighted mean of the official ones only."""
    t = _table(result)
    return apart in t and t["all"] == pytest.approx(np.mean([t[s] for s in official]), abs=1e-12)


def _rmbench_apart(c):
    rows = _rmbench(["chat", "math", "chta"])
    r = rl.evaluate(c["model"], rows, progress=False, extra_subsets=True)
    alone = rl.evaluate(c["model"], rows[:2], progress=False)
    return "chta" in _table(r) and _table(r)["all"] == pytest.approx(_table(alone)["all"], abs=1e-12)


# ------------------------------------------------------------------------------- the checks of right results
def _graph_of_a_bare_prompt(c):
    m, text = c["model"], "What is 2 + 2? 4"
    g = rl.attribution_graph(m, text, max_nodes=8)
    ids = m.to_tokens(text)[0]
    return list(g.token_ids) == ids.tolist() and g.reward == pytest.approx(float(m(ids[None])[0]), abs=1e-5)


def _minimal_pairs_from(c, source):
    got = minimal_pairs(c["model"], n=2, source=source)
    return len(got) == 2 and all(isinstance(p, rl.PreferencePair) for p in got)


def _pairs_file(tmp):
    path = tmp / "pairs.jsonl"
    rows = [{"prompt": p.prompt, "chosen": p.chosen, "rejected": p.rejected} for p in rl.demo_pairs()[:12]]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def _gcg_under_no_grad(c):
    with torch.no_grad():
        r = rl.search_triggers(c["model"], c["pairs"], length=2, n_steps=1, top_k=2)
    return len(r.token_ids) == 2 and torch.is_grad_enabled()


def _under_inference_mode(call):
    def run(c):
        with torch.inference_mode():
            return call(c)

    return run


def _membership_agrees_with_lookup(c):
    m = c["model"]
    m.set_use_split_qkv_input(True)
    try:
        _, cache = m.run_with_cache(m.to_tokens("hello there"))
    finally:
        m.set_use_split_qkv_input(False)
    found = 0
    for alias in m.hook_aliases:
        try:
            cache[alias]
            looks_up = True
        except KeyError:
            looks_up = False
        if (alias in cache) != looks_up:
            return False
        found += looks_up
    missing = "blocks.99.hook_q_input"
    return found > 0 and "blocks.1.hook_q_input" in cache and missing not in cache


def _rewards_at_the_model_precision(c):
    m = rl.load_demo_model(dtype="float64")
    p = c["pair"]
    got = score_texts(m, [p.prompt], [p.chosen])
    b = m.to_tokens([p.prompt], [p.chosen])
    with torch.no_grad():
        direct = float(m(b["input_ids"], attention_mask=b["attention_mask"])[0])
    return got.dtype == np.float64 and got[0] == direct  # not rounded to float32 on the way


def _quiet_before_the_command(tmp):
    out = tmp / "tr"
    code = main(
        ["--quiet", "triggers", "--model", "demo", "--max-pairs", "1", "--top-k", "3", "--out", str(out)]
    )
    return code == 0 and (out / "triggers.csv").exists()


def _biased_copy():
    torch.manual_seed(0)
    m = rl.load_demo_model()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.rsplit(".", 1)[-1] in ("b_V", "b_O", "b_in", "b_out"):
                p.add_(0.05 * torch.randn_like(p))
    return m


def _sources_and_errors_sum_to_r_minus_bias(c):
    """docs/theory.md: with value and MLP biases, the sources alone miss R - bias; the sources plus the
    error nodes (every head and MLP materialised) give it exactly (fp32: 1e-5 relative)."""
    m, p = _biased_copy(), c["pair"]
    g = rl.attribution_graph(m, p.prompt, p.chosen, max_nodes=None)
    f = g.to_frame()
    target = float(g.reward) - float(g.bias)
    sources = float(f[f.kind.isin(["embed", "bias"])].value.sum())
    errors = float(f[f.kind == "error"].value.sum())
    return abs(sources - target) > 1e-2 * abs(target) and abs(sources + errors - target) <= 1e-5 * abs(target)


M, P = "model", "pairs"
CASES = [  # (class, name, call(ctx, tmp), expected)
    # -- counts: never a slice, never rounded
    (
        "silent",
        "max_nodes=-1",
        lambda c, t: rl.attribution_graph(c[M], c["pair"].prompt, c["pair"].chosen, max_nodes=-1),
        ("refused", ValueError, ["max_nodes must be an integer >= 1", "-1"]),
    ),
    (
        "silent",
        "max_nodes=2.5",
        lambda c, t: rl.attribution_graph(c[M], c["pair"].prompt, c["pair"].chosen, max_nodes=2.5),
        ("refused", ValueError, ["max_nodes", "2.5 (float)"]),
    ),
    (
        "traceback",
        "max_nodes='3'",
        lambda c, t: rl.attribution_graph(c[M], c["pair"].prompt, c["pair"].chosen, max_nodes="3"),
        ("refused", ValueError, ["max_nodes", "'3' (str)"]),
    ),
    (
        "silent",
        "top_paths(-1)",
        lambda c, t: c["graph"].top_paths(-1),
        ("refused", ValueError, ["top_paths: n", "-1"]),
    ),
    (
        "silent",
        "top_paths(0)",
        lambda c, t: c["graph"].top_paths(0),
        ("refused", ValueError, ["top_paths: n", ">= 1"]),
    ),
    (
        "silent",
        "top_paths(1.5)",
        lambda c, t: c["graph"].top_paths(1.5),
        ("refused", ValueError, ["1.5 (float)"]),
    ),
    (
        "traceback",
        "top_paths('2')",
        lambda c, t: c["graph"].top_paths("2"),
        ("refused", ValueError, ["'2' (str)"]),
    ),
    (
        "traceback",
        "top_paths(None)",
        lambda c, t: c["graph"].top_paths(None),
        ("refused", ValueError, ["None"]),
    ),
    (
        "silent",
        "graph.html(max_nodes=-1)",
        lambda c, t: c["graph"].html(max_nodes=-1),
        ("refused", ValueError, ["html: max_nodes", "-1"]),
    ),
    (
        "silent",
        "search_triggers(top_k=-1)",
        lambda c, t: rl.search_triggers(c[M], c[P], top_k=-1),
        ("refused", ValueError, ["top_k must be an integer >= 1", "-1"]),
    ),
    (
        "silent",
        "search_triggers(top_k=2.5)",
        lambda c, t: rl.search_triggers(c[M], c[P], top_k=2.5),
        ("refused", ValueError, ["top_k", "2.5 (float)"]),
    ),
    (
        "silent",
        "search_triggers(length=2, n_restarts=0)",
        lambda c, t: rl.search_triggers(c[M], c[P], length=2, n_restarts=0),
        ("refused", ValueError, ["n_restarts", ">= 1"]),
    ),
    (
        "traceback",
        "lens(batch_size='4')",
        lambda c, t: rl.lens(c[M], c[P], batch_size="4"),
        ("refused", ValueError, ["lens: batch_size", "'4' (str)"]),
    ),
    (
        "silent",
        "patch(max_rows=-1)",
        lambda c, t: rl.patch(c[M], c[P], max_rows=-1, progress=False),
        ("refused", ValueError, ["patch: max_rows", "-1"]),
    ),
    (
        "silent",
        "faithfulness(n_boot=2.5)",
        lambda c, t: rl.faithfulness(c[M], c[P], n_boot=2.5),
        ("refused", ValueError, ["n_boot", "2.5 (float)"]),
    ),
    (
        "traceback",
        "minimal_pairs(n=0)",
        lambda c, t: minimal_pairs(c[M], n=0),
        ("refused", ValueError, ["minimal_pairs: n must be an integer >= 1", "0"]),
    ),
    (
        "traceback",
        "minimal_pairs(n=-2)",
        lambda c, t: minimal_pairs(c[M], n=-2),
        ("refused", ValueError, ["n must", "-2"]),
    ),
    (
        "traceback",
        "minimal_pairs(n=2.5)",
        lambda c, t: minimal_pairs(c[M], n=2.5),
        ("refused", ValueError, ["2.5 (float)"]),
    ),
    (
        "traceback",
        "minimal_pairs(n='3')",
        lambda c, t: minimal_pairs(c[M], n="3"),
        ("refused", ValueError, ["'3' (str)"]),
    ),
    # -- flags: booleans are booleans
    (
        "silent",
        "lens(include_mid='no')",
        lambda c, t: rl.lens(c[M], c[P], include_mid="no"),
        ("refused", ValueError, ["include_mid must be True or False", "'no'"]),
    ),
    (
        "silent",
        "attribute(neurons='no')",
        lambda c, t: rl.attribute(c[M], c[P], neurons="no"),
        ("refused", ValueError, ["neurons must be True or False"]),
    ),
    (
        "silent",
        "faithfulness(absolute='no')",
        lambda c, t: rl.faithfulness(c[M], c[P], absolute="no"),
        ("refused", ValueError, ["absolute must be True or False"]),
    ),
    (
        "silent",
        "set_use_attn_result('no')",
        lambda c, t: c[M].set_use_attn_result("no"),
        ("refused", ValueError, ["use_attn_result must be True or False"]),
    ),
    (
        "silent",
        "run_with_cache(readout_only='no')",
        lambda c, t: c[M].run_with_cache(c[M].to_tokens("hi"), readout_only="no"),
        ("refused", ValueError, ["readout_only must be True or False"]),
    ),
    (
        "silent",
        "run_audit(progress='no')",
        lambda c, t: run_audit(c[M], c[P], None, progress="no"),
        ("refused", ValueError, ["progress must be True or False"]),
    ),
    (
        "silent",
        "evaluate(extra_subsets='no')",
        lambda c, t: rl.evaluate(c[M], _rb2(["Math"]), progress=False, extra_subsets="no"),
        ("refused", ValueError, ["extra_subsets must be True or False"]),
    ),
    (
        "silent",
        "to_tokens(text, prepend_bos='no')",
        lambda c, t: c[M].to_tokens("hi", prepend_bos="no"),
        ("refused", ValueError, ["prepend_bos must be True, False or None", "'no'"]),
    ),
    # -- the benchmarks' names
    (
        "silent",
        "a typo'd RM-Bench domain next to the four",
        lambda c, t: rl.evaluate(c[M], _rmbench(["chat", "math", "chta"]), progress=False),
        (
            "refused",
            BenchmarkFormatError,
            ["'chta'", "did you mean 'chat'", "chat, math, code, safety", "extra_subsets=True"],
        ),
    ),
    (
        "silent",
        "a typo'd RM-Bench domain alone",
        lambda c, t: rl.evaluate(c[M], _rmbench(["chta"]), progress=False),
        ("refused", BenchmarkFormatError, ["'chta'", "chat, math, code, safety"]),
    ),
    (
        "silent",
        "other domains asked for explicitly: scored apart",
        lambda c, t: _rmbench_apart(c),
        ("right", bool),
    ),
    (
        "silent",
        "a subset that is not RewardBench 2's",
        lambda c, t: rl.evaluate(c[M], _rb2(["Math", "Math", "Chat"]), progress=False),
        (
            "refused",
            BenchmarkFormatError,
            ["'Chat'", "Factuality, Precise IF, Math, Safety, Focus, Ties", "extra_subsets=True"],
        ),
    ),
    (
        "silent",
        "another subset asked for explicitly: scored apart",
        lambda c, t: _apart(
            rl.evaluate(c[M], _rb2(["Math", "Safety", "Chat"]), progress=False, extra_subsets=True),
            ["Math", "Safety"],
            "Chat",
        ),
        ("right", bool),
    ),
    (
        "silent",
        "a RewardBench 2 subset with surrounding spaces",
        lambda c, t: rl.evaluate(c[M], _rb2(["Math ", "Math "]), progress=False),
        ("refused", BenchmarkFormatError, ["'Math '", "surrounding spaces", "spell it 'Math'"]),
    ),
    (
        "silent",
        "float64 rewards kept at float64",
        lambda c, t: _rewards_at_the_model_precision(c),
        ("right", bool),
    ),
    # -- the circuits' words
    (
        "traceback",
        "attribution_graph(model, prompt) alone",
        lambda c, t: _graph_of_a_bare_prompt(c),
        ("right", bool),
    ),
    (
        "traceback",
        "attribution_graph of a list of texts",
        lambda c, t: rl.attribution_graph(c[M], ["a b", "c d"]),
        ("refused", ValueError, ["one text", "list of 2 texts", "once per text"]),
    ),
    (
        "traceback",
        "float ids",
        lambda c, t: rl.attribution_graph(c[M], input_ids=torch.ones(5)),
        ("refused", TypeError, ["integer token ids", "dtype torch.float32"]),
    ),
    (
        "traceback",
        "prune('0.5')",
        lambda c, t: c["graph"].prune("0.5"),
        ("refused", ValueError, ["node_threshold", "'0.5'"]),
    ),
    (
        "traceback",
        "prune(edge_threshold=None)",
        lambda c, t: c["graph"].prune(0.8, None),
        ("refused", ValueError, ["edge_threshold", "None"]),
    ),
    (
        "traceback",
        "minimal_pairs from a pairs file",
        lambda c, t: _minimal_pairs_from(c, _pairs_file(t)),
        ("right", bool),
    ),
    (
        "traceback",
        "minimal_pairs from dicts",
        lambda c, t: _minimal_pairs_from(c, [json.loads(x) for x in _pairs_file(t).read_text().splitlines()]),
        ("right", bool),
    ),
    (
        "traceback",
        "faithfulness_curve of a short ranking without sizes",
        lambda c, t: rl.faithfulness_curve(c[M], c[P], [("L0H0", "readout")]),
        ("refused", ValueError, ["the ranking holds 1 of the model's", "pass sizes="]),
    ),
    ("traceback", "GCG inside torch.no_grad()", lambda c, t: _gcg_under_no_grad(c), ("right", bool)),
    (
        "traceback",
        "attribution_patch in inference_mode",
        lambda c, t: _under_inference_mode(lambda c: rl.attribution_patch(c[M], c[P], progress=False))(c),
        ("refused", ValueError, ["attribution_patch takes gradients", "inference_mode"]),
    ),
    (
        "traceback",
        "attribution_graph in inference_mode",
        lambda c, t: _under_inference_mode(
            lambda c: rl.attribution_graph(c[M], c["pair"].prompt, c["pair"].chosen)
        )(c),
        ("refused", ValueError, ["attribution_graph takes gradients"]),
    ),
    (
        "traceback",
        "edge_attribution in inference_mode",
        lambda c, t: _under_inference_mode(lambda c: rl.edge_attribution(c[M], c[P], steps=2))(c),
        ("refused", ValueError, ["edge_attribution takes gradients"]),
    ),
    (
        "traceback",
        "edge_attribution at every position in inference_mode",
        lambda c, t: _under_inference_mode(
            lambda c: rl.edge_attribution(c[M], minimal_pairs(c[M], 2), steps=2, positions="all")
        )(c),
        ("refused", ValueError, ["edge_attribution takes gradients"]),
    ),
    (
        "traceback",
        "GCG in inference_mode",
        lambda c, t: _under_inference_mode(lambda c: rl.search_triggers(c[M], c[P], length=2, n_steps=1))(c),
        ("refused", ValueError, ["search_triggers (GCG, length >= 2) takes gradients"]),
    ),
    (
        "traceback",
        "a logistic concept vector in inference_mode",
        lambda c, t: _under_inference_mode(
            lambda c: rl.concept_vector(c[M], rl.demo_pairs()[:8], method="probe")
        )(c),
        ("refused", ValueError, ["concept_vector takes gradients"]),
    ),
    (
        "traceback",
        "run_audit(patch_modes=None)",
        lambda c, t: run_audit(c[M], c[P], None, patch_modes=None),
        ("refused", ValueError, ["patch_modes must be a list of mode names", "None"]),
    ),
    (
        "traceback",
        "search_triggers(length=10000)",
        lambda c, t: rl.search_triggers(c[M], c[P], length=10000),
        ("refused", ValueError, ["length=10000", "n_ctx=1024", "give length <="]),
    ),
    (
        "traceback",
        "search_triggers(candidates=[])",
        lambda c, t: rl.search_triggers(c[M], c[P], candidates=[]),
        ("refused", ValueError, ["candidates is empty"]),
    ),
    (
        "silent",
        "search_triggers(candidates=[1.5])",
        lambda c, t: rl.search_triggers(c[M], c[P], candidates=[1.5]),
        ("refused", ValueError, ["candidates: token id", "1.5 (float)"]),
    ),
    (
        "traceback",
        "search_triggers(side='chosen ')",
        lambda c, t: rl.search_triggers(c[M], c[P], side="chosen "),
        ("refused", ValueError, ["side must be 'chosen' or 'rejected'", "'chosen '"]),
    ),
    ("traceback", "reward-lens --quiet triggers", lambda c, t: _quiet_before_the_command(t), ("right", bool)),
    (
        "traceback",
        "an alias is in the cache as it looks up",
        lambda c, t: _membership_agrees_with_lookup(c),
        ("right", bool),
    ),
    (
        "traceback",
        "the graph's sources and errors sum to R - bias",
        lambda c, t: _sources_and_errors_sum_to_r_minus_bias(c),
        ("right", bool),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c[1] for c in CASES])
def test_careless_input(ctx, tmp_path, capsys, case):
    _, _, call, expected = case
    if expected[0] == "refused":
        _, exc, words = expected
        with pytest.raises(exc) as info:
            call(ctx, tmp_path)
        message = one_line(str(info.value))
        assert all(w in message for w in words), message
    else:
        assert expected[1](call(ctx, tmp_path))


def test_the_search_refuses_what_it_cannot_allocate_before_any_work(ctx, monkeypatch):
    monkeypatch.setattr(validation, "memory_budget", lambda: 2**30)  # as under `ulimit -v` 1 GiB
    with pytest.raises(MemoryError) as info:  # every scored string is kept: about 3 GiB of tuples
        rl.search_triggers(ctx["model"], ctx["pairs"], length=200)
    message = one_line(str(info.value))
    assert "search_triggers(length=200) would allocate about" in message and "smaller length" in message
    assert rl.search_triggers(ctx["model"], ctx["pairs"], length=2, n_steps=1, top_k=2).length == 2  # fits


def test_the_memory_budget_reads_the_address_space_limit():
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/statm") as f:
        used = int(f.read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (used + 4 * 2**30, hard))  # as under `ulimit -v`
    try:
        budget = validation.memory_budget()
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    assert 0 < budget <= 4 * 2**30 and validation.memory_budget() != budget


# ------------------------------------------------------------------------------- CSVs that read back
CONTROL = [chr(i) for i in [*range(0x20), 0x7F, *range(0x80, 0xA0), 0x2028, 0x2029, 0xFEFF]]
QUOTING = ['"', '""', ",", "'", " ", "#", ";", "\\", '",', ',"', '"\r\n"']


def _cells():
    out = []
    for c in CONTROL + QUOTING:
        out += [c, "a" + c, c + "a", "a" + c + "b", c + c, '"' + c + '"', " " + c + " "]
    return out


def _written(frame: pd.DataFrame) -> pd.DataFrame:
    """The frame as its CSV cells hold it: a tuple column as its text."""
    return frame.apply(
        lambda s: s.map(str) if s.dtype == object and s.map(lambda v: isinstance(v, tuple)).any() else s
    )


def _reads_back(path, frame):
    got = pd.read_csv(path)
    want = _written(frame).reset_index(drop=True)
    assert list(got.columns) == list(want.columns) and len(got) == len(want)
    for col in want.columns:
        if want[col].dtype == object or pd.api.types.is_string_dtype(want[col]):
            assert got[col].astype(str).tolist() == want[col].astype(str).tolist(), col
        else:
            assert np.array_equal(got[col].to_numpy(float), want[col].to_numpy(float), equal_nan=True), col


def test_every_control_character_and_quoting_case_reads_back(tmp_path):
    cells = _cells()
    frame = pd.DataFrame({"text": cells, "value": np.linspace(-1, 1, len(cells)), "n": np.arange(len(cells))})
    write_csv(tmp_path / "t.csv", frame)
    _reads_back(tmp_path / "t.csv", frame)


def test_text_spelled_like_a_missing_value_reads_back_as_the_docstring_says(tmp_path):
    frame = pd.DataFrame(
        {"text": ["NA", "None", "null", "nan", "x"], "value": [1.0, np.nan, 3.0, np.inf, 5.0]}
    )
    write_csv(tmp_path / "t.csv", frame)
    got = pd.read_csv(tmp_path / "t.csv", keep_default_na=False, na_values=[""])
    assert got.text.tolist() == ["NA", "None", "null", "nan", "x"]
    assert np.array_equal(got.value.to_numpy(), [1.0, np.nan, 3.0, np.nan, 5.0], equal_nan=True)  # inf: empty


def test_triggers_csv_of_the_demo_tokenizer_reads_back(ctx, tmp_path):
    m = ctx["model"]
    assert "\r" in {m.tokenizer.decode([i]) for i in range(m.cfg.d_vocab)}  # the token that broke the rows
    out = tmp_path / "tr"
    assert (
        main(
            [
                "triggers",
                "--model",
                "demo",
                "--max-pairs",
                "1",
                "--top-k",
                str(m.cfg.d_vocab),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    got = pd.read_csv(out / "triggers.csv")
    ids = [int(s.strip("(),")) for s in got.token_ids]
    assert len(got) == len(set(ids)) > 900 and "\r" in set(got.text)
    assert got.text.tolist() == [m.tokenizer.decode([i]) for i in ids]


def test_token_attribution_csv_of_crlf_pairs_reads_back(ctx, tmp_path):
    pairs = [rl.PreferencePair('What is 2+2?\r\nAnswer, "briefly".', "4\r\nDone", "5\r\nDone", id="crlf")]
    frame = rl.token_attribution(ctx["model"], pairs).token_totals()
    assert frame.token.str.contains("\r").any()
    write_csv(tmp_path / "token_attribution.csv", frame)  # as the audit writes it
    _reads_back(tmp_path / "token_attribution.csv", frame)


def test_the_csv_module_quotes_what_it_must_with_crlf_line_ends(tmp_path):
    write_csv(tmp_path / "t.csv", pd.DataFrame({"a": ["x\ry", "plain"]}))
    with open(tmp_path / "t.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert rows == [["a"], ["x\ry"], ["plain"]]


# ------------------------------------------------------------------------------- one winner for a stale lock
def _race_for_the_lock(lock, target, barrier, results, done):
    barrier.wait()
    try:
        take_lock(lock, target)
    except OutputError:
        results.put("refused")
        return
    except Exception as exc:  # anything else fails the test too
        results.put(f"{type(exc).__name__}: {exc}")
        return
    results.put("won")
    done.wait(30)  # hold it, alive, until every racer has answered


def test_a_stale_lock_taken_over_by_racing_runs_has_one_winner(tmp_path, monkeypatch):
    from reward_lens.app import output

    alive = output._pid_alive

    def slow_pid_check(pid):  # a loaded machine: the racers are all between reading the lock and acting
        time.sleep(0.02)
        return alive(pid)

    monkeypatch.setattr(output, "_pid_alive", slow_pid_check)  # the forked racers inherit it
    ctx = multiprocessing.get_context("fork")
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    outcomes = []
    for trial in range(10):
        lock = tmp_path / f"o{trial}.lock"
        lock.write_text(dead.stdout.strip())
        barrier, results, done = ctx.Barrier(8), ctx.Queue(), ctx.Event()
        racers = [
            ctx.Process(
                target=_race_for_the_lock, args=(lock, tmp_path / f"o{trial}", barrier, results, done)
            )
            for _ in range(8)
        ]
        for p in racers:
            p.start()
        answers = sorted(results.get(timeout=60) for _ in racers)
        done.set()
        for p in racers:
            p.join(30)
        outcomes.append(answers)
    bad = [a for a in outcomes if a != ["refused"] * 7 + ["won"]]
    assert not bad, bad[:3]


# ------------------------------------------------------------------------------- every count and flag checked
COUNT_NAMES = {
    *("batch_size", "model_batch_size", "n", "k", "top", "top_k", "top_n", "top_per_position", "length"),
    *("n_boot", "n_perm", "n_steps", "n_restarts", "n_features", "n_bins", "n_components", "steps", "seed"),
    *("max_nodes", "max_rows", "max_pairs", "max_reference", "max_tokens", "expansion", "d_sae", "aux_k"),
    "dead_after",
}
CHECKS_ITS_OWN = {"evaluate"}  # batch_size, single_game and extra_subsets checked in its body (cases above)


def _checked(fn):
    names = set()
    while fn is not None:
        names |= set(getattr(fn, "checked_arguments", ()))
        fn = getattr(fn, "__wrapped__", None)
    return names


def test_every_count_and_flag_of_the_public_api_is_checked():
    """A count (by its name) or a flag (a bool default) of a public function or result method goes through
    `checked_arguments`; `progress` is exempt (a bool, or a str: its bar's label)."""
    unchecked = []
    for name in rl.__all__:
        obj = getattr(rl, name)
        if isinstance(obj, type):
            targets = [
                (f"{name}.{k}", v) for k, v in vars(obj).items() if callable(v) and not k.startswith("_")
            ]
        else:
            targets = [(name, obj)] if callable(obj) else []
        for qualname, fn in targets:
            if qualname in CHECKS_ITS_OWN:
                continue
            try:
                params = inspect.signature(fn).parameters.values()
            except (TypeError, ValueError):
                continue
            wanted = [
                p.name
                for p in params
                if p.name != "progress" and (p.name in COUNT_NAMES or isinstance(p.default, bool))
            ]
            unchecked += [f"{qualname}({p})" for p in wanted if p not in _checked(fn)]
    assert not unchecked, unchecked


def test_an_audit_of_a_benchmark_file_scores_other_subsets_apart(ctx, tmp_path):
    from reward_lens.app.cli import _audit_input

    path = tmp_path / "rb2.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in _rb2(["Math", "Safety", "Chat"])))
    pairs, result = _audit_input(str(path), ctx["model"], 8)  # audit has no --extra-subsets: never refused
    assert len(pairs) == 3 and _apart(result, ["Math", "Safety"], "Chat")
