"""Checkpoint checks: every load error names the file and the tensor, and what to do.

- `read_json`: config files, with the file and line of a syntax error.
- `load_safetensors` / `safetensors_header`: empty / truncated / garbage files refused with their path;
  `read_safetensors_tensor` reads one tensor with a plain read (no memory map) for streaming loads.
- `check_hf_tensors`: the checkpoint's tensors against what the transformers class for its config holds
  (built on the meta device, so no memory): missing, shape (incl. `num_labels` vs `score.weight`), dtype;
  unexpected tensors are warned about, as transformers does.
- `check_state_dict`: the converted weights against the hooked model (missing, unexpected, shape).
- `check_finite_weights`: one pass, NaN/inf weights named.
- `check_tokenizer_vocab`: a tokenizer whose ids reach beyond the embedding is refused.
- `check_overrides`: unknown keyword arguments to `from_pretrained` are a TypeError, as in transformers.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

import torch


class CheckpointError(ValueError):
    """A damaged or mismatched checkpoint; the message names the file and tensor."""


def _listing(names: List[str], k: int = 4) -> str:
    return ", ".join(names[:k]) + (f" and {len(names) - k} more" if len(names) > k else "")


def read_json(path: Path) -> Dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise CheckpointError(
            f"{path} is not valid JSON (line {exc.lineno} column {exc.colno}: {exc.msg}); repair or "
            "re-download it"
        ) from None
    except UnicodeDecodeError:
        raise CheckpointError(f"{path} is not UTF-8 text; repair or re-download it") from None
    if not isinstance(data, dict):
        raise CheckpointError(
            f"{path} holds a JSON {type(data).__name__}, not an object; repair or re-download it"
        )
    return data


def _corrupt(path: Path, exc: Exception) -> CheckpointError:
    return CheckpointError(
        f"weight file {path} is corrupt or truncated ({type(exc).__name__}: "
        f"{str(exc).splitlines()[0] if str(exc) else ''}); re-download or re-save it"
    )


def _check_file(path: Path) -> None:
    if not path.exists():
        raise CheckpointError(
            f"weight file {path} is missing (named by the checkpoint's index); re-download it"
        )
    if path.stat().st_size == 0:
        raise CheckpointError(f"weight file {path} is empty; re-download or re-save the checkpoint")


def load_safetensors(path: Path) -> Dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    _check_file(path)
    try:
        return load_file(str(path))
    except Exception as exc:  # safetensors' SafetensorError, OSError on truncation
        if isinstance(exc, (KeyboardInterrupt, MemoryError)):
            raise
        raise _corrupt(path, exc) from None


SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def safetensors_header(path: Path) -> Tuple[Dict[str, Dict[str, Any]], int]:
    """(tensor entries by name, offset of the data) of a safetensors file: its JSON header, checked against
    the file's size (truncated, garbage or unknown-dtype files are a CheckpointError naming the file)."""
    _check_file(path)
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 0 < n <= size - 8:
                raise ValueError(f"header length {n} does not fit the file's {size} bytes")
            header = json.loads(f.read(n))
        entries = {k: v for k, v in header.items() if k != "__metadata__"}
        end = max((int(v["data_offsets"][1]) for v in entries.values()), default=0)
        if 8 + n + end > size:
            raise ValueError(f"the header names {end} data bytes but the file holds {size - 8 - n}")
        unknown = sorted({v["dtype"] for v in entries.values()} - set(SAFETENSORS_DTYPES))
        if unknown:
            raise ValueError(f"unsupported dtype(s) {unknown}")
        for name, v in entries.items():  # a shape claiming more bytes than its data is never allocated
            lo, hi = (int(x) for x in v["data_offsets"])
            numel = math.prod(int(d) for d in v["shape"])
            nbytes = numel * SAFETENSORS_DTYPES[v["dtype"]].itemsize
            if min(int(d) for d in v["shape"] or [0]) < 0 or nbytes != hi - lo:
                raise ValueError(
                    f"tensor {name!r} of shape {list(v['shape'])} does not match its {hi - lo} data bytes"
                )
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as exc:
        raise _corrupt(path, exc) from None
    return entries, 8 + n


