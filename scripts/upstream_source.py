"""Upstream names and signatures read from a package's source files (a release's wheel, unpacked;
nothing imported): where a dotted name is defined (modules, re-exports through imports, classes
and their bases, methods, class and instance attributes, dataclass fields), and the signature a
call of it binds against (a function's parameters, ``copy_signature``/``wraps`` followed; a
class's ``__init__`` through its bases, or its dataclass/msgspec/pydantic fields). Used by
``scripts/check_upstream.py``; the signatures it finds for the releases installed here are
checked against ``inspect.signature`` in tests/test_compat.py.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
from dataclasses import dataclass, field
from pathlib import Path

KINDS = {"P": inspect.Parameter.POSITIONAL_ONLY, "PK": inspect.Parameter.POSITIONAL_OR_KEYWORD,
         "VP": inspect.Parameter.VAR_POSITIONAL, "KO": inspect.Parameter.KEYWORD_ONLY,
         "VK": inspect.Parameter.VAR_KEYWORD}
_FIELD_BASES = ("Struct", "BaseModel", "TypedDict")  # msgspec, pydantic, typing: keyword fields


@dataclass
class Found:
    kind: str  # module | class | function | value | external
    module: str
    node: ast.AST | None = None
    owner: Found | None = None
    """The class a method or attribute was found in."""
    decorators: list[str] = field(default_factory=list)


def _defines(body: list[ast.stmt], name: str) -> ast.AST | None:
    """The last top-level statement of ``body`` (inside if/try too) that binds ``name``."""
    hit = None
    for node in body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) \
                and node.name == name:
            if not any(_name(d) == "overload" for d in getattr(node, "decorator_list", [])):
                hit = node
        elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == name for t in node.targets):
            hit = hit or node
        elif isinstance(node, (ast.Assign,)) and any(
                isinstance(t, ast.Tuple) and any(isinstance(e, ast.Name) and e.id == name
                                                 for e in t.elts) for t in node.targets):
            hit = hit or node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                and node.target.id == name:
            hit = hit or node
        elif isinstance(node, (ast.Import, ast.ImportFrom)) and any(
                (a.asname or a.name.split(".")[0]) == name for a in node.names):
            hit = hit or node
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            inner = [*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", []),
                     *[s for h in getattr(node, "handlers", []) for s in h.body]]
            found = _defines(inner, name)
            if found is not None and (hit is None or isinstance(found, (
                    ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))):
                hit = found
    return hit


def _name(expr: ast.expr) -> str:
    """The last name of a decorator or base (``a.b.c`` -> c; ``f(...)`` -> f)."""
    if isinstance(expr, ast.Call):
        expr = expr.func
    if isinstance(expr, ast.Attribute):
        return expr.attr
    return expr.id if isinstance(expr, ast.Name) else ""


def _dotted(expr: ast.expr) -> str | None:
    if isinstance(expr, ast.Name):
        return expr.id
    if isinstance(expr, ast.Attribute):
        base = _dotted(expr.value)
        return f"{base}.{expr.attr}" if base else None
    if isinstance(expr, ast.Subscript):  # Generic[T], Base[X]
        return _dotted(expr.value)
    return None


class Source:
    """The sources of one release of one package, unpacked under ``root``."""

    def __init__(self, root: Path, package: str):
        self.root, self.package = root, package
        self._trees: dict[str, ast.Module | None] = {}

    # ---------------------------------------------------------------- modules
    def _file(self, module: str) -> Path | None:
        base = self.root.joinpath(*module.split("."))
        for path in (base.with_suffix(".py"), base / "__init__.py"):
            if path.is_file():
                return path
        return None

    def tree(self, module: str) -> ast.Module | None:
        if module not in self._trees:
            path = self._file(module)
            self._trees[module] = ast.parse(path.read_text(), str(path)) if path else None
        return self._trees[module]

    def digest(self, dotted: str) -> str | None:
        """A digest of the definition's source (its AST, so formatting and comments do not count);
        None where it is not a class or function here."""
        f = self.find(dotted)
        if f is None or f.kind not in ("class", "function"):
            return None
        return hashlib.sha256(ast.dump(f.node).encode()).hexdigest()[:16]

    # ---------------------------------------------------------------- names
    def find(self, dotted: str, depth: int = 0) -> Found | None:
        """Where ``dotted`` is defined (Found), or None where these sources do not define it."""
        if depth > 12:
            return None
        if dotted.split(".")[0] != self.package:
            return Found("external", dotted)
        parts = dotted.split(".")
        for i in range(len(parts), 0, -1):
            module = ".".join(parts[:i])
            if self.tree(module) is not None:
                found: Found | None = Found("module", module, self.tree(module))
                for name in parts[i:]:
                    found = self._member(found, name, depth)
                    if found is None or found.kind == "external":
                        return found
                return found
        return None

    def _member(self, found: Found, name: str, depth: int) -> Found | None:
        if found.kind == "module":
            if self._file(f"{found.module}.{name}"):
                return Found("module", f"{found.module}.{name}", self.tree(f"{found.module}.{name}"))
            return self._in_module(found.module, name, depth)
        if found.kind == "class":
            return self._in_class(found, name, depth, seen=set())
        if name.startswith("__") and name.endswith("__"):
            return Found("external", name)  # __func__, __dict__, __version__.split, ...
        if found.kind == "value":
            return Found("external", name)  # an attribute of a value: its type is not read here
        return None

    def _in_module(self, module: str, name: str, depth: int) -> Found | None:
        tree = self.tree(module)
        node = _defines(tree.body, name) if tree else None
        if node is None:  # from .x import * (transformers' TYPE_CHECKING block re-exports so)
            for star in _star_imports(tree.body) if tree else []:
                base = self._absolute(star, module)
                if depth < 12 and self.tree(base) is not None:
                    hit = self._in_module(base, name, depth + 1)
                    if hit is not None:
                        return hit
            return None
        if isinstance(node, ast.ClassDef):
            return Found("class", module, node)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return Found("function", module, node, decorators=[_name(d) for d in node.decorator_list])
        if isinstance(node, ast.ImportFrom):
            alias = next(a for a in node.names if (a.asname or a.name) == name)
            base = self._absolute(node, module)
            return self.find(f"{base}.{alias.name}", depth + 1)
        if isinstance(node, ast.Import):
            alias = next(a for a in node.names if (a.asname or a.name.split(".")[0]) == name)
            return self.find(alias.name if alias.asname else alias.name.split(".")[0], depth + 1)
        value = getattr(node, "value", None)
        target = _dotted(value) if value is not None else None
        if target and target != name:  # an alias: X = Y, X = module.Y
            first, _, rest = target.partition(".")
            base = self._in_module(module, first, depth + 1) if first != name else None
            if base is not None:
                for part in rest.split(".") if rest else []:
                    base = self._member(base, part, depth + 1) if base.kind != "external" else base
                    if base is None:
                        break
                if base is not None:
                    return base
        return Found("value", module, node)

    def _absolute(self, node: ast.ImportFrom, module: str) -> str:
        if node.level == 0:
            return node.module or ""
        is_package = self._file(module) is not None and self._file(module).name == "__init__.py"
        parts = module.split(".")
        parts = parts if is_package else parts[:-1]
        parts = parts[: len(parts) - (node.level - 1)]
        return ".".join([*parts, node.module] if node.module else parts)

    def bases(self, cls: Found, depth: int = 0) -> list[Found]:
        """The class's bases where these sources define them; ``external`` for the others."""
        out = []
        for b in cls.node.bases:
            dotted = _dotted(b)
            if dotted is None:
                continue
            first, _, rest = dotted.partition(".")
            found = self._in_module(cls.module, first, depth + 1)
            if found is None:
                out.append(Found("external", dotted))  # a builtin (object, Exception, ...)
                continue
            if found.kind == "external":  # import msgspec; class X(msgspec.Struct)
                out.append(Found("external", f"{found.module}.{rest}" if rest else found.module))
                continue
            for part in rest.split(".") if rest else []:
                if found is None or found.kind == "external":
                    break
                found = self._member(found, part, depth + 1)
            out.append(found if found is not None else Found("external", dotted))
        return out

    def _in_class(self, cls: Found, name: str, depth: int, seen: set[int]) -> Found | None:
        if id(cls.node) in seen or depth > 12:
            return None
        seen.add(id(cls.node))
        node = _defines(cls.node.body, name)
        if isinstance(node, ast.ClassDef):
            return Found("class", cls.module, node, owner=cls)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return Found("function", cls.module, node, owner=cls,
                         decorators=[_name(d) for d in node.decorator_list])
        if node is not None:
            return Found("value", cls.module, node, owner=cls)
        for fn in cls.node.body:  # instance attributes: self.<name> = ... in any method
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for sub in ast.walk(fn):
                    targets = sub.targets if isinstance(sub, ast.Assign) else \
                        [sub.target] if isinstance(sub, (ast.AnnAssign, ast.AugAssign)) else []
                    for t in targets:
                        if isinstance(t, ast.Attribute) and t.attr == name and \
                                isinstance(t.value, ast.Name) and t.value.id == "self":
                            return Found("value", cls.module, sub, owner=cls)
        external = False
        for base in self.bases(cls, depth):
            if base.kind == "class":
                hit = self._in_class(base, name, depth + 1, seen)
                if hit is not None:
                    return hit
            elif base.kind == "external" and base.module.rsplit(".", 1)[-1] not in (
                    "object", "ABC", "Generic", "Protocol", "Enum"):
                external = True
        return Found("external", f"{cls.module}.{cls.node.name}.{name}") if external else None

    # ---------------------------------------------------------------- signatures
    def signature(self, dotted: str, bound_self: bool) -> list | str | None:
        """``[[name, kind, has_default], ...]`` of what a call of ``dotted`` binds against;
        "open" where it cannot be read here (defined outside these sources); None where
        ``dotted`` is not defined."""
        found = self.find(dotted)
        if found is None:
            return None
        return self._signature(found, bound_self)

    def _signature(self, found: Found, bound_self: bool, depth: int = 0) -> list | str:
        if depth > 8 or found.kind in ("external", "value", "module"):
            return "open"
        if found.kind == "class":
            return self._constructor(found, depth)
        fn = found.node
        for d in fn.decorator_list:
            if _name(d) in ("copy_signature", "wraps") and isinstance(d, ast.Call) and d.args:
                source = _dotted(d.args[0])
                if source:
                    first, _, rest = source.partition(".")
                    target = self._in_module(found.module, first, depth + 1)
                    for part in rest.split(".") if rest else []:
                        target = self._member(target, part, depth + 1) if target else None
                    if target is not None:
                        return self._signature(target, False, depth + 1)
                return "open"
        params = _params(fn.args)
        method = found.owner is not None
        static = "staticmethod" in found.decorators
        if method and not static and ("classmethod" in found.decorators or bound_self):
            params = params[1:]
        return params

    def _constructor(self, cls: Found, depth: int) -> list | str:
        mro = self._mro(cls)
        outside = [c.module.rsplit(".", 1)[-1] for c in mro if c.kind != "class"]
        if any(b in _FIELD_BASES for b in outside):
            return self._fields([m for m in mro if m.kind == "class"],
                                optional="TypedDict" in outside, every=True)
        for c in mro:
            if c.kind != "class":
                if c.module.rsplit(".", 1)[-1] not in ("object", "ABC", "Generic", "Protocol"):
                    return "open"
                continue
            init = _defines(c.node.body, "__init__")
            if isinstance(init, (ast.FunctionDef, ast.AsyncFunctionDef)):
                return self._signature(Found("function", c.module, init, owner=c,
                                             decorators=[_name(d) for d in init.decorator_list]),
                                       True, depth + 1)
            if any(_name(d) in ("dataclass", "strict") for d in c.node.decorator_list):
                fields = self._fields([m for m in mro if m.kind == "class"], every=False)
                if any(isinstance(d, ast.Call) and any(
                        k.arg == "accept_kwargs" and getattr(k.value, "value", False)
                        for k in d.keywords) for m in mro if m.kind == "class"
                        for d in m.node.decorator_list):  # huggingface_hub's strict: extras
                    fields.append(["kwargs", "VK", False])  # to __post_init__ (HF configs)
                return fields
        return []

    def _mro(self, cls: Found, seen: set[int] | None = None) -> list[Found]:
        """Depth-first, left to right (close enough to C3 for finding __init__)."""
        seen = seen if seen is not None else set()
        if cls.kind != "class":
            return [cls]
        if id(cls.node) in seen:
            return []
        seen.add(id(cls.node))
        out = [cls]
        for base in self.bases(cls):
            out += self._mro(base, seen)
        return out

    @staticmethod
    def _fields(classes: list[Found], optional: bool = False, every: bool = True) -> list:
        """Keyword fields, the bases' first; a field without a default after one with it (kw_only
        dataclasses) keyword-only; all optional for a TypedDict (``optional``). ``every``: the
        annotations of every class (msgspec, pydantic, TypedDict), else of the dataclasses."""
        fields: dict[str, list] = {}
        for c in reversed(classes):  # the bases' fields first, as dataclasses orders them
            if not every and not any(_name(d) in ("dataclass", "strict")
                                     for d in c.node.decorator_list):
                continue
            for node in c.node.body:
                if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                    continue
                if "ClassVar" in ast.dump(node.annotation):
                    continue
                value = node.value
                if isinstance(value, ast.Call) and _name(value) == "field" and any(
                        k.arg == "init" and isinstance(k.value, ast.Constant)
                        and k.value.value is False for k in value.keywords):
                    continue
                default = value is not None and not (
                    isinstance(value, ast.Call) and _name(value) == "field" and not any(
                        k.arg in ("default", "default_factory") for k in value.keywords))
                fields[node.target.id] = [node.target.id, "PK", optional or default]
        out, defaulted = [], False
        for name, _, has_default in fields.values():
            out.append([name, "KO" if defaulted and not has_default else "PK", has_default])
            defaulted = defaulted or has_default
        if any(k == "KO" for _, k, _ in out):  # everything after the first keyword-only too
            first = next(i for i, (_, k, _) in enumerate(out) if k == "KO")
            out = out[:first] + [[n, "KO", d] for n, _, d in out[first:]]
        return out


