import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(1)  # tiny models: thread start-up costs more than it saves

from helpers import tiny_hf_model  # noqa: E402

from reward_lens import HookedRewardModel  # noqa: E402

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]


@pytest.fixture(scope="session")
def hf_models():
    return {arch: tiny_hf_model(arch) for arch in ARCHS}


@pytest.fixture(scope="session")
def llama_hf(hf_models):
    return hf_models["llama"]


@pytest.fixture(scope="session")
def llama_model(llama_hf):
    return HookedRewardModel.from_hf_model(llama_hf)


@pytest.fixture(autouse=True)
def close_figures():
    """Results' plot() makes pyplot figures (so notebooks show them); close them after each test."""
    yield
    if "matplotlib.pyplot" in sys.modules:
        sys.modules["matplotlib.pyplot"].close("all")


@pytest.fixture
def count_readout_sweeps(monkeypatch):
    """A list that grows by one per call of the patching engines' readout (KV-cache) sweep."""
    import reward_lens.instruments.patching.engines as engines

    calls = []
    original = engines.readout_sweep

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(engines, "readout_sweep", counted)
    return calls
