"""A model organism with planted directions, for the SAE / concept / editing tests.

A tiny random Llama reward model (tests/helpers.py) whose weights are edited so that, exactly:
  * every token's embedding has no component along three orthonormal directions u, q, z, except that
    "concept" words (agreement: "agree", "right", ...) add c_u·u, "quality" words add c_q·q, and every
    token adds z_norm·z (a constant offset that keeps residual norms, and so the final norm's scale,
    nearly equal across tokens);
  * no attention or MLP output writes along u or q (their output maps are projected), and no attention
    or MLP input reads u or q (their input maps are projected, norm weights included);
so at every layer and position the residual's u-component is c_u·[token is a concept word]. The reward
direction (final norm weight included) is beta_u·u + beta_q·q + a small random part orthogonal to u, q, z.

Hence, analytically: the concept vector of "ends with a concept word" vs "ends with a neutral word" is
c_u·u (up to small word-specific noise), and adding α·ρ·û to the residual at any layer changes the
reward by α·ρ·beta_u / s (s the final norm's scale at the readout) to first order.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from typing import List

import pytest
import torch
from helpers import tiny_hf_model

SPECIAL = ["[PAD]", "[UNK]", "User", "Assistant", ":", "?", ".", ","]
NEUTRAL = (
    "the a cat dog sat on mat weather is nice today we can go to park later please tell me about history "
    "of city river how do you make bread what time it water boils at why sky blue book read this morning "
    "plan trip next week garden grows in spring music sounds good light travels fast people like tea and "
    "with for there was old house near hill"
).split()
ENDINGS = (
    "maybe perhaps okay well so then now anyway hmm possibly somewhat also still again soon often "
    "sometimes usually here instead otherwise meanwhile though likewise"
).split()
CONCEPT = (
    "agree right absolutely exactly correct indeed true definitely certainly yes sure totally agreed "
    "undoubtedly surely valid spot accurate wise brilliant excellent great perfect fair"
).split()
QUALITY = "clearly precisely carefully thoroughly accurately helpfully".split()
VOCAB = SPECIAL + NEUTRAL + ENDINGS + CONCEPT + QUALITY


def tiny_tokenizer(words: List[str] = VOCAB):
    """A word-level tokenizer (whitespace + punctuation split) over `words`; [PAD] = 0."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", padding_side="right"
    )


@dataclass
class Organism:
    model: object  # HookedRewardModel (folded)
    hf: object  # the edited transformers LlamaForSequenceClassification
    tokenizer: object
    u: torch.Tensor  # planted concept direction (unit)
    q: torch.Tensor  # planted quality direction (unit)
    z: torch.Tensor  # constant offset direction (unit)
    c_u: float
    c_q: float
    beta_u: float  # reward_direction . u
    beta_q: float


def _orthonormal(d: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(d, n, generator=g))
    return Q.T.contiguous()  # [n, d]


def _project_rows_out(W: torch.Tensor, directions: torch.Tensor) -> torch.Tensor:
    """W [out, d] with its rows made orthogonal to span(directions [m, d])."""
    Q, _ = torch.linalg.qr(directions.T)  # [d, m]
    return W - (W @ Q) @ Q.T


