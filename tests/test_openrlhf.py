"""OpenRLHF-layout reward checkpoints load as saved and match a reference forward written from OpenRLHF's
definition (openrlhf/models/model.py `_get_reward_model`): rewards within 1e-4 (fp32) on left-padded
batches built as OpenRLHF's reward dataset builds them (last token replaced by EOS, pad = EOS)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import one_thread, padded_batch, randomise_norms  # noqa: F401

from reward_lens import HookedRewardModel
from reward_lens.model.hooks import final_resid_name

EOS = 0  # pad = EOS, as for Llama-3-style tokenizers: the case where transformers' readout is one token early
MEAN, STD = 0.37, 1.9


def base_decoder(seed: int = 0):
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        pad_token_id=EOS,
        eos_token_id=EOS,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaModel(cfg).eval()
    randomise_norms(model, seed)
    head = torch.randn(1, cfg.hidden_size, generator=torch.Generator().manual_seed(seed + 1)) * 0.5
    return model, head


def save_openrlhf(
    directory, model, head, *, head_prefix="value_head", architecture="RewardModel", normalize=True, **extra
):
    """The files OpenRLHF's save_pretrained writes: base decoder under "model.", bias-free head, no
    num_labels."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    sd = {f"model.{k}": v.contiguous() for k, v in model.state_dict().items()}
    sd[f"{head_prefix}.weight"] = head.contiguous()
    save_file(sd, str(directory / "model.safetensors"))
    config = model.config.to_dict()
    for key in ("num_labels", "id2label", "label2id"):
        config.pop(key, None)
    config.update(architectures=[architecture], normalize_reward=normalize, mean=[MEAN], std=STD, **extra)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@torch.no_grad()
def openrlhf_reference(model, head, ids, mask, normalize=True):
    """OpenRLHF's RewardModel.forward in eval mode, written from its definition."""
    position_ids = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)
    hidden = model(input_ids=ids, attention_mask=mask, position_ids=position_ids).last_hidden_state
    values = (hidden @ head.T).squeeze(-1)
    eos_indices = mask.shape[1] - 1 - mask.long().fliplr().argmax(dim=1, keepdim=True)
    reward = values.gather(dim=1, index=eos_indices).squeeze(1)
    return (reward - MEAN) / STD if normalize else reward


def openrlhf_batch(lengths=(5, 9, 3, 7), seed=0):
    """Left-padded with pad id EOS, each row's last token replaced by EOS (OpenRLHF's dataset + collate)."""
    ids, mask = padded_batch(lengths, "left", pad=EOS, seed=seed)
    ids[:, -1] = EOS
    return ids, mask


@pytest.mark.parametrize(
    "head_prefix,architecture,normalize",
    [
        ("value_head", "RewardModel", True),  # older releases
        ("score", "RewardModel", True),  # newer releases
        ("value_head", "LLMForSequenceRegression", False),
    ],
)
def test_openrlhf_checkpoint_matches_reference(tmp_path, head_prefix, architecture, normalize):
    model, head = base_decoder()
    path = save_openrlhf(
        tmp_path / "rm", model, head, head_prefix=head_prefix, architecture=architecture, normalize=normalize
    )
    hooked = HookedRewardModel.from_pretrained(path)
    assert hooked.cfg.readout == "last_attended" and hooked.cfg.input_format == "openrlhf"
    assert hooked.cfg.n_outputs == 1
    ids, mask = openrlhf_batch()
    ref = openrlhf_reference(model, head, ids, mask, normalize)
    rewards = hooked(ids, attention_mask=mask)
    assert (rewards - ref).abs().max() < 1e-4
    # Unpadded, one at a time: the same rewards (left padding and OpenRLHF's position ids are exact).
    for b in range(ids.shape[0]):
        row = ids[b, mask[b].bool()][None]
        assert (hooked(row) - ref[b]).abs().max() < 1e-4
    # transformers' rule (rightmost non-pad) reads one token before the EOS: measurably different.
    wrong = HookedRewardModel.from_pretrained(path, readout="last_non_pad")(ids, attention_mask=mask)
    assert (wrong - ref).abs().max() > 1e-3


