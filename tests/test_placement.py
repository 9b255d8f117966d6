"""Streaming loading and multi-device placement.

- `plan_blocks`: contiguous ranges, optimal (checked against brute force), embedding first, head last.
- Streaming: a sharded checkpoint (transformers' `save_pretrained(max_shard_size=...)`) loads to exactly
  the weights of the whole-dict conversion (`from_hf_model`), parameters own their storage, and a damaged
  shard is named.
- Placement: a model "placed" on a list of devices that are all "cpu" runs the residual-moving code
  (counted) and gives rewards, lens, attribution, token attribution, patching (fast = the single-device
  naive reference), AtP and path patching equal to the single-device model (exactly: the same operations).
- On >= 2 GPUs the same over cuda:0 / cuda:1 (fp32, 1e-5); skipped otherwise.
"""

import itertools

import pandas as pd
import pytest
import torch
from helpers import tiny_hf_model, token_pairs

import reward_lens.model.native as native_module
import reward_lens.model.recompute as recompute_module
from reward_lens import HookedRewardModel
from reward_lens.instruments import attribute, attribution_patch, lens, patch
from reward_lens.instruments.patching.path import path_patch
from reward_lens.instruments.tokens import token_attribution
from reward_lens.model.placement import plan_blocks, resolve_devices

PAIRS = token_pairs([(5, 9), (12, 3), (7, 7)], prompt_len=4)


def brute_force(block_bytes, k, first, last):
    n = len(block_bytes)
    best = None
    for cuts in itertools.combinations_with_replacement(range(n + 1), k - 1):
        bounds = [0, *cuts, n]
        loads = [
            sum(block_bytes[bounds[d] : bounds[d + 1]])
            + (first if d == 0 else 0)
            + (last if d == k - 1 else 0)
            for d in range(k)
        ]
        best = max(loads) if best is None else min(best, max(loads))
    return best


def loads_of(owners, block_bytes, k, first, last):
    loads = [0] * k
    for b, d in zip(block_bytes, owners):
        loads[d] += b
    loads[0] += first
    loads[-1] += last
    return loads


def test_plan_blocks_is_contiguous_balanced_and_optimal():
    assert plan_blocks([10] * 8, 2) == [0, 0, 0, 0, 1, 1, 1, 1]
    assert plan_blocks([10] * 8, 1) == [0] * 8
    # a heavy embedding on device 0 and a heavy head on the last device take blocks away from them
    assert plan_blocks([10] * 8, 2, first_bytes=40) == [0, 0, 1, 1, 1, 1, 1, 1]
    owners = plan_blocks([10] * 6, 3, last_bytes=20)
    assert max(loads_of(owners, [10] * 6, 3, 0, 20)) == 30
    g = torch.Generator().manual_seed(0)
    for _ in range(40):
        n, k = int(torch.randint(1, 8, (1,), generator=g)), int(torch.randint(1, 4, (1,), generator=g))
        sizes = torch.randint(1, 50, (n,), generator=g).tolist()
        first, last = (int(x) for x in torch.randint(0, 60, (2,), generator=g))
        owners = plan_blocks(sizes, k, first, last)
        assert owners == sorted(owners) and all(0 <= d < k for d in owners)  # contiguous ranges in order
        assert max(loads_of(owners, sizes, k, first, last)) == brute_force(sizes, k, first, last)
    with pytest.raises(ValueError, match="n_devices must be >= 1"):
        plan_blocks([1, 2], 0)


def test_resolve_devices_errors_are_actionable():
    assert resolve_devices(None, None, None) is None and resolve_devices("cpu", 1, None) is None
    assert resolve_devices(None, None, ["cpu", "cpu"]) == [torch.device("cpu")] * 2
    with pytest.raises(ValueError, match="not both"):
        resolve_devices(None, 2, ["cpu"])
    with pytest.raises(ValueError, match="spreads the model over GPUs"):
        resolve_devices("cpu", 2, None)
    if torch.cuda.device_count() < 64:
        with pytest.raises(ValueError, match="needs 64 GPUs"):
            resolve_devices(None, 64, None)
    with pytest.raises(ValueError, match="empty list"):
        resolve_devices(None, None, [])


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory):
    hf = tiny_hf_model("llama")
    d = tmp_path_factory.mktemp("sharded")
    hf.save_pretrained(str(d), max_shard_size=40_000)  # several shards, layers split across them
    assert (d / "model.safetensors.index.json").exists() and len(list(d.glob("*.safetensors"))) >= 3
    return d, hf


