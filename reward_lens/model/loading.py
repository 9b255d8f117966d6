"""Loading: HF reward checkpoints (local dir or hub id) and saved hooked checkpoints into HookedRewardModel."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Union

import torch

from reward_lens.model.config import RewardModelConfig
from reward_lens.converters import StateDict, get_weight_map
from reward_lens.converters.processing import fold_norm_weights
from reward_lens.model.heads.scalar import HEAD_TYPES

HOOKED_CONFIG = "reward_lens_config.json"
HOOKED_WEIGHTS = "model.safetensors"
_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "float64": torch.float64,
}


def resolve_dtype(dtype: Union[str, torch.dtype, None]) -> torch.dtype:
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype).lower().replace("torch.", "")]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}") from None


def resolve_device(device: Union[str, torch.device, None]) -> torch.device:
    if device is None:
        return torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device} requested but CUDA is not available here; use device='cpu'")
    return device


def resolve_checkpoint_dir(path_or_id: Union[str, Path]) -> Path:
    """A local directory as is; otherwise a hub id, downloaded (weights, config, tokenizer files only)."""
    path = Path(path_or_id).expanduser()
    if path.is_dir():
        return path
    if path.exists() or str(path_or_id).startswith((".", "/", "~")) or str(path_or_id).count("/") != 1:
        raise FileNotFoundError(
            f"no checkpoint directory at {str(path_or_id)!r}; pass a directory holding config.json and "
            "safetensors weights, or a hub id such as 'Skywork/Skywork-Reward-Llama-3.1-8B-v0.2'"
        )
    try:
        from huggingface_hub import snapshot_download

        return Path(
            snapshot_download(
                str(path_or_id),
                allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "tokenizer*"],
            )
        )
    except Exception as exc:  # offline, unknown repo, gated repo, ...
        raise FileNotFoundError(
            f"could not fetch {str(path_or_id)!r} from the HuggingFace hub ({type(exc).__name__}: {exc}); "
            "download it where the hub is reachable and pass the local directory"
        ) from None


def load_hf_state_dict(directory: Path) -> StateDict:
    """All tensors of a transformers checkpoint directory (sharded or not, safetensors or .bin)."""
    from safetensors.torch import load_file

    index = directory / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        sd: StateDict = {}
        for shard in shards:
            sd.update(load_file(str(directory / shard)))
        return sd
    single = directory / "model.safetensors"
    if single.exists():
        return load_file(str(single))
    bins = sorted(directory.glob("pytorch_model*.bin"))
    if bins:
        sd = {}
        for b in bins:
            sd.update(torch.load(b, map_location="cpu", weights_only=True))
        return sd
    raise FileNotFoundError(f"no weights in {directory}: expected model.safetensors(.index.json) or pytorch_model.bin")


def load_tokenizer(directory: Path):
    """The checkpoint's tokenizer, or None (with a warning) when it ships none."""
    has_files = any((directory / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))
    if not has_files:
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(directory))
    except Exception as exc:
        warnings.warn(f"tokenizer files in {directory} could not be loaded ({exc}); model.to_tokens will not work")
        return None


def load_pretrained(
    cls, path_or_id, *, device=None, dtype=None, fold_ln=True, tokenizer=None, generic=False, module_map=None, **overrides
):
    if overrides.get("gguf_file") is not None:  # a llama.cpp file: transformers dequantises it (model/gguf.py)
        from reward_lens.model.gguf import load_gguf

        return load_gguf(cls, path_or_id, overrides.pop("gguf_file"), tokenizer=tokenizer, device=device, dtype=dtype,
                         fold_ln=fold_ln, generic=generic, module_map=module_map, **overrides)
    directory = resolve_checkpoint_dir(path_or_id)
    if tokenizer is None:
        tokenizer = load_tokenizer(directory)
    if (directory / HOOKED_CONFIG).exists():
        return load_hooked(cls, directory, tokenizer=tokenizer, device=device, dtype=dtype, fold_ln=fold_ln)
    if not (directory / "config.json").exists():
        raise FileNotFoundError(f"{directory} has no config.json; is it a transformers checkpoint directory?")
    hf_config = _load_hf_config(directory)
    for key, value in overrides.items():
        setattr(hf_config, key, value)
    # No native weight map (or asked for): the generic component-level path (reward_lens/generic.py).
    if generic or module_map is not None or (directory / "reward_lens_generic.json").exists() or not has_native_weight_map(hf_config):
        from reward_lens.model.generic.wrapper import load_generic

        return load_generic(
            directory, hf_config, tokenizer=tokenizer, device=device, dtype=dtype, fold_ln=fold_ln, module_map=module_map
        )
    return convert_state_dict(
        cls, hf_config, load_hf_state_dict(directory), tokenizer=tokenizer, device=device, dtype=dtype, fold_ln=fold_ln
    )


