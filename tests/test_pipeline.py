"""One pipeline over pairs (reward_lens.core.pipeline): several instruments in one call equal each called
alone, the clean passes run once per batch and side, batch sizes and torchrun ranks do not change results."""

import os
import sys

import pytest
import torch
from armorm_reference import chat_ids, save_tiny_armorm
from test_distributed import assert_same, token_pairs

from reward_lens import HookedRewardModel
from reward_lens.core.pipeline import run_pipeline
from reward_lens.core.ranks import Ranks
from reward_lens.data.pairs import TokenPair
from reward_lens.instruments import (
    AtPSpec,
    AttributionSpec,
    DivergenceSpec,
    EffectSpec,
    LensSpec,
    PatchSpec,
    attribute,
    attribution_patch,
    divergence_patch,
    effect_decomposition,
    lens,
    patch,
    token_attribution,
)
from reward_lens.instruments.tokens import TokenSpec

MODES = ["noising", "denoising", "zero", "mean"]
ONE = Ranks()  # one process, whatever process group a test run may have joined


def specs(divergence: bool = True):
    out = [
        LensSpec(),
        AttributionSpec(heads=True),
        PatchSpec(mode=MODES, level="component"),
        PatchSpec(mode="noising", level="head"),
        AtPSpec(mode=MODES, level=["component", "head"]),
    ]
    return out + ([DivergenceSpec(), EffectSpec("noising")] if divergence else [])


def alone(model, pairs, bs, divergence: bool = True):
    kw = dict(batch_size=bs, progress=False)
    out = {
        "lens": lens(model, pairs, **kw),
        "attribution": attribute(model, pairs, heads=True, **kw),
        "patch": patch(model, pairs, mode=MODES, level="component", **kw),
        "patch:head": patch(model, pairs, mode="noising", level="head", **kw),
        "atp": attribution_patch(model, pairs, mode=MODES, level=["component", "head"], **kw),
    }
    if divergence:
        out["divergence"] = divergence_patch(model, pairs, **kw)
        out["effect_decomposition"] = effect_decomposition(model, pairs, mode="noising", **kw)
    return out


def test_instruments_in_one_call_equal_each_alone_llama(llama_model):
    pairs, bs = token_pairs(), 3
    together = run_pipeline(llama_model, pairs, specs(), batch_size=bs, ranks=ONE)
    want = alone(llama_model, pairs, bs)
    assert set(together) == set(want)
    for name in want:
        assert_same(together[name], want[name], name)


def armorm_pairs(n=5):
    out = []
    for i in range(n):
        c, r = chat_ids(3 + i % 2, 2 + i % 3, seed=i), chat_ids(3 + i % 2, 4, seed=i)
        out.append(TokenPair(c, r, id=f"armo-{i}"))
    return out


def test_instruments_in_one_call_equal_each_alone_armorm(tmp_path):
    model = HookedRewardModel.from_pretrained(save_tiny_armorm(tmp_path / "armo", seed=0))
    assert model.cfg.head_type == "armorm"
    pairs, bs = armorm_pairs(), 2
    together = run_pipeline(model, pairs, specs(divergence=False), batch_size=bs, ranks=ONE)
    want = alone(model, pairs, bs, divergence=False)
    for name in want:
        assert_same(together[name], want[name], name)


def count_forwards(model, monkeypatch):
    """A list that grows by one per full forward of the model (readout recomputations are not forwards)."""
    calls = []
    original = model.forward

    def counted(*args, **kwargs):
        calls.append(kwargs.get("start_at_layer"))
        return original(*args, **kwargs)

    monkeypatch.setattr(model, "forward", counted)
    return calls


def test_clean_passes_run_once_per_batch_and_side(llama_model, monkeypatch, count_readout_sweeps):
    pairs, bs = token_pairs(7), 3  # 3 batches
    request = [
        LensSpec(),
        AttributionSpec(heads=True),
        PatchSpec(mode=MODES, level="component"),
        AtPSpec(mode=MODES, level=["component", "head"]),
    ]
    calls = count_forwards(llama_model, monkeypatch)
    run_pipeline(llama_model, pairs, request, batch_size=bs, ranks=ONE)
    assert len(calls) == 2 * 3 and set(calls) == {None}  # mean ablation's pre-pass kept its captures
    assert len(count_readout_sweeps) == 3 * 2  # per batch and target, its modes in one sweep
    calls.clear()
    run_pipeline(llama_model, pairs, request, batch_size=bs, ranks=ONE, keep_bytes=0)
    assert len(calls) == 2 * 2 * 3  # no captures kept: the second pass reruns the clean forwards
    calls.clear()
    run_pipeline(llama_model, pairs, request[:2], batch_size=bs, ranks=ONE)
    assert len(calls) == 2 * 3


