"""Bind every call our code makes into megatron-core, Transformer Engine, vLLM, SGLang and
transformers against the real signature, and find every upstream name we read, in the released
source of both ends of each range pyproject.toml admits; record what was read in
tests/fixtures/upstream_api.json, which tests/test_compat.py binds our code against on every run.

    python scripts/check_upstream.py                 # downloads each end's wheel (pip, no deps)
    python scripts/check_upstream.py --cache DIR     # where the wheels are kept (reused)

What is checked (``problems``):
- every call ``scripts/upstream_refs.py`` finds (imports, lazy imports, our variables of upstream
  classes, keyword dicts built and spread in our code) binds against the target's signature at
  every version read: keyword names, positional count, required arguments where the call is
  fully known (``upstream_source.bind``);
- every upstream attribute we read exists there; so does every name in a module's
  ``UPSTREAM_SYMBOLS`` (the names compat code patches or reads through objects);
- ``UPSTREAM_VERSIONED`` (name -> version range) names exist exactly in the versions inside their
  range, and a call's keyword that is such a name (``Class.keyword``) is not bound outside it;
- ``UPSTREAM_DIGESTS`` of a stand-in in the tests (upstream name -> the digests of its source as
  the stand-in's author read it) holds the digest of every version read: a release that changes
  code a stand-in mirrors fails until someone reads it again.
Installed releases are also imported by tests/test_compat.py, which checks the signatures read
here against ``inspect.signature``.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "upstream_api.json"
sys.path.insert(0, str(ROOT / "scripts"))

from upstream_refs import UPSTREAM, Ref, references  # noqa: E402
from upstream_source import Source, bind  # noqa: E402

DISTS = {"megatron-core": "megatron", "transformer-engine": "transformer_engine", "vllm": "vllm",
         "sglang": "sglang", "transformers": "transformers"}
"""Distribution -> its top-level package."""
_WHEEL_TAGS = (("3.12", "manylinux_2_28_x86_64"), ("3.11", "manylinux_2_34_x86_64"),
               ("3.12", "manylinux_2_34_x86_64"))
"""(python, platform) tried in turn: megatron-core 0.19 has cp312 wheels only, SGLang cp311
ones for manylinux 2.34, the rest any."""


def ranges() -> dict[str, list[str]]:
    """pyproject's specifiers of each distribution (TE has one per Python version)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = project["dependencies"] + [s for extra in project["optional-dependencies"].values()
                                       for s in extra]
    out: dict[str, list[str]] = {}
    for spec in specs:
        m = re.match(r"^([A-Za-z0-9_.-]+)(\[[^\]]*\])?\s*([<>=!~][^;]*)", spec)
        if m and m.group(1) in DISTS:
            out.setdefault(m.group(1), []).append(m.group(3).strip())
    return {k: sorted(v) for k, v in out.items()}


def ends(dist: str, specs: list[str]) -> list[str]:
    """The lowest and the highest release inside each specifier, on the package index."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    listed = set()
    for py, platform in [(None, None), *_WHEEL_TAGS]:  # the releases for any of the tags
        tags = [] if py is None else ["--python-version", py, "--only-binary=:all:",
                                      "--platform", platform]
        text = subprocess.run([sys.executable, "-m", "pip", "index", "versions", dist, *tags],
                              capture_output=True, text=True).stdout
        if m := re.search(r"Available versions: (.*)", text):
            listed |= {Version(v) for v in m.group(1).split(", ")}
    out = set()
    for spec in specs:
        inside = sorted(v for v in listed if v in SpecifierSet(spec) and not v.is_prerelease
                        and not v.is_devrelease)
        out |= {str(inside[0]), str(inside[-1])}
    return sorted(out, key=Version)


def wheel_sources(dist: str, version: str, cache: Path) -> Path:
    """The Python sources of ``dist``'s wheel at ``version``, unpacked under ``cache``."""
    out = cache / f"{dist}-{version}"
    if (out / ".done").is_file():
        return out
    prefix = dist.replace("-", "_") + f"-{version}"
    wheel = next((p for p in cache.glob("*.whl") if p.name.lower().startswith(prefix)), None)
    for py, platform in _WHEEL_TAGS if wheel is None else ():
        done = subprocess.run([sys.executable, "-m", "pip", "download", "-q", f"{dist}=={version}",
                               "--no-deps", "--only-binary=:all:", "--python-version", py,
                               "--platform", platform, "-d", str(cache)], capture_output=True)
        wheel = next((p for p in cache.glob("*.whl") if p.name.lower().startswith(prefix)), None)
        if done.returncode == 0 and wheel is not None:
            break
    if wheel is None:
        raise SystemExit(f"no wheel of {dist}=={version} for any of {_WHEEL_TAGS}")
    with zipfile.ZipFile(wheel) as z:
        z.extractall(out, [n for n in z.namelist() if n.endswith(".py")])
    (out / ".done").write_text("")
    return out


