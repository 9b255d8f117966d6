"""Multi-device placement: a model's blocks in contiguous ranges over k devices, balanced by parameter
bytes (the embedding on the first device, the final norm and the head on the last), TransformerLens's
`n_devices`. The forward moves the residual at block boundaries; each block's device is read off its
parameters, so `model.to(device)` gathers a placed model onto one device again.

Activations that instruments cache from a placed model are moved to the model's home device
(`cfg.device`, the first one); code that applies a block's weights to cached activations moves them to
the block's device (`block_device`) and the result back.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Union

import torch
import torch.nn as nn

from reward_lens.model.devices import resolve_device

DeviceLike = Union[str, torch.device]


def plan_blocks(
    block_bytes: Sequence[int], n_devices: int, first_bytes: int = 0, last_bytes: int = 0
) -> List[int]:
    """The device index of every block: contiguous, non-decreasing ranges that minimise the largest
    device's bytes, device 0 also holding `first_bytes` (embedding) and device k-1 `last_bytes` (final
    norm and head). Exact (dynamic programming over split points); a device may get no block."""
    n, k = len(block_bytes), int(n_devices)
    if k < 1:
        raise ValueError(f"n_devices must be >= 1, got {n_devices}")
    prefix = [0]
    for b in block_bytes:
        prefix.append(prefix[-1] + int(b))

    def load(d: int, i: int, j: int) -> int:  # blocks i..j-1 on device d
        return prefix[j] - prefix[i] + (first_bytes if d == 0 else 0) + (last_bytes if d == k - 1 else 0)

    best = [[load(0, 0, j) for j in range(n + 1)]]
    cut: List[List[int]] = [[0] * (n + 1)]
    for d in range(1, k):
        row, arg = [], []
        for j in range(n + 1):
            cost, i_best = min((max(best[d - 1][i], load(d, i, j)), i) for i in range(j + 1))
            row.append(cost)
            arg.append(i_best)
        best.append(row)
        cut.append(arg)
    owners, j = [0] * n, n
    for d in range(k - 1, 0, -1):
        i = cut[d][j]
        owners[i:j] = [d] * (j - i)
        j = i
    return owners


def resolve_devices(
    device: Optional[DeviceLike], n_devices: Optional[int], device_map: Union[None, str, Sequence[DeviceLike]]
) -> Optional[List[torch.device]]:
    """The devices a model is spread over, or None for one device. `n_devices=k`: cuda:0..k-1;
    `device_map`: "auto" (every visible GPU) or a list of devices (repeats allowed, e.g. for tests)."""
    if n_devices is not None and device_map is not None:
        raise ValueError("give n_devices or device_map, not both")
    if device_map is None:
        if n_devices is None or int(n_devices) == 1:
            return None
        if int(n_devices) < 1:
            raise ValueError(f"n_devices must be >= 1, got {n_devices}")
        if device is not None and torch.device(device).type != "cuda":
            raise ValueError(
                f"n_devices={n_devices} spreads the model over GPUs, but device={str(device)!r}; drop "
                "device= or pass device_map=[...] with the devices to use"
            )
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have < int(n_devices):
            raise ValueError(
                f"n_devices={n_devices} needs {n_devices} GPUs but {have} are visible here; use "
                f"n_devices<={max(have, 1)} or device_map=[...]"
            )
        return [torch.device("cuda", i) for i in range(int(n_devices))]
    if device is not None:
        raise ValueError("give device or device_map, not both (device_map lists every device)")
    if isinstance(device_map, dict):
        targets = {str(v) if not isinstance(v, int) else f"cuda:{v}" for v in device_map.values()}
        if set(device_map) == {""}:  # transformers' "everything on one device"
            return [resolve_device(next(iter(targets)))]
        raise ValueError(
            f"device_map is a dict of {len(device_map)} module(s) -> device (transformers' form); here it "
            f"is a list of devices the blocks are spread over, e.g. device_map={sorted(targets)!r}, or "
            "'auto', or device='cuda:0'"
        )
    if isinstance(device_map, str):
        if device_map != "auto":
            raise ValueError(f"device_map must be 'auto' or a list of devices, got {device_map!r}")
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return [torch.device("cuda", i) for i in range(have)] or [torch.device("cpu")]
    devices = [resolve_device(d) for d in device_map]
    if not devices:
        raise ValueError("device_map is an empty list; list at least one device")
    return devices


def module_device(module: nn.Module, default: Optional[torch.device] = None) -> Optional[torch.device]:
    """The device of a module's first parameter (or buffer); `default` when it has none."""
    for t in module.parameters():
        return t.device
    for t in module.buffers():
        return t.device
    return default


def block_device(model, layer: int) -> torch.device:
    """The device block `layer` of `model` runs on."""
    return module_device(model.blocks[layer], model.cfg.device)


def head_device(model) -> torch.device:
    """The device of the final norm and the reward head."""
    return module_device(model.reward_head, model.cfg.device)


def model_devices(model) -> List[torch.device]:
    """Every distinct device holding a parameter of `model`, in first-use order."""
    seen: List[torch.device] = []
    for t in model.parameters():
        if t.device not in seen:
            seen.append(t.device)
    return seen


def is_placed(model) -> bool:
    """Whether the model's blocks are spread over several devices (`device_map` / `n_devices`)."""
    return bool(getattr(model, "placed_devices", None))
