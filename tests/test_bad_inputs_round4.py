"""Careless inputs to the heads, judges, `evaluate`, circuits and the CLI added last, and the cases left over
from the earlier sets. Each case is tagged with its class:

- ``silent``: used to give a silently wrong number (a rounded index, an `<unk>` logit, NaN steps, a subset
  dropped from "all", a widened list, ±inf for a tie): now one clear line, or the right result;
- ``traceback``: one clear line (what was wrong, what to do) instead of a traceback or a misleading line;
- ``right-result``: the input is read as the user meant it.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from mlp_reference import STEP_TAG, VOCAB, save_tiny
from qrm_reference import save_tiny_qrm
from test_judge import tiny_causal_lm
from test_prm import prm_tokenizer

import reward_lens as rl
from reward_lens import HookedRewardModel, PreferencePair, read_step
from reward_lens.app.cli import main
from reward_lens.evaluation import BenchmarkFormatError
from reward_lens.model.hooks import act_name


def one_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    assert len(lines) == 1, text
    assert "Traceback" not in text
    return lines[0]


def raises_one_line(exc, words, call):
    with pytest.raises(exc) as info:
        call()
    message = one_line(str(info.value))
    assert all(w in message for w in words), message


@pytest.fixture(scope="module")
def demo():
    torch.set_num_threads(1)
    return rl.load_demo_model()


# ------------------------------------------------------------------------------- heads and judges
@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    root = tmp_path_factory.mktemp("heads")
    prm_dir = save_tiny("qwen2_prm", root / "prm", seed=5)
    tiny_causal_lm(root / "judge", tied=False)
    headless = Path(shutil.copytree(root / "judge", root / "headless"))  # the backbone only, untied
    from safetensors.torch import load_file, save_file

    sd = load_file(headless / "model.safetensors")
    save_file({k: v for k, v in sd.items() if k != "lm_head.weight"}, headless / "model.safetensors")
    return {
        "qrm": HookedRewardModel.from_pretrained(save_tiny_qrm(root / "qrm", seed=0)),
        "prm": HookedRewardModel.from_pretrained(prm_dir, tokenizer=prm_tokenizer()),
        "prm_dir": prm_dir,
        "judge": root / "judge",
        "headless": headless,
    }


def _set(obj, name, value):
    setattr(obj, name, value)


def _enter(ctx):
    with ctx:
        pass


HEADS = [  # (class, name, call(heads), exception, words)
    (
        "silent",
        "a hook name's layer as a float",
        lambda h: act_name("resid_post", 1.5),
        ValueError,
        ["act_name('resid_post', 1.5)", "must be an integer"],
    ),
    (
        "silent",
        "quantile as a float",
        lambda h: h["qrm"].reward_head.set_quantile(1.7),
        ValueError,
        ["quantile index must be an integer index", "1.7", "never rounded"],
    ),
    (
        "silent",
        "quantile given as its level",
        lambda h: h["qrm"].reward_head.set_quantile(0.5),
        ValueError,
        ["quantile index must be an integer index", "levels 0:"],
    ),
    (
        "silent",
        "objective index as a float",
        lambda h: h["qrm"].reward_head.set_objective(1.5),
        ValueError,
        ["objective index must be an integer index", "or give its name"],
    ),
    (
        "silent",
        "step as a float",
        lambda h: _enter(read_step(h["prm"], 0.5)),
        ValueError,
        ["step must be an integer index"],
    ),
    (
        "silent",
        "step tag id beyond the vocabulary",
        lambda h: HookedRewardModel.from_pretrained(
            h["prm_dir"], tokenizer=prm_tokenizer(), step_tag=VOCAB + 3
        ),
        ValueError,
        ["step tag id", f"{VOCAB + 3} out of range", f"0..{VOCAB - 1}"],
    ),
    (
        "silent",
        "step tag id set beyond the vocabulary",
        lambda h: _set(h["prm"].reward_head, "step_tag_id", 10**6),
        ValueError,
        ["step tag id 1000000 out of range"],
    ),
    (
        "silent",
        "step tag id as a float",
        lambda h: _set(h["prm"].reward_head, "step_tag_id", float(STEP_TAG)),
        ValueError,
        ["step tag id must be an integer index"],
    ),
    (
        "silent",
        "step tag unknown to the tokenizer",
        lambda h: HookedRewardModel.from_pretrained(
            h["prm_dir"], tokenizer=prm_tokenizer(), step_tag="<step>"
        ),
        ValueError,
        ["step_tag='<step>'", "unknown to this tokenizer"],
    ),
    (
        "silent",
        "step tag of several tokens",
        lambda h: HookedRewardModel.from_pretrained(
            h["prm_dir"], tokenizer=prm_tokenizer(), step_tag="w3 w4"
        ),
        ValueError,
        ["step_tag='w3 w4'", "2 tokens"],
    ),
    (
        "silent",
        "step rewards of a text without step tags",
        lambda h: h["prm"].step_rewards(torch.tensor([[3, 4, 5, STEP_TAG], [3, 4, 5, 6]])),
        ValueError,
        ["rows [1]", "no step tag", "<extra_0>"],
    ),
    (
        "silent",
        "judge from a checkpoint without an LM head",
        lambda h: HookedRewardModel.from_judge(h["headless"], positive="Yes", negative="No"),
        ValueError,
        ["no lm_head.weight", "tie_word_embeddings is false", "ForCausalLM"],
    ),
    (
        "silent",
        "judge word unknown to the tokenizer",
        lambda h: HookedRewardModel.from_judge(h["judge"], positive="Maybe", negative="No"),
        ValueError,
        ["positive='Maybe'", "unknown to this tokenizer", "'<unk>'"],
    ),
    (
        "silent",
        "judge word of several tokens",
        lambda h: HookedRewardModel.from_judge(h["judge"], positive="Yes", negative="is right"),
        ValueError,
        ["negative='is right'", "2 tokens"],
    ),
    (
        "silent",
        "judge answer id as a bool",
        lambda h: HookedRewardModel.from_judge(h["judge"], positive=True, negative="No"),
        ValueError,
        ["positive token id must be an integer index", "True"],
    ),
]


@pytest.mark.parametrize("cls,name,call,exc,words", HEADS, ids=[c[1] for c in HEADS])
def test_heads_and_judges(heads, cls, name, call, exc, words):
    raises_one_line(exc, words, lambda: call(heads))


def test_integer_indices_still_work(heads):
    head = heads["qrm"].reward_head
    head.set_quantile(torch.tensor(1))  # a 0-d integer tensor is an integer
    assert head.quantile == 1
    head.set_quantile(None)
    head.set_objective(__import__("numpy").int64(0))
    assert head.objective == 0
    head.set_objective(None)


# ------------------------------------------------------------------------------- evaluate: subset names
def _v1_rows(subsets):
    pairs = rl.demo_pairs()[:6]
    return [
        {"id": str(i), "prompt": p.prompt, "chosen": p.chosen, "rejected": p.rejected, "subset": s}
        for i, (p, s) in enumerate(zip(pairs, subsets))
    ]


EVALUATE = [  # (class, name, rows, the rows meant (None: refused), words)
    (
        "silent",
        "misspelled subset",
        _v1_rows(["alpacaeval-easy", "alpacaeval_easy", "math-prm"]),
        None,
        ["'alpacaeval_easy' is not a RewardBench subset", "did you mean 'alpacaeval-easy'?"],
    ),
    (
        "silent",
        "unknown subset beside known ones",
        _v1_rows(["alpacaeval-easy", "my-own", "math-prm"]),
        None,
        ["'my-own' is not a RewardBench subset", "left out of the sections and 'all'"],
    ),
    (
        "silent",
        "subsets with stray whitespace",
        _v1_rows([" alpacaeval-easy", "math-prm\t", "hep-go "]),
        _v1_rows(["alpacaeval-easy", "math-prm", "hep-go"]),
        None,
    ),
]


@pytest.mark.parametrize("cls,name,rows,meant,words", EVALUATE, ids=[c[1] for c in EVALUATE])
def test_evaluate_subset_names(demo, cls, name, rows, meant, words):
    if meant is None:
        raises_one_line(BenchmarkFormatError, words, lambda: rl.evaluate(demo, rows, progress=False))
        return
    got = rl.evaluate(demo, rows, progress=False).summary()
    want = rl.evaluate(demo, meant, progress=False).summary()
    assert got.equals(want), (got, want)


def _rb2_rows(subsets):
    return [
        {"id": str(i), "prompt": p.prompt, "chosen": [p.chosen], "rejected": [p.rejected, "No."], "subset": s}
        for i, (p, s) in enumerate(zip(rl.demo_pairs()[:6], subsets))
    ]


def _rmbench_rows(domains):
    return [
        {"prompt": p.prompt, "chosen": [p.chosen] * 3, "rejected": [p.rejected] * 3, "domain": d}
        for p, d in zip(rl.demo_pairs()[:6], domains)
    ]


def _judge_rows(sources):
    return [
        {"question": p.prompt, "response_A": p.chosen, "response_B": p.rejected, "label": "A>B", "source": s}
        for p, s in zip(rl.demo_pairs()[:6], sources)
    ]


SPELLINGS = [  # (class, name, rows, words): one group spelled two ways would be scored as two
    (
        "silent",
        "RewardBench 2 subset in two cases",
        _rb2_rows(["Factuality", "factuality", "Math"]),
        ["'Factuality', 'factuality'", "one RewardBench 2 subset spelled 2 ways", "spell them 'Factuality'"],
    ),
    (
        "silent",
        "RewardBench 2 subset with a typo",
        _rb2_rows(["Precise IF", "Precise I", "Math"]),
        ["'Precise IF', 'Precise I'", "spell them 'Precise IF'"],
    ),
    (
        "silent",
        "RM-Bench domain in two cases",
        _rmbench_rows(["chat", "Chat", "math"]),
        ["domains 'chat', 'Chat'", "one RM-Bench domain", "spell them 'chat'"],
    ),
    (
        "silent",
        "JudgeBench source with a typo",
        _judge_rows(["livebench-reasoning", "livebench-reasonin", "livecodebench"]),
        ["sources 'livebench-reasoning', 'livebench-reasonin'", "one JudgeBench source"],
    ),
]


@pytest.mark.parametrize("cls,name,rows,words", SPELLINGS, ids=[c[1] for c in SPELLINGS])
def test_one_group_spelled_two_ways_is_refused(demo, cls, name, rows, words):
    raises_one_line(BenchmarkFormatError, words, lambda: rl.evaluate(demo, rows, progress=False))


def test_another_spelling_next_to_official_subsets_is_refused_naming_it(demo):
    # run_v2 compares names as written: "factuality" is another subset, which would enter "all"
    raises_one_line(
        BenchmarkFormatError,
        ["'factuality'", "did you mean 'Factuality'", "extra_subsets=True"],
        lambda: rl.evaluate(demo, _rb2_rows(["factuality", "factuality", "Math"]), progress=False),
    )


@pytest.mark.parametrize("domain", [" chat", "chat "])
def test_rmbench_domain_with_stray_whitespace_is_refused_naming_the_spelling(demo, domain):
    p = rl.demo_pairs()[0]
    row = {"prompt": p.prompt, "chosen": [p.chosen] * 3, "rejected": [p.rejected] * 3}
    raises_one_line(
        BenchmarkFormatError,
        [repr(domain), "surrounding spaces", "spell it 'chat'"],
        lambda: rl.evaluate(demo, [dict(row, domain=domain)], progress=False),
    )


# ------------------------------------------------------------------------------- circuits
@pytest.fixture(scope="module")
def circuit_pairs():
    return rl.demo_pairs()[:2]


CIRCUITS = [  # (class, name, call(model, pairs), words)
    ("silent", "no senders", lambda m, p: rl.edge_attribution(m, p, senders=[]), ["senders=[]", "non-empty"]),
    (
        "silent",
        "no receivers",
        lambda m, p: rl.edge_attribution(m, p, receivers=()),
        ["receivers=()", "non-empty"],
    ),
    (
        "silent",
        "steps as a float",
        lambda m, p: rl.edge_attribution(m, p, steps=2.5),
        ["steps must be an integer"],
    ),
    (
        "silent",
        "steps as a bool",
        lambda m, p: rl.edge_attribution(m, p, steps=True),
        ["steps must be an integer"],
    ),
    ("silent", "path patching: no senders", lambda m, p: rl.path_patch(m, p, senders=[]), ["senders=[]"]),
    (
        "traceback",
        "no circuit sizes",
        lambda m, p: rl.faithfulness_curve(m, p, [("L0H0", "readout")], sizes=[]),
        ["sizes=[]", "non-empty list of circuit sizes"],
    ),
    (
        "silent",
        "a circuit size as a float",
        lambda m, p: rl.faithfulness_curve(m, p, [("L0H0", "readout")], sizes=[0, 0.5]),
        ["circuit size must be an integer"],
    ),
    (
        "silent",
        "a negative circuit size",
        lambda m, p: rl.faithfulness_curve(m, p, [("L0H0", "readout")], sizes=[-1]),
        ["circuit size -1 out of range", "the ranking has 1 edges"],
    ),
]


@pytest.mark.parametrize("cls,name,call,words", CIRCUITS, ids=[c[1] for c in CIRCUITS])
def test_circuit_entry_points(demo, circuit_pairs, cls, name, call, words):
    raises_one_line(ValueError, words, lambda: call(demo, circuit_pairs))


def test_a_reward_tie_of_different_texts_has_nan_never_inf(demo):
    """Equal rewards but different texts: the edges carry something, the gap is 0: NaN, not ±inf."""
    from reward_lens.instruments.circuits.edges import EdgeAttributionResult

    res = rl.edge_attribution(
        demo, rl.demo_pairs()[:1], method="eap", senders=["L0H0"], receivers=["readout"]
    )
    tied = EdgeAttributionResult(**{**res.__dict__, "clean_rejected": res.clean_chosen.clone()})
    assert float(res.scores.abs().sum()) > 0 and torch.isnan(tied.normalized()).all()


def test_a_tie_has_nan_faithfulness_never_inf(demo):
    p = rl.demo_pairs()[0]
    pairs = [PreferencePair(p.prompt, p.chosen, p.chosen, id="tie"), p]
    f = rl.circuit_faithfulness(demo, pairs, [("L0H0", "readout")])
    assert torch.isnan(f[0]) and torch.isfinite(f[1])
    curve = rl.faithfulness_curve(demo, pairs, [("L0H0", "readout")], sizes=[0, 1])
    assert not torch.isinf(torch.as_tensor(curve.faithfulness)).any()


# ------------------------------------------------------------------------------- CLI: a missing checkpoint
@pytest.mark.parametrize("spec", ["./no-such-dir", "no/such/dir/", "pairs.jsonl"])
def test_triggers_names_a_missing_checkpoint_first(tmp_path, capsys, monkeypatch, spec):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pairs.jsonl").write_text('{"prompt": "q", "chosen": "a", "rejected": "b"}\n')
    assert main(["triggers", "--model", spec, "--out", str(tmp_path / "o")]) == 2  # no --pairs given
    message = one_line(capsys.readouterr().err)
    what = "is a file, not a checkpoint directory" if spec == "pairs.jsonl" else "does not exist"
    assert f"--model {spec!r} {what}" in message and "give --pairs" not in message, message


@pytest.mark.parametrize("command", ["audit", "evaluate", "compare", "sweep"])
@pytest.mark.parametrize("spec", ["./no-such-dir", "no-such/dir"])
def test_every_command_names_a_missing_checkpoint(tmp_path, capsys, monkeypatch, command, spec):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    p = rl.demo_pairs()[0]
    (tmp_path / "pairs.jsonl").write_text(
        json.dumps({"prompt": p.prompt, "chosen": p.chosen, "rejected": p.rejected})
    )
    argv = {
        "audit": ["audit", "--model", spec, "--pairs", "pairs.jsonl"],
        "evaluate": ["evaluate", "pairs.jsonl", "--benchmark", "rewardbench", "--model", spec],
        "compare": ["compare", spec, "demo", "--pairs", "pairs.jsonl"],
        "sweep": ["sweep", "--model", spec, "--pairs", "pairs.jsonl"],
    }[command]
    assert main([*argv, "--out", "o"]) == 2
    message = one_line(capsys.readouterr().err)
    said = (
        "no checkpoint directory at './no-such-dir'"
        if spec.startswith(".")
        else "no local directory 'no-such/dir'"
    )
    assert said in message, message


# ------------------------------------------------------------------------------- left over
def test_a_pairs_file_without_prompt_is_the_missing_columns_line(tmp_path):
    path = tmp_path / "qa.jsonl"
    path.write_text('{"question": "q", "response_a": "a", "response_b": "b"}\n')
    raises_one_line(
        ValueError, ["qa.jsonl, line 1", "lacks column(s)", "'prompt'"], lambda: rl.load_pairs(path)
    )


def test_a_misspelled_keyword_on_the_gguf_path_is_named(tmp_path):
    from test_bad_inputs_checkpoints import _gguf

    _gguf(tmp_path / "m.gguf")
    raises_one_line(
        TypeError,
        ["unexpected keyword argument 'dtpye'"],
        lambda: HookedRewardModel.from_pretrained(tmp_path, gguf_file="m.gguf", dtpye="float16"),
    )


def test_a_sweep_resumes_with_the_checkpoint_spelled_otherwise(tmp_path, capsys, monkeypatch):
    from reward_lens.demo import DEMO_DIR

    shutil.copytree(DEMO_DIR, tmp_path / "ckpt", ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    (tmp_path / "p.jsonl").write_text(
        "".join(
            json.dumps({"prompt": p.prompt, "chosen": p.chosen, "rejected": p.rejected}) + "\n"
            for p in rl.demo_pairs()[:2]
        )
    )
    monkeypatch.chdir(tmp_path)
    base = ["sweep", "--pairs", "p.jsonl", "--chunk-size", "1", "--levels", "component", "--out", "sw"]
    assert main([*base, "--model", "ckpt"]) == 0
    for spelled in ("./ckpt", str(tmp_path / "ckpt"), "ckpt/"):
        capsys.readouterr()
        assert main([*base, "--model", spelled]) == 0, capsys.readouterr().err
        assert "2 already done" in capsys.readouterr().err  # a progress line: on stderr
    other = Path(shutil.copytree(tmp_path / "ckpt", tmp_path / "other"))
    assert main([*base, "--model", str(other)]) == 2  # another directory is another model
    assert "other model" in capsys.readouterr().err


def test_a_damaged_sae_training_record_names_the_file(tmp_path):
    from reward_lens.representations.sae import SAEConfig, SparseAutoencoder, load_sae

    sae = SparseAutoencoder(SAEConfig(d_in=4, d_sae=6, k=2, hook_name="blocks.0.hook_resid_post"))
    with torch.no_grad():
        sae.W_dec.copy_(torch.randn(6, 4))
    sae.save(tmp_path / "sae")
    (tmp_path / "sae" / "reward_lens_training.json").write_text('{"steps": ')
    raises_one_line(
        ValueError, ["reward_lens_training.json", "not valid JSON"], lambda: load_sae(tmp_path / "sae")
    )


def test_a_lora_adapter_without_a_score_head_keeps_the_bases(tmp_path):
    import peft
    import transformers
    from helpers import tiny_hf_model
    from safetensors.torch import load_file, save_file

    tiny_hf_model("llama", seed=1).save_pretrained(tmp_path / "base")
    base = transformers.LlamaForSequenceClassification.from_pretrained(tmp_path / "base")
    lora = peft.get_peft_model(
        base, peft.LoraConfig(task_type="SEQ_CLS", r=4, target_modules=["q_proj", "v_proj"])
    )
    lora.save_pretrained(tmp_path / "adapter")
    path = tmp_path / "adapter" / "adapter_model.safetensors"
    torch.manual_seed(0)
    sd = {k: (torch.randn_like(v) * 0.5 if "lora_B" in k else v) for k, v in load_file(path).items()}
    shutil.copytree(
        tmp_path / "adapter", tmp_path / "reference"
    )  # the same adapter, the base's head saved in it
    head = load_file(tmp_path / "base" / "model.safetensors")["score.weight"]
    save_file(
        {**sd, "base_model.model.score.weight": head}, tmp_path / "reference" / "adapter_model.safetensors"
    )
    save_file({k: v for k, v in sd.items() if "score" not in k}, path)
    ids = torch.tensor([[1, 5, 7, 9, 11]])
    with pytest.warns(UserWarning, match="holds no score head; the base .* own score head is used"):
        got = HookedRewardModel.from_pretrained(tmp_path / "adapter")(ids)
    torch.testing.assert_close(got, HookedRewardModel.from_pretrained(tmp_path / "reference")(ids))
    assert not torch.allclose(got, HookedRewardModel.from_pretrained(tmp_path / "base")(ids))  # LoRA applied


def test_a_zero_concept_vector_is_named(demo):
    from reward_lens import ContrastPair

    probes = [ContrastPair("q", "a", "b")]
    raises_one_line(
        ValueError,
        ["concept direction is zero", "nothing to project out"],
        lambda: rl.edit_reward(demo, torch.zeros(demo.cfg.d_model), probes=probes),
    )


def test_token_attribution_of_a_prompt_with_no_response(demo):
    conversation = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."}]
    for prompt, meant in (("What is 2+2?", ""), (conversation, [])):
        got = rl.token_attribution(demo, [(prompt, None)])
        want = rl.token_attribution(demo, [(prompt, meant)])
        assert got.tokens == want.tokens and torch.equal(got.reward["text"], want.reward["text"])
        direct = demo(demo.to_tokens([prompt], [meant])["input_ids"])  # the prompt rendered, no response
        torch.testing.assert_close(got.total("text").float(), direct.float(), atol=1e-4, rtol=0)


def test_ctrl_c_after_the_report_is_swapped_in_says_it_is_complete(demo, tmp_path, capsys, monkeypatch):
    from reward_lens.app.output import ReportDir

    p = rl.demo_pairs()[0]
    src = tmp_path / "jb.jsonl"
    src.write_text(
        json.dumps({"question": p.prompt, "response_A": p.chosen, "response_B": p.rejected, "label": "A>B"})
        + "\n"
    )
    real = ReportDir.commit

    def commit_then_interrupt(self, write):
        real(self, write)
        raise KeyboardInterrupt

    monkeypatch.setattr(ReportDir, "commit", commit_then_interrupt)
    assert main(["evaluate", str(src), "--out", str(tmp_path / "ev")]) == 0
    message = one_line(capsys.readouterr().err)
    assert "interrupted after the report was written" in message and "complete" in message
    assert "no partial report" not in message
    assert json.loads((tmp_path / "ev" / "results.json").read_text())["benchmark"] == "judgebench"
