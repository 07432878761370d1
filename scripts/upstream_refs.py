"""Every reference our code makes into an upstream package, read from our source (no import):
each call with its positional count and keyword names, and each attribute read, resolved to a
dotted path through the imports (module-level and lazy ones inside functions), the
upstream classes our variables hold (a call of one, a parameter or variable annotated with one,
``self.x = Upstream(...)``), and keyword dicts built and spread in our code (``**kw`` where
``kw`` is a ``dict(...)``/``{...}`` grown by ``update``/item assignment, or returned by one of
our functions). ``scripts/check_upstream.py`` binds them against the upstream source;
``tests/test_compat.py`` binds them against the signatures it recorded.

Written here because no maintained tool binds calls against the source of packages that cannot
be imported here (TE, vLLM's CUDA wheels, megatron-core 0.19 beside 0.16).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

UPSTREAM = ("megatron", "transformer_engine", "vllm", "sglang", "transformers")
"""The top-level packages whose calls are checked."""
OURS = "mugrpo_megatron"
SCANNED = ("mugrpo_megatron", "benchmarks", "scripts")
"""Where our calls live (benchmarks/device_check.py runs on the GPU; scripts convert)."""


@dataclass
class Ref:
    """One use of an upstream name: ``target`` dotted (``pkg.module.Class.attr``; the source side
    finds which prefix is the module), where, and for a call what
    it passes (``keywords`` None: a ``**`` spread we could not read)."""

    target: str
    where: str
    call: bool
    positional: int = 0
    star_args: bool = False
    keywords: tuple[str, ...] | None = ()
    bound_self: bool = False
    """Called through an instance (``obj.method(...)``): the method's first parameter is bound."""
    forwarded: bool = False
    """Passes on the calling function's own ``*args``/``**kwargs`` (a wrapper of the target:
    whatever reaches it was bound by the wrapper's callers)."""
    twice: tuple[str, ...] = ()
    """Keywords two of the call's parts may both pass (``f(a=1, **kw)`` with ``a`` in ``kw``, or
    two spreads sharing a key): a TypeError at run time whenever both do."""


@dataclass
class _Scope:
    names: dict[str, str] = field(default_factory=dict)
    """local name -> dotted path (``pkg.module.attr``), or ``inst:<path>`` for an instance."""
    dicts: dict[str, set[str] | None] = field(default_factory=dict)
    """local name -> keys of a keyword dict built here (None: not readable)."""
    parent: _Scope | None = None

    def lookup(self, name: str) -> str | None:
        s: _Scope | None = self
        while s is not None:
            if name in s.names:
                return s.names[name]
            s = s.parent
        return None


def _module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _absolute(module: str | None, level: int, current: str, is_package: bool) -> str:
    if level == 0:
        return module or ""
    base = current.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, module] if module else base)


