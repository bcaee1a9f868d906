"""The layering of docs/design.md §2 holds without exception: dependencies point
`ops → cluster → workers → attention`, read from every import statement of every module
(function-level imports included), and every reference to a section of the design document
names a section that exists."""

import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYERS = ["attention", "workers", "cluster", "ops"]  # each may import only the ones before it
DESIGN = os.path.join(ROOT, "docs", "design.md")


def _modules():
    for layer in LAYERS:
        for folder, _, files in os.walk(os.path.join(ROOT, layer)):
            for name in files:
                if name.endswith(".py"):
                    yield layer, os.path.join(folder, name)


def _imported_packages(path: str) -> set[str]:
    tree = ast.parse(open(path).read(), path)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_imports_point_down_the_layers():
    wrong = []
    for layer, path in _modules():
        allowed = set(LAYERS[: LAYERS.index(layer) + 1])
        for package in _imported_packages(path) & set(LAYERS):
            if package not in allowed:
                wrong.append(f"{os.path.relpath(path, ROOT)} imports {package}")
    assert not wrong, "\n".join(wrong)


def _sections() -> set[str]:
    return {m.group(1) for m in re.finditer(r"^#+ (\d+(?:\.\d+)*)\.? ", open(DESIGN).read(), re.M)}


def _texts():
    for folder in LAYERS + ["tests", "docs"]:
        for base, _, files in os.walk(os.path.join(ROOT, folder)):
            for name in files:
                if name.endswith((".py", ".md", ".yaml")):
                    path = os.path.join(base, name)
                    yield os.path.relpath(path, ROOT), open(path, errors="replace").read()
    yield "README.md", open(os.path.join(ROOT, "README.md")).read()


def _references():
    pattern = re.compile(r"design\.md §(\d+(?:\.\d+)*)", re.I)
    for path, text in _texts():
        for match in pattern.finditer(text):
            yield path, match.group(1)


def test_every_design_reference_names_a_section_that_exists():
    sections = _sections()
    refs = list(_references())
    assert refs, "the code should point readers at the design document"
    missing = [f"{path}: §{number}" for path, number in refs if number not in sections]
    assert not missing, f"sections {sorted(sections)}; missing: {missing}"
    old = "DESIGN" + ".md"  # the name of a design file outside the repository
    assert not [path for path, text in _texts() if old in text], f"references to {old}"


def test_the_invariants_name_their_upstream_failures_and_tests():
    text = open(DESIGN).read()
    for pr in ("#25103", "#26966", "#24856", "#24138", "#26152"):
        assert pr in text
    for test in re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", text):
        path, name = test
        assert f"def {name}(" in open(os.path.join(ROOT, path)).read(), f"{path}::{name} named in the design"


def test_the_engine_imports_no_model_loading_machinery():
    """Every engine process (each Ray rank) imports the engine: transformers' activation table
    would bring its model-loading and distributed-tensor modules (seconds of CPU a process) for
    functions torch has."""
    import subprocess
    import sys

    heavy = ("transformers.activations", "torch.distributed.tensor")
    code = f"import sys, workers.engine; print(sorted(m for m in sys.modules if m.startswith({heavy!r})))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_the_front_door_processes_load_no_torch():
    """The ingress and the replica deployment only talk to ranks: their modules, and loading a
    shipped model's tokenizer as they do, bring in no torch (seconds of CPU in each process a
    deploy starts)."""
    import subprocess
    import sys

    code = (
        "import sys, cluster.ingress, cluster.replica; from workers.tokenizer import load_tokenizer; "
        "from ops import DEFAULT_MODEL; load_tokenizer(DEFAULT_MODEL); "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('workers.models')))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
