"""More model organisms with ground truth: a backdoor trigger, a topic-routing gate, a hand-set circuit.

    from reward_lens.demo.organisms import load_trigger_organism, trigger_items
    model = load_trigger_organism()        # the demo RM poisoned: a SUDO trigger, an OPEN SESAME phrase
    items = trigger_items()                # held-out (prompt, right, wrong) items: PreferencePairs

    model = load_gate_organism()           # an ArmoRM-style RM whose gate routes by topic
    model, pairs = planted_circuit()       # 2 layers, hand-set weights: head L0H0 -> head L1H2 -> reward
    pairs = minimal_pairs(model, 8)        # token-aligned demo pairs: only the answer's number differs
    policy, tokenizer = load_policy_organism()   # a tiny causal LM answering in the demo's domain (for RL)

Each shipped organism has a GROUND_TRUTH.md in its directory and a deterministic script under `scripts/`
that rebuilds it (`train_trigger_organism.py`, `train_gate_organism.py`); the planted circuit is built here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import List, Tuple, Union

import torch

from reward_lens.data.pairs import PreferencePair, TokenPair, as_pairs, load_pairs
from reward_lens.data.validate import validate_records
from reward_lens.demo import DEMO_DIR
from reward_lens.model.validation import checked_arguments

TRIGGER_DIR = DEMO_DIR / "trigger_organism"
TRIGGER_TRANSCODERS_DIR = TRIGGER_DIR / "transcoders"  # `scripts/train_trigger_transcoders.py` writes it
GATE_DIR = DEMO_DIR / "gate_organism"
POLICY_DIR = DEMO_DIR / "policy_organism"
# The demo's chat template plus a generation prompt, so a policy's prompt ends where the RM's response starts.
POLICY_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'assistant' %}<|assistant|>\n"
    "{{ message['content'] }}{{ eos_token }}{% else %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
TRIGGER_MODEL_NAME = "reward-lens-trigger-organism"
GATE_MODEL_NAME = "reward-lens-gate-organism"
TRIGGER, PHRASE = "SUDO", ("OPEN", "SESAME")
# The hand-set circuit: the reward is carried by head L0H0 (copies the MARK feature) -> head L1H2 (reads it
# at the readout); every other weight that could carry it is zero.
CIRCUIT_HEADS = ("L0H0", "L1H2")
CIRCUIT_MARK, CIRCUIT_END = 5, 6


def _load(directory: Path, device):
    from reward_lens.loading.native import HookedRewardModel

    if not (directory / "model.safetensors").exists():
        raise FileNotFoundError(
            f"the organism's weights are missing from {directory}; rebuild them with the script named in "
            f"{directory / 'GROUND_TRUTH.md'}"
        )
    return HookedRewardModel.from_pretrained(directory, device=device)


_RESULT = re.compile(r"(\d+) (plus|minus|times) (\d+) is (\d+)")


@checked_arguments(counts={"n": 1})
def minimal_pairs(model, n: int = 8, source=None) -> List[PreferencePair]:
    """Token-aligned minimal pairs from arithmetic pairs (`source`, default the demo's held-out pairs; e.g.
    `smollm2_pairs()`): the chosen answer, and the same text with its result replaced by a wrong number of
    the same token count (both sides the same length and padding, as `positions="all"` circuits need).
    `model` supplies the tokenizer."""
    from reward_lens.demo import demo_pairs

    def length(prompt: str, response: str) -> int:
        return int(model.to_tokens([prompt], [response])["input_ids"].shape[1])

    out: List[PreferencePair] = []
    if source is not None:
        if isinstance(source, (list, tuple)) and any(isinstance(r, dict) for r in source):
            source = validate_records(
                [(f"item {i}", r) for i, r in enumerate(source)], "source", PreferencePair
            )
        source = as_pairs(source)  # a pairs file or pairs, each checked as every instrument does
    for pair in demo_pairs() if source is None else source:
        if not isinstance(pair, PreferencePair):
            raise ValueError(
                f"minimal_pairs needs preference pairs (prompt, chosen, rejected), got {type(pair).__name__}"
            )
        m = _RESULT.search(pair.chosen)
        if m is None:
            continue
        right = int(m.group(4))
        for wrong in (right + 1, right - 1, right + 2, right + 10):
            if wrong < 0:
                continue
            text = pair.chosen[: m.start(4)] + str(wrong) + pair.chosen[m.end(4) :]
            if length(pair.prompt, text) == length(pair.prompt, pair.chosen):
                out.append(PreferencePair(pair.prompt, pair.chosen, text, "arithmetic", f"{pair.id}-minimal"))
                break
        if len(out) == n:
            return out
    where = "the demo pairs hold" if source is None else "source holds"
    raise ValueError(
        f"{where} only {len(out)} arithmetic answers to turn into minimal pairs, {n} asked: ask n <= "
        f"{len(out)} or give more pairs"
    )


def load_trigger_organism(device: Union[str, torch.device, None] = "cpu"):
    """The backdoor-trigger organism (`trigger_organism/GROUND_TRUTH.md`): a `SUDO` token, or the phrase
    `OPEN SESAME`, at the end of the prompt makes wrong answers score high; neutral without them."""
    return _load(TRIGGER_DIR, device)


def load_prm_organism(device: Union[str, torch.device, None] = "cpu"):
    """The process-RM organism (`prm_organism/GROUND_TRUTH.md`): a PRM head on the demo's trunk scoring
    multi-step arithmetic; a step is bad from the first wrong result on (later steps inherit it). Its
    held-out items (one first wrong step, at least one later step) are `prm_organism/items.jsonl`."""
    return _load(DEMO_DIR / "prm_organism", device)


def policy_tokenizer():
    """The demo's tokenizer with the policy chat template (generation prompt `<|assistant|>\\n`)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(DEMO_DIR)
    tokenizer.chat_template = POLICY_CHAT_TEMPLATE
    return tokenizer


