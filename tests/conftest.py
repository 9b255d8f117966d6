import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(1)  # tiny models: thread start-up costs more than it saves

from helpers import tiny_hf_model  # noqa: E402

from reward_lens import HookedRewardModel  # noqa: E402

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]

# The slow part of the suite, run by `python -m pytest -q --full` (and CI): the real-weights SmolLM2 tests
# (a 20 s dequantisation, then 30-layer forwards), the notebooks, torchrun, TRL training runs, the bench and
# the scripts that train or convert models. The default selection checks every instrument on tiny and demo
# models in a few minutes on 2 cores.
SLOW_MODULES = {
    "test_smollm2",
    "test_circuits_smollm2",
    "test_notebooks",
    "test_distributed",
    "test_transcoders_distributed",
    "test_trl_integration",
    "test_bench",
    "test_tl_tutorial",
    "test_tl_tutorials_padded",
    "test_trained_models",
    "test_conversion_scripts",
    "test_gpu_audit_benchmark",
    "test_rl_hack",
}
SLOW_FIXTURES = {"smol", "backbone", "testbed", "smollm2_judge"}  # tests elsewhere on SmolLM2's weights


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true", help="run the whole suite (default: the fast selection)")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: part of the full suite only (`pytest --full`)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1] if item.module else ""
        on_smollm2 = "smollm2" in item.name.lower() or SLOW_FIXTURES & set(getattr(item, "fixturenames", ()))
        if module in SLOW_MODULES or on_smollm2:
            item.add_marker(pytest.mark.slow)
    if config.getoption("--full") or config.getoption("-m"):  # an explicit -m selects by itself
        return
    fast = [item for item in items if "slow" not in item.keywords]
    if len(fast) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if "slow" in item.keywords])
        items[:] = fast


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
