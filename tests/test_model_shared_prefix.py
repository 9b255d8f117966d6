"""Rows sharing prefixes, scored over their radix tree (`model.shared_prefix_run`): equal to a forward of
the padded batch (fp32, 1e-5 of the largest reward) on Llama-, Mistral- (sliding window 4), Qwen3- (q/k
norms) and Gemma-2-style (post-norms, soft-caps, windows) tiny models, an MLP head (INF-ORM) and ArmoRM (its
gate reads the prompt: in the shared part for some rows, in a row's own tail for another), left and right
padded; the final residual and the final norm's scale too; the hacking probes give the same verdicts,
p-values and intervals either way."""

import numpy as np
import pytest
import torch
from armorm_reference import save_tiny_armorm
from helpers import one_thread, tiny_hf_model  # noqa: F401
from mlp_reference import save_tiny
from test_gemma2 import tiny_gemma2

from reward_lens import HookedRewardModel
from reward_lens.model.hooks import final_resid_name
from reward_lens.model.suffix import prefix_tree

TOL = 1e-5
GATE = [7, 8]  # the tiny ArmoRM's gating pattern


def shared_rows(seed: int = 0):
    """Rows that share prefixes at several depths: one row is a prefix of others, one is repeated, one
    shares nothing, one carries the gate pattern again in its own tail (ids 10..90: no pad, no pattern)."""
    g = torch.Generator().manual_seed(seed)

    def rand(n):
        return torch.randint(10, 90, (n,), generator=g).tolist()

    base = rand(3) + GATE + rand(7)  # 12 tokens
    return [
        base[:6] + rand(4),
        base[:6] + rand(7),
        base + [11, 12],
        base,
        base,
        base + [11, 13, 14],
        rand(2) + GATE + rand(3),
        base[:4] + rand(2) + GATE + rand(3),
        base + [11, 12] + rand(6),
    ]


def padded(rows, side: str, pad: int = 0):
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        sl = slice(T - len(r), T) if side == "left" else slice(0, len(r))
        ids[i, sl], mask[i, sl] = torch.tensor(r), 1
    return ids, mask


KINDS = ["llama", "mistral", "qwen3", "gemma2", "armorm", "inform"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for kind in KINDS:
        if kind == "gemma2":
            out[kind] = HookedRewardModel.from_hf_model(tiny_gemma2(), fold_ln=False)
        elif kind == "armorm":
            path = save_tiny_armorm(
                tmp_path_factory.mktemp("armo"),
                vocab_size=97,
                pad_token_id=0,
                num_objectives=5,
                gating_token_pattern=GATE,
            )
            out[kind] = HookedRewardModel.from_pretrained(path)
        elif kind == "inform":
            out[kind] = HookedRewardModel.from_pretrained(
                save_tiny("inform", tmp_path_factory.mktemp("inform"), pad_token_id=0)
            )
        else:
            out[kind] = HookedRewardModel.from_hf_model(tiny_hf_model(kind), fold_ln=kind != "mistral")
    return out


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("side", ["left", "right"])
def test_rewards_residuals_and_scales_equal_a_forward(models, kind, side):
    model = models[kind]
    assert model.cfg.pad_token_id == 0
    ids, mask = padded(shared_rows(), side)
    last, scale = final_resid_name(model.cfg.n_layers), "ln_final.hook_scale"
    want, cache = model.run_with_cache(ids, attention_mask=mask, names_filter=[last, scale])
    # max_tokens=12: several runs per level of the tree
    got = model.shared_prefix_run(ids, mask, [last, scale], max_tokens=12)
    assert got.rewards.shape == want.shape
    assert (got.rewards - want).abs().max() / want.abs().max().clamp(min=1) < TOL
    on = mask.bool()
    resid = cache[last][on]
    assert (got.acts[last][on] - resid).abs().max() / resid.abs().max() < TOL
    assert (got.acts[scale][on] - cache[scale][on]).abs().max() / cache[scale][on].abs().max() < TOL
    assert not got.acts[last][~on].any()  # padding: zeros


def test_armorm_gate_read_in_a_rows_own_tail(models):
    """The row whose gate pattern recurs in its tail reads the gate there: the test above covers it."""
    model = models["armorm"]
    ids, mask = padded(shared_rows(), "right")
    gate = model.reward_head.gate_positions(ids)
    assert int(gate[7]) > 4 and int(gate[3]) == 3  # row 7 leaves the shared base after 4 tokens


def test_the_tree_computes_each_shared_token_once():
    rows = shared_rows()
    tree = prefix_tree(rows)
    prefixes = {tuple(r[:k]) for r in rows for k in range(1, len(r) + 1)}
    assert tree.n_tokens == len(prefixes) < sum(len(r) for r in rows)
    flat = [t for seg in tree.tokens for t in seg]
    for r, row in enumerate(rows):
        assert [flat[i] for i in tree.flat_positions(tree.ends[r])] == row
    for node, parent in enumerate(tree.parent):
        assert tree.depth[node] == (0 if parent < 0 else tree.depth[parent] + len(tree.tokens[parent]))


def test_bad_input_is_refused(models):
    model = models["llama"]
    ids, mask = padded(shared_rows(), "right")
    holed = mask.clone()
    holed[0, 2] = 0
    with pytest.raises(ValueError, match="one run"):
        model.shared_prefix_run(ids, holed)
    with pytest.raises(ValueError, match="final norm's and the head's"):
        model.shared_prefix_run(ids, mask, ["blocks.0.hook_resid_pre"])


def test_probes_give_the_same_verdicts_p_values_and_intervals():
    from reward_lens.demo import load_demo_model
    from reward_lens.probes.suite import run_probes

    model = load_demo_model(device="cpu")
    plain = run_probes(model, shared_prefixes=False, n_perm=2000)
    shared = run_probes(model, shared_prefixes=True, n_perm=2000)
    a, b = plain.to_frame(), shared.to_frame()
    assert a.verdict.tolist() == b.verdict.tolist() and "rewards" in a.verdict.tolist()
    assert a.p_value.tolist() == b.p_value.tolist()
    for col in ("effect", "cohens_d", "ci_low", "ci_high"):
        assert np.allclose(a[col], b[col], rtol=0, atol=1e-4), col
    for col in ("reward_a", "reward_b"):
        diff = np.abs(plain.per_item[col] - shared.per_item[col]).max()
        assert diff < TOL * np.abs(plain.per_item[col]).max()
    assert np.abs(plain.item_deltas - shared.item_deltas).max() < TOL * np.abs(plain.item_deltas).max()
