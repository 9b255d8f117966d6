"""Devices and dtypes as the loaders and the model accept them: names ("bf16", "cuda:1") or torch objects,
and the default device (CUDA when available, as TransformerLens)."""

from __future__ import annotations

from typing import Union

import torch

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float64": torch.float64,
}


def resolve_dtype(dtype: Union[str, torch.dtype, None]) -> torch.dtype:
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point or dtype.itemsize < 2:
            raise ValueError(
                f"dtype {dtype} cannot hold the weights and activations; use one of {sorted(_DTYPES)} "
                "(quantised checkpoints are dequantised on load)"
            )
        return dtype
    try:
        return _DTYPES[str(dtype).lower().replace("torch.", "")]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}") from None


def default_device() -> torch.device:
    """CUDA when available (as TransformerLens), else CPU: the device of `device=None`."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_device(device: Union[str, torch.device, None]) -> torch.device:
    """`device` as a torch.device; None is `default_device()` (CUDA when available, else CPU)."""
    if device is None:
        return default_device()
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device} requested but CUDA is not available here; use device='cpu'")
    return device
