"""Streaming loading: a checkpoint converted, checked, folded, cast and placed one layer at a time.

Peak host memory is the model's final parameters plus about one layer in flight, never the whole
checkpoint twice: `LazyStateDict` reads tensors from the safetensors files on access, each with a plain
read into a fresh tensor (a memory map would count the file's pages as this process's memory for as long
as any tensor viewing them lives: reading the embedding would hold it twice); `build_model` asks a
`WeightSource` for the converted weights outside the blocks, then for each block's, and each part is
checked (names, shapes, finite values: `reward_lens.loading.checks`), folded (`converters.processing`),
cast and assigned to its device before the next is read. The weight maps convert part by part
(`WeightMap.convert_rest` / `convert_layer`), so every architecture's quirks stay in its one module.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import torch

from reward_lens.converters import StateDict, get_weight_map
from reward_lens.converters.openrlhf import warn_if_relabelled
from reward_lens.converters.processing import fold_final_norm, fold_layer_norms, folded_config
from reward_lens.loading.checks import (
    SAFETENSORS_DTYPES,
    CheckpointError,
    check_finite_weights,
    check_state_dict,
    check_tokenizer_vocab,
    read_json,
    read_safetensors_tensor,
    safetensors_header,
)
from reward_lens.model.config import RewardModelConfig
from reward_lens.model.devices import resolve_device, resolve_dtype
from reward_lens.model.heads import head_class
from reward_lens.model.placement import plan_blocks

_BLOCK_KEY = re.compile(r"blocks\.(\d+)\.")


def load_pickled_weights(path: Path) -> Dict[str, torch.Tensor]:
    """A `pytorch_model.bin` read with `weights_only=True` (never running code it holds); a refused or broken
    pickle is a one-line CheckpointError naming the file."""
    import pickle

    try:
        try:
            sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as exc:
            if "mmap" not in str(exc):  # the legacy (non-zip) format cannot be memory-mapped
                raise
            sd = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        why = next((ln.strip() for ln in str(exc).splitlines() if "Unsupported" in ln or "global" in ln), "")
        raise CheckpointError(
            f"{path} was refused: it is a pickle holding code or objects other than tensors "
            f"({why[:160] or 'weights_only=True failed'}); never load it from an untrusted source; use "
            "safetensors weights"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        raise CheckpointError(
            f"{path} is corrupt or truncated ({(str(exc).splitlines() or [''])[0][:160]}); re-download or "
            "re-save the checkpoint"
        ) from None
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise CheckpointError(f"{path} holds {type(sd).__name__}, not a state dict of tensors")
    return sd


class LazyStateDict(Mapping):
    """The tensors of a checkpoint's weight files by name, read only when accessed. safetensors tensors are
    read from the file (its header parsed once) into fresh tensors; `.bin` files are `torch.load`ed with
    `mmap=True`. `release()` closes the open files."""

    def __init__(self, files: Dict[str, Path]):
        self.files = files  # tensor name -> file
        self.headers: Dict[Path, Any] = {}  # file -> (entries, data offset) or, for .bin, its mmap-ed dict
        self.open_files: Dict[Path, Any] = {}

    @classmethod
    def from_directory(cls, directory: Path) -> "LazyStateDict":
        """A transformers checkpoint directory: sharded (index) or single safetensors, or .bin files."""
        index = directory / "model.safetensors.index.json"
        if index.exists():
            weight_map = read_json(index).get("weight_map", {})
            return cls({name: directory / file for name, file in weight_map.items()})
        if (directory / "model.safetensors").exists():
            return cls.from_file(directory / "model.safetensors")
        bins = sorted(directory.glob("pytorch_model*.bin"))
        if not bins:
            raise FileNotFoundError(
                f"no weights in {directory}: expected model.safetensors(.index.json) or pytorch_model.bin"
            )
        lazy = cls({})
        for b in bins:
            lazy.files.update({name: b for name in lazy.header(b)})
        return lazy

    @classmethod
    def from_file(cls, path: Path) -> "LazyStateDict":
        lazy = cls({})
        header = lazy.header(path)
        lazy.files = {name: path for name in (header if path.suffix == ".bin" else header[0])}
        return lazy

    def header(self, path: Path) -> Any:
        if path not in self.headers:
            if path.suffix == ".bin":
                self.headers[path] = load_pickled_weights(path)
            else:
                self.headers[path] = safetensors_header(path)
        return self.headers[path]

    def __getitem__(self, name: str) -> torch.Tensor:
        path = self.files[name]  # KeyError for an absent name, as a dict
        header = self.header(path)
        if path.suffix == ".bin":
            return header[name]
        entries, start = header
        if name not in entries:
            raise CheckpointError(
                f"{path} lacks tensor {name!r} that its index names; the checkpoint is incomplete"
            )
        if path not in self.open_files:
            self.open_files[path] = open(path, "rb")
        return read_safetensors_tensor(path, entries[name], start, self.open_files[path])

    def __iter__(self) -> Iterator[str]:
        return iter(self.files)

    def __len__(self) -> int:
        return len(self.files)

    def __contains__(self, name: object) -> bool:
        return name in self.files

    def release(self) -> None:
        """Close every open file; later reads reopen them."""
        for f in self.open_files.values():
            f.close()
        self.open_files.clear()

    def meta(self) -> Dict[str, torch.Tensor]:
        """Every tensor as a meta tensor of its shape and dtype (from the file headers; no data read)."""
        out = {}
        for name, path in self.files.items():
            header = self.header(path)
            if path.suffix == ".bin":
                t = header[name]
                out[name] = torch.empty(t.shape, dtype=t.dtype, device="meta")
            elif name in header[0]:
                entry = header[0][name]
                out[name] = torch.empty(
                    entry["shape"], dtype=SAFETENSORS_DTYPES[entry["dtype"]], device="meta"
                )
        return out


def owns_tensors(sd: Mapping) -> bool:
    """Whether every tensor `sd` returns is freshly read (a LazyStateDict of safetensors files)."""
    return isinstance(sd, LazyStateDict) and not any(p.suffix == ".bin" for p in set(sd.files.values()))


@dataclass
class WeightSource:
    """Converted weights (our names; unfolded unless `cfg` says folded) part by part: `rest()` everything
    outside the blocks, `layer(l)` the `blocks.{l}.*` weights; `release()` frees what reading them held.
    `owned`: the tensors are fresh (read from a file), so the model may keep them without a copy."""

    cfg: RewardModelConfig
    rest: Callable[[], StateDict]
    layer: Callable[[int], StateDict]
    release: Callable[[], None] = lambda: None
    owned: bool = False


def partitioned_source(
    cfg: RewardModelConfig, sd: Mapping, transform: Optional[Callable] = None
) -> WeightSource:
    """A source over weights already in our names (a dict or a `LazyStateDict` of a hooked checkpoint),
    split by block; `transform(name, tensor)` is applied to each tensor as it is read."""
    groups: Dict[Optional[int], List[str]] = {}
    for name in sd:
        m = _BLOCK_KEY.match(name)
        layer = (
            int(m.group(1)) if m and int(m.group(1)) < cfg.n_layers else None
        )  # others: unexpected, in rest
        groups.setdefault(layer, []).append(name)

    def part(layer: Optional[int]) -> StateDict:
        return {k: transform(k, sd[k]) if transform else sd[k] for k in groups.get(layer, [])}

    release = getattr(sd, "release", lambda: None)
    return WeightSource(cfg, lambda: part(None), part, release, owned=owns_tensors(sd))


def converted_source(
    hf_config: Any, sd: Mapping, source: str, weight_map: Optional[Any] = None
) -> WeightSource:
    """A source converting a transformers state dict (dict or `LazyStateDict`) by its architecture's
    weight map (or `weight_map`, e.g. a judge's), one part at a time; a tensor the map needs but the
    checkpoint lacks is a CheckpointError."""
    if weight_map is None:
        weight_map = get_weight_map(hf_config)
        warn_if_relabelled(hf_config, weight_map.architecture)
    cfg = weight_map.build_config(hf_config)

    def guarded(convert: Callable[[], StateDict]) -> StateDict:
        try:
            return convert()
        except KeyError as exc:
            raise CheckpointError(
                f"{source} lacks tensor {exc.args[0]!r}; the checkpoint is incomplete"
            ) from None

    return WeightSource(
        cfg,
        rest=lambda: guarded(lambda: weight_map.convert_rest(sd, cfg, hf_config)),
        layer=lambda l: guarded(lambda: weight_map.convert_layer(sd, cfg, hf_config, l)),
        release=getattr(sd, "release", lambda: None),
        owned=owns_tensors(sd),
    )


def hooked_source(directory: Path, cfg: RewardModelConfig) -> WeightSource:
    """A saved hooked checkpoint (`save_hooked`'s model.safetensors) read block by block."""
    from reward_lens.loading.checkpoint import HOOKED_WEIGHTS

    def restore_layout(name: str, t: torch.Tensor) -> torch.Tensor:
        if name.endswith(("attn.W_Q", "attn.W_K", "attn.W_V")):  # the fast head-major storage (components)
            return t.transpose(1, 2).contiguous().transpose(1, 2)
        return t

    return partitioned_source(cfg, LazyStateDict.from_file(directory / HOOKED_WEIGHTS), restore_layout)


def cast_part(
    sd: StateDict, dtype: torch.dtype, device: Callable[[str], torch.device], copy: bool
) -> StateDict:
    """Each tensor in `dtype` (RoPE frequency buffers stay float32) on `device(name)`; `copy`: always a new
    tensor (the caller's dict or a memory map must not share storage with the model). Strides are kept
    (the fast head-major storage of W_Q/W_K/W_V)."""
    return {
        k: v.to(device=device(k), dtype=v.dtype if k.endswith("inv_freq") else dtype, copy=copy)
        for k, v in sd.items()
    }


def block_bytes(model: torch.nn.Module, dtype: torch.dtype) -> List[int]:
    """Parameter bytes of each block of a (meta) model in `dtype`."""
    size = torch.empty((), dtype=dtype).element_size()
    return [sum(p.numel() for p in block.parameters()) * size for block in model.blocks]


def place_plan(
    model: torch.nn.Module, dtype: torch.dtype, devices: Sequence[torch.device]
) -> List[torch.device]:
    """The device of each block: contiguous ranges balanced by bytes (embedding first, head last)."""
    size = torch.empty((), dtype=dtype).element_size()
    first = sum(p.numel() for p in model.embed.parameters()) * size
    last = sum(p.numel() for m in (model.ln_final, model.reward_head) for p in m.parameters()) * size
    owners = plan_blocks(block_bytes(model, dtype), len(devices), first, last)
    return [devices[d] for d in owners]


def expected_parts(expected: StateDict, n_layers: int) -> Dict[Optional[int], StateDict]:
    parts: Dict[Optional[int], StateDict] = {l: {} for l in range(n_layers)}
    parts[None] = {}
    for name, t in expected.items():
        m = _BLOCK_KEY.match(name)
        parts[int(m.group(1)) if m else None][name] = t
    return parts


def check_part(expected: StateDict, part: StateDict, source: str) -> None:
    check_state_dict(expected, part, source)
    check_finite_weights(part.items(), source)


def build_model(
    cls,
    src: WeightSource,
    *,
    tokenizer: Any = None,
    device=None,
    dtype=None,
    fold_ln: bool = True,
    source: str = "the checkpoint",
    devices: Optional[Sequence[torch.device]] = None,
):
    """A `cls` model (on the meta device, then filled part by part) holding `src`'s weights: the rest
    first (the embedding is the largest single part, best read while little else is held), then each
    block on its device. `devices`: spread the blocks over these (see `reward_lens.model.placement`)."""
    cfg, dtype = src.cfg, resolve_dtype(dtype)
    check_tokenizer_vocab(tokenizer, cfg.d_vocab, source)
    with torch.device("meta"):  # shapes to check each part against, before folding touches it
        expected = expected_parts(cls(cfg, tokenizer=None).state_dict(), cfg.n_layers)
    fold = fold_ln and cfg.normalization_type == "RMS"
    home = devices[0] if devices else resolve_device(device)
    final_cfg = dataclasses.replace(folded_config(cfg) if fold else cfg, dtype=dtype, device=home)
    with torch.device("meta"):
        model = cls(final_cfg, tokenizer=tokenizer)
    plan = place_plan(model, dtype, devices) if devices else [home] * cfg.n_layers
    last = devices[-1] if devices else home
    try:
        rest = src.rest()
        check_part(expected[None], rest, source)
        if fold:
            rest = fold_final_norm(rest, cfg, head_class(cfg).final_norm_readers)
        rest = cast_part(
            rest, dtype, lambda k: home if k.startswith(("embed.", "rotary.")) else last, not src.owned
        )
        src.release()
        model.load_state_dict(rest, strict=False, assign=True)
        del rest
        for l in range(cfg.n_layers):
            part = src.layer(l)
            check_part(expected[l], part, source)
            part = cast_part(
                fold_layer_norms(part, cfg, l) if fold else part, dtype, lambda k: plan[l], not src.owned
            )
            src.release()
            prefix = f"blocks.{l}."
            model.blocks[l].load_state_dict(
                {k[len(prefix) :]: v for k, v in part.items()}, strict=True, assign=True
            )
    finally:
        src.release()
    model.placed_devices = list(devices) if devices else None
    return model