def read_safetensors_tensor(
    path: Path, entry: Dict[str, Any], data_start: int, file: Any = None
) -> torch.Tensor:
    """One tensor of a safetensors file read straight into a fresh tensor (a plain read, no memory map: the
    file's pages never count as this process's memory, and the tensor owns its storage)."""
    t = torch.empty([int(d) for d in entry["shape"]], dtype=SAFETENSORS_DTYPES[entry["dtype"]])
    lo, hi = (int(x) for x in entry["data_offsets"])
    raw = t.reshape(-1).view(torch.uint8)
    if hi - lo != raw.numel():
        raise _corrupt(path, ValueError(f"a tensor of shape {list(t.shape)} has {hi - lo} data bytes"))
    f = file if file is not None else open(path, "rb")
    try:
        f.seek(data_start + lo)
        if raw.numel() and f.readinto(memoryview(raw.numpy())) != raw.numel():
            raise _corrupt(path, EOFError("the file ends inside a tensor"))
    finally:
        if file is None:
            f.close()
    return t


def tensor_files(directory: Path) -> Dict[str, str]:
    """Which file holds each tensor (sharded checkpoints: from the index), for error messages."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        return dict(read_json(index).get("weight_map", {}))
    return {}


def _where(name: str, files: Mapping[str, str], directory: Path, default: str = "model.safetensors") -> str:
    return str(directory / files.get(name, default))


def sequence_classification_class(hf_config: Any):
    """The transformers *ForSequenceClassification class named in the config's architectures, or None."""
    import transformers

    for name in getattr(hf_config, "architectures", None) or []:
        if name.endswith("ForSequenceClassification") and hasattr(transformers, name):
            return getattr(transformers, name)
    return None


def expected_hf_tensors(hf_config: Any) -> Optional[Dict[str, torch.Size]]:
    """Names and shapes of the transformers *ForSequenceClassification model for this config (meta device);
    None when there is no such class (e.g. custom heads): the converted weights are checked instead."""

    cls = sequence_classification_class(hf_config)
    if cls is None:
        return None
    try:
        with torch.device("meta"):
            model = cls(hf_config)
    except Exception:  # a config transformers cannot build: the conversion reports what is wrong
        return None
    return {k: v.shape for k, v in model.state_dict().items()}


def check_hf_tensors(hf_config: Any, sd: Mapping[str, torch.Tensor], directory: Path) -> None:
    """The checkpoint's tensors against the transformers model for its config; errors name file and tensor."""
    expected = expected_hf_tensors(hf_config)
    if expected is None:
        return
    files = tensor_files(directory)
    tied = getattr(hf_config, "tie_word_embeddings", False)
    missing = sorted(k for k in expected if k not in sd and not (tied and k.endswith("lm_head.weight")))
    if missing:
        hint = ""
        if (
            "score.weight" in missing and "value_head.weight" in sd
        ):  # an OpenRLHF head under a transformers name
            hint = (
                "; it holds value_head.weight, OpenRLHF's head: set architectures to ['RewardModel'] in "
                "config.json (as OpenRLHF saves it) to load it natively"
            )
        raise CheckpointError(
            f"{_where(missing[0], files, directory)} lacks tensor(s) {_listing(missing)} that "
            f"{type(hf_config).__name__.replace('Config', '')} needs; the checkpoint is incomplete{hint}"
        )
    unexpected = sorted(k for k in sd if k not in expected and not k.endswith("inv_freq"))
    if unexpected:
        warnings.warn(
            f"{directory}: unused tensor(s) in the checkpoint: {_listing(unexpected)} (ignored, as "
            "transformers does)",
            stacklevel=2,
        )
    for name, shape in expected.items():
        got = sd[name]
        if tuple(got.shape) != tuple(shape):
            hint = ""
            if name.endswith("score.weight"):
                hint = (
                    f"; config.json says num_labels={getattr(hf_config, 'num_labels', '?')} but the head "
                    f"has {got.shape[0]} output(s): fix num_labels in config.json"
                )
            raise CheckpointError(
                f"{_where(name, files, directory)}: tensor {name} has shape {tuple(got.shape)}, the "
                f"config implies {tuple(shape)}{hint or '; config.json and weights disagree'}"
            )
        if got.is_floating_point() is False and not name.endswith("inv_freq"):
            raise CheckpointError(
                f"{_where(name, files, directory)}: tensor {name} has dtype {got.dtype}; weights must be "
                "floating point (float32/bfloat16/float16)"
            )