class _Analyzer(ast.NodeVisitor):
    def __init__(self, index: _Index, module: str, tree: ast.Module, file: str, package: bool):
        self.index, self.module, self.file, self.package = index, module, file, package
        self.scope = _Scope()
        self.classes: list[dict[str, str]] = []  # self.x types of the enclosing classes
        self.refs: list[Ref] = []
        self.tree = tree
        self.consts: dict[str, ast.expr] = {}  # names bound to a tuple or list display

    # ---------------------------------------------------------------- names
    def _bind_import(self, node: ast.Import | ast.ImportFrom, scope: _Scope) -> None:
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    scope.names[a.asname] = a.name
                else:
                    top = a.name.split(".")[0]
                    scope.names[top] = top
            return
        base = _absolute(node.module, node.level, self.module, self.package)
        for a in node.names:
            scope.names[a.asname or a.name] = f"{base}.{a.name}"

    def resolve(self, expr: ast.expr) -> str | None:
        """The dotted path (or ``inst:<path>``) ``expr`` stands for, where it is one."""
        if isinstance(expr, ast.Name):
            return self.scope.lookup(expr.id)
        if isinstance(expr, ast.Attribute):
            if isinstance(expr.value, ast.Name) and expr.value.id == "self" and self.classes:
                return self.classes[-1].get(expr.attr)
            base = self.resolve(expr.value)
            return f"{base}.{expr.attr}" if base else None
        if isinstance(expr, ast.Call):
            target = self.resolve(expr.func)
            if target and not target.startswith("inst:") and self._is_class(target):
                return "inst:" + target
        return None

    def _is_class(self, path: str) -> bool:
        """Whether an upstream path names a class (by its last part's spelling: CamelCase)."""
        last = path.rsplit(".", 1)[-1]
        return last[:1].isupper() and not last.isupper() and _upstream(path)

    def annotation(self, ann: ast.expr | None) -> str | None:
        """An annotation naming one upstream class (``X``, ``X | None``, ``Optional[X]``)."""
        if ann is None:
            return None
        if isinstance(ann, ast.BinOp):
            sides = [self.annotation(ann.left), self.annotation(ann.right)]
            sides = [s for s in sides if s]
            return sides[0] if len(sides) == 1 else None
        if isinstance(ann, ast.Subscript):
            return self.annotation(ann.slice) if (self.resolve(ann.value) or "").endswith(
                "Optional") else None
        path = self.resolve(ann)
        return "inst:" + path if path and not path.startswith("inst:") and _upstream(path) else None

    # ---------------------------------------------------------------- scopes
    def visit_Module(self, node: ast.Module) -> None:
        for stmt in node.body:  # our own functions and classes, for keyword dicts they return
            if isinstance(stmt, (ast.FunctionDef, ast.ClassDef)):
                self.scope.names[stmt.name] = f"{self.module}.{stmt.name}"
        for stmt in ast.walk(node):  # module-level imports wherever they sit (guards)
            if isinstance(stmt, (ast.Import, ast.ImportFrom)) and _top_level(node, stmt):
                self._bind_import(stmt, self.scope)
        self.generic_visit(node)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        types: dict[str, str] = {}
        for fn in [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
            inner = _Analyzer(self.index, self.module, self.tree, self.file, self.package)
            inner.scope = _Scope(parent=self.scope)
            inner._params(fn)
            for sub in ast.walk(fn):
                if isinstance(sub, (ast.Import, ast.ImportFrom)):
                    inner._bind_import(sub, inner.scope)
            for sub in ast.walk(fn):
                if isinstance(sub, ast.Assign) and len(sub.targets) == 1:
                    t = sub.targets[0]
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) \
                            and t.value.id == "self":
                        typ = inner.resolve(sub.value)
                        if typ and typ.startswith("inst:"):
                            types[t.attr] = typ
                elif isinstance(sub, ast.AnnAssign) and isinstance(sub.target, ast.Attribute):
                    typ = inner.annotation(sub.annotation)
                    if typ:
                        types[sub.target.attr] = typ
        for b in node.bases:
            self.visit(b)
        self.classes.append(types)
        for stmt in node.body:
            self.visit(stmt)
        self.classes.pop()

    def _params(self, fn: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        a = fn.args
        for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs]:
            typ = self.annotation(arg.annotation)
            if typ:
                self.scope.names[arg.arg] = typ

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        for d in [*node.decorator_list, *node.args.defaults, *node.args.kw_defaults]:
            if d is not None:
                self.visit(d)
        outer = self.scope
        self.scope = _Scope(parent=outer)
        self._params(node)
        for star in (node.args.vararg, node.args.kwarg):
            if star is not None:
                self.scope.dicts[star.arg] = _FORWARDED
        for stmt in node.body:
            self.visit(stmt)
        self.scope = outer

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Import(self, node: ast.Import) -> None:
        if self.scope.parent is not None:
            self._bind_import(node, self.scope)

    visit_ImportFrom = visit_Import

    def visit_Assign(self, node: ast.Assign) -> None:
        self.generic_visit(node)
        for t in node.targets:
            if isinstance(t, ast.Name) and isinstance(node.value, (ast.Tuple, ast.List)):
                self.consts[t.id] = node.value
            if isinstance(t, ast.Name):
                typ = self.resolve(node.value)
                if typ:
                    self.scope.names[t.id] = typ
                keys = self._dict_keys(node.value)
                if keys is not _NOT_A_DICT:
                    self.scope.dicts[t.id] = keys
            elif isinstance(t, (ast.Subscript, ast.Tuple)):
                for sub in (t.elts if isinstance(t, ast.Tuple) else [t]):
                    self._item_assign(sub)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self.generic_visit(node)
        if isinstance(node.target, ast.Name):
            typ = self.annotation(node.annotation) or (self.resolve(node.value)
                                                       if node.value else None)
            if typ:
                self.scope.names[node.target.id] = typ
            if node.value is not None:
                keys = self._dict_keys(node.value)
                if keys is not _NOT_A_DICT:
                    self.scope.dicts[node.target.id] = keys

    def _item_assign(self, t: ast.expr) -> None:
        if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) \
                and isinstance(self.scope.dicts.get(t.value.id), set):
            key = t.slice
            if isinstance(key, ast.Constant) and isinstance(key.value, str):
                self.scope.dicts[t.value.id].add(key.value)
            else:
                self.scope.dicts[t.value.id] = None

    # ---------------------------------------------------------------- keyword dicts
    def _dict_keys(self, expr: ast.expr):
        """Keys of a keyword dict ``expr`` builds: a set, None (a dict we cannot read), or
        ``_NOT_A_DICT``."""
        if isinstance(expr, ast.Dict):
            keys: set[str] | None = set()
            for k, v in zip(expr.keys, expr.values):
                if k is None:
                    more = self._spread(v)
                    keys = None if more is None or keys is None else keys | more
                elif isinstance(k, ast.Constant) and isinstance(k.value, str):
                    if keys is not None:
                        keys.add(k.value)
                else:
                    return None
            return keys
        if isinstance(expr, ast.IfExp):  # a None branch spreads nothing (it is never spread)
            a, b = (set() if isinstance(e, ast.Constant) and e.value is None else
                    self._dict_keys(e) for e in (expr.body, expr.orelse))
            if a is _NOT_A_DICT or b is _NOT_A_DICT:
                return _NOT_A_DICT
            return None if a is None or b is None else a | b
        if isinstance(expr, ast.DictComp) and len(expr.generators) == 1 \
                and isinstance(expr.key, ast.Name) \
                and isinstance(expr.generators[0].target, ast.Name) \
                and expr.key.id == expr.generators[0].target.id:
            return self._strings(expr.generators[0].iter)  # {k: v for k in <str constants>}
        if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id == "dict":
            keys = set()
            for kw in expr.keywords:
                if kw.arg is None:
                    more = self._spread(kw.value)
                    if more is None:
                        return None
                    keys |= more
                else:
                    keys.add(kw.arg)
            return None if expr.args else keys
        if isinstance(expr, ast.Call):
            ours = self.index.function(self.resolve(expr.func) or "")
            if ours is not None:
                return ours
        return _NOT_A_DICT

    def _strings(self, expr: ast.expr) -> set[str] | None:
        """A tuple or list of string constants, written out or bound to a name here."""
        if isinstance(expr, ast.Name):
            expr = self.consts.get(expr.id, expr)
        if isinstance(expr, (ast.Tuple, ast.List)) and all(
                isinstance(e, ast.Constant) and isinstance(e.value, str) for e in expr.elts):
            return {e.value for e in expr.elts}
        return None

    def _spread(self, expr: ast.expr) -> set[str] | None:
        """Keys a ``**expr`` spreads, or None."""
        if isinstance(expr, ast.Name):
            s: _Scope | None = self.scope
            while s is not None:
                if expr.id in s.dicts:
                    return s.dicts[expr.id]
                s = s.parent
        keys = self._dict_keys(expr)
        return None if keys is _NOT_A_DICT else keys

    def visit_Expr(self, node: ast.Expr) -> None:  # kw.update(...)
        self.generic_visit(node)
        c = node.value
        if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute) \
                and c.func.attr == "update" and isinstance(c.func.value, ast.Name) \
                and c.func.value.id in self.scope.dicts:
            name = c.func.value.id
            got = self._dict_keys(ast.Call(func=ast.Name("dict"), args=[], keywords=c.keywords))
            extra = [self._spread(a) for a in c.args]
            keys = self.scope.dicts[name]
            if not isinstance(keys, set) or got is None or any(not isinstance(e, set) for e in extra):
                self.scope.dicts[name] = None
            else:
                self.scope.dicts[name] = keys | got | set().union(*extra)

    # ---------------------------------------------------------------- references
    def visit_Call(self, node: ast.Call) -> None:
        if isinstance(node.func, ast.IfExp):  # (A if c else B)(...): a call of each
            for branch in (node.func.body, node.func.orelse):
                self.visit_Call(ast.Call(func=branch, args=node.args, keywords=node.keywords,
                                         lineno=node.lineno, col_offset=node.col_offset))
            self.visit(node.func.test)
            return
        target = self.resolve(node.func)
        if target and _upstream(target.removeprefix("inst:")):
            bound = isinstance(node.func, ast.Attribute) and \
                (self.resolve(node.func.value) or "").startswith("inst:")
            keywords: set[str] | None = set()
            twice: set[str] = set()
            forwarded = any(isinstance(a, ast.Starred) and self._spread(a.value) is _FORWARDED
                            for a in node.args)
            for kw in node.keywords:
                if kw.arg is not None:
                    if keywords is not None and kw.arg in keywords:
                        twice.add(kw.arg)
                    keywords = None if keywords is None else keywords | {kw.arg}
                    continue
                more = self._spread(kw.value)
                if more is _FORWARDED:
                    forwarded = True
                    continue
                if isinstance(more, set) and keywords is not None:
                    twice |= keywords & more
                keywords = None if more is None or keywords is None else keywords | more
            path = target.removeprefix("inst:")
            if target.startswith("inst:") and not bound:  # calling an instance: __call__
                path += ".__call__"
                bound = True
            self.refs.append(Ref(
                path, f"{self.file}:{node.lineno}", True,
                positional=sum(not isinstance(a, ast.Starred) for a in node.args),
                star_args=any(isinstance(a, ast.Starred) for a in node.args),
                keywords=None if keywords is None else tuple(sorted(keywords)), bound_self=bound,
                forwarded=forwarded, twice=tuple(sorted(twice))))
            for a in [*node.args, *[k.value for k in node.keywords]]:
                self.visit(a)
            if isinstance(node.func, ast.Attribute):
                self.visit(node.func.value)
            return
        self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:  # an imported upstream name, used
        target = self.scope.lookup(node.id)
        if target and isinstance(node.ctx, ast.Load) and not target.startswith("inst:") \
                and _upstream(target) and "." in target:
            self.refs.append(Ref(target, f"{self.file}:{node.lineno}", False))

    def visit_Attribute(self, node: ast.Attribute) -> None:
        target = self.resolve(node)
        if target and _upstream(target.removeprefix("inst:")) and isinstance(node.ctx, ast.Load):
            self.refs.append(Ref(target.removeprefix("inst:"),
                                 f"{self.file}:{node.lineno}", False))
            return
        self.generic_visit(node)


