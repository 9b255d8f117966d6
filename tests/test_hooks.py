"""model/hooks.py, the one source of hook names, checked against the hooks a real model has and the
shapes its cache holds."""

import pytest
import torch

from reward_lens.model import hooks


def test_every_hook_of_the_model_round_trips(llama_model):
    for name in llama_model.hook_dict:
        kind, layer = hooks.kind_of(name), hooks.layer_of(name)
        if kind in ("scale", "normalized"):
            norm = name.split(".")[2] if layer is not None else None
            assert hooks.act_name(kind, layer, norm=norm) == name
        elif kind.startswith("final_"):
            assert hooks.act_name(kind) == name
        else:
            assert hooks.act_name(kind, layer) == name, name


def test_widths_and_query_axes_match_the_cache(llama_model):
    cfg = llama_model.cfg
    ids = torch.randint(1, cfg.d_vocab, (2, 7))
    _, cache = llama_model.run_with_cache(ids)
    for name, act in cache.items():
        width = hooks.hook_width(cfg, name)
        if width is not None:
            assert act.shape[-1] == width, name
        assert act.shape[hooks.query_axis(name)] == 7 or act.dim() < 3, name
        assert hooks.is_per_head(name) == (act.dim() == 4 and ".attn." in name), name


def test_names_and_errors():
    assert hooks.act_name("resid_pre", 3) == "blocks.3.hook_resid_pre"
    assert hooks.act_name("z", 1) == "blocks.1.attn.hook_z"
    assert hooks.act_name("post", 0) == "blocks.0.mlp.hook_post"
    assert hooks.act_name("scale", 2, norm="ln1") == "blocks.2.ln1.hook_scale"
    assert hooks.act_name("scale") == "ln_final.hook_scale"
    assert hooks.act_name("gate") == "reward_head.hook_gate"
    assert hooks.resid_entering(4, 4) == "blocks.3.hook_resid_post"
    assert hooks.stop_layer("hook_embed") == 0 and hooks.stop_layer("blocks.2.attn.hook_z") == 3
    assert hooks.stop_layer("reward_head.hook_pooled") is None
    with pytest.raises(ValueError, match="needs a layer"):
        hooks.act_name("resid_pre")
    with pytest.raises(ValueError, match="not a reward-lens hook name"):
        hooks.kind_of("nonsense.name")


def test_resetting_hooks_matches_hooked_root_module(llama_model):
    """The model resets only hook points that hold a hook; what remains after each reset (temporary vs
    permanent, forward vs backward, by level) and the cleared contexts equal TransformerLens's own
    `HookedRootModule` methods on the same hooks."""
    from transformer_lens import HookedRootModule

    def noop(t, hook):
        return None

    def state():
        return {
            n: ([h.hook.id for h in hp.fwd_hooks], [h.hook.id for h in hp.bwd_hooks], dict(hp.ctx))
            for n, hp in llama_model.hook_dict.items()
        }

    cases = [dict(), dict(including_permanent=True), dict(direction="fwd"), dict(level=1)]
    for kw in cases:
        got = {}
        for impl in ("ours", "tl"):
            llama_model.reset_hooks(including_permanent=True)
            llama_model.add_hook("blocks.0.hook_resid_pre", noop)
            llama_model.add_hook("blocks.1.hook_attn_out", noop, is_permanent=True)
            llama_model.add_hook("blocks.1.hook_mlp_out", noop, dir="bwd")
            llama_model.add_hook("hook_embed", noop, level=1)
            llama_model.hook_dict["blocks.0.hook_resid_post"].ctx["kept"] = 1
            if impl == "ours":
                llama_model.remove_all_hook_fns(**kw)
                llama_model.clear_contexts()
            else:
                HookedRootModule.remove_all_hook_fns(llama_model, **kw)
                HookedRootModule.clear_contexts(llama_model)
            got[impl] = {n: (len(f), len(b), c) for n, (f, b, c) in state().items()}
        assert got["ours"] == got["tl"], kw
        assert sum(f + b for f, b, _ in got["ours"].values()) < 4  # something was removed
    llama_model.reset_hooks(including_permanent=True)
    assert all(not (hp.fwd_hooks or hp.bwd_hooks) for hp in llama_model.hook_dict.values())