def _load_hf_config(directory: Path):
    """transformers' config class for the checkpoint's model_type; never runs remote code."""
    from transformers import AutoConfig

    raw = json.loads((directory / "config.json").read_text())
    raw.pop("auto_map", None)  # remote-code pointers: our weight maps stand in for that code
    model_type = raw.get("model_type")
    try:
        return AutoConfig.for_model(model_type, **{k: v for k, v in raw.items() if k != "model_type"})
    except (ValueError, KeyError):
        from reward_lens.converters import supported_architectures

        raise ValueError(
            f"config.json in {directory} has model_type {model_type!r}, which transformers does not know; "
            f"supported architectures: {', '.join(supported_architectures())} (generic loading was tried too: it "
            "needs a model type transformers knows)"
        ) from None


def has_native_weight_map(hf_config) -> bool:
    """Whether a weight map in reward_lens.converters handles this config's architecture."""
    try:
        get_weight_map(hf_config)
        return True
    except ValueError:
        return False


def convert_state_dict(cls, hf_config, hf_state_dict: StateDict, *, tokenizer=None, device=None, dtype=None, fold_ln=True):
    """transformers config + state dict -> HookedRewardModel (weights converted, norms optionally folded)."""
    weight_map = get_weight_map(hf_config)
    cfg = weight_map.build_config(hf_config)
    sd = weight_map.convert(hf_state_dict, cfg, hf_config)
    return _build(cls, cfg, sd, tokenizer=tokenizer, device=device, dtype=dtype, fold_ln=fold_ln)


def _build(cls, cfg: RewardModelConfig, sd: StateDict, *, tokenizer, device, dtype, fold_ln):
    dtype, device = resolve_dtype(dtype), resolve_device(device)
    if fold_ln and cfg.normalization_type == "RMS":
        sd = fold_norm_weights(sd, cfg, HEAD_TYPES[cfg.head_type].final_norm_readers)
    cfg.dtype, cfg.device = dtype, device
    # Buffers (RoPE frequencies) stay float32; parameters take the requested dtype.
    sd = {k: (v if k.endswith("inv_freq") else v.to(dtype)) for k, v in sd.items()}
    with torch.device("meta"):
        model = cls(cfg, tokenizer=tokenizer)
    model.load_state_dict(sd, strict=True, assign=True)
    model.requires_grad_(False)
    return model.to(device)


def save_hooked(model, path: Union[str, Path]) -> None:
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / HOOKED_CONFIG).write_text(json.dumps(model.cfg.to_dict(), indent=1))
    save_file({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}, str(path / HOOKED_WEIGHTS))
    if model.tokenizer is not None:
        model.tokenizer.save_pretrained(str(path))


def load_hooked(cls, directory: Path, *, tokenizer=None, device=None, dtype=None, fold_ln=True):
    from safetensors.torch import load_file

    cfg = RewardModelConfig.from_dict(json.loads((directory / HOOKED_CONFIG).read_text()))
    sd = load_file(str(directory / HOOKED_WEIGHTS))
    for key in list(sd):
        if key.endswith(("attn.W_Q", "attn.W_K", "attn.W_V")):  # restore the fast storage layout
            sd[key] = sd[key].transpose(1, 2).contiguous().transpose(1, 2)
    return _build(cls, cfg, sd, tokenizer=tokenizer, device=device, dtype=dtype, fold_ln=fold_ln)
