"""The model's loaders, installed from the layer above.

Reading a checkpoint needs the weight maps (`reward_lens.converters`), which are built on the model's own
config; so the loading code (`reward_lens.loading`) sits above both and installs its functions here when it is
imported: by the public API (`reward_lens.HookedRewardModel`, ...) or, for code that imported only the model's
module, by name on the first lookup here. `from_pretrained` / `save_pretrained` call them through this table;
the model has no import statement of the loading code (no import cycle between the layers)."""

from __future__ import annotations

import importlib
from typing import Any, Callable, Dict

_INSTALLED: Dict[str, Callable[..., Any]] = {}


def install(**functions: Callable[..., Any]) -> None:
    """Register loader functions by name (called once, by `reward_lens.loading`)."""
    _INSTALLED.update(functions)


def loader(name: str) -> Callable[..., Any]:
    """The installed loader `name`."""
    if not _INSTALLED:
        importlib.import_module("reward_lens.loading")  # installs them (see the module docstring)
    try:
        return _INSTALLED[name]
    except KeyError:
        raise RuntimeError(
            f"no loader {name!r} is installed: import reward_lens first (it installs reward_lens.loading)"
        ) from None