def test_instruments_share_one_readout_sweep_per_mode_and_target(llama_model, count_readout_sweeps):
    """The audit's set: the effect decomposition steps beside patching (the last pass) and reads the
    noising rows of chosen's one sweep (noising, zero, mean); divergence-aware patching reads them too."""
    pairs, bs = token_pairs(7), 3  # 3 batches
    request = [PatchSpec(mode=MODES, level="component"), DivergenceSpec(), EffectSpec("noising")]
    for keep in (2**30, 0):
        count_readout_sweeps.clear()
        run_pipeline(llama_model, pairs, request, batch_size=bs, ranks=ONE, keep_bytes=keep)
        assert len(count_readout_sweeps) == 3 * 2  # per batch: chosen's three modes; rejected's three
    count_readout_sweeps.clear()
    run_pipeline(llama_model, pairs, [EffectSpec("noising"), PatchSpec()], batch_size=bs, ranks=ONE)
    assert len(count_readout_sweeps) == 3  # one pass: the patch reuses the decomposition's sweep


def test_results_do_not_depend_on_the_batch_size(llama_model):
    pairs = token_pairs()
    runs = [run_pipeline(llama_model, pairs, specs(), batch_size=bs, ranks=ONE) for bs in (2, 5, 11)]
    for other in runs[1:]:
        for name in runs[0]:
            for path, a, b in _tensors(runs[0][name], other[name], name):
                torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5, msg=path)


def _tensors(a, b, path):
    if isinstance(a, torch.Tensor):
        yield path, a, b
    elif isinstance(a, dict):
        for k in a:
            yield from _tensors(a[k], b[k], f"{path}.{k}")
    elif hasattr(a, "__dataclass_fields__"):
        for k in a.__dataclass_fields__:
            yield from _tensors(getattr(a, k), getattr(b, k), f"{path}.{k}")


def test_token_spec_pieces_give_token_attribution(llama_model):
    pairs = token_pairs(5)
    pieces = run_pipeline(llama_model, pairs, [TokenSpec(), LensSpec()], batch_size=2, ranks=ONE)["tokens"]
    res = token_attribution(llama_model, pairs, batch_size=2)
    got = torch.cat([torch.cat(p["chosen"]["reward"]) for p in pieces])
    torch.testing.assert_close(got, res.reward["chosen"], atol=1e-6, rtol=1e-6)


def _rank_worker(rank, world, store, out):
    import torch.distributed as dist

    sys.path.insert(0, os.path.dirname(__file__))
    from helpers import tiny_hf_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    model = HookedRewardModel.from_hf_model(tiny_hf_model("llama"))
    got = run_pipeline(model, token_pairs(), specs(), batch_size=3, ranks=Ranks(rank, world))
    if rank == 0:
        torch.save(got, out)
    else:
        assert got is None
    dist.destroy_process_group()


def test_ranks_merge_by_the_one_rule(llama_model, tmp_path):
    """2 gloo ranks: each computes its shard (whole batches), pre-passes reduced over ranks, pieces
    gathered to rank 0 and finished there; equal to one process."""
    import torch.multiprocessing as mp

    out = tmp_path / "rank0.pt"
    mp.spawn(_rank_worker, args=(2, str(tmp_path / "store"), str(out)), nprocs=2, join=True)
    got = torch.load(out, weights_only=False)
    want = run_pipeline(llama_model, token_pairs(), specs(), batch_size=3, ranks=ONE)
    for name in want:
        assert_same(got[name], want[name], name)


def test_two_specs_of_one_name_are_refused(llama_model):
    with pytest.raises(ValueError, match="share a name"):
        run_pipeline(llama_model, token_pairs(3), [LensSpec(), LensSpec()], ranks=ONE)
