"""The package's structure, read from its source (AST), as docs/design.md states it:

* only the data plane (``executor``) and the control plane (``control_plane``) call
  ``torch.distributed`` collectives or make groups; ``VerlEngine`` goes through the
  control plane too;
* the package's modules import each other without a cycle; the engine's end and the
  trainer's end never import each other; nothing outside ``remote/`` imports it, and
  nothing outside ``derive/`` imports more than the three names its package exports;
* no module keeps mutable state at module level (``global``, or a lower-case name bound to
  a dict, list or set): state lives on objects with a lifetime;
* every module says what it exports (``__all__``), and each exported name exists (and so does
  ``entrypoints/verl_engine.py``);
* private SGLang names are imported only by ``sglang_compat``.

And the tests' own structure, read from every file under ``test/``:

* no module imports a test module (one whose name starts with ``test_``): shared helpers and
  oracles live in ``test/support`` (or the ``*_cases.py`` helpers beside the tests);
* nothing runs when a test module is imported: outside function bodies and decorators (and
  ``pytestmark``, pytest's decorator of the whole module), a test module calls nothing from
  ``IMPORT_TIME_MODULES`` (``tempfile``, ``os``, ``subprocess``, ``shutil``, ``atexit``,
  ``torch``), under whatever name it imports them; work such as a temporary directory goes
  in a fixture or a function.
"""

import ast
from pathlib import Path
from typing import Dict, List, Set

import pytest
from house_ends import ENGINE_END, TRAINER_END
from series_script import load_pr_series

ROOT = Path(__file__).resolve().parents[2] / "python" / "sglang" / "srt"
PACKAGE = ROOT / "weight_sync"
PREFIX = "sglang.srt.weight_sync"
# torch.distributed calls that ask, not talk: allowed anywhere
QUERIES = {
    "get_rank",
    "get_world_size",
    "get_backend",
    "get_global_rank",
    "get_group_rank",
    "get_process_group_ranks",
    "is_initialized",
    "is_available",
}
# remote.rendezvous makes the TCP store a weight-sync group meets in (no collective)
COLLECTIVE_MODULES = {"executor", "control_plane", "remote.rendezvous"}
MUTABLE_CALLS = {
    "dict",
    "list",
    "set",
    "OrderedDict",
    "defaultdict",
    "WeakValueDictionary",
    "WeakKeyDictionary",
    "deque",
    "Counter",
}


