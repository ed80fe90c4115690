"""The shape of the product code, read from its source with ``ast`` (nothing is imported): no import circle in
either package, no function over 100 lines, none with more than 8 parameters (issue 18, "Must show").

A failure names every offender at once (file:line, the measure, the limit)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"pdoperator": ROOT / "operator" / "pdoperator", "pdruntime": ROOT / "runtime" / "pdruntime"}
MAX_LINES = 100  # def line to last line, decorators not counted
MAX_PARAMS = 8  # self/cls not counted; *args and **kwargs count one each


def _modules(pkg: str) -> dict[str, Path]:
    """Dotted module name -> file, for every module of ``pkg`` (a package is its ``__init__``)."""
    out = {}
    for p in sorted(PACKAGES[pkg].rglob("*.py")):
        parts = p.relative_to(PACKAGES[pkg].parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (isinstance(t, ast.Attribute)
                                                                       and t.attr == "TYPE_CHECKING")


def _imports(tree: ast.Module, *, deferred: bool) -> list[ast.Import | ast.ImportFrom]:
    """The import statements run when the module is imported (class bodies, ``if``/``try`` blocks included;
    ``if TYPE_CHECKING:`` blocks never run), plus, with ``deferred``, those inside functions."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(stmts: list[ast.stmt]) -> None:
        for n in stmts:
            if isinstance(n, (ast.Import, ast.ImportFrom)):
                found.append(n)
            elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if deferred:
                    visit(n.body)
            elif isinstance(n, ast.If) and _is_type_checking(n):
                continue
            else:
                for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                    for child in getattr(n, field, None) or []:
                        visit(child.body if isinstance(child, (ast.ExceptHandler, ast.match_case)) else [child])

    visit(tree.body)
    return found


def _import_graph(pkg: str, *, deferred: bool) -> dict[str, set[str]]:
    """module -> the modules of ``pkg`` it imports. ``from X import y`` is an edge to ``X.y`` when that is a module
    (X's ``__init__`` is only a parent then), else to ``X`` (y is a name X's ``__init__`` must define)."""
    mods = _modules(pkg)
    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        deps: set[str] = set()
        for n in _imports(ast.parse(path.read_text(), str(path)), deferred=deferred):
            if isinstance(n, ast.Import):
                deps.update(a.name for a in n.names)
                continue
            if n.level:
                base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                base = base[:len(base) - (n.level - 1)]
                source = ".".join(base + ([n.module] if n.module else []))
            else:
                source = n.module or ""
            for a in n.names:
                deps.add(f"{source}.{a.name}" if f"{source}.{a.name}" in mods else source)
        graph[mod] = {d for d in deps if d in mods and d != mod}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def _cycle_report(graph: dict[str, set[str]], comp: list[str]) -> str:
    edges = [f"{a} -> {b}" for a in comp for b in sorted(graph[a]) if b in comp]
    return f"{' / '.join(comp)}: " + ", ".join(edges)


@pytest.mark.parametrize("pkg", sorted(PACKAGES))
def test_no_import_cycle_at_import_time(pkg):
    """Imports that run when a module is imported: a circle here can fail on a partially initialised module."""
    graph = _import_graph(pkg, deferred=False)
    cycles = _cycles(graph)
    assert not cycles, "import circles:\n" + "\n".join(_cycle_report(graph, c) for c in cycles)


@pytest.mark.parametrize("pkg", sorted(PACKAGES))
def test_no_import_cycle_even_through_imports_inside_functions(pkg):
    """A deferred import hides a circle from the interpreter, not from the reader: two modules that each need the
    other are one module, or a third is missing."""
    graph = _import_graph(pkg, deferred=True)
    cycles = _cycles(graph)
    assert not cycles, "import circles (through imports inside functions):\n" + "\n".join(
        _cycle_report(graph, c) for c in cycles)


def _is_triton_kernel(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    for d in fn.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        if isinstance(target, ast.Attribute) and target.attr == "jit" and isinstance(target.value, ast.Name) \
                and target.value.id == "triton":
            return True
    return False


def _functions() -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    out = []
    for pkg in sorted(PACKAGES):
        for path in _modules(pkg).values():
            for n in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    out.append((f"{path.relative_to(ROOT)}:{n.lineno} {n.name}", n))
    return out


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = fn.args
    named = a.posonlyargs + a.args
    n = len(named) + len(a.kwonlyargs) + (a.vararg is not None) + (a.kwarg is not None)
    return n - 1 if named and named[0].arg in ("self", "cls") else n


def test_no_function_is_over_100_lines():
    long = [f"{where}: {fn.end_lineno - fn.lineno + 1} lines" for where, fn in _functions()
            if fn.end_lineno - fn.lineno + 1 > MAX_LINES]
    assert not long, f"functions over {MAX_LINES} lines:\n" + "\n".join(long)


def test_no_function_takes_more_than_8_parameters():
    """Past 8, the values travel together: a context or config object names them once. ``@triton.jit`` kernels
    are exempt: a Triton kernel receives each tensor pointer, scalar stride and constexpr as its own argument
    (Triton has no struct arguments), and the wrapper that launches it is held to the limit instead."""
    wide = [f"{where}: {_params(fn)} parameters" for where, fn in _functions()
            if _params(fn) > MAX_PARAMS and not _is_triton_kernel(fn)]
    assert not wide, f"functions with more than {MAX_PARAMS} parameters:\n" + "\n".join(wide)


def test_the_checks_see_what_they_claim_to():
    """The walkers find the packages' modules and functions, and the cycle finder finds a planted circle."""
    for pkg in PACKAGES:  # the package itself (its __init__) and its modules (names survive a restructuring)
        assert pkg in _modules(pkg) and len(_modules(pkg)) > 15, sorted(_modules(pkg))
    assert len(_functions()) > 500
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    kernel = ast.parse("@triton.jit\ndef k(a, b, c, d, e, f, g, h, i): pass").body[0]
    method = ast.parse("def m(self, a, *args, b, **kw): pass").body[0]
    assert _is_triton_kernel(kernel) and _params(kernel) == 9 and _params(method) == 4
    tree = ast.parse("import x\nif TYPE_CHECKING:\n    import y\ntry:\n    import z\nexcept ImportError:\n"
                     "    import w\ndef f():\n    import v\nclass C:\n    import u\n")
    assert [n.names[0].name for n in _imports(tree, deferred=False)] == ["x", "z", "w", "u"]
    assert {n.names[0].name for n in _imports(tree, deferred=True)} == {"x", "z", "w", "u", "v"}
