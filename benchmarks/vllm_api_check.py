"""Does kvcomm's vLLM connector fit a given vLLM release? Read from its source tree, not installed.

    python benchmarks/vllm_api_check.py VLLM_DIR [--baseline installed|DIR] [--json PATH]

``VLLM_DIR``: a folder holding vLLM's ``vllm`` package (site-packages, an unpacked wheel,
a git checkout) or the package folder itself; ``--installed`` takes the installed vLLM's. Only
Python sources are parsed (``ast``): nothing of that vLLM is imported, so any release can be
checked from a venv holding another (``pip download --no-deps vllm==X -d D``, unzip the wheel).

What is checked, against the connector's sources in ``integrations/vllm/``:

1. ``hooks``: for every kvcomm class built on a vLLM class (the connector on
   ``KVConnectorBase_V1``, the metadata on ``KVConnectorMetadata`` / ``KVConnectorWorkerMetadata``):
   every abstract method of the vLLM base is defined (else vLLM cannot instantiate it); every
   method kvcomm overrides exists in the base and accepts what the base's signature passes
   (the same positional names in order, keyword-only names or ``**kwargs``; no required
   parameter the base lacks; classmethod stays classmethod); every ``self.X`` kvcomm reads
   but does not set is a member of the base.
2. ``fields``: every attribute kvcomm reads on a vLLM object is a member of its class in that
   tree (dataclass and class fields, ``self.X`` set in a method, properties, methods, through
   the class's bases). Types come from kvcomm's annotations (``scheduler_output:
   "SchedulerOutput"``, ``request: "Request"``, ...), then from vLLM's own annotations along
   the chain (``scheduler_output.scheduled_cached_reqs`` is a ``CachedRequestData``,
   ``kv_cache_config.kv_cache_groups[0]`` a ``KVCacheGroupSpec``), loop variables and
   assignments included; an unannotated parameter takes the type its name is annotated with
   elsewhere in the connector (the hooks pass vLLM's arguments down by name). A read the types cannot follow is not checked; members kvcomm's own
   subclasses define (its metadata's fields) are kvcomm's, not vLLM's.
3. ``layout``: what the tree offers for declaring KV layouts and hybrid KV cache support
   (``KVConnectorBase_V1.get_required_kvcache_layout``, ``SupportsHMA`` and its abstract
   methods) and whether the connector declares them: reported, not checked.

4. ``changed`` (with ``--baseline``, a tested release's tree): every method of the base classes
   and every annotation of a member kvcomm reads that differs between the two trees, new or
   gone: what to read before trusting a release the checks above pass (they see names and
   signatures, not behaviour).

One line per finding (PASS/FAIL/INFO), then ``SUMMARY {json}``; exit status 0 when nothing
fails, 1 when something does, 2 when ``VLLM_DIR`` holds no vLLM.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
KVCOMM_SOURCES = REPO / "integrations" / "vllm"
KVCOMM_PACKAGE = "kvcomm.integrations.vllm"
BASE_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.base"


@dataclass(frozen=True)
class Cls:
    """A class of the vLLM tree: its module (dotted) and name."""

    module: str
    name: str

    def __str__(self) -> str:
        return f"{self.name} ({self.module})"


@dataclass(frozen=True)
class Seq:
    """A list, tuple, set or other iterable whose elements have type ``item``."""

    item: object


@dataclass(frozen=True)
class Map:
    """A dict whose values have type ``value``."""

    value: object


class Tree:
    """The Python sources of one ``vllm`` package folder, parsed on demand."""

    def __init__(self, package: Path):
        self.package = package
        self._modules: dict[str, ast.Module | None] = {}
        self._members: dict[Cls, dict[str, ast.AST | None]] = {}
        self._resolved: dict[tuple[str, str], Cls | None] = {}
        self._classes: dict[str, dict[str, ast.ClassDef]] = {}
        self._imports: dict[str, dict[str, tuple[str, str]]] = {}

    def _index(self, module: str) -> None:
        """The module's classes (anywhere in it) and imported names, read once."""
        if module not in self._classes:
            tree = self.module(module)
            nodes = list(ast.walk(tree)) if tree is not None else []
            self._classes[module] = {n.name: n for n in reversed(nodes) if isinstance(n, ast.ClassDef)}
            self._imports[module] = {(alias.asname or alias.name): (alias.name, _absolute(n, module))
                                     for n in nodes if isinstance(n, ast.ImportFrom) for alias in n.names}

    def module(self, dotted: str) -> ast.Module | None:
        if dotted not in self._modules:
            parts = dotted.split(".")
            base = self.package.joinpath(*parts[1:])
            path = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
            self._modules[dotted] = ast.parse(path.read_text(encoding="utf-8"), str(path)) if path.is_file() else None
        return self._modules[dotted]

    def resolve(self, name: str, module: str, depth: int = 0) -> Cls | None:
        """The class ``name`` means in ``module``: defined there, or imported (followed)."""
        key = (name, module)
        if key not in self._resolved:
            self._resolved[key] = None
            self._index(module)
            if name in self._classes[module]:
                self._resolved[key] = Cls(module, name)
            elif name in self._imports[module] and depth < 8:
                original, source = self._imports[module][name]
                self._resolved[key] = self.resolve(original, source, depth + 1)
        return self._resolved[key]

    def classdef(self, cls: Cls) -> ast.ClassDef:
        self._index(cls.module)
        return self._classes[cls.module][cls.name]

    def bases(self, cls: Cls) -> list[Cls]:
        found = []
        for base in self.classdef(cls).bases:
            name = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", None)
            resolved = self.resolve(name, cls.module) if name else None
            if resolved is not None:
                found.append(resolved)
        return found

    def members(self, cls: Cls) -> dict[str, ast.AST | None]:
        """Member name -> its annotation (a field's, a property's or method's return), or None
        when unannotated; bases first, so the class's own definitions win."""
        if cls not in self._members:
            out: dict[str, ast.AST | None] = {}
            for base in self.bases(cls):
                out.update(self.members(base))
            for node in self.classdef(cls).body:
                if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    out[node.target.id] = node.annotation
                elif isinstance(node, ast.Assign):
                    out.update({t.id: None for t in node.targets if isinstance(t, ast.Name)})
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    out[node.name] = node.returns
                    for inner in ast.walk(node):
                        target = inner.target if isinstance(inner, ast.AnnAssign) else None
                        targets = [target] if target is not None else getattr(inner, "targets", [])
                        for t in targets:
                            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                                out.setdefault(t.attr, inner.annotation if isinstance(inner, ast.AnnAssign) else None)
            self._members[cls] = out
        return self._members[cls]

    def methods(self, cls: Cls) -> dict[str, tuple[ast.FunctionDef, Cls]]:
        """Method name -> (its definition, the class defining it), through the bases."""
        out: dict[str, tuple[ast.FunctionDef, Cls]] = {}
        for base in self.bases(cls):
            out.update(self.methods(base))
        for node in self.classdef(cls).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out[node.name] = (node, cls)
        return out

    def annotation_type(self, annotation: ast.AST | None, module: str):
        """The type an annotation written in ``module`` names: Cls, Seq, Map or None."""
        if annotation is None:
            return None
        if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
            try:
                return self.annotation_type(ast.parse(annotation.value, mode="eval").body, module)
            except SyntaxError:
                return None
        if isinstance(annotation, ast.BinOp) and isinstance(annotation.op, ast.BitOr):  # X | None
            return self.annotation_type(annotation.left, module) or self.annotation_type(annotation.right, module)
        if isinstance(annotation, ast.Subscript):
            outer = _name(annotation.value)
            args = annotation.slice.elts if isinstance(annotation.slice, ast.Tuple) else [annotation.slice]
            if outer in ("Optional", "Union"):
                return next((t for t in (self.annotation_type(a, module) for a in args) if t is not None), None)
            if outer in ("list", "List", "Sequence", "Iterable", "Iterator", "set", "Set", "frozenset", "tuple", "Tuple",
                         "Collection"):
                return Seq(self.annotation_type(args[0], module))
            if outer in ("dict", "Dict", "Mapping", "MutableMapping") and len(args) == 2:
                return Map(self.annotation_type(args[1], module))
            return None
        name = _name(annotation)
        return self.resolve(name, module) if name else None


