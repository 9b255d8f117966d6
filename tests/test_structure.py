"""The package's shape: no import cycles between modules of `reward_lens` (imports inside functions
count too), and no module importing another module's private (underscore) name.

The graph is built from the source with `ast`, so it sees every import a module can ever run, not only
those executed by a test.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set, Tuple

import reward_lens

PACKAGE = Path(reward_lens.__file__).parent
ROOT = "reward_lens"


def module_files() -> Dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, path: Path, modules: Set[str]) -> List[Tuple[str, str]]:
    """(imported module, imported name or '') for every import statement in the file, at any depth."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    out: List[Tuple[str, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, "") for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = resolve(module, is_package, node)
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in modules:  # `from a import b` with b a submodule imports a.b
                    out.append((sub, ""))
                else:
                    out.append((target, alias.name))
    return [(m, n) for m, n in out if m == ROOT or m.startswith(ROOT + ".")]


def import_graph() -> Dict[str, Set[str]]:
    files = module_files()
    modules = set(files)
    graph: Dict[str, Set[str]] = {}
    for module, path in files.items():
        targets = set()
        for target, _ in imports_of(module, path, modules):
            # importing a.b.c runs a and a.b too; a package's __init__ is the package's public face,
            # so an edge to the module itself is what matters for cycles
            if target in modules and target != module:
                targets.add(target)
        graph[module] = targets
    return graph


def find_cycle(graph: Dict[str, Set[str]]) -> List[str]:
    """One cycle as a list of modules (first == last), or [] when the graph is acyclic."""
    WHITE, GREY, BLACK = 0, 1, 2
    color = {m: WHITE for m in graph}
    stack: List[str] = []

    def visit(m: str) -> List[str]:
        color[m] = GREY
        stack.append(m)
        for n in sorted(graph[m]):
            if color.get(n) == GREY:
                return stack[stack.index(n) :] + [n]
            if color.get(n) == WHITE:
                found = visit(n)
                if found:
                    return found
        stack.pop()
        color[m] = BLACK
        return []

    for m in sorted(graph):
        if color[m] == WHITE:
            found = visit(m)
            if found:
                return found
    return []


def test_import_graph_is_built_from_every_module():
    graph = import_graph()
    assert "reward_lens.model.native" in graph and "reward_lens.instruments.patching.contrastive" in graph
    # an in-function import is an edge too: the CLI imports the audit inside its command function
    assert "reward_lens.app.audit" in graph["reward_lens.app.cli"]


def test_no_import_cycles():
    # explicit edges only: a submodule importing the package root (or a package's __init__) that imports
    # it back is a cycle; the implicit import of parent packages is not counted
    cycle = find_cycle(import_graph())
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) == []


def test_no_private_names_imported_across_modules():
    files = module_files()
    modules = set(files)
    bad = []
    for module, path in files.items():
        for target, name in imports_of(module, path, modules):
            if name.startswith("_") and not name.startswith("__") and target != module:
                bad.append(f"{module} imports {target}.{name}")
            if any(part.startswith("_") for part in target.split(".")):
                bad.append(f"{module} imports private module {target}")
    assert not bad, "\n".join(bad)


# ---------------------------------------------------------------------------------------------------
# Layers: each top-level part of the package imports only from the layers below it (siblings in one layer
# not at all), so no two subpackages import each other.

LAYERS = [
    {"version", "data", "stats", "results", "plotting"},
    {"model"},
    {"converters"},
    {"loading"},
    {"core"},
    {"demo"},
    {"instruments", "representations", "theory", "evaluation"},
    {"probes"},
    {"distributed"},
    {"integrations"},
    {"app"},
    {"__main__", "__init__"},
]