def check_state_dict(
    expected: Mapping[str, torch.Tensor], sd: Mapping[str, torch.Tensor], source: str
) -> None:
    """Converted (hooked-convention) weights against the model they load into."""
    missing = sorted(k for k in expected if k not in sd)
    unexpected = sorted(k for k in sd if k not in expected)
    if missing or unexpected:
        parts = ([f"lacks tensor(s) {_listing(missing)}"] if missing else []) + (
            [f"has unexpected tensor(s) {_listing(unexpected)}"] if unexpected else []
        )
        raise CheckpointError(f"{source} {' and '.join(parts)}; the checkpoint does not match its config")
    for name, ref in expected.items():
        if tuple(sd[name].shape) != tuple(ref.shape):
            raise CheckpointError(
                f"{source}: tensor {name} has shape {tuple(sd[name].shape)}, the config implies "
                f"{tuple(ref.shape)}; config and weights disagree"
            )
        if not sd[name].is_floating_point():
            raise CheckpointError(
                f"{source}: tensor {name} has dtype {sd[name].dtype}; weights must be floating point"
            )


def all_finite(t: torch.Tensor, chunk: int = 1 << 22) -> bool:
    """Whether every value is finite, checked in chunks: `isfinite` of a whole embedding would allocate
    intermediates larger than the tensor (a loader's peak memory)."""
    flat = t.reshape(-1)
    return all(bool(torch.isfinite(piece).all()) for piece in flat.split(chunk))


def check_finite_weights(tensors: Iterable[tuple], source: str) -> None:
    """One pass over (name, tensor); NaN or inf weights are named (every instrument would compute on them)."""
    bad = [name for name, t in tensors if t.is_floating_point() and not all_finite(t)]
    if bad:
        raise CheckpointError(
            f"{source}: non-finite (NaN/inf) values in tensor(s) {_listing(bad)}; the weights are damaged "
            "(re-download them, or check the dtype they were saved in)"
        )


def check_tokenizer_vocab(tokenizer: Any, d_vocab: int, source: str) -> None:
    if tokenizer is None:
        return
    n = len(tokenizer)
    if n > d_vocab:
        raise CheckpointError(
            f"{source}: the tokenizer has {n} tokens but the model's embedding only {d_vocab} rows, so "
            "ids >= {0} would read no embedding; use the tokenizer that ships with this model".format(d_vocab)
        )


def check_overrides(config: Any, overrides: Mapping[str, Any], known: Optional[Iterable[str]] = None) -> None:
    """Keyword arguments of `from_pretrained` that are neither loader options nor config fields: a
    TypeError."""
    names = set(known) if known is not None else None
    for key in overrides:
        ok = key in names if names is not None else hasattr(config, key)
        if not ok:
            raise TypeError(
                f"from_pretrained() got an unexpected keyword argument {key!r} (neither a loading option "
                "(device, dtype, fold_ln, generic, module_map, tokenizer, n_devices, device_map) nor a "
                "config field)"
            )
