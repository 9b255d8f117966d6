"""What the forward-equivalent benchmarks (`edge_attribution.py`, `patching_sweep.py`, `forward_overhead.py`)
share: their command-line sizes, the random-init Llama reward model they time, a pair of random token ids
sharing a prompt, and interleaved timing (so a method and the forward it is measured in share the
machine's load)."""

import argparse
import statistics
import time
from typing import Callable, List, Sequence, Tuple

import torch
import transformers


def size_args(ap: argparse.ArgumentParser, *, layers: int, d_model: int, seq: int, repeats: int) -> None:
    """--layers, --d-model, --seq, --repeats with these defaults."""
    ap.add_argument("--layers", type=int, default=layers)
    ap.add_argument("--d-model", type=int, default=d_model)
    ap.add_argument("--seq", type=int, default=seq)
    ap.add_argument("--repeats", type=int, default=repeats)


def random_llama(layers: int, d_model: int) -> transformers.LlamaForSequenceClassification:
    """A random-init Llama reward model in eval mode: heads of 64, half as many KV heads, MLP 4 x d_model,
    a 32000-token vocabulary (seed torch first)."""
    cfg = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=d_model,
        intermediate_size=4 * d_model,
        num_hidden_layers=layers,
        num_attention_heads=d_model // 64,
        num_key_value_heads=d_model // 128,
        num_labels=1,
        pad_token_id=0,
        max_position_embeddings=4096,
    )
    return transformers.LlamaForSequenceClassification(cfg).eval()


def random_pair(vocab_size: int, seq: int, aligned: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) random ids: chosen has `seq` tokens, its first half the prompt; rejected is the
    prompt and a response 16 tokens shorter, or with `aligned` chosen with its last 16 tokens replaced
    (token-aligned, for circuits at every position)."""
    prompt = torch.randint(1, vocab_size, (seq // 2,))
    chosen = torch.cat([prompt, torch.randint(1, vocab_size, (seq - len(prompt),))])
    if aligned:
        return chosen, torch.cat([chosen[:-16], torch.randint(1, vocab_size, (16,))])
    return chosen, torch.cat([prompt, torch.randint(1, vocab_size, (seq - 16 - len(prompt),))])


def no_grad_forward(model: Callable, *inputs, **options) -> Callable[[], torch.Tensor]:
    """The forward a method's cost is measured in (no gradients)."""

    def forward():
        with torch.no_grad():
            return model(*inputs, **options)

    return forward


def timed(fns: Sequence[Callable[[], object]], repeats: int) -> List[Tuple[float, float]]:
    """Min and median wall time (seconds) of each function, calls interleaved so that they share the
    machine's load (callers warm up first)."""
    times: List[List[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, t in zip(fns, times):
            start = time.perf_counter()
            fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            t.append(time.perf_counter() - start)
    return [(min(t), statistics.median(t)) for t in times]
