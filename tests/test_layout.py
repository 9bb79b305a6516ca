"""The code-size limits of ``impl/``, ``tpcheck/`` and ``benchmarks/``, read from the source with ``ast``.

* no file over 400 lines;
* no function or method over 80 lines (decorators excluded, docstring included);
* no public function or method, and no ``__init__``, with more than 10 parameters (``self`` / ``cls`` of a method
  not counted; ``*args`` and ``**kwargs`` count as one each);
* no import cycle among the imports of ``tpcheck.*`` and ``impl.*`` modules, those inside functions included;
* every import of one ``tpcheck`` stage by another goes down ``STAGES`` (docs/architecture.md draws it), those
  inside functions included: a stage may use the ones below it and its own, never one above.
* an import inside a function of ``tpcheck`` says why it is not at the top of its module (``LAZY_IMPORTS``, or a
  comment on its line or the line above).

The test fails listing every violation, one per line, so a change that breaks a limit names what to split.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREES = ("impl", "tpcheck", "benchmarks")
PACKAGES = ("impl", "tpcheck")  # the import graph is checked among these modules
MAX_FILE_LINES = 400
MAX_FUNC_LINES = 80
MAX_PARAMS = 10
#: tpcheck's stages, highest first; a module's stage is its first name under ``tpcheck`` (the package itself:
#: ``tpcheck.diff`` and friends, a front end). One level may hold several stages that do not import each other
#: in a cycle.
STAGES: tuple[tuple[str, ...], ...] = (
    ("", "cli", "properties", "pytest_plugin", "__main__"),  # front ends
    ("pipeline",),
    ("options",),
    ("engines", "reference", "judge"),
    ("result",),
    ("measure",),
    ("capture",),
    ("inputs",),
    ("progress",),
)
#: where every import inside a function has one reason, written here (elsewhere the import's line, or the comment
#: line above it, says why it is not at the top of its module)
LAZY_IMPORTS = {
    "tpcheck/cli/": "the command starts fast: --version, --help and completion import no torch; each command "
                    "imports what it runs",
    "tpcheck/pytest_plugin.py": "pytest loads the plugin in every session of a project that installs tpcheck: its "
                                "fixtures import torch and the pipeline when used",
    "tpcheck/__init__.py": "import tpcheck stays cheap: tpcheck.diff and friends import the pipeline on first use",
    "tpcheck/engines/vllm/plugin.py": "vLLM's plugin entry point, loaded in every vLLM process: vLLM and the capture "
                                      "are imported only once TPCHECK_DUMP asks for a dump",
    "tpcheck/engines/vllm/fault_plugin.py": "vLLM's plugin entry point, loaded in every vLLM process: nothing is "
                                            "imported unless TPCHECK_DUMP_FAULT asks for a fault",
    "tpcheck/engines/vllm/adapter.py": "vLLM is optional (its own virtual environment): imported when --engine vllm runs",
    "tpcheck/engines/vllm/worker.py": "runs in vLLM's worker processes: vLLM's modules, and the capture once "
                                      "tpcheck sets a rank up",
}
#: imports that go up, each with why it stays for now (a new one fails the test)
UPWARD_ALLOWED: set[tuple[str, str]] = set()


def _sources() -> dict[str, str]:
    """Repository-relative path -> source of every .py file under ``TREES``."""
    return {p.relative_to(ROOT).as_posix(): p.read_text(encoding="utf-8")
            for tree in TREES for p in sorted((ROOT / tree).rglob("*.py"))}


def _module_name(rel: str) -> str:
    parts = rel.removesuffix(".py").split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef, in_class: bool) -> int:
    a = fn.args
    names = [x.arg for x in a.posonlyargs + a.args]
    static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list)
    if in_class and not static and names and names[0] in ("self", "cls"):
        names = names[1:]
    return len(names) + len(a.kwonlyargs) + (a.vararg is not None) + (a.kwarg is not None)


def _function_violations(rel: str, tree: ast.Module) -> list[str]:
    out: list[str] = []

    def visit(node: ast.AST, scope: list[str], public: bool, in_class: bool, in_func: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, scope + [child.name], public and not child.name.startswith("_"), True, in_func)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = ".".join(scope + [child.name])
                lines = child.end_lineno - child.lineno + 1
                if lines > MAX_FUNC_LINES:
                    out.append(f"FUNC {rel}:{child.lineno} {name}: {lines} lines > {MAX_FUNC_LINES}")
                # public: reachable by name from outside (not underscored, not nested in a function or in a
                # private class); __init__ is the signature of every constructor call, so it always counts
                is_public = public and not in_func and not child.name.startswith("_")
                n = _params(child, in_class)
                if (is_public or child.name == "__init__") and n > MAX_PARAMS:
                    out.append(f"PARAMS {rel}:{child.lineno} {name}: {n} parameters > {MAX_PARAMS}")
                visit(child, scope + [child.name], False, False, True)
            else:
                visit(child, scope, public, in_class, in_func)

    visit(tree, [], True, False, False)
    return out


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or \
        (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _module_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Imports run when the module is imported: top-level statements and those in top-level if/try blocks;
    not those in functions or classes, nor under ``if TYPE_CHECKING:`` (never run)."""
    out: list = []

    def walk(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                out.append(node)
            elif isinstance(node, ast.If):
                if not _is_type_checking(node):
                    walk(node.body)
                walk(node.orelse)
            elif isinstance(node, ast.Try):
                for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                    walk(block)
            elif isinstance(node, ast.With):
                walk(node.body)

    walk(tree.body)
    return out


def _every_import(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import of a module, those inside functions and classes included (not under ``if TYPE_CHECKING:``)."""
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and _is_type_checking(node)
            for b in node.body for n in ast.walk(b)}
    return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in skip]


def _import_graph(trees: dict[str, ast.Module], every: bool = False) -> dict[str, set[str]]:
    """module -> the tpcheck / impl modules its module-level imports (``every``: all its imports) name; ``from pkg
    import name`` points at ``pkg.name`` when that is a module, else at ``pkg``."""
    modules = {_module_name(rel): rel for rel in trees if rel.split("/")[0] in PACKAGES}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, rel in modules.items():
        is_pkg = rel.endswith("__init__.py")
        for node in (_every_import if every else _module_level_imports)(trees[rel]):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    anchor = anchor[:len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            graph[mod] |= {t for t in targets if t in modules and t != mod}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return sorted(out)


def _stage(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "tpcheck"


def _stage_level(module: str) -> int | None:
    """The index in ``STAGES`` of a tpcheck module's stage (None: not a tpcheck module)."""
    parts = module.split(".")
    if parts[0] != "tpcheck":
        return None
    stage = parts[1] if len(parts) > 1 else ""
    for level, names in enumerate(STAGES):
        if stage in names:
            return level
    raise AssertionError(f"{module}: stage {stage!r} is not in tests/test_layout.py's STAGES")


def _upward(graph: dict[str, set[str]]) -> list[str]:
    """Imports of a stage above the importer's (``STAGES``), less ``UPWARD_ALLOWED``."""
    out = []
    for mod in sorted(graph):
        lm = _stage_level(mod)
        for tgt in sorted(graph[mod]):
            lt = _stage_level(tgt)
            if lm is not None and lt is not None and lt < lm and (mod, tgt) not in UPWARD_ALLOWED:
                out.append(f"UPWARD {mod} ({_stage(mod)}) imports {tgt} ({_stage(tgt)})")
    return out


def violations() -> list[str]:
    """Every violation of the limits, one line each."""
    sources = _sources()
    trees = {rel: ast.parse(src, filename=rel) for rel, src in sources.items()}
    out: list[str] = []
    for rel, src in sources.items():
        n = len(src.splitlines())
        if n > MAX_FILE_LINES:
            out.append(f"FILE {rel}: {n} lines > {MAX_FILE_LINES}")
        out += _function_violations(rel, trees[rel])
    graph = _import_graph(trees, every=True)
    graph = {m: {t for t in ts if (m, t) not in UPWARD_ALLOWED} for m, ts in graph.items()}
    out += _upward(graph)
    for comp in _cycles(graph):
        edges = [f"{a} -> {b}" for a in comp for b in sorted(graph[a]) if b in comp]
        out.append(f"CYCLE {', '.join(comp)}: {'; '.join(edges)}")
    return out


def test_code_size_limits():
    found = violations()
    assert not found, f"{len(found)} violation(s) of the code-size limits:\n" + "\n".join(found)


def test_checker_sees_each_kind():
    """The checker itself: each limit is caught on a small synthetic module."""
    long_body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNC_LINES))
    src = (f"def long():\n{long_body}\n\n"
           "def wide(a, b, c, d, e, f, g, h, i, j, *, k):\n    pass\n\n"
           "def _private_wide(a, b, c, d, e, f, g, h, i, j, k):\n    pass\n\n"
           "class C:\n    def __init__(self, a, b, c, d, e, f, g, h, i, j):\n        pass\n")
    found = _function_violations("m.py", ast.parse(src))
    assert [v.split(":")[0] for v in found] == ["FUNC m.py", "PARAMS m.py"], found
    assert "long" in found[0] and "wide" in found[1]
    pkg = {"tpcheck/__init__.py": "", "tpcheck/a.py": "from tpcheck import b\n",
           "tpcheck/b.py": "from . import a\n", "tpcheck/c.py": "def f():\n    import tpcheck.a\n",
           "tpcheck/d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from tpcheck import c\n"}
    graph = _import_graph({rel: ast.parse(s) for rel, s in pkg.items()})
    assert _cycles(graph) == [["tpcheck.a", "tpcheck.b"]]
    # every import, those in functions too: an upward import and a cycle closed inside a function are caught
    pkg = {"tpcheck/__init__.py": "", "tpcheck/inputs/__init__.py": "", "tpcheck/cli/__init__.py": "",
           "tpcheck/inputs/x.py": "def f():\n    from tpcheck.cli import y\n",
           "tpcheck/cli/y.py": "from tpcheck.inputs import x\n",
           "tpcheck/inputs/z.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from tpcheck.cli import y\n"}
    graph = _import_graph({rel: ast.parse(s) for rel, s in pkg.items()}, every=True)
    assert _upward(graph) == ["UPWARD tpcheck.inputs.x (inputs) imports tpcheck.cli.y (cli)"]
    assert _cycles(graph) == [["tpcheck.cli.y", "tpcheck.inputs.x"]]


