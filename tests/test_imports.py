"""flashdraft's module imports form no circle, and the packages keep their layers.

The graph is read from the source (every `import` / `from … import` statement of flashdraft/**/*.py, inside
functions too), not from what Python happens to import, so a lazy import cannot hide a circle. Layers, lowest
first: the root library files (cache, config, drafter, target, tree); data and decode; train (reads datasets);
eval and serve (score and serve what train wrote, through decode); the entry points (the CLI, quickstart). A
module imports its own package and lower layers only.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "flashdraft"

ENTRY_POINTS = {"flashdraft.cli", "flashdraft.info_cli", "flashdraft.quickstart", "flashdraft.__main__"}
LAYER = {"data": 1, "decode": 1, "train": 2, "eval": 3, "serve": 3}
# data's regeneration forward (data/native.py) runs the target's layers with the decoding engine's public layer
# primitives (decode/native.py: RoPE, RMSNorm, q/k/v, the float32 head): one implementation of that math
ALLOWED_ACROSS = {("flashdraft.data.native", "flashdraft.decode.native")}
# the trainer's validation runs `flashdraft eval`'s own references and replay, so its τ is the eval's τ
# (tests/train/test_validation.py), not a second implementation of it
ALLOWED_ACROSS |= {
    ("flashdraft.train.validation", f"flashdraft.eval.{m}")
    for m in ("evaluate", "offline", "prompts", "references", "replay")
}


def module_names() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """module → the flashdraft modules it imports (a package's `__init__` when the name is no module)."""
    mods = module_names()

    def known(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's package
                    pkg = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
                    pkg = pkg[: len(pkg) - node.level + 1]
                    base = ".".join([*pkg, *([node.module] if node.module else [])])
                # `from pkg import mod` names the submodule; `from mod import name` the module itself
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for n in names:
                if n.split(".")[0] == "flashdraft" and (dep := known(n)) is not None and dep != mod:
                    deps.add(dep)
        graph[mod] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                return [*path[path.index(d) :], d]
            if d not in state and (c := visit(d)) is not None:
                return c
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (c := visit(m)) is not None:
            return c
    return None


def layer(mod: str) -> tuple[int, str]:
    """(layer, group): group is the subpackage, or "root" for the library files at the top."""
    if mod in ENTRY_POINTS:
        return 4, mod
    parts = mod.split(".")
    if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYER):
        return LAYER[parts[1]], parts[1]
    return 0, "root"


def test_the_graph_sees_function_level_and_relative_imports(tmp_path, monkeypatch):
    pkg = tmp_path / "flashdraft"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("def f():\n    from flashdraft.sub.b import g\n")
    (pkg / "sub" / "b.py").write_text("from . import a\nimport os\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", pkg)
    g = import_graph()
    assert g["flashdraft.sub.a"] == {"flashdraft.sub.b"} and g["flashdraft.sub.b"] == {"flashdraft.sub.a"}
    assert find_cycle(g) == ["flashdraft.sub.a", "flashdraft.sub.b", "flashdraft.sub.a"]


def test_no_import_circle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_packages_import_only_their_own_and_lower_layers():
    wrong = []
    for mod, deps in import_graph().items():
        lm, gm = layer(mod)
        for d in deps:
            ld, gd = layer(d)
            if gd != gm and ld >= lm and (mod, d) not in ALLOWED_ACROSS:
                wrong.append(f"{mod} (layer {lm}) imports {d} (layer {ld})")
    assert not wrong, "\n".join(sorted(wrong))