def _star_imports(body: list[ast.stmt]) -> list[ast.ImportFrom]:
    out = []
    for node in body:
        if isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names):
            out.append(node)
        elif isinstance(node, (ast.If, ast.Try)):
            out += _star_imports([*node.body, *node.orelse,
                                  *[x for h in getattr(node, "handlers", []) for x in h.body]])
    return out


def _params(a: ast.arguments) -> list:
    out = []
    positional = [*a.posonlyargs, *a.args]
    defaults = [False] * (len(positional) - len(a.defaults)) + [True] * len(a.defaults)
    for i, arg in enumerate(positional):
        out.append([arg.arg, "P" if i < len(a.posonlyargs) else "PK", defaults[i]])
    if a.vararg:
        out.append([a.vararg.arg, "VP", False])
    for arg, default in zip(a.kwonlyargs, a.kw_defaults):
        out.append([arg.arg, "KO", default is not None])
    if a.kwarg:
        out.append([a.kwarg.arg, "VK", False])
    return out


def bind(params: list, positional: int, keywords: tuple[str, ...] | None, star_args: bool,
         forwarded: bool) -> str | None:
    """Why a call with ``positional`` arguments and these ``keywords`` fails to bind against
    ``params`` (None: it binds). A call that spreads ``*args`` or passes on its own arguments is
    bound partially (its missing ones may come in the spread); unread ``**`` spreads need a
    ``**kwargs`` parameter."""
    sig = inspect.Signature([inspect.Parameter(n, KINDS[k], default=None if d else
                                               inspect.Parameter.empty) for n, k, d in params])
    takes_any = any(k == "VK" for _, k, _ in params)
    if keywords is None and not takes_any:
        return "its ** spread could not be read and the target takes no **kwargs"
    named = {k: None for k in (keywords or ())}
    args = [None] * positional
    try:
        if star_args or forwarded or keywords is None:
            sig.bind_partial(*args, **named)
        else:
            sig.bind(*args, **named)
    except TypeError as e:
        return str(e)
    return None