def part_of(module: str) -> str:
    """The top-level part of the package a module belongs to ("__init__" for the package root)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def layer_of(part: str) -> int:
    for i, layer in enumerate(LAYERS):
        if part in layer:
            return i
    raise AssertionError(f"reward_lens.{part} is in no layer: add it to LAYERS in tests/test_structure.py")


def layer_violations(graph: Dict[str, Set[str]]) -> List[str]:
    bad = []
    for module, targets in graph.items():
        src = part_of(module)
        for target in targets:
            dst = part_of(target)
            if dst != src and target != ROOT and layer_of(dst) >= layer_of(src):
                bad.append(f"{module} ({src}) imports {target} ({dst}), which is not in a lower layer")
    return sorted(bad)


def test_layers_import_only_downwards():
    graph = import_graph()
    assert not layer_violations(graph), "\n".join(layer_violations(graph))


def test_layer_check_finds_a_back_edge():
    graph = {
        "reward_lens.model.native": {"reward_lens.loading.factory"},
        "reward_lens.loading.factory": set(),
    }
    assert layer_violations(graph) == [
        "reward_lens.model.native (model) imports reward_lens.loading.factory (loading), which is not in "
        "a lower layer"
    ]


def names_a_part(source: str, part: str) -> List[int]:
    """Lines where a source names `reward_lens.<part>`: in an import, a comment, a docstring, or a string a
    lookup could import by name (`importlib.import_module("reward_lens.loading")`, `".loading"`)."""
    import io
    import re
    import tokenize

    dotted = re.compile(rf"\breward_lens\.{part}\b")
    by_name = re.compile(rf"^(reward_lens)?\.?{part}(\.|$)")
    lines = {i for i, line in enumerate(source.splitlines(), 1) if dotted.search(line)}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.STRING:
            try:
                value = ast.literal_eval(tok.string)
            except (ValueError, SyntaxError):  # f-strings
                continue
            if isinstance(value, str) and by_name.match(value):
                lines.add(tok.start[0])
    return sorted(lines)


def test_nothing_below_loading_names_it():
    """The model, the weight maps and the shared modules never reach up into the loading layer, not even
    through a name looked up at run time: `from_pretrained` / `save_pretrained` live on the classes the
    loading layer defines (`reward_lens.loading.native`, `reward_lens.loading.generic`)."""
    below = {part for layer in LAYERS[: layer_of("loading")] for part in layer}
    offenders = [
        f"{name}:{line}"
        for name, path in module_files().items()
        if part_of(name) in below
        for line in names_a_part(path.read_text(), "loading")
    ]
    assert not offenders, offenders


def test_the_name_check_finds_a_lookup_by_string():
    hidden = (
        'import importlib\n\n\ndef loader():\n    return importlib.import_module("reward_lens.loading")\n'
    )
    assert names_a_part(hidden, "loading") == [5]
    assert names_a_part('mod = import_module(".loading", package="reward_lens")\n', "loading") == [1]
    assert names_a_part('"""Loads weights."""\nmessage = "loading the checkpoint failed"\n', "loading") == []


def test_the_model_layer_runs_without_the_loading_layer():
    """Importing every module below loading/ (in a fresh interpreter) imports nothing of loading/, and the
    public class still loads and saves: `reward_lens.HookedRewardModel.from_pretrained` needs no import
    of the loading layer first."""
    import subprocess
    import sys

    below = {part for layer in LAYERS[: layer_of("loading")] for part in layer}
    modules = sorted(name for name in module_files() if part_of(name) in below)
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('reward_lens.loading'))\n"
        "assert not loaded, loaded\n"
        "import reward_lens\n"
        "cls = reward_lens.HookedRewardModel\n"
        "assert callable(cls.from_pretrained) and callable(cls.save_pretrained)\n"
        "assert callable(reward_lens.GenericHookedRewardModel.from_pretrained)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PACKAGE.parent)
    assert result.returncode == 0, result.stderr[-2000:]


def test_no_compatibility_shims():
    """No old-path alias finder and no re-exports kept for old import paths."""
    assert not (PACKAGE / "_legacy.py").exists()
    offenders = [
        name
        for name, path in module_files().items()
        if "re-exported" in path.read_text()
        or "old home" in path.read_text()
        or "kept for one release" in path.read_text()
    ]
    assert not offenders, offenders


# ---------------------------------------------------------------------------------------------------
# Small units and one source of names.

MAX_FUNCTION_LINES = 80  # lines of code, the docstring excluded
MAX_MODULE_LINES = 600


def function_lengths(path: Path) -> List[Tuple[str, int]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            has_doc = (
                body
                and isinstance(body[0], ast.Expr)
                and isinstance(getattr(body[0], "value", None), ast.Constant)
                and isinstance(body[0].value.value, str)
            )
            start = body[0].end_lineno + 1 if has_doc and len(body) > 1 else node.lineno
            out.append((node.name, node.end_lineno - start + 1))
    return out


def test_small_units():
    too_long = []
    for name, path in module_files().items():
        n = path.read_text().count("\n")
        if n > MAX_MODULE_LINES:
            too_long.append(f"module {name}: {n} lines")
        too_long += [f"{name}.{fn}: {n} lines" for fn, n in function_lengths(path) if n > MAX_FUNCTION_LINES]
    assert not too_long, too_long


def test_hook_names_come_from_model_hooks():
    """No hand-built hook-name f-strings outside reward_lens/model/ (converters and loading build weight
    names)."""
    import re

    pattern = re.compile(r"""f["'](blocks\.\{|hook_|ln_final\.hook|reward_head\.hook)""")
    offenders = [
        f"{name}:{i}"
        for name, path in module_files().items()
        if not name.startswith(("reward_lens.model", "reward_lens.converters", "reward_lens.loading"))
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not offenders, offenders


def test_heads_are_asked_not_string_checked():
    """No `head_type ==` checks outside the heads: heads say what they are (is_gated, objectives, ...)."""
    offenders = [
        name
        for name, path in module_files().items()
        if not name.startswith("reward_lens.model.heads")
        and ("head_type ==" in path.read_text() or "head_type !=" in path.read_text())
    ]
    assert not offenders, offenders


# ---------------------------------------------------------------------------------------------------
# The model owns every way of running itself: instruments say what to read, substitute and reduce.

MODEL_ARITHMETIC = {
    "softmax": r"softmax",
    "rotary tables": r"\.rotary\b|apply_rotary",
    "attention scale": r"attn_scale",
    "sliding windows": r"window",
    "position ids": r"cumsum\(\s*-1\s*\)\s*-\s*1|position_ids",
    "soft-caps": r"soft_cap",
    "fused attention": r"scaled_dot_product_attention",
}


def code_only(source: str) -> str:
    """The source without comments and string literals (docstrings may describe what code must not do)."""
    import io
    import tokenize

    kept = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        skipped = (tokenize.COMMENT, tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", -1))
        if tok.type in skipped:
            continue
        kept.append(tok.string)
    return " ".join(kept)


def model_arithmetic(source: str) -> List[str]:
    """Which kinds of the model's own positional / attention arithmetic a source contains."""
    import re

    code = re.sub(r"\s*([().,\[\]-])\s*", r"\1", code_only(source))
    return [what for what, pattern in MODEL_ARITHMETIC.items() if re.search(pattern, code)]


def test_model_arithmetic_finder_catches_a_rebuilt_forward():
    # a readout step rebuilt in an instrument, as the patching fast paths once held it
    rebuilt = """
position_ids = (mask.long().cumsum(-1) - 1).clamp(min=0)
cos, sin = model.rotary(position_ids[rows, readout][:, None], cfg.dtype)  # RoPE at the readout
allowed = {w: before & (idx[None] > readout[:, None] - w) for w in set(cfg.window_sizes)}
scores = attn.soft_cap(torch.einsum("bpnh,btnh->bpnt", q, past_k) / cfg.attn_scale)
pattern = torch.softmax(scores.float(), -1)
"""
    assert set(model_arithmetic(rebuilt)) == set(MODEL_ARITHMETIC) - {"fused attention"}
    assert model_arithmetic('"""sliding windows and soft-caps live in the model"""\nx = 1  # softmax') == []


def test_no_model_arithmetic_outside_the_model():
    """No attention, softmax, rotary, window or position-id arithmetic outside reward_lens/model/
    (converters compute RoPE frequencies, and the exporter maps them back: weight maps): a new positional
    scheme or head type is a model change, never an instrument edit."""
    offenders = [
        f"{name}: {', '.join(found)}"
        for name, path in module_files().items()
        if not name.startswith(("reward_lens.model", "reward_lens.converters", "reward_lens.loading"))
        for found in [model_arithmetic(path.read_text())]
        if found
    ]
    assert not offenders, offenders


def test_progress_bars_are_tqdm_auto():
    """Progress bars come from tqdm.auto, so notebooks get widgets and terminals get text bars."""
    import re

    plain = re.compile(r"^\s*(from tqdm import|import tqdm\b|from tqdm\.std import)", re.M)
    offenders = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if plain.search(p.read_text())]
    assert not offenders, f"use `from tqdm.auto import tqdm` in {offenders}"


def unsafe_loads(source: str) -> List[int]:
    """Lines of `torch.load(...)` / `pickle.load(s)` calls: a torch.load must pass weights_only=True (torch
    >= 2.5 is allowed, where the default differs by version), a pickle is never loaded."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        owner = node.func.value.id if isinstance(node.func.value, ast.Name) else ""
        if owner == "pickle" and node.func.attr in ("load", "loads"):
            lines.append(node.lineno)
        if (
            owner == "torch"
            and node.func.attr == "load"
            and not any(
                k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                for k in node.keywords
            )
        ):
            lines.append(node.lineno)
    return lines


def test_no_pickle_is_loaded_that_could_run_code():
    bad = [
        f"{path.relative_to(PACKAGE.parent)}:{line}"
        for path in module_files().values()
        for line in unsafe_loads(path.read_text())
    ]
    assert not bad, f"torch.load without weights_only=True, or pickle.load: {bad}"


def test_the_unsafe_load_check_finds_a_bare_torch_load():
    assert unsafe_loads("import torch\ntorch.load('x')\ntorch.load('y', weights_only=True)\n") == [2]
    assert unsafe_loads("import pickle\npickle.loads(b'')\n") == [2]


MUTATORS = {"update", "extend", "append", "insert", "setdefault", "add"}


def tables_filled_from_outside(source: str, imported: Set[str]) -> List[int]:
    """Lines where module-level code fills a table it imported from another module (`TABLE.update(...)`,
    `TABLE[key] = ...`): a registry installed from elsewhere, which the import graph does not show."""
    lines = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            f = node.value.func
            if isinstance(f, ast.Attribute) and f.attr in MUTATORS and isinstance(f.value, ast.Name):
                if f.value.id in imported:
                    lines.append(node.lineno)
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and t.value.id in imported:
                    lines.append(node.lineno)
    return lines


def test_no_table_is_filled_from_another_module():
    """A registry lives with the module that owns it and is filled there (or by a module it imports), never
    by a module that imports it and writes into it at import time: that dependency would point the wrong
    way and hide from the import graph."""
    files = module_files()
    modules = set(files)
    bad = []
    for module, path in files.items():
        imported = {name for target, name in imports_of(module, path, modules) if name and target != module}
        bad += [
            f"{path.relative_to(PACKAGE.parent)}:{n}"
            for n in tables_filled_from_outside(path.read_text(), imported)
        ]
    assert not bad, f"module-level writes into another module's table: {bad}"


def test_the_table_check_finds_a_registration_from_above():
    source = (
        "from reward_lens.x import TABLE, other\n\nTABLE.update({'a': 1})\nTABLE['b'] = 2\n"
        "local = {}\nlocal['c'] = 3\n"
    )
    assert tables_filled_from_outside(source, {"TABLE", "other"}) == [3, 4]
