"""`train_transcoders` in a joined process group (run by tests/test_transcoders_distributed.py):

python -m torch.distributed.run --nproc_per_node 2 tests/torchrun_transcoders.py OUT.pt

Trains the settings of `SETTINGS` (TopK and BatchTopK, AuxK active, the buffer refilled at step 32, text
batches of 8 so each buffer holds several ranks' rows) on every rank; rank 0 saves each set's
state dict, its training curves and how many text batches each rank ran the model on."""

import sys

import torch

import reward_lens as rl
from reward_lens.core.ranks import Ranks
from reward_lens.demo import synthetic
from reward_lens.representations.transcoders import train as train_module

TEXTS = dict(n=120, seed=7)
SETTINGS = dict(
    d_tc=256,
    k=4,
    layers=[0, 2],
    steps=40,
    batch_size=128,
    buffer_tokens=1024,
    dead_after=100,
    model_batch_size=8,
)


def texts():
    return synthetic.training_pairs(TEXTS["n"], TEXTS["seed"], exclude=synthetic.held_out_pairs(1))


def train(model, kind):
    return rl.train_transcoders(model, texts(), kind=kind, progress=False, **SETTINGS)


def state(tc):
    return {f"{l}.{k}": v.clone() for l in tc.layers for k, v in tc[l].state_dict().items()}


if __name__ == "__main__":
    torch.set_num_threads(1)
    ranks = Ranks.from_env()
    calls = [0]
    run_model = train_module.mlp_io

    def counted(*args, **kwargs):
        calls[0] += 1
        return run_model(*args, **kwargs)

    train_module.mlp_io = counted
    model = rl.load_demo_model(device="cpu")
    out = {}
    for kind in ("topk", "batchtopk"):
        tc = train(model, kind)
        out[kind] = {"state": state(tc), "history": tc.metrics.history, "config": tc.config}
    out["model_batches"] = ranks.all_gather(calls[0])
    if ranks.is_main:
        torch.save(out, sys.argv[1])