def _module_name(path: Path) -> str:
    """``engine_update``, ``derive.target_cache``, ``remote`` (a subpackage's ``__init__``)."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> Dict[str, ast.Module]:
    return {
        _module_name(p): ast.parse(p.read_text(), str(p))
        for p in sorted(PACKAGE.rglob("*.py"))
        if p != PACKAGE / "__init__.py"
    }


MODULES = _modules()
# Our one module outside the package, parsed once: it calls no collective itself, and what it
# exports is checked with the package's modules.
VERL_ENGINE = ast.parse(
    (ROOT / "entrypoints" / "verl_engine.py").read_text(), "verl_engine.py"
)
EXPORTING = {**MODULES, "verl_engine": VERL_ENGINE}


def _dist_aliases(tree: ast.Module) -> Set[str]:
    aliases = {"torch.distributed"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {
                a.asname
                for a in node.names
                if a.name == "torch.distributed" and a.asname
            }
        if isinstance(node, ast.ImportFrom) and node.module == "torch":
            aliases |= {
                a.asname or a.name for a in node.names if a.name == "distributed"
            }
    return aliases


def _collective_calls(tree: ast.Module) -> Set[str]:
    aliases = _dist_aliases(tree)
    calls = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if (
                ast.unparse(node.func.value) in aliases
                and node.func.attr not in QUERIES
            ):
                calls.add(node.func.attr)
    return calls


@pytest.mark.parametrize("name", sorted(MODULES))
def test_only_the_two_planes_call_torch_distributed(name):
    calls = _collective_calls(MODULES[name])
    if name not in COLLECTIVE_MODULES:
        assert not calls, (
            f"{name}.py calls torch.distributed.{sorted(calls)}: collectives belong in control_plane.py"
        )


def test_the_planes_do_call_collectives_and_verl_engine_does_not():
    assert _collective_calls(MODULES["executor"]) >= {
        "batch_isend_irecv",
        "all_reduce",
    }
    # every group is made and destroyed there (the data plane's too: ``fresh_group``)
    assert _collective_calls(MODULES["control_plane"]) >= {
        "all_reduce",
        "monitored_barrier",
        "broadcast",
        "new_group",
        "destroy_process_group",
    }
    assert not _collective_calls(VERL_ENGINE), (
        "VerlEngine's collectives go through control_plane.ControlGroup"
    )


def _imports(tree: ast.Module) -> Set[str]:
    """The package's modules ``tree`` imports, by their names in ``MODULES``, read as ``make
    pr`` reads them: ``from ...weight_sync.remote import engine`` is ``remote.engine`` and
    ``remote``, ``from ...weight_sync.derive import DerivedTargets`` is ``derive``."""
    return {m for m, _ in load_pr_series().module_imports(tree, set(MODULES))}


def test_no_import_cycle():
    graph = {name: _imports(tree) - {name} for name, tree in MODULES.items()}
    state: Dict[str, int] = {}
    cycles: List[List[str]] = []

    def visit(node: str, path: List[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt) :] + [nxt])
            elif not state.get(nxt):
                visit(nxt, path + [nxt])
        state[node] = 2

    for name in sorted(graph):
        if not state.get(name):
            visit(name, [name])
    assert not cycles, f"import cycles: {cycles}"
    assert (
        "engine_update" not in graph["answer_guard"]
        and "engine_update" not in graph["trainer_flow"]
    )


def _reach(name: str) -> Set[str]:
    """Every module of the package that importing ``name`` imports, directly or not."""
    seen, todo = set(), [name]
    while todo:
        for nxt in _imports(MODULES[todo.pop()]) - seen - {name}:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def test_the_two_ends_never_import_each_other():
    assert ENGINE_END | TRAINER_END <= set(MODULES), sorted(
        (ENGINE_END | TRAINER_END) - set(MODULES)
    )
    crossing = {
        name: sorted(_reach(name) & other)
        for ends, other in ((ENGINE_END, TRAINER_END), (TRAINER_END, ENGINE_END))
        for name in ends
        if _reach(name) & other
    }
    assert not crossing, f"one end imports the other: {crossing}"


def test_the_core_never_imports_remote():
    core = [n for n in MODULES if n.split(".")[0] != "remote"]
    reaching = {
        n: sorted(r for r in _reach(n) if r.split(".")[0] == "remote") for n in core
    }
    reaching = {n: r for n, r in reaching.items() if r}
    assert not reaching, (
        f"modules outside remote/ import it: {reaching}; remote engines build on the "
        "core, not the reverse"
    )


def test_derive_is_reached_only_through_its_package():
    deep = {
        n: sorted(i for i in _imports(MODULES[n]) if i.startswith("derive."))
        for n in MODULES
        if n.split(".")[0] != "derive"
    }
    deep = {n: i for n, i in deep.items() if i}
    assert not deep, (
        f"modules outside derive/ import its modules {deep}: import the names "
        "sglang.srt.weight_sync.derive exports"
    )
    assert set(_exports(MODULES["derive"])) == {
        "DerivedTargets",
        "ProvenanceCheck",
        "engine_derived_targets",
    }


def _module_state(tree: ast.Module) -> List[str]:
    found = [
        f"global {', '.join(n.names)}"
        for n in ast.walk(tree)
        if isinstance(n, ast.Global)
    ]
    for node in tree.body:
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AnnAssign)
            else []
        )
        value = getattr(node, "value", None)
        if value is None:
            continue
        literal = isinstance(value, (ast.Dict, ast.List, ast.Set))
        call = (
            isinstance(value, ast.Call)
            and ast.unparse(value.func).split(".")[-1] in MUTABLE_CALLS
        )
        empty = call or (
            literal
            and not (getattr(value, "keys", None) or getattr(value, "elts", None))
        )
        for target in targets:
            if (
                isinstance(target, ast.Name)
                and target.id != "__all__"
                and (literal or call)
                and (not target.id.isupper() or empty)
            ):
                found.append(f"{target.id} = {ast.unparse(value)[:40]}")
    return found


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_level_mutable_state(name):
    assert not _module_state(MODULES[name]), (
        f"{name}.py keeps state at module level: {_module_state(MODULES[name])}"
    )


def _top_level_names(tree: ast.Module) -> Set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(t, ast.Name):
                    names.add(t.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {a.asname or a.name.split(".")[0] for a in node.names}
    return names


def _exports(tree: ast.Module):
    """The literal ``__all__`` of ``tree`` (a tuple of ``sorted(_EXPORTS)`` reads the
    lazy exports' keys), or None."""
    for n in tree.body:
        if isinstance(n, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets
        ):
            value = n.value
            if isinstance(value, ast.Call) and ast.unparse(value).startswith("tuple("):
                return sorted(_lazy_exports(tree))
            return ast.literal_eval(value)
    return None


def _lazy_exports(tree: ast.Module) -> Dict[str, str]:
    """A package ``__init__``'s ``_EXPORTS``: name -> the submodule defining it."""
    for n in tree.body:
        if isinstance(n, (ast.Assign, ast.AnnAssign)):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            if any(isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in targets):
                return ast.literal_eval(n.value)
    return {}


@pytest.mark.parametrize("name", sorted(EXPORTING))
def test_every_module_declares_what_it_exports(name):
    tree = EXPORTING[name]
    listed = _exports(tree)
    assert listed is not None, f"{name}.py has no __all__"
    assert isinstance(listed, (tuple, list)), (
        f"{name}.__all__ is {type(listed).__name__}, not a sequence of names"
    )
    lazy = _lazy_exports(tree)
    for (
        exported,
        module,
    ) in lazy.items():  # a subpackage's exports, resolved on first use
        assert exported in _top_level_names(MODULES[f"{name}.{module}"]), (
            f"{name}._EXPORTS says {module}.py defines {exported!r}; it does not"
        )
    missing = sorted(set(listed) - _top_level_names(tree) - set(lazy))
    assert not missing, (
        f"{name}.__all__ lists names the module does not define: {missing}"
    )


@pytest.mark.parametrize("name", sorted(set(MODULES) - {"sglang_compat"}))
def test_private_sglang_names_only_in_compat(name):
    private = []
    for node in ast.walk(MODULES[name]):
        if (
            isinstance(node, ast.ImportFrom)
            and node.module
            and node.module.startswith("sglang.")
            and not node.module.startswith(PREFIX)
        ):
            private += [
                f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")
            ]
    assert not private, (
        f"{name}.py imports SGLang's private {private}: adapt them in sglang_compat.py"
    )


# ---------------------------------------------------------------- the tests' own structure

TEST = Path(__file__).resolve().parents[1]
TEST_FILES = sorted(TEST.rglob("*.py"))
# what a test module may not call outside function bodies and decorators: it would run at import
IMPORT_TIME_MODULES = {"atexit", "os", "shutil", "subprocess", "tempfile", "torch"}


def _is_test_module(name: str) -> bool:
    return name.split(".")[-1].startswith("test_")


def _test_module_imports(tree: ast.Module) -> List[str]:
    """The test modules ``tree`` imports, by import statement or ``import_module``/``__import__``
    of a literal name, at any depth (lazy imports included)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if _is_test_module(a.name)]
        elif isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            if node.module and _is_test_module(node.module):
                found.append(module)
            elif not node.module:  # from . import test_x
                found += [
                    module + a.name for a in node.names if _is_test_module(a.name)
                ]
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None))
            in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and _is_test_module(node.args[0].value)
        ):
            found.append(node.args[0].value)
    return found


def test_no_module_imports_a_test_module():
    importing = {}
    for path in TEST_FILES:
        found = _test_module_imports(ast.parse(path.read_text(), str(path)))
        if found:
            importing[str(path.relative_to(TEST))] = found
    assert not importing, (
        f"modules under test/ import test modules {importing}: "
        "move what they share into test/support"
    )


def _import_roots(tree: ast.Module) -> Dict[str, str]:
    """Each name a module's top-level imports bind, to the top-level module it comes from."""
    roots, nodes = {}, list(tree.body)
    while nodes:
        node = nodes.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue  # imports in a function body bind names of that function only
        nodes.extend(ast.iter_child_nodes(node))
        if isinstance(node, ast.Import):
            for a in node.names:
                roots[a.asname or a.name.split(".")[0]] = a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                roots[a.asname or a.name] = node.module.split(".")[0]
    return roots


def _called_name(func: ast.expr) -> str:
    """The name a call's chain starts from: ``os`` for ``os.path.join(...)`` or
    ``os.environ.get(...).split()``."""
    while isinstance(func, (ast.Attribute, ast.Call, ast.Subscript)):
        func = func.func if isinstance(func, ast.Call) else func.value
    return func.id if isinstance(func, ast.Name) else ""


def _import_time_calls(body: List[ast.stmt], roots: Dict[str, str]) -> List[str]:
    """Calls into ``IMPORT_TIME_MODULES`` that run when ``body`` runs, outside function bodies,
    lambdas, decorators and ``pytestmark``; class bodies run at import and are read too."""
    calls = []
    for stmt in body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if isinstance(stmt, ast.ClassDef):
            calls += _import_time_calls(stmt.body, roots)
            continue
        if isinstance(stmt, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "pytestmark" for t in stmt.targets
        ):
            continue
        nodes = [stmt]
        while nodes:
            node = nodes.pop()
            if isinstance(node, ast.Lambda):
                continue
            if (
                isinstance(node, ast.Call)
                and roots.get(_called_name(node.func)) in IMPORT_TIME_MODULES
            ):
                calls.append(f"line {node.lineno}: {ast.unparse(node.func)}(...)")
            nodes.extend(ast.iter_child_nodes(node))
    return calls


def test_nothing_runs_when_a_test_module_is_imported():
    running = {}
    for path in TEST_FILES:
        if not path.name.startswith("test_"):
            continue
        tree = ast.parse(path.read_text(), str(path))
        calls = _import_time_calls(tree.body, _import_roots(tree))
        if calls:
            running[str(path.relative_to(TEST))] = calls
    assert not running, (
        f"test modules call {sorted(IMPORT_TIME_MODULES)} at import: {running}; "
        "do it in a fixture or a function"
    )