def _name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _absolute(node: ast.ImportFrom, module: str) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".")
    package = package[: len(package) - node.level] if not module.endswith("__init__") else package
    return ".".join(package + ([node.module] if node.module else []))


@dataclass
class Findings:
    rows: list[tuple[str, str, str]] = field(default_factory=list)
    reads: set[tuple[str, str]] = field(default_factory=set)
    owners: dict[str, Cls] = field(default_factory=dict)
    """``Class.member`` read -> the class, where the tree defines it."""
    own: dict[Cls, set[str]] = field(default_factory=dict)
    """vLLM class -> members kvcomm's subclasses of it define (metadata kvcomm sends itself)."""

    def add(self, verdict: str, kind: str, detail: str) -> None:
        self.rows.append((verdict, kind, detail))


class KvcommModule:
    """One of the connector's source files: the vLLM names it imports and its definitions."""

    def __init__(self, path: Path, tree: Tree):
        self.path, self.tree = path, tree
        self.ast = ast.parse(path.read_text(encoding="utf-8"), str(path))
        self.vllm_names: dict[str, Cls] = {}
        for node in ast.walk(self.ast):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vllm"):
                for alias in node.names:
                    cls = tree.resolve(alias.name, node.module)
                    if cls is not None:
                        self.vllm_names[alias.asname or alias.name] = cls

    def type_of_annotation(self, annotation: ast.AST | None):
        if annotation is None:
            return None
        if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
            try:
                annotation = ast.parse(annotation.value, mode="eval").body
            except SyntaxError:
                return None
        if isinstance(annotation, ast.BinOp):
            return self.type_of_annotation(annotation.left) or self.type_of_annotation(annotation.right)
        if isinstance(annotation, ast.Subscript):
            outer = _name(annotation.value)
            args = annotation.slice.elts if isinstance(annotation.slice, ast.Tuple) else [annotation.slice]
            if outer in ("list", "Sequence", "Iterable", "tuple"):
                return Seq(self.type_of_annotation(args[0]))
            if outer == "dict" and len(args) == 2:
                return Map(self.type_of_annotation(args[1]))
            return None
        name = _name(annotation)
        return self.vllm_names.get(name) if name else None