def declarations(root: Path = ROOT) -> dict:
    """``UPSTREAM_SYMBOLS`` (module level), ``UPSTREAM_VERSIONED`` (module level) and
    ``UPSTREAM_DIGESTS`` (in a class: a stand-in) of our modules and tests, read without import;
    symbols as dotted names."""
    symbols, versioned, digests = set(), {}, {}
    for path in sorted([*(root / "mugrpo_megatron").rglob("*.py"), *(root / "tests").rglob("*.py")]):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Assign, ast.AnnAssign)):
                continue
            target = node.targets[0] if isinstance(node, ast.Assign) else node.target
            name = getattr(target, "id", None)
            if name == "UPSTREAM_SYMBOLS":
                symbols |= {e.replace(":", ".") for e in ast.literal_eval(node.value)}
            elif name == "UPSTREAM_VERSIONED":
                versioned |= {k.replace(":", "."): v for k, v in ast.literal_eval(node.value).items()}
            elif name == "UPSTREAM_DIGESTS":
                for k, v in ast.literal_eval(node.value).items():
                    digests.setdefault(k.replace(":", "."), set()).update(v)
    ours = lambda name: name.split(".")[0] in UPSTREAM  # noqa: E731
    return {"symbols": sorted(s for s in symbols if ours(s)), "versioned": versioned,
            "digests": {k: sorted(v) for k, v in digests.items()}}


def _key(ref: Ref) -> str:
    return ref.target + ("#bound" if ref.bound_self else "")


def read(source: Source, refs: list[Ref], decl: dict, package: str) -> dict:
    """What one release's source says of our references and declarations."""
    mine = [r for r in refs if r.target.split(".")[0] == package]
    names = {r.target for r in mine} | {n for n in decl["symbols"] if n.startswith(package + ".")} \
        | {n for n in decl["versioned"] if n.startswith(package + ".")}
    found = {n: (f.kind if (f := source.find(n)) is not None else None) for n in sorted(names)}
    signatures = {_key(r): source.signature(r.target, r.bound_self) for r in mine if r.call}
    digests = {n: source.digest(n) for n in decl["digests"] if n.startswith(package + ".")}
    return {"found": found, "signatures": dict(sorted(signatures.items())), "digests": digests}


def problems(record: dict, refs: list[Ref], decl: dict) -> list[str]:
    """Everything that fails, as lines naming the version, the place and the name."""
    from packaging.specifiers import SpecifierSet

    out = []
    for release, got in sorted(record["read"].items()):
        dist, version = release.split("==")
        package = DISTS[dist]
        inside = {n: version in SpecifierSet(spec) for n, spec in decl["versioned"].items()
                  if n.startswith(package + ".")}
        for name, present in inside.items():
            if (got["found"].get(name) is not None) != present:
                out.append(f"{release}: {name} is {'absent' if present else 'present'} though "
                           f"UPSTREAM_VERSIONED says {decl['versioned'][name]}")
        for name in decl["symbols"]:
            if name.startswith(package + ".") and got["found"].get(name, "unread") is None:
                out.append(f"{release}: UPSTREAM_SYMBOLS {name} is not defined")
        for ref in refs:
            if ref.target.split(".")[0] != package:
                continue
            if ref.twice:
                out.append(f"{ref.where}: {ref.target}(...) may be given {', '.join(ref.twice)} "
                           f"twice (a TypeError whenever both parts pass it)")
            if ref.target not in got["found"] or (ref.call and _key(ref) not in got["signatures"]):
                out.append(f"{ref.where}: {ref.target} was not read at {release}: run "
                           f"python scripts/check_upstream.py")
                continue
            if got["found"][ref.target] is None:
                if inside.get(ref.target, True):
                    out.append(f"{ref.where}: {ref.target} is not defined in {release}")
                continue
            sig = got["signatures"].get(_key(ref)) if ref.call else None
            if sig is None or sig == "open":
                continue
            keywords = ref.keywords if ref.keywords is None else tuple(
                k for k in ref.keywords if inside.get(f"{ref.target}.{k}", True))
            why = bind(sig, ref.positional, keywords, ref.star_args, ref.forwarded)
            if why:
                out.append(f"{ref.where}: {ref.target}(...) at {release}: {why}")
        for name, want in decl["digests"].items():
            if name.startswith(package + ".") and got["digests"].get(name) not in want:
                out.append(f"{release}: the source of {name} is {got['digests'].get(name)}, which "
                           f"no stand-in declaring it in UPSTREAM_DIGESTS was read against ({want})")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(FIXTURE))
    ap.add_argument("--cache", default=str(Path.home() / ".cache" / "mugrpo-upstream"))
    args = ap.parse_args()
    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    refs, decl, specs = references(ROOT), declarations(), ranges()
    record: dict = {"ranges": specs, "read": {}}
    for dist, package in DISTS.items():
        versions = ends(dist, specs[dist])
        print(f"{dist}: {', '.join(versions)} (pyproject: {' | '.join(specs[dist])})", flush=True)
        for version in versions:
            source = Source(wheel_sources(dist, version, cache), package)
            record["read"][f"{dist}=={version}"] = read(source, refs, decl, package)
    Path(args.out).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    found = problems(record, refs, decl)
    calls = sum(r.call for r in refs)
    print(f"{len(refs)} references ({calls} calls) into {', '.join(DISTS)} at "
          f"{len(record['read'])} releases; wrote {args.out}")
    for line in found:
        print("PROBLEM", line)
    print(f"{len(found)} problem(s)")
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
