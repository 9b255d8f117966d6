"""Tiny random reward checkpoints built with transformers, for offline parity tests."""

from __future__ import annotations

import torch

ARCH_CONFIGS = {}


def randomise_norms(model: torch.nn.Module, seed: int = 0) -> None:
    """Norm weights away from 1 (and biases away from 0) so norm folding is really exercised."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.5 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def tiny_config(arch: str, **overrides):
    import transformers

    common = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        num_labels=1,
        pad_token_id=0,
        rms_norm_eps=1e-5,
    )
    if arch == "llama":
        cfg = transformers.LlamaConfig(
            **common,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
            rope_theta=500000.0,
        )
        cls = transformers.LlamaForSequenceClassification
    elif arch == "mistral":
        cfg = transformers.MistralConfig(**common, sliding_window=4)
        cls = transformers.MistralForSequenceClassification
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(
            **common, use_sliding_window=True, sliding_window=4, max_window_layers=1
        )
        cls = transformers.Qwen2ForSequenceClassification
    elif arch == "qwen3":
        cfg = transformers.Qwen3Config(**common, head_dim=24)
        cls = transformers.Qwen3ForSequenceClassification
    else:
        raise KeyError(arch)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg, cls


def tiny_hf_model(arch: str, seed: int = 0, **overrides):
    cfg, cls = tiny_config(arch, **overrides)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    randomise_norms(model, seed)
    return model


def padded_batch(lengths, side: str, vocab: int = 97, pad: int = 0, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids = torch.full((len(lengths), T), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        sl = slice(T - n, T) if side == "left" else slice(0, n)
        ids[i, sl] = torch.randint(1, vocab, (n,), generator=g)
        mask[i, sl] = 1
    return ids, mask


def tiny_tokenizer(vocab_size: int = 97, texts=None, padding_side: str = "right"):
    """A word-level tokenizer whose ids fit a tiny model's vocabulary, for tests that need text input.

    Lower-cased words and punctuation; [PAD] = 0 (the tiny configs' pad_token_id), [UNK] = 1, then the
    most frequent words of `texts` (default: the bundled pairs in the plain "User: ... Assistant: ..."
    format). Wrapped in transformers' PreTrainedTokenizerFast, so `model.tokenizer = tiny_tokenizer()`.
    """
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if texts is None:
        from reward_lens.data.pairs import bundled_pairs
        from reward_lens.model.tokenization import PLAIN_FORMAT

        texts = [
            PLAIN_FORMAT.format(prompt=p.prompt, response=r)
            for p in bundled_pairs()
            for r in (p.chosen, p.rejected)
        ]
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        texts, trainers.WordLevelTrainer(vocab_size=vocab_size, special_tokens=["[PAD]", "[UNK]"])
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", padding_side=padding_side
    )


def token_pairs(lengths, prompt_len: int = 3, vocab: int = 97, seed: int = 0, low: int = 1):
    """TokenPairs sharing a random `prompt_len`-token prompt, with random responses of the given
    (chosen, rejected) lengths; ids drawn from [low, vocab) so the pad id 0 never occurs."""
    from reward_lens.data.pairs import TokenPair

    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (nc, nr) in enumerate(lengths):
        prompt = torch.randint(low, vocab, (prompt_len,), generator=g)
        chosen = torch.cat([prompt, torch.randint(low, vocab, (nc,), generator=g)])
        rejected = torch.cat([prompt, torch.randint(low, vocab, (nr,), generator=g)])
        out.append(TokenPair(chosen, rejected, id=f"p{i}"))
    return out


try:
    import pytest

    @pytest.fixture(autouse=True, scope="module")
    def one_thread():
        """Import into a test module to run it single-threaded: tiny-model ops are ~10x faster on a loaded
        2-core box with one thread (no OpenMP wake-ups per op); restored afterwards."""
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        yield
        torch.set_num_threads(before)
except ImportError:  # helpers used outside pytest
    pass


def hf_parity_run(hf, ids, mask):
    """transformers forward with the position ids the hooked model uses by default (cumsum of the mask),
    so a left-padded row is the same computation as the unpadded one; hidden states included."""
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        return hf(ids, attention_mask=mask, position_ids=pos, output_hidden_states=True)


def assert_hf_parity(model, hf, ids, mask, tol: float = 1e-4) -> None:
    """Rewards and every layer's hidden states (non-pad positions) within `tol` of transformers."""
    out = hf_parity_run(hf, ids, mask)
    rewards, cache = model.run_with_cache(ids, attention_mask=mask)
    assert rewards.shape == (ids.shape[0],)
    assert (rewards - out.logits[:, 0]).abs().max() < tol
    for layer in range(model.cfg.n_layers - 1):  # HF's last hidden state is after the final norm
        diff = (cache[f"blocks.{layer}.hook_resid_post"] - out.hidden_states[layer + 1]) * mask[..., None]
        assert diff.abs().max() < tol, f"layer {layer}"
    if model.ln_final.w is not None:  # unfolded: the final norm's output is comparable too
        final = model.ln_final(cache[f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"])
        assert ((final - out.hidden_states[-1]) * mask[..., None]).abs().max() < tol


def word_tokenizer(
    tokens,
    *,
    bos=None,
    eos=None,
    pad=None,
    unk="<unk>",
    specials=(),
    template=None,
    add_bos=False,
    split: str = "whitespace",
    padding_side: str = "right",
):
    """A fixed-vocabulary word-level tokenizer: id i is `tokens[i]` (specials included), words split on
    whitespace ("whitespace") or whitespace and punctuation ("words"); `specials` are matched inside words
    too (as added special tokens); `add_bos` has the tokenizer itself prepend BOS (a Llama-style
    post-processor); `template` becomes the chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(dict.fromkeys(tokens))}  # a repeated token keeps its first id
    tok = Tokenizer(models.WordLevel(vocab, unk_token=unk))
    tok.pre_tokenizer = (
        pre_tokenizers.WhitespaceSplit() if split == "whitespace" else pre_tokenizers.Whitespace()
    )
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, vocab[bos])]
        )
    named = dict(
        bos_token=bos, eos_token=eos, pad_token=pad, unk_token=unk, additional_special_tokens=list(specials)
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, padding_side=padding_side, **{k: v for k, v in named.items() if v}
    )
    if template is not None:
        fast.chat_template = template
    return fast


LLAMA3_SPECIALS = ["<|eot_id|>", "<unk>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>"]
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ "
    "m['content'] | trim }}<|eot_id|>{% endfor %}{% if add_generation_prompt "
    "%}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def llama3_tokenizer(words, pad_is_eos: bool = True):
    """A Llama-3-style chat tokenizer over `words`: BOS from the template, EOS <|eot_id|> = id 0, and (as TRL
    sets it when a tokenizer has none) pad = EOS."""
    return word_tokenizer(
        LLAMA3_SPECIALS + ["user", "assistant", "system"] + list(words),
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
        pad="<|eot_id|>" if pad_is_eos else None,
        specials=LLAMA3_SPECIALS,
        template=LLAMA3_TEMPLATE,
    )
