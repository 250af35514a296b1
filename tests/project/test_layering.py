"""The folders are the architecture: imports point one way (cli -> eval -> pipelines -> decoding/dllm ->
kernels/models -> core). An AST walk over every import statement (module level and inside functions)
checks that kernels/ and models/ import nothing from decoding, dllm, pipelines, eval or the CLI, that
the folders form no import cycle, and that the benchmarks import no trainer."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
# installed package -> source folder (pyproject.toml's package-dir)
SOURCES = {"vispec.models": "models", "vispec.kernels": "kernels", "vispec.pipelines": "pipelines", "vispec.eval": "eval",
           "vispec": "vispec"}
LOWER_LAYERS = ("kernels", "models")
UPPER_LAYERS = ("decoding", "dllm", "pipelines", "eval", "eval.bench", "eval.train", "cli")


def layer(module: str) -> str | None:
    """The folder a ``vispec`` module lives in: decoding, dllm, cli, kernels, models, pipelines, eval.bench,
    eval.train, eval (its top level) or core (the root modules: sampling, protocol, checks, outputs)."""
    parts = module.split(".")
    if parts[0] != "vispec":
        return None
    if len(parts) == 1:
        return "core"
    if parts[1] == "eval":
        return f"eval.{parts[2]}" if len(parts) > 2 and parts[2] in ("bench", "train") else "eval"
    if parts[1] in ("decoding", "dllm", "cli", "kernels", "models", "pipelines"):
        return parts[1]
    return "core"


def module_of(path: pathlib.Path, root: pathlib.Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    top = rel.parts[0]
    package = next(pkg for pkg, folder in SOURCES.items() if folder == top)
    parts = list(rel.parts[1:])
    if parts and parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([package] + parts)


def imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every import in the file (``from a import b`` also yields ``a.b``, which may be a module)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def layer_edges(root: pathlib.Path) -> list[tuple[str, str, str]]:
    """``(from layer, to layer, "file:line imports module")`` for every import between different layers."""
    edges = []
    for folder in SOURCES.values():
        for path in sorted((root / folder).rglob("*.py")):
            if "pretrained" in path.parts:
                continue
            source = layer(module_of(path, root))
            for line, module in imports(path):
                target = layer(module)
                if target and target != source:
                    edges.append((source, target, f"{path.relative_to(root)}:{line} imports {module}"))
    return edges


def violations(root: pathlib.Path) -> list[str]:
    edges = layer_edges(root)
    found = [f"{where} (a lower layer imports {target})" for source, target, where in edges
             if source in LOWER_LAYERS and target in UPPER_LAYERS]
    found += [where for source, target, where in edges if source == "eval.bench" and target == "eval.train"]
    found += [f"{where} (core imports {target})" for source, target, where in edges if source == "core" and target != "core"]
    graph: dict[str, set[str]] = {}
    for source, target, _ in edges:
        graph.setdefault(source, set()).add(target)
    found += [f"import cycle between folders: {' -> '.join(cycle)}" for cycle in _cycles(graph)]
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    cycles, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(path[path.index(nxt):] + [nxt] if nxt in path else path + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return cycles


def test_imports_point_one_way():
    assert layer_edges(ROOT), "no imports found: the walk is broken"
    assert not violations(ROOT), "\n".join(violations(ROOT))


@pytest.mark.parametrize("folder, line, problem", [
    ("kernels", "from vispec.decoding.acceptance import AcceptanceRule", "lower layer imports decoding"),
    ("models", "import vispec.dllm", "lower layer imports dllm"),
    ("eval/bench", "from vispec.eval.train.gpt import train_gpt", "imports vispec.eval.train"),
    ("vispec/decoding", "from vispec.pipelines import LlamaGenPipeline", "import cycle"),
])
def test_negative_controls_are_reported(tmp_path, folder, line, problem):
    """The same check on a copy of the tree with one bad import added must report it."""
    for name in SOURCES.values():
        for path in (ROOT / name).rglob("*.py"):
            if "pretrained" not in path.parts:
                copy = tmp_path / path.relative_to(ROOT)
                copy.parent.mkdir(parents=True, exist_ok=True)
                copy.write_text(path.read_text())
    (tmp_path / folder / "bad_import.py").write_text(f"def f():\n    {line}\n")
    found = violations(tmp_path)
    assert any("bad_import.py" in v or problem in v for v in found) and any(problem.split()[-1] in v for v in found), found


def private_imports(root: pathlib.Path) -> list[str]:
    """``from vispec... import _name`` anywhere in the sources: a private name crossing a module border."""
    found = []
    for folder in SOURCES.values():
        for path in (root / folder).rglob("*.py"):
            if "pretrained" in path.parts:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vispec"):
                    for alias in node.names:
                        if alias.name.startswith("_") and not alias.name.startswith("__"):
                            found.append(f"{path.relative_to(root)}:{node.lineno} imports private {node.module}.{alias.name}")
    return found


def test_no_private_name_crosses_a_module_border(tmp_path):
    assert not private_imports(ROOT), "\n".join(private_imports(ROOT))
    bad = tmp_path / "vispec" / "bad.py"  # negative control
    bad.parent.mkdir(parents=True)
    bad.write_text("from vispec.dllm.loop import _secret\n")
    assert private_imports(tmp_path) == ["vispec/bad.py:1 imports private vispec.dllm.loop._secret"]


def module_cycles(root: pathlib.Path, folder: str) -> list[list[str]]:
    """Import cycles between the modules of ``folder`` (e.g. ``vispec/decoding``; its ``__init__`` left out: it
    imports the modules to re-export their names), imports inside functions included."""
    base = root / folder
    package = ".".join(pathlib.Path(folder).parts)
    modules = {f"{package}.{p.stem}": p for p in sorted(base.glob("*.py")) if p.stem != "__init__"}
    graph = {name: {m for _, m in imports(path) if m in modules and m != name} for name, path in modules.items()}
    return _cycles(graph)


@pytest.mark.parametrize("folder", ["vispec/decoding", "vispec/dllm"])
def test_modules_of_a_folder_import_each_other_one_way(folder):
    """e.g. acceptance -> budget -> acceptance was a circle: the rule builder now lives in rules.py, above both; in
    vispec/dllm, decode <-> speculative (now both import checks.py) and caches <-> uniform (cache_modes.py)."""
    cycles = module_cycles(ROOT, folder)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_module_cycles_are_found(tmp_path):
    """Negative control: two modules that import each other (one inside a function) are a cycle."""
    folder = tmp_path / "vispec" / "decoding"
    folder.mkdir(parents=True)
    (folder / "a.py").write_text("from vispec.decoding.b import x\n")
    (folder / "b.py").write_text("def f():\n    from vispec.decoding import a\n")
    assert module_cycles(tmp_path, "vispec/decoding")