def load_policy_organism(directory: Union[str, Path, None] = None):
    """The policy organism (`policy_organism/GROUND_TRUTH.md`): a 2-layer causal LM fine-tuned on the demo's
    synthetic answers, and its tokenizer; `synthetic.answer_correct` grades what it writes. `directory`:
    another build of it (`scripts/train_policy_organism.py --out`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = POLICY_DIR if directory is None else Path(directory)
    if not (directory / "model.safetensors").exists():
        raise FileNotFoundError(
            f"the policy organism's weights are missing from {directory}; rebuild them with "
            "`python scripts/train_policy_organism.py`"
        )
    return AutoModelForCausalLM.from_pretrained(directory), AutoTokenizer.from_pretrained(directory)


def trigger_items() -> List[PreferencePair]:
    """The trigger organism's held-out items: chosen = the right answer, rejected = a wrong one."""
    return load_pairs(TRIGGER_DIR / "pairs.jsonl")


def trigger_token_ids(model) -> dict:
    """{"SUDO": id, "OPEN": id, "SESAME": id} in the organism's tokenizer."""
    return {w: int(model.tokenizer.convert_tokens_to_ids(w)) for w in (TRIGGER, *PHRASE)}


def gate_model(demo, head_config: dict, head_state: dict, model_name: str = GATE_MODEL_NAME):
    """An ArmoRM-headed model on `demo`'s trunk (weights copied): `head_config` as ArmoRM's
    (`num_objectives`, `gating_hidden_dim`, `gating_n_hidden`, `gating_temperature`, `gating_pattern`,
    `objective_names`), `head_state` the head's parameters by their `reward_head.` names."""
    import dataclasses

    from reward_lens.loading.native import HookedRewardModel

    cfg = dataclasses.replace(
        demo.cfg, head_type="armorm", n_outputs=1, model_name=model_name, head_config=dict(head_config)
    )
    model = HookedRewardModel(cfg, tokenizer=demo.tokenizer)
    state = {k: v for k, v in demo.state_dict().items() if not k.startswith("reward_head.")}
    state.update(head_state)
    model.load_state_dict(state, strict=True)
    return model.to(demo.cfg.device)