_NOT_A_DICT = object()
_FORWARDED = object()  # a function's own *args / **kwargs


def _top_level(module: ast.Module, stmt: ast.stmt) -> bool:
    """Whether ``stmt`` sits at module level (possibly inside if/try blocks)."""
    todo: list[ast.stmt] = list(module.body)
    while todo:
        s = todo.pop()
        if s is stmt:
            return True
        if isinstance(s, (ast.If, ast.Try, ast.With)):
            todo += [*s.body, *getattr(s, "orelse", []), *getattr(s, "finalbody", []),
                     *[x for h in getattr(s, "handlers", []) for x in h.body]]
    return False


def _upstream(path: str) -> bool:
    return path.split(".")[0] in UPSTREAM


class _Index:
    """Our own functions that return keyword dicts, by dotted path."""

    def __init__(self, root: Path):
        self.defs: dict[str, tuple[ast.FunctionDef, str, ast.Module, str, bool]] = {}
        self.cache: dict[str, object] = {}
        self.root = root

    def add(self, module: str, tree: ast.Module, file: str, package: bool) -> None:
        for node in tree.body:
            if isinstance(node, ast.FunctionDef):
                self.defs[f"{module}.{node.name}"] = (node, module, tree, file, package)

    def function(self, path: str):
        """The keys one of our functions' returned dict has (a set or None), or _NOT_A_DICT."""
        if path not in self.defs:
            return _NOT_A_DICT
        if path in self.cache:
            return self.cache[path]
        self.cache[path] = None  # recursion guard
        fn, module, tree, file, package = self.defs[path]
        a = _Analyzer(self, module, tree, file, package)
        for stmt in ast.walk(tree):
            if isinstance(stmt, (ast.Import, ast.ImportFrom)) and _top_level(tree, stmt):
                a._bind_import(stmt, a.scope)
        a.scope = _Scope(parent=a.scope)
        keys: set[str] | None | object = _NOT_A_DICT
        for stmt in fn.body:
            a.visit(stmt)
        for ret in [n for n in ast.walk(fn) if isinstance(n, ast.Return) and n.value is not None]:
            got = a._spread(ret.value)
            keys = None if got is None or keys is None else \
                (got if keys is _NOT_A_DICT else keys | got)
        self.cache[path] = keys
        return keys


def references(root: Path) -> list[Ref]:
    """Every upstream reference in our scanned trees under ``root``."""
    files = sorted(p for d in SCANNED for p in (root / d).rglob("*.py"))
    index = _Index(root)
    parsed = []
    for path in files:
        tree = ast.parse(path.read_text(), str(path))
        module = _module_name(path, root)
        package = path.name == "__init__.py"
        index.add(module, tree, str(path.relative_to(root)), package)
        parsed.append((module, tree, str(path.relative_to(root)), package))
    refs: list[Ref] = []
    for module, tree, file, package in parsed:
        a = _Analyzer(index, module, tree, file, package)
        a.visit(tree)
        refs += a.refs
    return refs
