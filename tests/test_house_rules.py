"""The rules of DESIGN.md that keep the package a house and not a heap, checked on its source.

Read with ``ast`` from the files alone (nothing is imported, so this takes well under a second):

* the import graph of ``mmbalance`` has no cycle (imports inside functions count: a lazy import
  still closes a circle), and no module hides an edge from it with ``importlib``;
* no module imports a private ``_name`` of another module (a private module is importable only
  from inside the package that holds it), nor reads one as an attribute (``plan._source``: a
  private name that only other modules of the package define);
* every import crosses layers only as DESIGN.md's table allows, and the backend dispatcher
  (``kernels/dispatch.py``), which every layer may import, stays a leaf;
* ``__all__`` is exact: every name it lists exists, every public name a package's ``__init__``
  binds is listed, and a name another module imports from a module with an ``__all__`` is listed
  there;
* DESIGN.md's map ("Which file holds what") names every file of ``mmbalance/``'s layers, and
  nothing else.
"""

from __future__ import annotations

import ast
import functools
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "mmbalance"

# DESIGN.md's layer table: what each layer may import besides itself. ``mmbalance`` (the
# facade and the command line) and ``bench`` may import everything. ``dispatch`` is the one module
# ``mmbalance.kernels.dispatch``: a leaf every layer may import.
DISPATCH = "mmbalance.kernels.dispatch"
LAYERS = {
    "_core": set(),
    "dispatch": set(),
    "balancing": {"_core"},
    "kernels": {"dispatch"},
    "pyops": {"kernels", "dispatch"},
    "collectives": {"pyops", "balancing", "dispatch"},
    "integrations": {"collectives", "pyops", "balancing", "dispatch"},
    "bench": {"*"},
    "facade": {"*"},
}
# Third-party packages a layer may import (standard library always); ``None``: anything.
THIRD_PARTY = {
    "_core": set(),
    "dispatch": {"torch"},
    "balancing": {"numpy", "scipy"},  # scipy: the optional exact node-wise permutation
    "kernels": None,
    "pyops": None,
    "collectives": None,
    "integrations": None,
    "bench": None,
    "facade": None,
}

# Modules that may call ``importlib.import_module``: the facade's lazy attributes and the loader of
# the compiled core (a clear message when it is not built).
DYNAMIC_IMPORTS = {"mmbalance", "mmbalance.balancing._core_api"}

# What breaks a rule today, with the reason. Each entry must still be needed (see
# ``test_known_exceptions_are_still_needed``), so the lists only ever shrink.
KNOWN_PRIVATE_IMPORTS: dict[str, str] = {}
KNOWN_PRIVATE_ATTRIBUTES: dict[str, str] = {}
KNOWN_CYCLES: dict[frozenset[str], str] = {}


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    target: str  # the imported module (or the module a name is imported from)
    name: str | None  # the imported name (``from target import name``), None for ``import target``
    line: int


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@functools.cache
def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


@functools.cache
def tree(mod: str) -> ast.Module:
    path = modules()[mod]
    return ast.parse(path.read_text(), filename=str(path))


def is_package(mod: str) -> bool:
    return modules()[mod].name == "__init__.py"


def resolve(mod: str, level: int, target: str | None) -> str:
    """The absolute module of ``from <level dots><target> import ...`` written in ``mod``."""
    if level == 0:
        return target or ""
    base = mod.split(".")
    if not is_package(mod):
        base = base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def is_module(name: str) -> bool:
    return name in modules() or name == "mmbalance._core"