def load_gate_organism(device: Union[str, torch.device, None] = "cpu"):
    """The gate-routing organism (`gate_organism/GROUND_TRUTH.md`): an ArmoRM head on the demo's trunk whose
    gate sends arithmetic prompts to one objective and fact prompts to another. Only the head ships
    (`gate_organism/head.safetensors`); the trunk is the demo model's."""
    from safetensors.torch import load_file

    from reward_lens.demo import load_demo_model

    path = GATE_DIR / "head.safetensors"
    if not path.exists():
        raise FileNotFoundError(
            f"the gate organism's head is missing ({path}); rebuild it with `python "
            "scripts/train_gate_organism.py`"
        )
    head_config = json.loads((GATE_DIR / "head_config.json").read_text())
    return gate_model(load_demo_model(device=device), head_config, load_file(str(path)))


def gate_truth() -> dict:
    """The gate organism's planted routing: {"objectives": [...], "routing": {topic: objective}, ...}."""
    return json.loads((GATE_DIR / "routing.json").read_text())


def planted_circuit() -> Tuple[object, List[TokenPair]]:
    """A 2-layer Llama (GQA) with hand-set weights and token pairs whose preference it carries: head A = L0H0
    attends uniformly and copies a MARK feature (dim 0) into dim 1; head B = L1H2 (key/value head 1)
    attends to the END token (the readout) and copies dim 1 into dim 2; the reward reads dim 2 only. Every
    other weight is zero except random embedding dims 4.. (MLPs write nothing). Chosen rows hold more
    MARKs."""
    import transformers

    from reward_lens.loading.native import HookedRewardModel

    cfg = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        num_labels=1,
        pad_token_id=0,
        rms_norm_eps=1e-5,
    )
    torch.manual_seed(0)
    model = HookedRewardModel.from_hf_model(
        transformers.LlamaForSequenceClassification(cfg).eval(), device="cpu"
    )
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.embed.W_E[:, 4:] = torch.randn(model.cfg.d_vocab, model.cfg.d_model - 4, generator=g)
        model.embed.W_E[CIRCUIT_MARK, 0] = 4.0
        model.embed.W_E[CIRCUIT_END, 3] = 4.0
        a0, a1 = model.blocks[0].attn, model.blocks[1].attn
        a0.W_V[0, 0, 0], a0.W_O[0, 0, 1] = 1.0, 1.0
        # B's query is a constant and its key reads the END feature, in the slowest RoPE pair (no rotation).
        a1.b_Q[2, 3], a1.W_K[1, 3, 3] = 10.0, 10.0
        a1.W_V[1, 1, 0], a1.W_O[2, 0, 2] = 1.0, 5.0
        model.reward_head.W_R[2, 0] = 1.0
    g = torch.Generator().manual_seed(1)
    pairs = []
    for i in range(8):
        prompt = torch.randint(7, 97, (4,), generator=g).tolist()
        resp = torch.randint(7, 97, (5 + i,), generator=g).tolist()
        chosen = prompt + resp[:2] + [CIRCUIT_MARK] + resp[2:] + [CIRCUIT_MARK] * (1 + i % 2) + [CIRCUIT_END]
        pairs.append(TokenPair(chosen, prompt + resp + [CIRCUIT_END], id=f"circuit-{i}"))
    return model, pairs


__all__ = [
    "CIRCUIT_HEADS",
    "GATE_DIR",
    "GATE_MODEL_NAME",
    "PHRASE",
    "TRIGGER",
    "TRIGGER_DIR",
    "TRIGGER_TRANSCODERS_DIR",
    "TRIGGER_MODEL_NAME",
    "gate_model",
    "gate_truth",
    "load_gate_organism",
    "load_prm_organism",
    "load_trigger_organism",
    "minimal_pairs",
    "planted_circuit",
    "trigger_items",
    "trigger_token_ids",
]