def test_normalisation_is_folded_exactly_and_decomposes(tmp_path):
    model, head = base_decoder(seed=3)
    path = save_openrlhf(tmp_path / "rm", model, head)
    hooked = HookedRewardModel.from_pretrained(path)
    raw = HookedRewardModel.from_pretrained(save_openrlhf(tmp_path / "raw", model, head, normalize=False))
    ids, mask = openrlhf_batch(seed=1)
    r, r_raw = hooked(ids, attention_mask=mask), raw(ids, attention_mask=mask)
    assert (r - (r_raw - MEAN) / STD).abs().max() < 1e-5
    assert abs(hooked.reward_bias.item() + MEAN / STD) < 1e-6
    # reward = w . resid_final[readout] / scale + b, read at the last attended token.
    readout = hooked.readout_positions(ids, mask)
    assert torch.equal(readout, torch.full_like(readout, ids.shape[1] - 1))
    _, cache = hooked.run_with_cache(ids, attention_mask=mask)
    rows = torch.arange(ids.shape[0])
    resid = cache[final_resid_name(hooked.cfg.n_layers)][rows, readout]
    scale = cache["ln_final.hook_scale"][rows, readout]
    assert ((resid / scale) @ hooked.reward_direction + hooked.reward_bias - r).abs().max() < 1e-5


def test_saved_hooked_checkpoint_keeps_the_readout(tmp_path):
    model, head = base_decoder(seed=5)
    hooked = HookedRewardModel.from_pretrained(
        save_openrlhf(tmp_path / "rm", model, head, head_prefix="score")
    )
    hooked.save_pretrained(tmp_path / "hooked")
    again = HookedRewardModel.from_pretrained(tmp_path / "hooked")
    assert again.cfg.readout == "last_attended" and again.cfg.input_format == "openrlhf"
    ids, mask = openrlhf_batch(seed=2)
    assert (again(ids, attention_mask=mask) - hooked(ids, attention_mask=mask)).abs().max() < 1e-6


def test_clear_errors(tmp_path):
    model, head = base_decoder()
    unknown = save_openrlhf(tmp_path / "unknown", model, head, architecture="MyRewardThing")
    with pytest.raises(ValueError, match="OpenRLHF"):
        HookedRewardModel.from_pretrained(unknown)
    # Hand-edited to transformers' class name, OpenRLHF's head left as it was: no raw KeyError.
    edited = save_openrlhf(tmp_path / "edited", model, head, architecture="LlamaForSequenceClassification")
    with pytest.raises(ValueError, match="value_head.weight.*RewardModel"):
        HookedRewardModel.from_pretrained(edited)
    # Relabelled, head renamed, no num_labels: transformers' default of 2 labels is named, no raw size
    # mismatch.
    relabelled = save_openrlhf(
        tmp_path / "relabelled",
        model,
        head,
        head_prefix="score",
        architecture="LlamaForSequenceClassification",
    )
    with pytest.raises(ValueError, match="num_labels=2 but the head has 1 output.*fix num_labels"):
        HookedRewardModel.from_pretrained(relabelled)
    # ... and with num_labels added too: it loads (as labelled: transformers' readout), but not silently.
    relabelled = save_openrlhf(
        tmp_path / "relabelled1",
        model,
        head,
        head_prefix="score",
        architecture="LlamaForSequenceClassification",
        num_labels=1,
    )
    with pytest.warns(UserWarning, match="normalize_reward.*RewardModel"):
        HookedRewardModel.from_pretrained(relabelled)
    with pytest.raises(ValueError, match="unknown readout"):
        HookedRewardModel.from_pretrained(save_openrlhf(tmp_path / "ok", model, head), readout="first")


def test_instruments_read_where_openrlhf_reads(tmp_path):
    """Token pairs ending with EOS (= pad): instruments batch them (no 'ends with the pad id' refusal),
    read at the last attended token, and the attribution sums to OpenRLHF's reward."""
    from helpers import token_pairs

    from reward_lens import instruments as ins
    from reward_lens.data.pairs import TokenPair

    model, head = base_decoder(seed=7)
    hooked = HookedRewardModel.from_pretrained(save_openrlhf(tmp_path / "rm", model, head))
    pairs = [
        TokenPair(
            torch.cat([p.chosen, torch.tensor([EOS])]), torch.cat([p.rejected, torch.tensor([EOS])]), id=p.id
        )
        for p in token_pairs([(3, 5), (4, 2), (6, 6)], seed=4)
    ]
    attr = ins.attribute(hooked, pairs, batch_size=2, padding_side="left")
    for side in ("chosen", "rejected"):
        rows = [getattr(p, side) for p in pairs]
        ref = torch.stack(
            [openrlhf_reference(model, head, r[None], torch.ones_like(r)[None])[0] for r in rows]
        )
        assert (getattr(attr, f"reward_{side}") - ref).abs().max() < 1e-4
    assert attr.max_relative_error() < 1e-5
    div = ins.divergence_patch(hooked, pairs, batch_size=2, padding_side="left")
    assert div.flagged.shape == (len(pairs), len(div.patching.sites))
