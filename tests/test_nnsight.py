"""The same numbers from nnsight (the `test` extra's nnsight==0.8.1) as from bare transformers and from
HookedRewardModel, on tiny random Llama, Gemma-2 and Qwen3 reward checkpoints, right- and left-padded and
unbatched: the reward; at the readout, every layer's residual, attention output and MLP output; and one
patched reward (block `PATCH_LAYER`'s resid_pre at the readout, from the rejected run into the chosen).

nnsight runs in its own interpreter (tests/nnsight_reference.py: importing nnsight patches torch and every
object for the rest of a process), wrapping each saved checkpoint both as `NNsight(hf_model)` and as
`TransformersModel(dir, task="text-classification")`. Bare transformers is read here with torch hooks.
Tolerances (fp32): nnsight and bare transformers run the same modules, 1e-6; HookedRewardModel 1e-4, as
tests/test_parity.py. docs/nnsight.md is executed as written and its printed numbers checked.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import tiny_hf_model, tiny_tokenizer, token_pairs
from test_gemma2 import tiny_gemma2

from reward_lens import HookedRewardModel, patch

ROOT = Path(__file__).resolve().parents[1]
ARCHS = ["llama", "gemma2", "qwen3"]
CASES = ["right", "left", "unbatched"]
WRAPPERS = ["NNsight", "TransformersModel"]
PATCH_LAYER = 1
SAME_MODULES_TOL = 1e-6
TOL = 1e-4


def tiny_checkpoint(arch: str):
    return tiny_gemma2() if arch == "gemma2" else tiny_hf_model(arch)


def pairs_for(case: str):
    lengths = [(4, 2)] if case == "unbatched" else [(5, 2), (2, 6), (4, 4)]
    return token_pairs(lengths, prompt_len=3, seed=1)


def padded(rows, side):
    """[batch, pos] ids padded with 0 (the tiny configs' pad id) on `side`, and the mask; None: one row."""
    if side == "unbatched":
        return rows[0][None], None
    T = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        cols = slice(T - len(r), T) if side == "left" else slice(0, len(r))
        ids[i, cols], mask[i, cols] = r, 1
    return ids, mask


def batches(case: str):
    pairs = pairs_for(case)
    return {
        "chosen": padded([p.chosen for p in pairs], case),
        "rejected": padded([p.rejected for p in pairs], case),
    }


@pytest.fixture(scope="module")
def models():
    return {arch: tiny_checkpoint(arch) for arch in ARCHS}


@pytest.fixture(scope="module")
def nnsight_runs(models, tmp_path_factory):
    """tests/nnsight_reference.py's numbers for every (arch, wrapper, case), from one subprocess."""
    tmp = tmp_path_factory.mktemp("nnsight")
    checkpoints = {}
    for arch, hf in models.items():
        hf.save_pretrained(tmp / arch)
        tiny_tokenizer().save_pretrained(tmp / arch)  # TransformersModel builds a pipeline: needs one
        checkpoints[arch] = str(tmp / arch)
    spec = {"checkpoints": checkpoints, "patch_layer": PATCH_LAYER, "cases": {c: batches(c) for c in CASES}}
    torch.save(spec, tmp / "cases.pt")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    script = str(ROOT / "tests" / "nnsight_reference.py")
    out = subprocess.run(
        [sys.executable, script, str(tmp / "cases.pt"), str(tmp / "out.pt")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return torch.load(tmp / "out.pt")


def mask_kwargs(mask):
    return {} if mask is None else {"attention_mask": mask}


def block_outputs(layer):
    """What a block adds to the residual (Gemma-2: its post-norms' outputs)."""
    if hasattr(layer, "post_feedforward_layernorm"):
        return {"attn": layer.post_attention_layernorm, "mlp": layer.post_feedforward_layernorm}
    return {"attn": layer.self_attn, "mlp": layer.mlp}


def hf_hooked_run(hf, ids, mask, readout, patch_source=None):
    """Bare transformers with torch forward hooks: the reward and, at `readout`, each layer's attention
    output, MLP output and residual. A forward pre-hook records block PATCH_LAYER's input (resid_pre) at
    the readout as "source", then writes `patch_source` ([batch, d_model]) there when given."""
    rows = torch.arange(ids.shape[0])
    got = {"attn": [], "mlp": [], "resid": [], "source": []}

    def record(key):
        return lambda module, args, out: got[key].append(
            (out[0] if isinstance(out, tuple) else out)[rows, readout]
        )

    def replace(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        got["source"].append(hidden[rows, readout])
        if patch_source is None:
            return None
        hidden = hidden.clone()
        hidden[rows, readout] = patch_source
        return ((hidden, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": hidden})

    handles = []
    for l, layer in enumerate(hf.model.layers):
        for key, module in block_outputs(layer).items():
            handles.append(module.register_forward_hook(record(key)))
        handles.append(layer.register_forward_hook(record("resid")))
        if l == PATCH_LAYER:
            handles.append(layer.register_forward_pre_hook(replace, with_kwargs=True))
    try:
        with torch.no_grad():
            reward = hf(ids, **mask_kwargs(mask)).logits[:, 0]
    finally:
        for h in handles:
            h.remove()
    return {"reward": reward, **{k: torch.stack(v) for k, v in got.items()}}


def hf_readout(ids, pad_token_id):
    return (torch.arange(ids.shape[1]) * (ids != pad_token_id)).argmax(-1)


@pytest.fixture(scope="module")
def hf_runs(models):
    """Bare transformers' numbers (torch hooks) for every (arch, case)."""
    out = {}
    for arch, hf in models.items():
        for case in CASES:
            (ids_c, mask_c), (ids_r, mask_r) = batches(case).values()
            pad = hf.config.pad_token_id
            clean = hf_hooked_run(hf, ids_c, mask_c, hf_readout(ids_c, pad))
            source = hf_hooked_run(hf, ids_r, mask_r, hf_readout(ids_r, pad))["source"][0]
            patched = hf_hooked_run(hf, ids_c, mask_c, hf_readout(ids_c, pad), patch_source=source)
            out[arch, case] = {**clean, "readout": hf_readout(ids_c, pad), "patched": patched["reward"]}
    return out


@pytest.fixture(scope="module")
def hooked_runs(models):
    """HookedRewardModel's numbers: run_with_cache gathered at readout_positions; reward_lens.patch."""
    out = {}
    for arch, hf in models.items():
        model = HookedRewardModel.from_hf_model(hf, device="cpu")
        for case in CASES:
            ids, mask = batches(case)["chosen"]
            reward, cache = model.run_with_cache(ids, attention_mask=mask)
            readout = model.readout_positions(ids, mask)
            rows = torch.arange(ids.shape[0])

            def at_readout(name):
                return torch.stack(
                    [cache[f"blocks.{l}.{name}"][rows, readout] for l in range(model.cfg.n_layers)]
                )

            res = patch(
                model,
                pairs_for(case),
                mode="noising",
                level="residual",
                layers=[PATCH_LAYER],
                padding_side=None if case == "unbatched" else case,
                progress=False,
            )
            assert res.components == [f"resid_L{PATCH_LAYER}"]
            out[arch, case] = {
                "reward": reward,
                "readout": readout,
                "attn": at_readout("hook_attn_out"),
                "mlp": at_readout("hook_mlp_out"),
                "resid": at_readout("hook_resid_post"),
                "patched": res.patched_reward("noising")[:, 0],
            }
    return out


QUANTITIES = ["reward", "resid", "attn", "mlp", "patched"]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("arch", ARCHS)
def test_nnsight_bare_transformers_and_hooked_model_agree(nnsight_runs, hf_runs, hooked_runs, arch, case):
    hf, ours = hf_runs[arch, case], hooked_runs[arch, case]
    assert torch.equal(ours["readout"], hf["readout"])
    for wrapper in WRAPPERS:
        nn = nnsight_runs[arch][wrapper][case]
        assert torch.equal(nn["readout"], hf["readout"]), wrapper
        for q in QUANTITIES:
            assert nn[q].shape == hf[q].shape, (wrapper, q)
            assert (nn[q] - hf[q]).abs().max() <= SAME_MODULES_TOL, (wrapper, q)
    for q in QUANTITIES:
        assert ours[q].shape == hf[q].shape, q
        assert (ours[q] - hf[q]).abs().max() < TOL, q


@pytest.mark.parametrize("arch", ARCHS)
def test_the_patch_and_the_padding_are_really_exercised(hf_runs, arch):
    """The patch moves the reward far beyond the agreement asked; one pair's numbers do not depend on the
    padding side."""
    for case in CASES:
        run = hf_runs[arch, case]
        assert (run["patched"] - run["reward"]).abs().max() > 10 * TOL, case
    right, left = hf_runs[arch, "right"], hf_runs[arch, "left"]
    for q in QUANTITIES:
        assert torch.allclose(right[q], left[q], atol=TOL), q
    assert right["readout"].tolist() != left["readout"].tolist()


DOC = ROOT / "docs" / "nnsight.md"
NUMBER = re.compile(r"-?\d+\.\d+(?:e-?\d+)?")


def doc_blocks(kind: str):
    return re.findall(rf"```{kind}\n(.*?)```", DOC.read_text(encoding="utf-8"), re.S)


def test_the_guide_runs_as_written_and_prints_its_numbers(tmp_path):
    """docs/nnsight.md's Python blocks, run in order as one script (a fresh interpreter, an empty
    directory), print exactly its `text` blocks, each number to one unit of its last printed digit (a
    rounding flip under another torch)."""
    code = "\n".join(doc_blocks("python"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    printed, written = out.stdout.strip().splitlines(), "".join(doc_blocks("text")).strip().splitlines()
    assert len(printed) == len(written), out.stdout
    for got, want in zip(printed, written):
        assert NUMBER.sub("#", got) == NUMBER.sub("#", want), (got, want)
        for g, w in zip(NUMBER.findall(got), NUMBER.findall(want)):
            last_digit = 10.0 ** -len(w.split(".")[1].split("e")[0])
            assert abs(float(g) - float(w)) <= 1.01 * last_digit, (got, want)
