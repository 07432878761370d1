"""The package's shape, read from its source (no import): no import circle between its modules,
the layout and the dry run free of the learner, heavy dependencies behind their one room each,
and no module much over 500 lines."""

import ast
from pathlib import Path

import pytest
from helpers import ROOT

PACKAGE = ROOT / "mugrpo_megatron"
MAX_LINES = 520
"""~500 lines a file, with room for a docstring's growth."""
ROOMS = {
    "megatron": ("mugrpo_megatron.learner",),
    "vllm": ("mugrpo_megatron.engines.vllm_engine", "mugrpo_megatron.engines.compat_vllm"),
    "sglang": ("mugrpo_megatron.engines.sglang_engine",),
    "transformer_engine": ("mugrpo_megatron.learner.fp8",),
}
"""Where each heavy dependency may be imported (a module, or a package and everything in it)."""


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(path: Path, package: str | None = None) -> list[tuple[str, bool]]:
    """(module imported, at the module's top level) for every import in ``path``, a module of
    ``package`` (its own, by default): top level means it runs when the module is imported (not
    inside a function, nor under TYPE_CHECKING)."""
    tree = ast.parse(path.read_text())
    if package is None:
        name = module_name(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, False)
            elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                visit(child, False)
            elif isinstance(child, ast.Import):
                out.extend((a.name, top) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package.split(".")[:len(package.split(".")) - child.level + 1]
                    base = ".".join(up + ([child.module] if child.module else []))
                # `from pkg import module` needs the module complete, `from pkg import name`
                # the package's __init__
                out.extend((f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base, top)
                           for a in child.names)
            else:
                visit(child, top)

    visit(tree, True)
    return out


def internal(name: str) -> str | None:
    """The package module ``name`` is or lies in."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def graph(top_only: bool) -> dict[str, set[str]]:
    out = {}
    for name, path in MODULES.items():
        out[name] = {t for imp, top in imports(path) if (top or not top_only)
                     and (t := internal(imp)) is not None and t != name}
    return out


def test_no_import_circle():
    """No module needs, while it is being imported, a module that needs it back: an edge is a
    top-level import of a module (or of a name from a package's ``__init__``). A circle found is
    printed whole."""
    g = graph(top_only=True)
    assert circle(g) is None, "import circle: " + " -> ".join(circle(g))


def circle(g: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``g`` (first found, depth first), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(g.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if state.get(m) is None and (found := dfs(m)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for name in sorted(g):
        if state.get(name) is None and (found := dfs(name)):
            return found
    return None


def test_the_layout_and_the_dry_run_import_nothing_from_the_learner():
    """layout/ and dryrun/ are arithmetic on configs and shapes: they run where megatron-core is
    absent, and the learner builds on them, not the reverse (lazy imports count too)."""
    g = graph(top_only=False)
    for name, targets in g.items():
        if name.startswith(("mugrpo_megatron.layout", "mugrpo_megatron.dryrun")):
            bad = sorted(t for t in targets if t.startswith("mugrpo_megatron.learner"))
            assert not bad, (name, bad)


@pytest.mark.parametrize("dependency", sorted(ROOMS))
def test_heavy_dependencies_stay_in_their_room(dependency):
    """megatron-core only under learner/, vLLM and SGLang each in their engine file (and vLLM's
    compat module), Transformer Engine only in learner/fp8.py (lazily)."""
    rooms = ROOMS[dependency]
    for name, path in MODULES.items():
        if name.startswith(rooms):
            continue
        bad = [imp for imp, _ in imports(path) if imp == dependency
               or imp.startswith(dependency + ".")]
        assert not bad, (name, bad)


def test_no_file_is_much_over_500_lines():
    files = [*PACKAGE.rglob("*.py"), *(ROOT / "benchmarks").glob("*.py"),
             *(ROOT / "scripts").rglob("*.py"), *(ROOT / "tests").rglob("*.py")]
    long = {str(p.relative_to(ROOT)): n for p in files
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_the_checker_sees_a_circle_and_a_learner_import(tmp_path):
    """The parser finds what it must (a top-level import, a relative one, a lazy one), and the
    cycle search finds a circle of three."""
    a = tmp_path / "mugrpo_megatron" / "layout" / "x.py"
    a.parent.mkdir(parents=True)
    a.write_text("from ..learner import model\nimport os\n\n"
                 "def f():\n    import mugrpo_megatron.dryrun\n")
    got = imports(a, package="mugrpo_megatron.layout")
    assert ("mugrpo_megatron.learner.model", True) in got
    assert ("mugrpo_megatron.dryrun", False) in got
    assert circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert circle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
