"""Loading: checkpoint directories (local or hub ids), transformers configs and state dicts, converted into
our config and weights; saved hooked checkpoints. Nothing here builds a model: `reward_lens.loading.native`
chooses the native or the generic model and builds it from what these functions return."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, Dict, Optional, Tuple, Union

from reward_lens.converters import StateDict, get_weight_map, supported_architectures
from reward_lens.converters.openrlhf import warn_if_relabelled
from reward_lens.loading.checks import CheckpointError, check_overrides, read_json
from reward_lens.model.config import RewardModelConfig

HOOKED_CONFIG = "reward_lens_config.json"
HOOKED_WEIGHTS = "model.safetensors"


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
            f"could not fetch {str(path_or_id)!r} from the HuggingFace hub ({type(exc).__name__}: "
            f"{(str(exc).strip().splitlines() or [''])[0][:160]}), and there is no local directory "
            f"{str(path_or_id)!r} either (for a local one, check the path); download it where the hub is "
            "reachable and pass the local directory"
        ) from None


def load_tokenizer(directory: Path):
    """The checkpoint's tokenizer, or None (with a warning) when it ships none."""
    has_files = any(
        (directory / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    )
    if not has_files:
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(directory))
    except Exception as exc:
        warnings.warn(
            f"tokenizer files in {directory} could not be loaded ({exc}); model.to_tokens will not work",
            stacklevel=2,
        )
        return None


def load_hf_config(directory: Path, overrides: Optional[Dict[str, Any]] = None):
    """transformers' config class for the checkpoint's model_type (attributes in `overrides` set on it);
    never runs remote code."""
    from transformers import AutoConfig

    if not (directory / "config.json").exists():
        raise FileNotFoundError(f"{directory} has no config.json; is it a transformers checkpoint directory?")
    raw = read_json(directory / "config.json")
    raw.pop("auto_map", None)  # remote-code pointers: our weight maps stand in for that code
    model_type = raw.get("model_type")
    try:
        config = AutoConfig.for_model(model_type, **{k: v for k, v in raw.items() if k != "model_type"})
    except (ValueError, KeyError, TypeError) as exc:
        if model_type is not None and "model_type" not in str(exc) and "Unrecognized" not in str(exc):
            raise CheckpointError(
                f"{directory / 'config.json'} is invalid for model_type {model_type!r}: "
                f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
            ) from None
        raise ValueError(
            f"config.json in {directory} has model_type {model_type!r}, which transformers does not know; "
            f"supported architectures: {', '.join(supported_architectures())} (generic loading was tried "
            "too: it needs a model type transformers knows)"
        ) from None
    check_overrides(config, overrides or {})  # a misspelled option is an error, as in transformers
    for key, value in (overrides or {}).items():
        setattr(config, key, value)
    return config


def has_native_weight_map(hf_config) -> bool:
    """Whether a weight map in reward_lens.converters handles this config's architecture."""
    try:
        get_weight_map(hf_config)
        return True
    except ValueError:
        return False


def convert_weights(
    hf_config, hf_state_dict: StateDict, source: str = "the checkpoint"
) -> Tuple[RewardModelConfig, StateDict]:
    """transformers config + state dict -> our config and (unfolded) weights, by the architecture's weight
    map."""
    weight_map = get_weight_map(hf_config)
    warn_if_relabelled(hf_config, weight_map.architecture)
    cfg = weight_map.build_config(hf_config)
    try:
        return cfg, weight_map.convert(hf_state_dict, cfg, hf_config)
    except KeyError as exc:
        raise CheckpointError(
            f"{source} lacks tensor {exc.args[0]!r}; the checkpoint is incomplete"
        ) from None


def convert_state_dict(
    cls,
    hf_config,
    hf_state_dict: StateDict,
    *,
    tokenizer=None,
    device=None,
    dtype=None,
    fold_ln=True,
    source: str = "the checkpoint",
):
    """transformers config + state dict -> a `cls` (HookedRewardModel) model (norms optionally folded)."""
    cfg, sd = convert_weights(hf_config, hf_state_dict, source)
    return cls.from_state_dict(
        cfg, sd, tokenizer=tokenizer, device=device, dtype=dtype, fold_ln=fold_ln, source=source
    )


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json")


def foreign_checkpoint_files(path: Path) -> list:
    """The files of a checkpoint in `path` that a hooked save would overwrite or leave beside a hooked config
    (a transformers/PEFT/GGUF checkpoint: its config.json and weights); none for an earlier hooked save."""
    if not path.is_dir() or (path / HOOKED_CONFIG).exists():
        return []
    names = sorted(n.name for n in path.iterdir())
    return [n for n in names if n in ("config.json", "adapter_config.json") or n.endswith(WEIGHT_SUFFIXES)]


def save_hooked(model, path: Union[str, Path], overwrite: bool = False) -> None:
    from safetensors.torch import save_file

    path = Path(path)
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"save_pretrained: {str(path)!r} is a file; give a directory")
    theirs = foreign_checkpoint_files(path)
    if theirs and not overwrite:
        raise CheckpointError(
            f"save_pretrained: {str(path)!r} holds another checkpoint ({', '.join(theirs[:4])}), e.g. the "
            "one this model was loaded from; the hooked format would replace its weights and transformers "
            "would then load a randomly initialised head: save into a new directory, or pass overwrite=True"
        )
    path.mkdir(parents=True, exist_ok=True)
    (path / HOOKED_CONFIG).write_text(json.dumps(model.cfg.to_dict(), indent=1))
    save_file(
        {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}, str(path / HOOKED_WEIGHTS)
    )
    if model.tokenizer is not None:
        model.tokenizer.save_pretrained(str(path))


def load_hooked_config(directory: Path, overrides: Optional[Dict[str, Any]] = None) -> RewardModelConfig:
    """The config (with `overrides` of its fields) of a saved hooked checkpoint (as `save_hooked` wrote it);
    its weights are read by `reward_lens.loading.streaming.hooked_source`."""
    raw = read_json(directory / HOOKED_CONFIG)
    check_overrides(None, overrides or {}, known=raw)
    raw.update(overrides or {})
    try:
        return RewardModelConfig.from_dict(raw)
    except (TypeError, ValueError, AttributeError) as exc:
        raise CheckpointError(f"{directory / HOOKED_CONFIG} is invalid: {str(exc).splitlines()[0]}") from None