def test_sharded_checkpoint_streams_to_the_same_weights(sharded_dir):
    d, hf = sharded_dir
    streamed = HookedRewardModel.from_pretrained(d, device="cpu")
    whole = HookedRewardModel.from_hf_model(hf, device="cpu")
    a, b = streamed.state_dict(), whole.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
        assert a[k].stride() == b[k].stride(), k  # the head-major storage of W_Q/W_K/W_V is kept
    bf = HookedRewardModel.from_pretrained(d, device="cpu", dtype="bfloat16")
    assert (
        all(p.dtype == torch.bfloat16 for p in bf.parameters()) and bf.rotary.inv_freq.dtype == torch.float32
    )
    for k, v in bf.state_dict().items():
        if v.is_floating_point() and not k.endswith("inv_freq"):
            assert torch.equal(v, b[k].to(torch.bfloat16)), k  # folded in fp32, then rounded once


def test_damaged_shard_is_named(sharded_dir, tmp_path):
    import shutil

    d, _ = sharded_dir
    copy = tmp_path / "ckpt"
    shutil.copytree(d, copy)
    shard = sorted(copy.glob("*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(ValueError, match=rf"{shard.name}.*corrupt or truncated"):
        HookedRewardModel.from_pretrained(copy, device="cpu")


def frames_equal(a, b, tol=0.0):
    fa, fb = a.to_frame(), b.to_frame()
    assert list(fa.columns) == list(fb.columns)
    num = fa.select_dtypes("number").columns
    pd.testing.assert_frame_equal(fa.drop(columns=num), fb.drop(columns=num))
    pd.testing.assert_frame_equal(
        fa[num], fb[num], check_exact=tol == 0, atol=tol or None, rtol=0 if tol else None
    )


def compare_instruments(placed, single, tol=0.0):
    for fn in (
        lambda m: lens(m, PAIRS),
        lambda m: attribute(m, PAIRS, heads=True, neurons=True),
        lambda m: token_attribution(m, PAIRS, batch_size=3),
        lambda m: attribution_patch(
            m, PAIRS, mode=["noising", "denoising"], level=["component", "head"], progress=False
        ),
        lambda m: path_patch(m, PAIRS, ["L0H0", "mlp_L0"], ["L1H1.q", "L2KV1.v", "mlp_L1", "readout"]),
    ):
        frames_equal(fn(placed), fn(single), tol)
    kw = dict(
        mode=["noising", "denoising", "zero"],
        level=["component", "head", "residual"],
        batch_size=3,
        progress=False,
    )
    fast = patch(placed, PAIRS, **kw)
    frames_equal(fast, patch(single, PAIRS, **kw), tol)
    naive = patch(single, PAIRS, method="naive", **kw)
    for key in fast.patched:
        assert torch.allclose(fast.patched[key].cpu(), naive.patched[key].cpu(), atol=1e-5), key
    frames_equal(
        patch(placed, PAIRS, positions="prompt", **kw), patch(single, PAIRS, positions="prompt", **kw), tol
    )


def test_placed_on_cpu_devices_equals_single_device(sharded_dir, monkeypatch):
    d, _ = sharded_dir
    single = HookedRewardModel.from_pretrained(d, device="cpu")
    placed = HookedRewardModel.from_pretrained(d, device_map=["cpu", "cpu", "cpu"])
    assert placed.placed_devices == [torch.device("cpu")] * 3
    moved = {"forward": 0, "engine": 0}

    def counting(name, original):
        def wrapped(*args, **kwargs):
            moved[name] += 1
            return original(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(native_module, "module_device", counting("forward", native_module.module_device))
    monkeypatch.setattr(recompute_module, "block_device", counting("engine", recompute_module.block_device))
    ids = torch.randint(1, 97, (3, 9))
    expected = single(ids)
    moved["forward"] = 0
    assert torch.equal(placed(ids), expected)
    assert moved["forward"] == placed.cfg.n_layers  # the per-block device step ran for every block
    compare_instruments(placed, single)
    assert moved["engine"] > 0  # the fast path's per-block device step ran
    placed.to("cpu")
    assert placed.placed_devices is None


def test_placement_is_refused_where_unsupported(tmp_path):
    hf = tiny_hf_model("llama")
    hf.save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="native architectures only"):
        HookedRewardModel.from_pretrained(tmp_path, generic=True, device_map=["cpu", "cpu"])


@pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs >= 2 CUDA GPUs (multi-device placement on real devices)"
)
def test_two_gpus_equal_one(sharded_dir):
    d, _ = sharded_dir
    single = HookedRewardModel.from_pretrained(d, device="cuda:0")
    placed = HookedRewardModel.from_pretrained(d, n_devices=2)
    assert {p.device for p in placed.parameters()} == {torch.device("cuda", 0), torch.device("cuda", 1)}
    assert placed.embed.W_E.device == torch.device("cuda", 0)
    assert placed.reward_head.W_R.device == torch.device("cuda", 1)
    ids = torch.randint(1, 97, (3, 9))
    assert torch.allclose(placed(ids), single(ids), atol=1e-5)
    compare_instruments(placed, single, tol=1e-5)
