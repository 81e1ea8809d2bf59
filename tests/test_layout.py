"""The tree is the architecture: imports point one way (trainer_bridge ->
rollout -> workspace), only `rollout/cluster` imports Ray, the engine's parts
never reach the cluster, and no source file outgrows one sitting."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("rollout", "workspace", "trainer_bridge")
MAX_LINES = 400


def _sources(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))


def _imported(path: Path, text: str | None = None) -> set[str]:
    """Absolute names of every module `path` (or `text` as if it were there) imports, relative imports resolved."""
    package = path.relative_to(ROOT).with_suffix("").parts[:-1]
    names = set()
    for node in ast.walk(ast.parse(path.read_text() if text is None else text)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else ()
            module = ".".join((*base, node.module) if node.module else base)
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def _offenders(folders: tuple[str, ...], forbidden: tuple[str, ...]) -> list[str]:
    return [
        f"{p.relative_to(ROOT)} imports {name}"
        for p in _sources(*folders)
        for name in sorted(_imported(p))
        if any(name == f or name.startswith(f + ".") for f in forbidden)
    ]


def test_only_the_cluster_imports_ray():
    inside = ROOT / "rollout" / "cluster"
    outside = [p for p in _sources(*PACKAGES) if inside not in p.parents]
    offenders = [f"{p.relative_to(ROOT)}" for p in outside if any(n.split(".")[0] == "ray" for n in _imported(p))]
    assert offenders == []


@pytest.mark.parametrize(
    ("folders", "forbidden"),
    [
        (("workspace",), ("rollout", "trainer_bridge")),
        (("rollout",), ("trainer_bridge", "scripts", "examples", "tests")),
        (("rollout/engine", "rollout/model", "rollout/kernels"), ("rollout.cluster", "ray")),
        (("rollout/model", "rollout/kernels"), ("rollout.engine",)),
        (("rollout/kernels",), ("rollout.model",)),
    ],
)
def test_imports_point_one_way(folders, forbidden):
    assert _offenders(folders, forbidden) == []


def test_relative_imports_resolve():
    """`from ..cluster import api` inside rollout/engine is seen as rollout.cluster.api."""
    probe = ROOT / "rollout" / "engine" / "probe.py"
    assert "rollout.cluster.api" in _imported(probe, "from ..cluster import api\n")
    assert "workspace.kv_pool" in _imported(probe, "from workspace.kv_pool import KVPool\n")


def test_no_source_file_over_400_lines():
    long = {
        str(p.relative_to(ROOT)): n for p in _sources(*PACKAGES) if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


def test_readme_stays_short():
    """The README opens the project in one screenful or two; detail lives in docs/."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 160