@functools.cache
def imports(mod: str) -> tuple[Import, ...]:
    out = []
    for node in ast.walk(tree(mod)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                out.append(Import(mod, alias.name, None, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            target = resolve(mod, node.level, node.module)
            for alias in node.names:
                out.append(Import(mod, target, alias.name, node.lineno))
    return tuple(out)


def first_party(imp: Import) -> bool:
    return imp.target == "mmbalance" or imp.target.startswith("mmbalance.")


def edges(mod: str) -> set[str]:
    """The ``mmbalance`` modules that importing ``mod`` runs, directly: the imported module (or
    submodule, for ``from package import submodule``) and the packages above it that ``mod`` is
    not itself inside (those are already running)."""
    out = set()
    for imp in imports(mod):
        if not first_party(imp):
            continue
        target = imp.target
        if imp.name is not None and is_module(f"{target}.{imp.name}"):
            target = f"{target}.{imp.name}"
            # ``from . import sub`` inside the package does not run the package again
            if not (mod == imp.target or mod.startswith(imp.target + ".")):
                out.add(imp.target)
        out.add(target)
        parts = target.split(".")
        for k in range(1, len(parts)):
            parent = ".".join(parts[:k])
            if not (mod == parent or mod.startswith(parent + ".")):
                out.add(parent)
    out.discard(mod)
    return {m for m in out if m in modules()}


def layer(mod: str) -> str:
    parts = mod.split(".")
    if mod == "mmbalance._core":
        return "_core"
    if mod == DISPATCH:
        return "dispatch"
    if len(parts) == 1 or parts[1] in ("cli", "__main__"):
        return "facade"
    return parts[1]


def defined_names(mod: str) -> set[str]:
    """Every name bound at the top level of ``mod`` (defs, classes, assignments, imports)."""
    names: set[str] = set()

    def visit(body):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    for n in ast.walk(t):
                        if isinstance(n, ast.Name):
                            names.add(n.id)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                for alias in node.names:
                    if alias.name == "*":  # binds exactly the other module's __all__
                        assert isinstance(node, ast.ImportFrom)
                        names.update(all_of(resolve(mod, node.level, node.module)) or [])
                        continue
                    names.add(alias.asname or alias.name.split(".")[0])
            elif isinstance(node, (ast.If, ast.Try)):
                visit(node.body)
                visit(getattr(node, "orelse", []))
                for h in getattr(node, "handlers", []):
                    visit(h.body)
                visit(getattr(node, "finalbody", []))

    visit(tree(mod).body)
    return names


def all_of(mod: str) -> list[str] | None:
    """``mod``'s ``__all__`` (None without one): a list or tuple of strings, which may unpack a
    submodule's (``[*varlen.__all__, "name"]``)."""
    for node in tree(mod).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                assert isinstance(node.value, (ast.List, ast.Tuple)), f"{mod}: __all__ must be a list"
                names: list[str] = []
                for item in node.value.elts:
                    if isinstance(item, ast.Starred):
                        ref = item.value
                        assert isinstance(ref, ast.Attribute) and ref.attr == "__all__", ast.dump(item)
                        assert isinstance(ref.value, ast.Name), ast.dump(item)
                        names += all_of(f"{mod}.{ref.value.id}") or []
                    else:
                        names.append(ast.literal_eval(item))
                return names
    return None


def module_getattr(mod: str) -> bool:
    return any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in tree(mod).body)


# ---------------------------------------------------------------------------------------- tests
def test_the_package_is_found():
    found = set(modules())
    assert {"mmbalance.balancing.plan", "mmbalance.collectives.exchange.alltoall", "mmbalance.cli"} <= found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    color: dict[str, int] = {}
    stack: list[str] = []

    def dfs(node: str) -> list[str] | None:
        color[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if color.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in color:
                found = dfs(nxt)
                if found:
                    return found
        stack.pop()
        color[node] = 2
        return None

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for node in sorted(graph):
        if node not in color:
            found = dfs(node)
            if found:
                return found
    return None


def cyclic_sets(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected sets of ``graph`` that hold a cycle (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1 or v in graph.get(v, ()):
                out.append(group)

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def import_graph() -> dict[str, set[str]]:
    return {mod: edges(mod) for mod in modules()}


def test_no_import_cycle():
    graph = import_graph()
    found = []
    for group in cyclic_sets(graph):
        if frozenset(group) in KNOWN_CYCLES:
            continue
        cycle = find_cycle({m: graph[m] & group for m in group})
        found.append(" -> ".join(cycle or sorted(group)))
    assert not found, "import cycles:\n" + "\n".join(found)


def test_known_cycles_are_still_cycles():
    current = [frozenset(g) for g in cyclic_sets(import_graph())]
    stale = [sorted(k) for k in KNOWN_CYCLES if k not in current]
    assert not stale, f"no longer a cycle of exactly these modules (update KNOWN_CYCLES): {stale}"


def test_the_cycle_check_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
    graph = {"a": {"b"}, "b": {"a", "c"}, "c": {"d"}, "d": {"c"}, "e": {"e"}, "f": {"a"}}
    assert sorted(map(sorted, cyclic_sets(graph))) == [["a", "b"], ["c", "d"], ["e"]]


def test_no_hidden_imports():
    """``importlib.import_module`` hides an edge from the graph: only DYNAMIC_IMPORTS may call it."""
    found = []
    for mod in modules():
        for node in ast.walk(tree(mod)):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "import_module"
                and mod not in DYNAMIC_IMPORTS
            ):
                found.append(f"{mod} line {node.lineno}")
    assert not found, (
        "importlib.import_module outside DYNAMIC_IMPORTS (use an import statement): " + ", ".join(found)
    )


def private_import_problems() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for mod in modules():
        for imp in imports(mod):
            if not first_party(imp):
                continue
            full = imp.target if imp.name is None else f"{imp.target}.{imp.name}"
            parts = full.split(".")
            for k, part in enumerate(parts):
                if not part.startswith("_") or (part.startswith("__") and part.endswith("__")):
                    continue
                owner = ".".join(parts[:k])  # the module or package that holds the private name
                if is_module(".".join(parts[: k + 1])):
                    # a private module: importable from inside the package that holds it
                    if mod == owner or mod.startswith(owner + "."):
                        continue
                    if owner == "mmbalance" and layer(mod) == "balancing" and part == "_core":
                        continue  # the compiled core, loaded by balancing (DESIGN.md's table)
                out.setdefault(mod, []).append(f"line {imp.line}: {full}")
                break
    return out


def test_no_private_name_crosses_a_module():
    problems = {m: p for m, p in private_import_problems().items() if m not in KNOWN_PRIVATE_IMPORTS}
    assert not problems, "private names imported from other modules:\n" + "\n".join(
        f"{m}: {', '.join(p)}" for m, p in sorted(problems.items())
    )


def private_attribute_problems() -> dict[str, list[str]]:
    """``obj._name`` where ``_name`` is defined (def, class, assignment) only in other modules of
    the package, and one of those is imported by the reader (directly or through its package): a
    private name read across modules. ``self``/``cls`` attributes are the class's own; a private
    name of a third-party object that one of our modules happens to define too is not flagged
    unless the reader imports that module."""
    owners: dict[str, set[str]] = {}
    for mod in modules():
        for node in ast.walk(tree(mod)):
            name = None
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = node.name
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                name = node.attr
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                name = node.id
            if name and name.startswith("_") and not name.startswith("__"):
                owners.setdefault(name, set()).add(mod)
    found: dict[str, list[str]] = {}
    for mod in modules():
        imported = set()
        for imp in imports(mod):
            if first_party(imp):
                imported.add(imp.target)
                if imp.name is not None:
                    imported.add(f"{imp.target}.{imp.name}")
        for node in ast.walk(tree(mod)):
            if not (isinstance(node, ast.Attribute) and node.attr in owners and mod not in owners[node.attr]):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if not any(o == i or o.startswith(i + ".") for o in owners[node.attr] for i in imported):
                continue
            found.setdefault(mod, []).append(
                f"line {node.lineno}: {ast.unparse(node)} (defined in {sorted(owners[node.attr])})"
            )
    return found


def test_no_private_attribute_crosses_a_module():
    found = {m: p for m, p in private_attribute_problems().items() if m not in KNOWN_PRIVATE_ATTRIBUTES}
    assert not found, "private attributes read across modules:\n" + "\n".join(
        f"{m}: {', '.join(p)}" for m, p in sorted(found.items())
    )


def test_known_exceptions_are_still_needed():
    stale = set(KNOWN_PRIVATE_IMPORTS) - set(private_import_problems())
    assert not stale, f"no longer break the rule (remove them from KNOWN_PRIVATE_IMPORTS): {sorted(stale)}"
    stale = set(KNOWN_PRIVATE_ATTRIBUTES) - set(private_attribute_problems())
    assert not stale, f"no longer break the rule (remove them from KNOWN_PRIVATE_ATTRIBUTES): {sorted(stale)}"


def test_layers_import_only_what_design_allows():
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    problems = []
    for mod in modules():
        mine = layer(mod)
        for imp in imports(mod):
            if first_party(imp):
                full = imp.target
                if imp.name is not None and is_module(f"{imp.target}.{imp.name}"):
                    full = f"{imp.target}.{imp.name}"
                if full == "mmbalance":
                    if imp.name in ("__version__",) or imp.name is None:
                        continue
                other = layer(full)
                allowed = LAYERS[mine]
                if other != mine and "*" not in allowed and other not in allowed:
                    problems.append(f"{mod} ({mine}) line {imp.line} imports {full} ({other})")
            else:
                top = imp.target.split(".")[0]
                allowed3 = THIRD_PARTY[mine]
                if allowed3 is not None and top not in stdlib and top not in allowed3:
                    problems.append(f"{mod} ({mine}) line {imp.line} imports {imp.target}")
    assert not problems, "imports DESIGN.md's layer table does not allow:\n" + "\n".join(problems)


def test_the_dispatcher_is_a_leaf():
    """Every layer may import ``kernels.dispatch``: importing it must run no other module of the
    package (its package ``mmbalance.kernels`` included, whose ``__init__`` must import nothing)."""
    assert edges(DISPATCH) <= {"mmbalance.kernels"}, edges(DISPATCH)
    assert edges("mmbalance.kernels") == set(), edges("mmbalance.kernels")


def test_all_lists_exactly_what_a_module_exports():
    problems = []
    for mod in modules():
        writes = [
            n.lineno
            for n in ast.walk(tree(mod))
            if (isinstance(n, ast.Name) and n.id == "__all__" and isinstance(n.ctx, ast.Store))
            or (isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "__all__")
            or (isinstance(n, ast.AugAssign) and isinstance(n.target, ast.Name) and n.target.id == "__all__")
        ]
        if len(writes) > 1:
            problems.append(
                f"{mod}: __all__ is written more than once (lines {writes}): write it once, whole"
            )
        listed = all_of(mod)
        names = defined_names(mod)
        if listed is None:
            if is_package(mod) and any(not n.startswith("_") for n in names - {"annotations"}):
                problems.append(f"{mod}: a package that binds public names has no __all__")
            continue
        if len(set(listed)) != len(listed):
            problems.append(f"{mod}: __all__ lists a name twice")
        for name in listed:
            if name not in names and not is_module(f"{mod}.{name}") and not module_getattr(mod):
                problems.append(f"{mod}: __all__ lists {name!r}, which it does not define")
        if is_package(mod):
            # what a package's __init__ binds is its export: listed, or private (a submodule
            # imported for its side effects is bound as a module, not re-exported)
            for node in tree(mod).body:
                if isinstance(node, ast.ImportFrom):
                    for alias in node.names:
                        bound = alias.asname or alias.name
                        target = resolve(mod, node.level, node.module)
                        if bound == "*":  # binds the other module's __all__: listed here?
                            missing = set(all_of(target) or []) - set(listed)
                            if missing:
                                problems.append(
                                    f"{mod}: star-imports {sorted(missing)} but does not list them"
                                )
                            continue
                        if bound.startswith("_") or node.module == "__future__":
                            continue
                        if is_module(f"{target}.{alias.name}") and target == mod:
                            continue
                        if bound not in listed:
                            problems.append(
                                f"{mod}: binds {bound!r} (line {node.lineno}) but __all__ does not list it"
                            )
    # a name imported from a module with an __all__ must be listed there
    for mod in modules():
        for imp in imports(mod):
            if not first_party(imp) or imp.name is None or imp.target not in modules():
                continue
            listed = all_of(imp.target)
            if (
                listed is None
                or imp.name == "*"
                or imp.name.startswith("_")
                or is_module(f"{imp.target}.{imp.name}")
            ):
                continue
            if imp.name not in listed:
                problems.append(
                    f"{mod} line {imp.line} imports {imp.name!r} from {imp.target}, whose __all__ does not list it"
                )
    assert not problems, "\n".join(problems)


def design_map() -> tuple[set[Path], list[str]]:
    """The files that DESIGN.md's paragraphs on `mmbalance/<layer>/` name, and the names that match
    no file (``models/<family>.py`` stands for every file of that folder)."""
    named: set[Path] = set()
    unknown = []
    for para in re.split(r"\n\s*\n", (ROOT / "DESIGN.md").read_text()):
        head = re.match(r"`mmbalance/([\w/]+?)/`:", para.strip())
        if not head:
            continue
        base = PKG / head.group(1)
        for name in re.findall(r"`([\w/<>.]+\.py)`", para):
            hits = (
                [p for p in base.glob(re.sub(r"<\w+>", "*", name)) if p.name != "__init__.py"]
                if "<" in name
                else [base / name]
                if (base / name).is_file()
                else []
            )
            if not hits:
                unknown.append(f"mmbalance/{head.group(1)}/{name}")
            named.update(hits)
    return named, unknown


def test_design_maps_every_file():
    named, unknown = design_map()
    layers = {p for p in PKG.rglob("*.py") if p.parent != PKG and p.name != "__init__.py"}
    missing = sorted(str(p.relative_to(ROOT)) for p in layers - named)
    assert not missing, f"files DESIGN.md's map does not name: {missing}"
    assert not unknown, f"DESIGN.md's map names files that do not exist: {unknown}"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
