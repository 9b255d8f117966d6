"""Loading: checkpoints (directories, hub ids, OpenRLHF and PEFT-adapter layouts, GGUF files, models in
memory) read, checked and converted by the weight maps (`reward_lens.converters`) into hooked models; and
hooked models saved or exported back to transformers.

`checkpoint` (files -> config and weights), `checks` (named checkpoint damage), `streaming` (one block in
memory at a time), `factory` (native or generic), `generic` (the generic path's files), `inmemory`,
`peft_adapter`, `gguf`, `export`. This layer sits above the model and the converters and installs its
entry points into the model's loader table (`reward_lens.model.loaders`).
"""

from reward_lens.loading import checkpoint, factory, generic, streaming
from reward_lens.model.loaders import install

install(
    load_pretrained=factory.load_pretrained,
    from_hf_model=factory.from_hf_model,
    build_model=streaming.build_model,
    partitioned_source=streaming.partitioned_source,
    save_hooked=checkpoint.save_hooked,
    resolve_checkpoint_dir=checkpoint.resolve_checkpoint_dir,
    load_tokenizer=checkpoint.load_tokenizer,
    load_hf_config=checkpoint.load_hf_config,
    load_sequence_classifier=generic.load_sequence_classifier,
    saved_module_map=generic.saved_module_map,
    save_generic=generic.save_generic,
)
