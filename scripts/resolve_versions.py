"""Ask the package index what each of pyproject.toml's install variants resolves to on Python 3.11
and 3.12 (Linux x86_64), without installing anything, and print the versions that matter as the
README's supported-versions table.

    pip install uv && python scripts/resolve_versions.py

Each variant is the base dependencies plus one extra (vllm, sglang, te, and vllm with te, what a
GPU cluster installs); uv's resolver reads the index's metadata (``uv pip compile
--python-version --python-platform``; pip cannot resolve for another Python when a dependency is
a source distribution, as TE's PyTorch part is). A variant that does not resolve is printed with
uv's reason. Run by hand: it needs the index, and what it prints changes with new releases.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHOWN = ("torch", "megatron-core", "transformers", "vllm", "sglang", "transformer-engine")
PYTHONS = ("3.11", "3.12")
PLATFORM = "x86_64-manylinux_2_35"  # SGLang's wheels need glibc 2.35


def uv() -> list[str]:
    if shutil.which("uv"):
        return ["uv"]
    if subprocess.run([sys.executable, "-m", "uv", "--version"], capture_output=True).returncode == 0:
        return [sys.executable, "-m", "uv"]
    raise SystemExit("needs uv: pip install uv")


def variants() -> dict[str, list[str]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base, extras = project["dependencies"], project["optional-dependencies"]
    return {"base": base, "vllm": base + extras["vllm"], "sglang": base + extras["sglang"],
            "te": base + extras["te"], "vllm + te": base + extras["vllm"] + extras["te"]}


def interpreter(version: str) -> str | None:
    """A local interpreter of ``version``, for the source distributions uv must build to read
    their metadata (it would download one otherwise)."""
    found = [shutil.which(f"python{version}"),
             *map(str, sorted(Path.home().glob(f".pyenv/versions/{version}*/bin/python")))]
    for path in filter(None, found):  # the first that runs (pyenv's shims may refuse)
        if subprocess.run([path, "--version"], capture_output=True).returncode == 0:
            return path
    return None


def resolve(requirements: list[str], python: str) -> dict[str, str] | str:
    """{distribution: version} uv resolves ``requirements`` to, or why it cannot."""
    with tempfile.TemporaryDirectory() as tmp:
        req = Path(tmp) / "requirements.in"
        req.write_text("\n".join(requirements) + "\n")
        cmd = [*uv(), "pip", "compile", str(req), "--python-version", python,
               "--python-platform", PLATFORM, "--no-header", "--quiet"]
        if (exe := interpreter(python)) is not None:
            cmd += ["--python", exe]
        proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        lines = [line.strip() for line in proc.stderr.splitlines() if "cause" in line
                 or "because" in line.lower()]
        return " ".join(lines[:2]) or proc.stderr.strip()[-300:]
    pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==([^\s;]+)", proc.stdout, re.M))
    return {k.lower().replace("_", "-"): v for k, v in pins.items()}


def main() -> int:
    rows = []
    for name, requirements in variants().items():
        for python in PYTHONS:
            got = resolve(requirements, python)
            if isinstance(got, str):
                rows.append(f"| {name} | {python} | does not resolve: {got} |")
                continue
            cells = [got.get(d, "-") for d in SHOWN]
            rows.append(f"| {name} | {python} | " + " | ".join(cells) + " |")
    print("| install | Python | " + " | ".join(SHOWN) + " |")
    print("|---|---|" + "---|" * len(SHOWN))
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