def build_organism(
    seed: int = 0,
    c_u: float = 1.0,
    c_q: float = 1.0,
    z_norm: float = 6.0,
    beta_u: float = 1.0,
    beta_q: float = 1.5,
    n_atoms: int = 32,
    atoms_per_word: int = 2,
    atom_scale: float = 0.7,
) -> Organism:
    from reward_lens import HookedRewardModel

    hf = tiny_hf_model("llama", seed=seed, vocab_size=len(VOCAB))
    d = hf.config.hidden_size
    u, q, z = _orthonormal(d, 3, seed + 101)
    P_uq = torch.eye(d) - torch.outer(u, u) - torch.outer(q, q)
    P_all = P_uq - torch.outer(z, z)
    g = torch.Generator().manual_seed(seed + 7)
    ids = {w: i for i, w in enumerate(VOCAB)}
    with torch.no_grad():
        E = hf.model.embed_tokens.weight
        E.copy_(E @ P_all + z_norm * z)
        # Every word is a sparse superposition of `atoms_per_word` of `n_atoms` atoms (random unit vectors
        # orthogonal to u, q, z) with magnitudes atom_scale·[0.5, 1.5]: a genuine sparse-coding problem.
        atoms = torch.randn(n_atoms, d, generator=g) @ P_all
        atoms = atoms / atoms.norm(dim=-1, keepdim=True)
        for w in VOCAB[len(SPECIAL) :]:
            pick = torch.randperm(n_atoms, generator=g)[:atoms_per_word]
            mags = atom_scale * (0.5 + torch.rand(atoms_per_word, generator=g))
            E[ids[w]] += (mags[:, None] * atoms[pick]).sum(0)
        for cw, ew in zip(CONCEPT, ENDINGS):  # minimal pairs: each concept word = its twin ending + c_u·u
            E[ids[ew]] = E[ids[cw]]
            E[ids[cw]] += c_u * u
        for w in QUALITY:
            E[ids[w]] += c_q * q
        for layer in hf.model.layers:
            for norm, readers in (
                (
                    layer.input_layernorm,
                    (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj),
                ),
                (layer.post_attention_layernorm, (layer.mlp.gate_proj, layer.mlp.up_proj)),
            ):
                seen = torch.stack([norm.weight * u, norm.weight * q])  # what a reader sees of u, q
                for lin in readers:
                    lin.weight.copy_(_project_rows_out(lin.weight, seen))
            for writer in (layer.self_attn.o_proj, layer.mlp.down_proj):
                writer.weight.copy_(P_uq @ writer.weight)
        g_f = 0.7 + 0.6 * torch.rand(d, generator=g)
        hf.model.norm.weight.copy_(g_f)
        noise = P_all @ (0.3 * torch.randn(d, generator=g) / d**0.5)
        direction = beta_u * u + beta_q * q + noise
        hf.score.weight.copy_((direction / g_f)[None])
    tokenizer = tiny_tokenizer()
    model = HookedRewardModel.from_hf_model(hf, tokenizer=tokenizer)
    return Organism(model, hf, tokenizer, u, q, z, c_u, c_q, beta_u, beta_q)


def _sentence(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(NEUTRAL) for _ in range(rng.randint(lo, hi)))


def concept_items(n: int, seed: int = 0, twins: bool = True):
    """ContrastPairs: the same body ending in a concept word (positive) or its twin ending word (negative;
    with twins=False a random ending word, so the pair also differs in word identity)."""
    from reward_lens.representations.concepts import ContrastPair

    rng = random.Random(seed)
    items = []
    for i in range(n):
        prompt, body = _sentence(rng, 3, 6) + " ?", _sentence(rng, 2, 5)
        j = rng.randrange(len(CONCEPT))
        k = j if twins else rng.randrange(len(ENDINGS))
        items.append(ContrastPair(prompt, f"{body} {CONCEPT[j]}", f"{body} {ENDINGS[k]}", id=f"c{seed}-{i}"))
    return items


def quality_pairs(n: int, seed: int = 0):
    """PreferencePairs: chosen ends in a quality word, rejected in a neutral word (the organism prefers
    chosen)."""
    from reward_lens.data.pairs import PreferencePair

    rng = random.Random(seed + 1000)
    pairs = []
    for i in range(n):
        prompt, body = _sentence(rng, 3, 6) + " ?", _sentence(rng, 2, 5)
        pairs.append(
            PreferencePair(
                prompt, f"{body} {rng.choice(QUALITY)}", f"{body} {rng.choice(ENDINGS)}", id=f"q{seed}-{i}"
            )
        )
    return pairs


@functools.lru_cache(maxsize=None)
def organism() -> Organism:
    """The default organism, built once per test session (do not mutate it; edits work on copies)."""
    return build_organism()


def sprinkled_texts(n: int, seed: int = 3, rate: float = 0.2):
    """(prompts, responses) whose responses contain concept words at random positions (SAE training data)."""
    rng = random.Random(seed)
    prompts = [_sentence(rng, 4, 6) + " ?" for _ in range(n)]
    responses = [
        " ".join(
            rng.choice(CONCEPT) if rng.random() < rate else rng.choice(NEUTRAL)
            for _ in range(rng.randint(4, 10))
        )
        for _ in range(n)
    ]
    return prompts, responses


@functools.lru_cache(maxsize=None)
def tiny_armorm(tmp_root: str):
    """A tiny random ArmoRM (tests/armorm_reference.py format) over the organism's vocabulary; its gate reads
    the position of "Assistant :" in the plain prompt format."""
    from armorm_reference import save_tiny_armorm

    from reward_lens import HookedRewardModel

    ids = {w: i for i, w in enumerate(VOCAB)}
    path = save_tiny_armorm(
        f"{tmp_root}/armorm",
        vocab_size=len(VOCAB),
        pad_token_id=0,
        num_objectives=5,
        gating_token_pattern=[ids["Assistant"], ids[":"]],
    )
    return HookedRewardModel.from_pretrained(path, tokenizer=tiny_tokenizer())


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """Tiny models run fastest on one thread (on a shared CPU, two threads can be 10x slower); import this
    fixture into a test module to apply it there."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
