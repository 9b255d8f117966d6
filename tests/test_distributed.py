"""Data-parallel runs (reward_lens.distributed): shards merged = one process; torchrun audit/compare = one
process."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from reward_lens import distributed as dist
from reward_lens.core.autobatch import BatchSize
from reward_lens.data.pairs import TokenPair
from reward_lens.instruments import attribute, attribution_patch, divergence_patch, lens, patch, site_means
from reward_lens.instruments.divergence import fit_reference, reference_pairs, reference_states, state_hook
from reward_lens.instruments.patching.contrastive import means_from_sums, site_sums
from reward_lens.instruments.sites import sites_for

ROOT = Path(__file__).resolve().parents[1]


def token_pairs(n=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        prompt = torch.randint(1, 97, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g)
        c = torch.randint(1, 97, (int(torch.randint(1, 5, (1,), generator=g)),), generator=g)
        r = torch.randint(1, 97, (int(torch.randint(1, 5, (1,), generator=g)),), generator=g)
        out.append(TokenPair(torch.cat([prompt, c]), torch.cat([prompt, r]), prompt_len=len(prompt)))
    return out


def test_shards_are_contiguous_whole_batches_covering_every_pair():
    for n, unit, world in [(11, 3, 2), (5, 4, 3), (40, 8, 4), (1, 8, 2)]:
        parts = [dist.Ranks(r, world).shard(n, unit) for r in range(world)]
        assert [i for p in parts for i in range(n)[p]] == list(range(n))
        assert all(p.start % unit == 0 for p in parts if p.stop > p.start)


def assert_same(a, b, path=""):
    """Dataclass results equal field by field (tensors within 1e-6)."""
    if isinstance(a, torch.Tensor):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6, msg=path)
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif hasattr(a, "__dataclass_fields__"):
        for k in a.__dataclass_fields__:
            assert_same(getattr(a, k), getattr(b, k), f"{path}.{k}")
    else:
        assert a == b, (path, a, b)


@pytest.mark.parametrize("name", ["lens", "attribute", "patch", "atp"])
def test_merged_shards_equal_one_call(llama_model, name):
    pairs, bs = token_pairs(), 3
    sites = sites_for(llama_model.cfg, ["component", "head"])
    means = site_means(llama_model, pairs, sites, batch_size=bs)
    call = {
        "lens": lambda p: lens(llama_model, p, batch_size=bs, progress=False),
        "attribute": lambda p: attribute(llama_model, p, batch_size=bs, progress=False),
        "patch": lambda p: patch(
            llama_model,
            p,
            mode=["noising", "denoising", "zero", "mean"],
            level=["component", "head"],
            means=means,
            batch_size=bs,
            progress=False,
        ),
        "atp": lambda p: attribution_patch(
            llama_model,
            p,
            mode=["noising", "mean"],
            level=["component", "head"],
            means=means,
            batch_size=bs,
            progress=False,
        ),
    }[name]
    parts = [call(pairs[dist.Ranks(r, 2).shard(len(pairs), bs)]) for r in range(2)]
    full = call(pairs)
    merged = dist.merge(parts, full.pair_ids)
    assert merged.pair_ids == full.pair_ids == [str(i) for i in range(len(pairs))]
    assert_same(merged, full)


def test_site_sums_of_shards_give_the_means_over_all_pairs(llama_model):
    pairs = token_pairs()
    sites = sites_for(llama_model.cfg, ["component", "head"])
    for positions in ("readout", "prompt"):
        sums, count = {}, 0
        for r in range(3):
            s, c = site_sums(
                llama_model, pairs[dist.Ranks(r, 3).shard(len(pairs), 2)], sites, positions, batch_size=2
            )
            sums = {h: sums.get(h, 0) + v for h, v in s.items()}
            count += c
        got = means_from_sums(llama_model, sites, sums, count)
        want = site_means(llama_model, pairs, sites, positions, batch_size=2)
        for k in want:
            torch.testing.assert_close(got[k], want[k], atol=1e-6, rtol=1e-6)


def test_divergence_shards_with_a_gathered_fit_equal_one_call(llama_model):
    pairs, bs = token_pairs(), 3
    full = divergence_patch(llama_model, pairs, batch_size=bs, progress=False)
    hooks = [state_hook(s, llama_model.cfg.n_layers) for s in full.patching.sites]
    ref = reference_pairs(pairs, None)
    states = [
        reference_states(llama_model, ref, hooks, bs, within=dist.Ranks(r, 2).shard(len(ref), bs))
        for r in range(2)
    ]
    fit = fit_reference({h: torch.cat([s[h] for s in states]) for h in states[0]})
    parts = [
        divergence_patch(
            llama_model,
            pairs,
            batch_size=bs,
            reference=fit,
            progress=False,
            shard=dist.Ranks(r, 2).shard(len(pairs), bs),
        )
        for r in range(2)
    ]
    assert parts[0].patching.pair_ids == ["0", "1", "2", "3", "4", "5"]
    merged = dist.merge(parts, full.pair_ids)
    assert_same(merged, full)
    assert not torch.equal(parts[0].threshold, full.threshold)  # the threshold is recomputed over all pairs


def fake_oom(limit):
    """A patch_batch stand-in that runs out of memory on batches of more than `limit` pairs."""
    from reward_lens.instruments.patching import engines

    real = engines.patch_batch
    sizes = []

    def patch_batch(model, batch, *args, **kwargs):
        n = batch.chosen.input_ids.shape[0]
        sizes.append(n)
        if n > limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (fake)")
        return real(model, batch, *args, **kwargs)

    return patch_batch, sizes


def test_auto_batch_size_halves_on_out_of_memory(llama_model, monkeypatch):
    from reward_lens.instruments.patching import contrastive

    pairs = token_pairs(9)
    stub, sizes = fake_oom(2)
    monkeypatch.setattr(contrastive, "patch_batch", stub)
    batch = BatchSize.parse("auto", "cpu")
    assert (batch.initial, batch.backoff) == (8, True)
    with pytest.warns(UserWarning, match="out of memory; retrying with batch size 2"):
        got = dist.patch(llama_model, pairs, batch_size=batch, progress=False)
    assert batch.size == 2 and sizes[:2] == [8, 4] and set(sizes[2:]) <= {1, 2}
    stub_free = patch(llama_model, pairs, batch_size=2, progress=False)  # (stub passes batches of 2)
    assert_same(got, stub_free)
    with pytest.raises(torch.OutOfMemoryError):  # a fixed size is never changed behind the user's back
        dist.patch(llama_model, pairs, batch_size=4, progress=False)
    monkeypatch.setattr(contrastive, "patch_batch", fake_oom(0)[0])
    with pytest.raises(torch.OutOfMemoryError), pytest.warns(UserWarning):  # at size 1: the real error
        dist.patch(llama_model, pairs, batch_size=BatchSize.parse("auto", "cpu"), progress=False)


def test_auto_batch_size_retries_only_out_of_memory():
    calls = []

    def fn(bs):
        calls.append(bs)
        raise ValueError("a real bug")

    with pytest.raises(ValueError, match="a real bug"):
        BatchSize.auto("cuda").run(fn)
    assert calls == [32]
    with pytest.raises(ValueError, match="integer >= 1 or 'auto'"):
        BatchSize.parse("big")


def close(a, b, path=""):
    if path.split(".")[-1] in ("timings_s", "total_time_s", "world_size", "options"):
        return
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            close(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (u, v) in enumerate(zip(a, b)):
            close(u, v, f"{path}[{i}]")
    elif isinstance(a, float) and isinstance(b, float):
        assert math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-5), (path, a, b)
    else:
        assert a == b, (path, a, b)


def assert_same_report(one: Path, two: Path) -> None:
    for name in ("results.json", "run.json"):
        if (one / name).exists():
            close(json.loads((one / name).read_text()), json.loads((two / name).read_text()), name)
    csvs = sorted(p.name for p in one.glob("*.csv"))
    assert csvs and csvs == sorted(p.name for p in two.glob("*.csv"))
    for name in csvs:
        pd.testing.assert_frame_equal(pd.read_csv(one / name), pd.read_csv(two / name), rtol=1e-5, atol=1e-5)


def test_torchrun_audit_compare_and_sweep_write_the_single_process_outputs(tmp_path):
    """2 CPU ranks (gloo) under torchrun: one report (or sweep table) each, equal to the one-process one
    within 1e-5."""
    from reward_lens.app.cli import main

    audit = ["audit", "--max-pairs", "8", "--batch-size", "4"]
    compare = ["compare", "demo", "demo", "--max-pairs", "4", "--batch-size", "2"]
    sweep = [
        "sweep",
        "--max-pairs",
        "6",
        "--chunk-size",
        "2",
        "--instruments",
        "patch,attribute",
        "--modes",
        "noising,mean",
        "--batch-size",
        "2",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(ROOT / "tests" / "torchrun_cli.py"),
        *audit,
        "--out",
        str(tmp_path / "a2"),
        "::",
        *compare,
        "--out",
        str(tmp_path / "c2"),
        "::",
        *sweep,
        "--out",
        str(tmp_path / "s2"),
    ]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert main([*audit, "--out", str(tmp_path / "a1")]) == 0
    assert main([*compare, "--out", str(tmp_path / "c1")]) == 0
    assert main([*sweep, "--out", str(tmp_path / "s1")]) == 0
    assert_same_report(tmp_path / "a1", tmp_path / "a2")
    assert_same_report(tmp_path / "c1", tmp_path / "c2")
    assert json.loads((tmp_path / "a2" / "results.json").read_text())["world_size"] == 2
    assert json.loads((tmp_path / "a1" / "results.json").read_text())["world_size"] == 1
    assert json.loads((tmp_path / "c2" / "run.json").read_text())["world_size"] == 2
    one, two = (pd.read_parquet(tmp_path / d / "sweep.parquet") for d in ("s1", "s2"))
    assert len(one) and len(list((tmp_path / "s2" / "parts").iterdir())) == 3  # ranks took disjoint chunks
    pd.testing.assert_frame_equal(one, two, rtol=1e-5, atol=1e-5)
    assert not list(tmp_path.glob("*.lock"))  # rank 0 took and released the only lock