class Reads(ast.NodeVisitor):
    """Attribute reads on vLLM objects inside one kvcomm function, by type flow."""

    def __init__(self, module: KvcommModule, env: dict[str, object], self_types: dict[str, object], findings: Findings):
        self.module, self.tree, self.env, self.self_types, self.findings = module, module.tree, dict(env), self_types, findings

    def type_of(self, node: ast.AST, record: bool = True):
        if isinstance(node, ast.Name):
            return self.env.get(node.id)
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id == "self":
                return self.self_types.get(node.attr)
            owner = self.type_of(node.value, record)
            if not isinstance(owner, Cls):
                return None
            members = self.tree.members(owner)
            if record and node.attr not in self.findings.own.get(owner, ()):
                where = f"{self.module.path.name}:{node.lineno}"
                self.findings.reads.add((f"{owner.name}.{node.attr}", where))
                self.findings.owners[f"{owner.name}.{node.attr}"] = owner
                if node.attr not in members:
                    self.findings.add("FAIL", "fields", f"{owner} has no member {node.attr!r} (read at {where})")
            return self.tree.annotation_type(members.get(node.attr), owner.module)
        if isinstance(node, ast.Subscript):
            owner = self.type_of(node.value, record)
            return owner.item if isinstance(owner, Seq) else owner.value if isinstance(owner, Map) else None
        if isinstance(node, ast.Call):
            return self.type_of(node.func, record)
        return None

    def learn(self, body: list[ast.stmt]) -> None:
        """Bind names to types from assignments, loops and comprehensions (two passes: a
        binding may be used above where it is made, in a loop)."""
        for _ in range(2):
            for node in (n for stmt in body for n in ast.walk(stmt)):
                if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                    kind = self.type_of(node.value, record=False)
                    if kind is not None:
                        self.env[node.targets[0].id] = kind
                elif isinstance(node, (ast.For, ast.comprehension)) and isinstance(node.target, ast.Name):
                    kind = self.type_of(node.iter, record=False)
                    if isinstance(kind, Seq) and kind.item is not None:
                        self.env[node.target.id] = kind.item

    def visit_Attribute(self, node: ast.Attribute) -> None:
        self.type_of(node)
        # the chain's inner attributes were just recorded by type_of; do not walk them again
        for child in ast.iter_child_nodes(node.value) if isinstance(node.value, ast.Attribute) else [node.value]:
            self.visit(child)


