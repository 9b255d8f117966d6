"""GGUF backbones: `HookedRewardModel.from_pretrained(dir, gguf_file=...)`, dequantised, like transformers.

transformers reads a `.gguf` file (llama.cpp's format; quantised Q4/Q8/... or float) and dequantises every
tensor to float32 when it loads it (`from_pretrained(dir_or_hub_id, gguf_file=...)`, which needs the `gguf`
package). We let it build the `*ForSequenceClassification` model and convert that with `from_hf_model`, so
the hooked model computes exactly what transformers computes on the dequantised weights (no quantised
arithmetic anywhere). A GGUF file holds a language model, never a reward head: the score head is what
transformers initialises (random, from torch's RNG), and it is the caller's to train or set (see
`reward_lens.demo.smollm2` for a shipped head on a GGUF backbone).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Union

import torch

from reward_lens.loading.checks import check_overrides

SCORE_HEAD_NOTE = (
    "{file} holds a language model, not a reward head: the score head is randomly initialised (as "
    "transformers does); set model weights for a trained head before reading rewards"
)


def load_gguf_hf_model(
    path_or_id: Union[str, Path], gguf_file: str, **config_overrides: Any
) -> torch.nn.Module:
    """transformers' `AutoModelForSequenceClassification` from a GGUF file (dequantised to float32).

    `config_overrides` go to transformers' `from_pretrained` (e.g. `num_labels`, default 1; `pad_token_id`).
    """
    from transformers import AutoModelForSequenceClassification

    _check_gguf_available()
    config_overrides.setdefault("num_labels", 1)
    check_gguf_file(path_or_id, gguf_file)
    check_gguf_overrides(Path(path_or_id).expanduser() / gguf_file, config_overrides)
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # transformers' own notes on the dequantisation
            # Its load report ("score.weight MISSING ... consider training") is replaced by SCORE_HEAD_NOTE
            # (and by nothing when a trained head is set after): any other missing tensor is an error below.
            hf_logging.set_verbosity_error()
            model, info = AutoModelForSequenceClassification.from_pretrained(
                str(path_or_id), gguf_file=gguf_file, output_loading_info=True, **config_overrides
            )
    except Exception as exc:  # gguf's reader: struct/index/value errors on a damaged file
        if isinstance(exc, (KeyboardInterrupt, MemoryError, ImportError)):
            raise
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
        raise ValueError(
            f"{gguf_file} in {path_or_id} cannot be read as GGUF ({type(exc).__name__}: {first}); it may "
            "be truncated or of an architecture transformers cannot load: re-download it"
        ) from None
    finally:
        hf_logging.set_verbosity(verbosity)
    missing = sorted(k for k in info.get("missing_keys") or [] if not k.startswith(("score.", "classifier.")))
    if missing:
        raise ValueError(
            f"{gguf_file} lacks {len(missing)} backbone tensor(s) ({', '.join(missing[:3])}); "
            "transformers would initialise them at random: re-download or re-convert the file"
        )
    model.eval()
    return model


# transformers' `from_pretrained` keywords that are not config fields (everything else must be one)
LOADER_KEYWORDS = frozenset(
    {"revision", "cache_dir", "token", "local_files_only", "force_download", "proxies", "subfolder"}
    | {"trust_remote_code", "torch_dtype", "attn_implementation", "low_cpu_mem_usage", "device_map"}
)


def check_gguf_overrides(path: Path, overrides: dict) -> None:
    """A keyword that is neither a transformers loading option nor a field of the file's architecture's
    config is a TypeError naming it (a misspelled `dtpye=` is not a damaged file). Files that cannot be
    read here are left to the loader's own error."""
    unknown = [k for k in overrides if k not in LOADER_KEYWORDS]
    if not unknown or not path.is_file():
        return
    try:
        import gguf
        from transformers import CONFIG_MAPPING

        field = gguf.GGUFReader(str(path)).fields["general.architecture"]
        arch = bytes(field.parts[field.data[0]]).decode()
        config = CONFIG_MAPPING[arch]()
    except Exception as exc:  # damaged file, unknown architecture: the loader says which
        if isinstance(exc, (KeyboardInterrupt, MemoryError)):
            raise
        return
    check_overrides(config, {k: overrides[k] for k in unknown})


def check_gguf_file(path_or_id: Union[str, Path], gguf_file: str) -> None:
    """A local directory must exist and hold `gguf_file`, a non-empty file starting with the GGUF magic
    (FileNotFoundError / ValueError naming it); a hub id (org/name) is left to transformers."""
    directory = Path(path_or_id).expanduser()
    text = str(path_or_id)
    local = directory.exists() or text.startswith((".", "/", "~")) or text.count("/") != 1
    if not local:
        return
    if not directory.is_dir():
        raise FileNotFoundError(
            f"no directory at {str(path_or_id)!r} (gguf_file={gguf_file!r} is looked up inside it); pass "
            "the directory holding the .gguf file"
        )
    path = directory / gguf_file
    if not path.is_file():
        raise FileNotFoundError(
            f"no GGUF file {gguf_file!r} in {directory}; pass gguf_file= a file name inside it"
        )
    with open(path, "rb") as f:
        magic = f.read(4)
    if not magic:
        raise ValueError(f"{path} is empty (0 bytes); re-download it")
    if magic != b"GGUF":
        raise ValueError(
            f"{path} is not a GGUF file (it starts with {magic!r}, not b'GGUF'); give a llama.cpp .gguf"
        )


def load_gguf_tokenizer(path_or_id: Union[str, Path], gguf_file: str):
    """The tokenizer (with its chat template) stored in the GGUF file's metadata."""
    from transformers import AutoTokenizer

    _check_gguf_available()
    return AutoTokenizer.from_pretrained(str(path_or_id), gguf_file=gguf_file)


def load_gguf(
    cls,
    path_or_id,
    gguf_file: str,
    *,
    tokenizer=None,
    device=None,
    dtype=None,
    fold_ln=True,
    generic=False,
    module_map=None,
    **config_overrides,
):
    """`cls.from_pretrained(path_or_id, gguf_file=...)`: transformers loads and dequantises, we convert."""
    hf_model = load_gguf_hf_model(path_or_id, gguf_file, **config_overrides)
    warnings.warn(SCORE_HEAD_NOTE.format(file=gguf_file), stacklevel=3)
    if tokenizer is None:
        tokenizer = load_gguf_tokenizer(path_or_id, gguf_file)
    return cls.from_hf_model(
        hf_model,
        tokenizer,
        device=device,
        dtype=dtype,
        fold_ln=fold_ln,
        generic=generic,
        module_map=module_map,
    )


def _check_gguf_available() -> None:
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise ImportError("loading a .gguf file needs the `gguf` package: pip install gguf") from None
