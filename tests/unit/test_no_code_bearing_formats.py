"""No format that can carry code is read or written by the services: JSON and safetensors only.

A pickle (``torch.load`` without ``weights_only``, ``numpy.load(allow_pickle=True)``, PyYAML's
full loader) runs whatever the file's author put in it; a checkpoint, a trajectory or a policy
pointer read from a shared disk or Redis must not. This reads the source of every package the
services are made of and names each call or import that could.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ["services", "env_server", "rollout_server", "trainer", "deploy"]
CODE_BEARING_MODULES = {"pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve", "joblib"}


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((kw.value for kw in call.keywords if kw.arg == name), None)


def _is_true(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def problems_in(source: str, where: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            found += [
                f"{where}:{node.lineno}: imports {n}"
                for n in names
                if n.split(".")[0] in CODE_BEARING_MODULES
            ]
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        owner = node.func.value.id if isinstance(node.func.value, ast.Name) else ""
        name = f"{owner}.{node.func.attr}"
        if name == "torch.load" and not _is_true(_keyword(node, "weights_only")):
            found.append(f"{where}:{node.lineno}: torch.load without weights_only=True")
        if name in ("np.load", "numpy.load") and _is_true(_keyword(node, "allow_pickle")):
            found.append(f"{where}:{node.lineno}: numpy.load with allow_pickle=True")
        if name in ("yaml.load", "yaml.load_all", "yaml.unsafe_load", "yaml.full_load"):
            found.append(f"{where}:{node.lineno}: {name} (use yaml.safe_load)")
    return found


def test_the_checker_finds_what_it_looks_for() -> None:
    source = (
        "import pickle\nimport torch, yaml\ntorch.load('x')\nyaml.load(s)\nnp.load(f, allow_pickle=True)\n"
    )
    assert len(problems_in(source, "sample.py")) == 4
    assert problems_in("torch.load('x', weights_only=True)\nyaml.safe_load(s)\n", "sample.py") == []


def test_no_service_reads_or_writes_a_code_bearing_format() -> None:
    found = []
    for package in PACKAGES:
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            found += problems_in(path.read_text(), str(path.relative_to(REPO_ROOT)))
    assert found == []
