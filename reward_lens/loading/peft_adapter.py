"""PEFT adapter directories (what `trainer.save_model` writes for a LoRA reward model) loaded as merged
models.

Such a directory holds adapter_config.json + adapter_model.safetensors (+ tokenizer files) and no
config.json. The base checkpoint is `base_model_name_or_path` from adapter_config.json (a local
directory, or a hub id) unless `base_model=` is given. With `peft` installed the base is loaded as a
transformers sequence-classification model in float32, the adapter applied (its `modules_to_save`
carry the trained score head) and merged (`merge_and_unload`), then converted like any in-memory model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional

from reward_lens.loading.checkpoint import load_tokenizer, resolve_checkpoint_dir
from reward_lens.loading.checks import CheckpointError, read_json

ADAPTER_CONFIG = "adapter_config.json"
PREFIX = "base_model.model."


class PeftRequiredError(ImportError, ValueError):
    """An adapter directory met without `peft` installed (a ValueError too, so the CLI prints one line)."""


def is_peft_adapter_dir(directory: Path) -> bool:
    return (directory / ADAPTER_CONFIG).exists() and not (directory / "config.json").exists()


def adapter_tensor_shapes(directory: Path) -> Dict[str, tuple]:
    """Names (with PEFT's `base_model.model.` prefix removed) and shapes of the adapter's saved tensors."""
    from safetensors import safe_open

    path = directory / "adapter_model.safetensors"
    if not path.exists():
        raise FileNotFoundError(f"{directory} has {ADAPTER_CONFIG} but no adapter_model.safetensors")
    try:
        with safe_open(str(path), framework="pt") as f:
            return {
                k[len(PREFIX) :] if k.startswith(PREFIX) else k: tuple(f.get_slice(k).get_shape())
                for k in f.keys()
            }
    except Exception as exc:  # safetensors' SafetensorError on a damaged file
        if isinstance(exc, (KeyboardInterrupt, MemoryError)):
            raise
        raise CheckpointError(
            f"{path} is corrupt or truncated ({type(exc).__name__}: "
            f"{(str(exc).splitlines() or [''])[0][:120]}); re-save the adapter"
        ) from None


def adapter_settings(directory: Path) -> Dict[str, Any]:
    settings = read_json(directory / ADAPTER_CONFIG)
    if not isinstance(settings, dict):
        raise CheckpointError(
            f"{directory / ADAPTER_CONFIG} is not an object; is this a PEFT adapter directory?"
        )
    return settings


def resolve_base(directory: Path, base_model: Optional[str], settings: Dict[str, Any]) -> Path:
    """The base checkpoint's directory: `base_model=`, else the adapter's `base_model_name_or_path`; a
    relative path is tried from the current directory, then from the adapter's. Errors name what the user
    gave."""
    given = base_model or settings.get("base_model_name_or_path")
    where = "base_model=" if base_model else f"base_model_name_or_path in {directory / ADAPTER_CONFIG}"
    if not given:
        raise ValueError(
            f"{directory / ADAPTER_CONFIG} names no base_model_name_or_path; pass base_model='<dir or hub "
            "id>'"
        )
    path = Path(str(given)).expanduser()
    if not path.is_absolute() and not path.is_dir() and (directory / path).is_dir():
        return directory / path
    try:
        return resolve_checkpoint_dir(given)
    except FileNotFoundError as exc:
        relative = (
            "" if path.is_absolute() else f" (a relative path: tried from {Path.cwd()} and from {directory})"
        )
        raise FileNotFoundError(
            f"the adapter's base {str(given)!r} ({where}) is not found{relative}: {exc}; or pass "
            "base_model='<the base checkpoint directory or hub id>'"
        ) from None


def merged_adapter_model(directory: Path, *, base_model: Optional[str] = None, tokenizer: Any = None):
    """The base model with the adapter merged in (float32, CPU): a plain transformers model."""
    settings = adapter_settings(directory)
    base = base_model or settings.get("base_model_name_or_path")
    try:
        from peft import PeftModel
    except ImportError:
        raise PeftRequiredError(
            f"{directory} is a PEFT adapter (adapter_config.json, no config.json) on base {base!r}; "
            "loading it needs PEFT: `pip install peft` (or `pip install reward-lens[peft]`), or merge it "
            "yourself with PeftModel.from_pretrained(base, "
            "adapter_dir).merge_and_unload().save_pretrained(out_dir) and load out_dir"
        ) from None
    import torch
    from transformers import AutoModelForSequenceClassification

    if not base:
        raise ValueError(
            f"{directory / ADAPTER_CONFIG} names no base_model_name_or_path; pass base_model='<dir or hub "
            "id>'"
        )
    task = settings.get("task_type")
    if task not in (None, "SEQ_CLS"):
        raise ValueError(
            f"the adapter in {directory} has task_type {task!r}; a reward model's adapter is SEQ_CLS (a "
            "score head on a sequence-classification model)"
        )
    shapes = adapter_tensor_shapes(directory)
    head = next(
        (shape for name, shape in shapes.items() if name.endswith(("score.weight", "classifier.weight"))),
        None,
    )
    kwargs = {"num_labels": head[0]} if head is not None else {}

    hf, info = AutoModelForSequenceClassification.from_pretrained(
        str(resolve_base(directory, base_model, settings)),
        dtype=torch.float32,
        output_loading_info=True,
        **kwargs,
    )
    unset = sorted(k for k in info.get("missing_keys") or [] if k not in shapes)
    if unset:
        raise ValueError(
            f"neither the base {base!r} nor the adapter in {directory} holds {unset[:4]}: transformers "
            "would initialise them at random (a score head not saved with modules_to_save?), so the "
            "rewards would be meaningless"
        )
    config = None
    if head is None and task == "SEQ_CLS":
        # PEFT's SEQ_CLS model expects the score head among the adapter's tensors (its KeyError otherwise);
        # an adapter without one changes the backbone only and keeps the base's own score head.
        import warnings

        from peft import PeftConfig

        config = PeftConfig.from_pretrained(str(directory))
        config.task_type = None
        saved = [m for m in config.modules_to_save or [] if any(f".{m}." in name for name in shapes)]
        config.modules_to_save = saved or None
        warnings.warn(
            f"the adapter in {directory} holds no score head; the base {base!r}'s own score head is used",
            stacklevel=3,
        )
    try:
        loaded = PeftModel.from_pretrained(hf, str(directory), **({"config": config} if config else {}))
        merged = loaded.merge_and_unload()
    except RuntimeError as exc:  # torch's "size mismatch for ...": the adapter was trained on another base
        lines = str(exc).splitlines() or [""]
        first = next((ln.strip() for ln in lines if "size mismatch" in ln), lines[0])
        raise ValueError(
            f"the adapter in {directory} does not fit the base {base!r} ({first[:200]}); pass base_model= "
            "the checkpoint it was trained on"
        ) from None
    if merged.config.pad_token_id is None and getattr(tokenizer, "pad_token_id", None) is not None:
        merged.config.pad_token_id = tokenizer.pad_token_id  # TRL trains with the tokenizer's pad id
    return merged.eval()


def load_peft_adapter(
    cls, directory: Path, *, tokenizer=None, base_model: Optional[str] = None, **convert: Any
):
    """`from_pretrained` on an adapter directory: merged, then `cls.from_hf_model(merged, tokenizer,
    **convert)`."""
    if tokenizer is None:
        settings = adapter_settings(directory)
        if base_model or settings.get("base_model_name_or_path"):
            tokenizer = load_tokenizer(resolve_base(directory, base_model, settings))
    merged = merged_adapter_model(directory, base_model=base_model, tokenizer=tokenizer)
    return cls.from_hf_model(merged, tokenizer, **convert)
