"""What watching the reward model costs a TRL GRPO run: step time with a plain reward function, with
`RewardLensReward` (attribution from the scoring forward) and with it plus `RewardLensCallback`.

Setting: CPU, one thread, a random-init LlamaForCausalLM policy (the demo tokenizer, so completions decode
to text), the demo reward model, GRPO with `--batch` completions per step. Prints the mean step time of each
run, the reward function's and the callback's overhead as fractions of the plain step time, and the cost of
one check. The policy here is tiny, so these fractions are upper bounds for real runs, where generation and
the policy update dominate a step and the reward model's share shrinks.
Run: python benchmarks/trl_overhead.py [--hidden 256 --layers 4 --completion 48 --batch 32 --steps 30 --every
10]
"""

import argparse
import tempfile
import time

import torch


def run(kind, args, rm):
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from reward_lens.integrations.trl import RewardLensReward, watch
    from reward_lens.probes.suite import demo_probe_items

    tok = rm.tokenizer
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )
    policy = LlamaForCausalLM(cfg)

    def plain(prompts, completions, **kwargs):
        batch = rm.to_tokens(prompts, completions)
        with torch.no_grad():
            return rm(batch["input_ids"], attention_mask=batch["attention_mask"]).tolist()

    reward_fn = plain if kind == "plain" else RewardLensReward(rm, batch_size=32)
    out = tempfile.mkdtemp()
    conf = GRPOConfig(
        output_dir=out,
        per_device_train_batch_size=args.batch,
        num_generations=4,
        max_completion_length=args.completion,
        max_steps=args.steps,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
    )
    data = Dataset.from_list([{"prompt": it.prompt} for it in demo_probe_items()])
    trainer = GRPOTrainer(
        model=policy, reward_funcs=reward_fn, args=conf, train_dataset=data, processing_class=tok
    )
    callback = None
    if kind == "callback":
        callback = watch(
            trainer, reward_fn, every=args.every, sample_size=32, log_path=f"{out}/monitor.jsonl"
        )
    start = time.perf_counter()
    trainer.train()
    step = (time.perf_counter() - start) / args.steps
    checks = [r["cost_s"] for r in callback.records] if callback else []
    return step, checks


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--completion", type=int, default=48)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from reward_lens import load_demo_model

    rm = load_demo_model()
    plain, _ = run("plain", args, rm)
    lens, _ = run("reward", args, rm)
    watched, checks = run("callback", args, rm)
    print(
        f"step time: plain reward fn {plain:.3f} s | RewardLensReward {lens:.3f} s | + callback (every "
        f"{args.every}) {watched:.3f} s"
    )
    print(
        f"overhead vs plain: reward fn {100 * (lens - plain) / plain:+.1f}% | reward fn + callback "
        f"{100 * (watched - plain) / plain:+.1f}%"
    )
    if checks:
        print(
            f"one check: baseline {checks[0]:.2f} s, later {sum(checks[1:]) / max(1, len(checks) - 1):.2f} "
            f"s = {sum(checks[1:]) / max(1, len(checks) - 1) / plain:.1f} plain steps"
        )


if __name__ == "__main__":
    main()
