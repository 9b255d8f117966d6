"""The nnsight side of tests/test_nnsight.py: reward model numbers as a researcher writes them in nnsight.

Run in its own interpreter (`python tests/nnsight_reference.py CASES OUT`), because importing nnsight
patches `torch.Tensor.backward` and mounts `.save()` on every Python object for the rest of the process;
the test session must not run under those patches. No reward_lens import: these numbers are independent.

CASES (torch.save): {"checkpoints": {arch: dir}, "patch_layer": l, "cases": {case: {"chosen": (ids, mask),
"rejected": (ids, mask)}}}, mask None for an unbatched row. OUT: {arch: {wrapper: {case: {"reward",
"readout", "resid", "attn", "mlp", "patched"}}}}, activations [n_layers, batch, d_model] at the readout.
Each checkpoint is wrapped twice: `NNsight(hf_model)` and `TransformersModel(dir, task=...)`.
"""

from __future__ import annotations

import sys
import warnings

import torch
from nnsight import NNsight, TransformersModel
from transformers import AutoModelForSequenceClassification


def hf_readout(ids: torch.Tensor, pad_token_id) -> torch.Tensor:
    """transformers' `*ForSequenceClassification` pooling: the rightmost token that is not the pad id."""
    if pad_token_id is None:
        return torch.full((ids.shape[0],), ids.shape[1] - 1)
    return (torch.arange(ids.shape[1]) * (ids != pad_token_id)).argmax(-1)


def forward_kwargs(mask) -> dict:
    """What a researcher passes: the mask (position ids left to transformers; RoPE sees only relative
    positions, so a left-padded row computes as the unpadded one)."""
    return {} if mask is None else {"attention_mask": mask}


def component_modules(layer):
    """What a block adds to the residual: Gemma-2 adds its post-norms' outputs (there
    `post_attention_layernorm` is the attention's post-norm; in Llama it is the norm before the MLP)."""
    if hasattr(layer, "post_feedforward_layernorm"):
        return layer.post_attention_layernorm, layer.post_feedforward_layernorm
    return layer.self_attn, layer.mlp


def first(value):
    return value[0] if isinstance(value, tuple) else value


def readout_run(nn_model, ids, mask):
    """The reward and, at the readout, every layer's attention output, MLP output and residual."""
    readout = hf_readout(ids, nn_model.config.pad_token_id)
    rows = torch.arange(ids.shape[0])
    with torch.no_grad():
        with nn_model.trace(ids, **forward_kwargs(mask)):
            attn, mlp, resid = [].save(), [].save(), [].save()
            for layer in nn_model.model.layers:
                attn_module, mlp_module = component_modules(layer)
                attn.append(first(attn_module.output)[rows, readout])
                mlp.append(mlp_module.output[rows, readout])
                resid.append(layer.output[rows, readout])
            reward = nn_model.output.logits[:, 0].save()
    return {
        "reward": reward,
        "readout": readout,
        "attn": torch.stack(attn),
        "mlp": torch.stack(mlp),
        "resid": torch.stack(resid),
    }


def patched_reward(nn_model, chosen, rejected, layer: int) -> torch.Tensor:
    """Noising: the chosen run with block `layer`'s input (resid_pre) at its readout replaced by the
    rejected run's resid_pre at the rejected readout."""
    (ids_c, mask_c), (ids_r, mask_r) = chosen, rejected
    pad = nn_model.config.pad_token_id
    rows = torch.arange(ids_c.shape[0])
    with torch.no_grad():
        with nn_model.trace(ids_r, **forward_kwargs(mask_r)):
            source = nn_model.model.layers[layer].input[rows, hf_readout(ids_r, pad)].save()
        with nn_model.trace(ids_c, **forward_kwargs(mask_c)):
            nn_model.model.layers[layer].input[rows, hf_readout(ids_c, pad)] = source
            patched = nn_model.output.logits[:, 0].save()
    return patched


def wrappers(directory: str):
    yield "NNsight", NNsight(AutoModelForSequenceClassification.from_pretrained(directory).eval())
    yield "TransformersModel", TransformersModel(directory, task="text-classification", dispatch=True)


def main(cases_path: str, out_path: str) -> None:
    torch.set_num_threads(1)
    spec = torch.load(cases_path)
    out = {}
    for arch, directory in spec["checkpoints"].items():
        out[arch] = {}
        for name, nn_model in wrappers(directory):
            nn_model._module.eval()
            runs = {}
            for case, sides in spec["cases"].items():
                runs[case] = readout_run(nn_model, *sides["chosen"])
                runs[case]["patched"] = patched_reward(
                    nn_model, sides["chosen"], sides["rejected"], spec["patch_layer"]
                )
            out[arch][name] = runs
    torch.save(out, out_path)


if __name__ == "__main__":
    warnings.simplefilter("ignore")  # transformers' and nnsight's load-time notices
    main(*sys.argv[1:3])
