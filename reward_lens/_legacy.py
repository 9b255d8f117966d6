"""Old deep module paths (before the `model/ core/ instruments/ representations/ app/` layout) kept importable
for one release: `import reward_lens.runner` gives the very module `reward_lens.core.readout`, private names
and monkeypatching included. New code imports the new paths."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

MOVED = {
    "reward_lens.config": "reward_lens.model.config",
    "reward_lens.components": "reward_lens.model.components",
    "reward_lens.heads": "reward_lens.model.heads.scalar",
    "reward_lens.armorm": "reward_lens.model.heads.armorm",
    "reward_lens.loading": "reward_lens.model.loading",
    "reward_lens.tokenization": "reward_lens.model.tokenization",
    "reward_lens.generic": "reward_lens.model.generic.wrapper",
    "reward_lens.runner": "reward_lens.core.readout",
    "reward_lens.instruments._common": "reward_lens.instruments.sites",
    "reward_lens.instruments.attribution_patching": "reward_lens.instruments.patching.atp",
    "reward_lens.sae": "reward_lens.representations.sae",
    "reward_lens.features": "reward_lens.representations.features",
    "reward_lens.concepts": "reward_lens.representations.concepts",
    "reward_lens.editing": "reward_lens.representations.editing",
    "reward_lens.theory._stats": "reward_lens.stats",
    "reward_lens.compare": "reward_lens.instruments.compare",
    "reward_lens.audit": "reward_lens.app.audit",
    "reward_lens.report": "reward_lens.app.report",
    "reward_lens.cli": "reward_lens.app.cli",
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname in MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module):  # the target module is already executed; its attributes stay its own
        pass


def install() -> None:
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.append(_Alias())
