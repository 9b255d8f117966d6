"""The model's loaders, installed from the layer above.

Reading a checkpoint needs the weight maps (`reward_lens.converters`), which are built on the model's own
config; so the loading code (`reward_lens.loading`) sits above both and installs its functions here when
`reward_lens` is imported. `from_pretrained` / `save_pretrained` call them through this table, and the
model never imports the loading code (no import cycle between the layers)."""

from __future__ import annotations

from typing import Any, Callable, Dict

_INSTALLED: Dict[str, Callable[..., Any]] = {}


def install(**functions: Callable[..., Any]) -> None:
    """Register loader functions by name (called once, by `reward_lens.loading`)."""
    _INSTALLED.update(functions)


def loader(name: str) -> Callable[..., Any]:
    """The installed loader `name`."""
    try:
        return _INSTALLED[name]
    except KeyError:
        raise RuntimeError(
            f"no loader {name!r} is installed: import reward_lens first (it installs reward_lens.loading)"
        ) from None