def parameter_types(modules: list[KvcommModule]) -> dict[str, object]:
    """Parameter name -> the vLLM type it is annotated with wherever the connector annotates it
    (names annotated with two different types are left out): the hooks hand their arguments down
    to the scheduler and worker sides under vLLM's names, not always annotated again."""
    seen: dict[str, set] = {}
    for module in modules:
        for function in (n for n in ast.walk(module.ast) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            for arg in _arguments(function):
                kind = module.type_of_annotation(arg.annotation)
                if kind is not None:
                    seen.setdefault(arg.arg, set()).add(kind)
    return {name: next(iter(kinds)) for name, kinds in seen.items() if len(kinds) == 1}


def check_fields(modules: list[KvcommModule], findings: Findings) -> None:
    by_name = parameter_types(modules)

    def typed(module: KvcommModule, arg: ast.arg):
        return module.type_of_annotation(arg.annotation) if arg.annotation is not None else by_name.get(arg.arg)

    for module in modules:
        for cls_node in (n for n in module.ast.body if isinstance(n, ast.ClassDef)):
            for base in (module.vllm_names.get(_name(b) or "") for b in cls_node.bases):
                if base is not None:
                    findings.own.setdefault(base, set()).update(own_members(cls_node))
    for module in modules:
        for cls_node in [n for n in module.ast.body if isinstance(n, ast.ClassDef)] + [None]:
            functions = [n for n in (cls_node.body if cls_node else module.ast.body) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
            self_types: dict[str, object] = {}
            for function in functions:  # self.X = <typed parameter> anywhere in the class
                env = {a.arg: typed(module, a) for a in _arguments(function)}
                for node in ast.walk(function):
                    if isinstance(node, (ast.Assign, ast.AnnAssign)):
                        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                        for t in targets:
                            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                                kind = module.type_of_annotation(node.annotation) if isinstance(node, ast.AnnAssign) else None
                                if kind is None and isinstance(node.value, ast.Name):
                                    kind = env.get(node.value.id)
                                if kind is not None:
                                    self_types[t.attr] = kind
            for function in functions:
                env = {a.arg: t for a in _arguments(function) if (t := typed(module, a)) is not None}
                reads = Reads(module, env, self_types, findings)
                reads.learn(function.body)
                for stmt in function.body:
                    reads.visit(stmt)


def _arguments(function: ast.FunctionDef) -> list[ast.arg]:
    a = function.args
    return [*a.posonlyargs, *a.args, *([a.vararg] if a.vararg else []), *a.kwonlyargs, *([a.kwarg] if a.kwarg else [])]


def _decorators(function: ast.FunctionDef) -> set[str]:
    return {_name(d.func if isinstance(d, ast.Call) else d) or "" for d in function.decorator_list}


def signature_problem(ours: ast.FunctionDef, theirs: ast.FunctionDef) -> str | None:
    """Why ``ours`` cannot take the calls ``theirs``' signature allows, or None."""
    if ("classmethod" in _decorators(ours)) != ("classmethod" in _decorators(theirs)):
        return "classmethod in one, not in the other"
    if ("staticmethod" in _decorators(ours)) != ("staticmethod" in _decorators(theirs)):
        return "staticmethod in one, not in the other"
    a, b = ours.args, theirs.args
    our_positional = [x.arg for x in [*a.posonlyargs, *a.args]]
    their_positional = [x.arg for x in [*b.posonlyargs, *b.args]]
    for i, name in enumerate(their_positional):
        if i < len(our_positional):
            if our_positional[i] != name:
                return f"parameter {i} is {our_positional[i]!r}, vLLM's is {name!r}"
        elif a.vararg is None:
            return f"no parameter {name!r} (vLLM passes it)"
    for name in (x.arg for x in b.kwonlyargs):
        if name not in our_positional and name not in {x.arg for x in a.kwonlyargs} and a.kwarg is None:
            return f"no keyword parameter {name!r} (vLLM's signature has it)"
    if b.kwarg is not None and a.kwarg is None:
        return f"no **{b.kwarg.arg} (vLLM's signature takes extra keywords)"
    required = len(our_positional) - len(a.defaults)
    for name in our_positional[len(their_positional):required]:
        return f"requires {name!r}, which vLLM's signature does not have"
    for arg, default in zip(a.kwonlyargs, a.kw_defaults):
        if default is None and arg.arg not in {x.arg for x in b.kwonlyargs} and arg.arg not in their_positional:
            return f"requires keyword {arg.arg!r}, which vLLM's signature does not have"
    return None


def _is_abstract(function: ast.FunctionDef) -> bool:
    return "abstractmethod" in _decorators(function)


def check_hooks(modules: list[KvcommModule], tree: Tree, findings: Findings) -> None:
    for module in modules:
        for cls_node in (n for n in module.ast.body if isinstance(n, ast.ClassDef)):
            bases = [module.vllm_names[name] for b in cls_node.bases if (name := _name(b)) in module.vllm_names]
            if not bases:
                continue
            ours = {n.name: n for n in cls_node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
            assigned = own_members(cls_node)
            theirs: dict[str, tuple[ast.FunctionDef, Cls]] = {}
            members: dict[str, ast.AST | None] = {}
            for base in bases:
                theirs.update(tree.methods(base))
                members.update(tree.members(base))
            where = f"{cls_node.name} ({module.path.name})"
            missing = sorted(name for name, (fn, _) in theirs.items() if _is_abstract(fn) and name not in ours)
            if missing:
                findings.add("FAIL", "hooks", f"{where} does not define vLLM's abstract {', '.join(missing)}: vLLM cannot build it")
            for name, function in sorted(ours.items()):
                if name.startswith("__") and name != "__init__":
                    continue
                if name not in theirs:
                    if name != "__init__" and not name.startswith("_"):
                        findings.add("INFO", "hooks", f"{where}.{name}: not in vLLM's {', '.join(b.name for b in bases)} (kvcomm's own)")
                    continue
                base_fn, owner = theirs[name]
                problem = signature_problem(function, base_fn)
                if problem:
                    findings.add("FAIL", "hooks", f"{where}.{name} vs {owner.name}.{name}: {problem}")
                else:
                    findings.add("PASS", "hooks", f"{where}.{name} fits {owner.name}.{name}{_signature(base_fn)}")
            for node in ast.walk(cls_node):
                if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
                        and isinstance(node.ctx, ast.Load) and node.attr not in ours and node.attr not in assigned):
                    if node.attr in members:
                        findings.reads.add((f"{bases[0].name}.{node.attr}", f"{module.path.name}:{node.lineno}"))
                        findings.owners[f"{bases[0].name}.{node.attr}"] = bases[0]
                    else:
                        findings.add("FAIL", "hooks", f"{where} reads self.{node.attr} (line {node.lineno}), which vLLM's "
                                                      f"{', '.join(b.name for b in bases)} no longer has")


def own_members(cls_node: ast.ClassDef) -> set[str]:
    """What a kvcomm class defines itself: methods, class-level fields, ``self.X`` it sets."""
    names = {n.name for n in cls_node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    names |= {n.target.id for n in cls_node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    names |= {t.id for n in cls_node.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    return names | {t.attr for n in ast.walk(cls_node) for t in getattr(n, "targets", [getattr(n, "target", None)])
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}


def _signature(function: ast.FunctionDef) -> str:
    return "(" + ", ".join(a.arg for a in _arguments(function) if a.arg not in ("self", "cls")) + ")"


def check_layout(modules: list[KvcommModule], tree: Tree, findings: Findings) -> dict:
    base = tree.resolve("KVConnectorBase_V1", BASE_MODULE)
    methods = tree.methods(base)
    connector = next(n for m in modules for n in m.ast.body if isinstance(n, ast.ClassDef) and n.name == "KvcommConnector")
    ours = {n.name for n in connector.body if isinstance(n, ast.FunctionDef)}
    out = {}
    if "get_required_kvcache_layout" in methods:
        fn = methods["get_required_kvcache_layout"][0]
        declared = "get_required_kvcache_layout" in ours
        out["get_required_kvcache_layout"] = {"in_vllm": True, "declared_by_kvcomm": declared}
        keeps = "keeps vLLM's default (requires no layout: the connector learns any layout at register_kv_caches)"
        findings.add("INFO", "layout", f"KVConnectorBase_V1.get_required_kvcache_layout{_signature(fn)} exists; kvcomm "
                                       f"{'overrides it' if declared else keeps}")
    else:
        out["get_required_kvcache_layout"] = {"in_vllm": False, "declared_by_kvcomm": "get_required_kvcache_layout" in ours}
        findings.add("INFO", "layout", "KVConnectorBase_V1 has no get_required_kvcache_layout in this tree")
    hma = tree.resolve("SupportsHMA", BASE_MODULE)
    declared = any(_name(b) == "SupportsHMA" for b in connector.bases)
    if hma is None:
        out["SupportsHMA"] = {"in_vllm": False, "declared_by_kvcomm": declared}
        findings.add("INFO", "layout", "no SupportsHMA in this tree")
    else:
        abstract = sorted(n for n, (fn, _) in tree.methods(hma).items() if _is_abstract(fn))
        out["SupportsHMA"] = {"in_vllm": True, "module": hma.module, "abstract": abstract, "declared_by_kvcomm": declared}
        findings.add("INFO", "layout", f"SupportsHMA in {hma.module} (abstract: {', '.join(abstract)}); kvcomm "
                                       f"{'declares it' if declared else 'does not declare it: vLLM turns its hybrid KV cache manager off for this connector'}")
    return out


def surface(package: Path, owners: dict[str, Cls]) -> dict[str, str]:
    """What of the tree the connector depends on, as text to compare between releases: every
    method of the base classes (signature, abstract or classmethod) and the annotation of every
    member kvcomm reads (``owners``: ``Class.member`` -> the class, looked up in this tree at
    the same module)."""
    tree = Tree(package)
    out = {}
    for name in ("KVConnectorBase_V1", "SupportsHMA", "KVConnectorMetadata", "KVConnectorWorkerMetadata"):
        cls = tree.resolve(name, BASE_MODULE)
        for method, (fn, _) in (tree.methods(cls).items() if cls else ()):
            kind = "abstract " if _is_abstract(fn) else "classmethod " if "classmethod" in _decorators(fn) else ""
            out[f"{name}.{method}"] = kind + ast.unparse(fn.args) + (f" -> {ast.unparse(fn.returns)}" if fn.returns else "")
    for read, owner in owners.items():
        cls = tree.resolve(owner.name, owner.module)
        members = tree.members(cls) if cls is not None else {}
        member = read.partition(".")[2]
        if member in members:
            out[read] = ast.unparse(members[member]) if members[member] is not None else "(unannotated)"
    return out


def compare(baseline: dict[str, str], current: dict[str, str], findings: Findings) -> None:
    """INFO rows for what differs from the baseline tree (a tested release)."""
    for key in sorted(set(baseline) | set(current)):
        if key not in baseline:
            findings.add("INFO", "changed", f"new in this tree: {key}: {current[key]}")
        elif key not in current:
            findings.add("INFO", "changed", f"gone from this tree: {key}: {baseline[key]}")
        elif baseline[key] != current[key]:
            findings.add("INFO", "changed", f"{key}: {baseline[key]}  ->  {current[key]}")


def vllm_package(folder: Path) -> Path | None:
    for candidate in (folder / "vllm", folder):
        if (candidate / "__init__.py").is_file() and (candidate / "distributed").is_dir() and candidate.name == "vllm":
            return candidate
    return None


def version_of(package: Path) -> str:
    for name in ("_version.py", "version.py"):
        path = package / name
        if path.is_file():
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Assign) and any(_name(t) in ("__version__", "version") for t in node.targets):
                    if isinstance(node.value, ast.Constant):
                        return str(node.value.value)
    return "unknown"


def run(package: Path, baseline: Path | None = None) -> tuple[list[tuple[str, str, str]], dict]:
    tree = Tree(package)
    if tree.resolve("KVConnectorBase_V1", BASE_MODULE) is None:
        raise FileNotFoundError(f"{package}: no KVConnectorBase_V1 in {BASE_MODULE}")
    modules = [KvcommModule(path, tree) for path in sorted(KVCOMM_SOURCES.rglob("*.py"))]
    findings = Findings()
    check_hooks(modules, tree, findings)
    check_fields(modules, findings)
    layout = check_layout(modules, tree, findings)
    fields_read = sorted({name for name, _ in findings.reads})
    if not any(kind == "fields" and verdict == "FAIL" for verdict, kind, _ in findings.rows):
        findings.add("PASS", "fields", f"{len(fields_read)} members of vLLM classes read by kvcomm exist: {', '.join(fields_read)}")
    if baseline is not None:
        compare(surface(baseline, findings.owners), surface(package, findings.owners), findings)
    summary = {
        "vllm": version_of(package), "source": str(package),
        "ok": not any(verdict == "FAIL" for verdict, _, _ in findings.rows),
        "failed": [f"{kind}: {detail}" for verdict, kind, detail in findings.rows if verdict == "FAIL"],
        "hooks_checked": sum(kind == "hooks" and verdict == "PASS" for verdict, kind, _ in findings.rows),
        "fields_read": fields_read, "layout": layout,
        "baseline": None if baseline is None else {"vllm": version_of(baseline), "source": str(baseline),
                                                   "changed": [d for v, k, d in findings.rows if k == "changed"]},
    }
    return findings.rows, summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("vllm_dir", nargs="?", help="a folder holding the vllm package, or the package folder")
    parser.add_argument("--installed", action="store_true", help="check the installed vLLM's sources")
    parser.add_argument("--baseline", metavar="DIR", help="a tested vLLM's folder ('installed': the installed one): "
                        "also list what the connector depends on that differs from it (INFO)")
    parser.add_argument("--json", help="write the rows and the summary here")
    args = parser.parse_args(argv)
    if args.installed == (args.vllm_dir is not None):
        parser.error("give VLLM_DIR or --installed (one of them)")
    if args.installed:
        import importlib.util

        spec = importlib.util.find_spec("vllm")
        folder = Path(spec.origin).parent if spec and spec.origin else None
    else:
        folder = Path(args.vllm_dir)
    package = vllm_package(folder) if folder is not None and folder.is_dir() else None
    if package is None:
        print(f"vllm_api_check: no vllm package (vllm/__init__.py with vllm/distributed/) in {folder}", file=sys.stderr)
        return 2
    baseline = None
    if args.baseline:
        if args.baseline == "installed":
            import importlib.util

            spec = importlib.util.find_spec("vllm")
            args.baseline = str(Path(spec.origin).parent) if spec and spec.origin else ""
        baseline = vllm_package(Path(args.baseline)) if Path(args.baseline).is_dir() else None
        if baseline is None:
            print(f"vllm_api_check: no vllm package in --baseline {args.baseline}", file=sys.stderr)
            return 2
    try:
        rows, summary = run(package, baseline)
    except FileNotFoundError as error:
        print(f"vllm_api_check: {error}", file=sys.stderr)
        return 2
    print(f"== vLLM {summary['vllm']} at {package}")
    for verdict, kind, detail in rows:
        print(f"{verdict:5} {kind:7} {detail}")
    print("CONNECTOR FITS" if summary["ok"] else "CONNECTOR DOES NOT FIT")
    print("SUMMARY " + json.dumps(summary))
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "rows": [dict(zip(("verdict", "kind", "detail"), r)) for r in rows]}, indent=1))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