def test_the_pass_loop_reads_in_one_sitting():
    """``DiffPass`` (one pass over the steps: golden, references, engine) stays under 150 lines: rows are made in
    ``pipeline/rows.py``, MoE routes followed in ``pipeline/routes.py``, each behind one object."""
    tree = ast.parse((ROOT / "tpcheck" / "pipeline" / "steps.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "DiffPass")
    assert cls.end_lineno - cls.lineno + 1 < 150, cls.end_lineno - cls.lineno + 1


def test_an_import_inside_a_function_says_why():
    """An import inside a function hides a dependency from the top of its module: each one is in a module of
    ``LAZY_IMPORTS`` (one reason for all) or has its reason on its line or the comment line above it (an optional
    dependency, a transformers version, start-up time)."""
    bad = []
    for rel, src in _sources().items():
        if not rel.startswith("tpcheck/") or rel.startswith(tuple(LAZY_IMPORTS)):
            continue
        lines = src.splitlines()
        tree = ast.parse(src)
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)) and "#" not in lines[node.lineno - 1] \
                        and not lines[node.lineno - 2].strip().startswith("#"):
                    bad.append(f"{rel}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    assert not bad, "imports inside functions without a reason (move them up, or say why):\n" + "\n".join(bad)


#: the engines that each live in one package ``tpcheck/engines/<name>/``: its adapter, what runs in its ranks, its
#: plugins and its faults. A module elsewhere in ``tpcheck/`` whose path names the engine (a path component equal
#: to it or joined to it by ``_``: ``capture/vllm_plugin.py``, ``engines/impl.py``, ``stage_dump.py``) fails
ENGINE_PACKAGES = ("impl", "vllm", "hf_tp", "dump")
#: modules outside their engine's package that carry its name, each with why
ENGINE_NAME_ALLOWED = {
    "tpcheck/capture/dump.py": "the dump format's writer, which every engine's ranks (and a user's, through "
                               "tpcheck.capture.from_env) write through: engine-independent",
    "tpcheck/capture/dump_format.py": "the dump format's placements and checks, shared by the writer, the replay "
                                      "and SGLang's reader: engine-independent",
    "tpcheck/engines/sglang_dump/": "SGLang's dumper files, an engine of their own (read into the dump model)",
}


def _names_engine(rel: str, engine: str) -> bool:
    """Whether a path component of ``rel`` (``.py`` dropped) is ``engine`` or joins it with ``_``."""
    return any(re.search(rf"(^|_){engine}(_|$)", part) for part in rel.removesuffix(".py").split("/")[1:])


def test_one_package_per_engine():
    """Each engine of ``ENGINE_PACKAGES`` is a package under ``tpcheck/engines/``, and no module of ``tpcheck/``
    outside it has the engine's name (``ENGINE_NAME_ALLOWED`` lists the exceptions, with why)."""
    sources = [rel for rel in _sources() if rel.startswith("tpcheck/")]
    bad = [f"tpcheck/engines/{e}/__init__.py is missing" for e in ENGINE_PACKAGES
           if not (ROOT / "tpcheck" / "engines" / e / "__init__.py").is_file()]
    for e in ENGINE_PACKAGES:
        home = f"tpcheck/engines/{e}/"
        bad += [f"{rel}: names engine {e!r} outside {home}" for rel in sources
                if not rel.startswith(home) and not rel.startswith(tuple(ENGINE_NAME_ALLOWED))
                and _names_engine(rel, e)]
    assert not bad, "\n".join(bad)
    assert _names_engine("tpcheck/capture/vllm_plugin.py", "vllm") and _names_engine("tpcheck/engines/impl.py", "impl")
    assert _names_engine("tpcheck/engines/stage_dump.py", "dump") and not _names_engine("tpcheck/inputs/x.py", "impl")


def _adapter_members() -> set[str]:
    """The members of ``tpcheck.engines.adapter.EngineAdapter`` (its capabilities and required methods), read from
    the source, plus the hooks the registry reads of an engine's module."""
    tree = ast.parse((ROOT / "tpcheck" / "engines" / "adapter.py").read_text(encoding="utf-8"))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "EngineAdapter")
    names = {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    names |= {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
    return names | {"start", "check_layout", "FAULTS"}


def _capability_probes(rel: str, src: str, members: set[str]) -> list[str]:
    """``getattr(obj, "name", ...)`` / ``hasattr(obj, "name")`` calls that probe an engine: ``name`` a member of
    ``EngineAdapter`` (or an engine module's hook), or ``obj`` an engine (its source names ``engine``, ``adapter``
    or ``module``)."""
    out = []
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") \
                and len(node.args) >= 2:
            obj, attr = ast.unparse(node.args[0]), node.args[1]
            named = isinstance(attr, ast.Constant) and attr.value in members
            if named or re.search(r"\b(engine|adapter|module)\b", obj):
                out.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    return out


def test_the_pipeline_reads_adapters_without_probing():
    """``pipeline/`` reads an adapter's capabilities directly: each is declared, with its default, on
    ``tpcheck.engines.adapter.EngineAdapter`` (an object that does not derive from it is wrapped once by
    ``as_adapter``), and an engine module's hooks are read by ``tpcheck.engines.registry.EngineEntry``. So no
    ``getattr`` / ``hasattr`` in ``tpcheck/pipeline/`` names a member of ``EngineAdapter`` or an engine module's
    hook (``start``, ``check_layout``, ``FAULTS``), nor takes an engine, an adapter or a module as its object."""
    members = _adapter_members()
    assert {"reductions", "teacher_forcing", "lacking", "point_rows", "point_stage", "rounding", "step"} <= members
    bad = [p for rel, src in _sources().items() if rel.startswith("tpcheck/pipeline/")
           for p in _capability_probes(rel, src, members)]
    assert not bad, "capability probes in pipeline/ (declare the capability on EngineAdapter):\n" + "\n".join(bad)
    caught = _capability_probes("m.py", "getattr(c.engine, 'x', None)\nhasattr(cap, 'lacking')\n"
                                        "getattr(cfg, 'moe', None)\n", members)
    assert [c.split(":")[1] for c in caught] == ["1", "2"], caught


def test_entry_points_name_modules_that_exist():
    """Every entry point and script of pyproject.toml (vLLM's ``general_plugins`` among them, loaded by vLLM by
    name in every process) names a module of this tree that defines the attribute: a module moved without its
    entry point fails here, not in vLLM's log."""
    import tomllib
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    targets = list(project.get("scripts", {}).values())
    targets += [v for group in project.get("entry-points", {}).values() for v in group.values()]
    bad = []
    for target in targets:
        mod, _, attr = target.partition(":")
        path = ROOT / Path(*mod.split("."))
        path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        if not path.is_file():
            bad.append(f"{target}: no module {mod}")
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))} | \
            {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
        if attr and attr not in defined:
            bad.append(f"{target}: {mod} defines no {attr}")
    assert len(targets) >= 4 and not bad, "\n".join(bad)
