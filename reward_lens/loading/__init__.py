"""Loading: checkpoints (directories, hub ids, OpenRLHF and PEFT-adapter layouts, GGUF files, models in
memory) read, checked and converted by the weight maps (`reward_lens.converters`) into hooked models; and
hooked models saved or exported back to transformers.

`native` (`HookedRewardModel`: the native model with its `from_pretrained` / `save_pretrained`, and the
choice of native or generic), `generic` (the generic path's files and `GenericHookedRewardModel`),
`checkpoint` (files -> config and weights), `checks` (named checkpoint damage), `streaming` (one block in
memory at a time), `inmemory`, `peft_adapter`, `gguf`, `export`, `judge`. This layer sits above the model
and the converters: the public model classes are the model layer's classes with the I/O added here, so
every dependency points down.
"""
