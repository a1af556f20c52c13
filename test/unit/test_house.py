"""The package's structure, read from its source (AST), as docs/design.md states it:

* only the data plane (``executor``) and the control plane (``control_plane``) call
  ``torch.distributed`` collectives or make groups; ``VerlEngine`` goes through the
  control plane too;
* the package's modules import each other without a cycle;
* no module keeps mutable state at module level (``global``, or a lower-case name bound to
  a dict, list or set): state lives on objects with a lifetime;
* every module says what it exports (``__all__``), and each exported name exists (and so does
  ``entrypoints/verl_engine.py``);
* private SGLang names are imported only by ``sglang_compat``.
"""

import ast
from pathlib import Path
from typing import Dict, List, Set

import pytest

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
COLLECTIVE_MODULES = {"executor", "control_plane"}
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


def _modules() -> Dict[str, ast.Module]:
    return {
        p.stem: ast.parse(p.read_text(), str(p))
        for p in sorted(PACKAGE.glob("*.py"))
        if p.stem != "__init__"
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
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith(PREFIX + "."):
                found.add(node.module[len(PREFIX) + 1 :].split(".")[0])
            elif node.module == PREFIX:
                found |= {a.name for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {
                a.name[len(PREFIX) + 1 :].split(".")[0]
                for a in node.names
                if a.name.startswith(PREFIX + ".")
            }
    return found & set(MODULES)


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


@pytest.mark.parametrize("name", sorted(EXPORTING))
def test_every_module_declares_what_it_exports(name):
    tree = EXPORTING[name]
    exported = [
        n
        for n in tree.body
        if isinstance(n, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets)
    ]
    assert exported, f"{name}.py has no __all__"
    listed = ast.literal_eval(exported[0].value)
    assert isinstance(listed, (tuple, list)), (
        f"{name}.__all__ is {type(listed).__name__}, not a sequence of names"
    )
    missing = sorted(set(listed) - _top_level_names(tree))
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
