"""minirl's import graph, read with `ast` (module-level and function-level imports; imports under
`if TYPE_CHECKING:` are annotations only and do not count), has no circle and no arrow that runs
from a lower floor up to a higher one. A module may import from its own floor or any floor below.

Floors, from the ground up (a module's floor is that of its longest listed prefix; every folder
is on one floor, so a reader, or a drawing of the folders, sees no arrow back up either). README's
"Layering" lists the same floors, and tests/unit/test_readme.py checks that the two agree entry for entry.

  0  what crosses a boundary, and leaves that import nothing above them:
     wire (coordinates, failure taxonomy, `/run` error bodies and row extras), types (what a step is
     made of: Call, Trace, Rollout, GroupOutcome, TrainBatch), faults, metrics, timeline (where a
     step's time goes: the `timing/*` metrics), algo/ (the GRPO math), runtime/ (the process and I/O
     helpers: a child process tied to its Ray actor, the HTTP server thread, JSON on the HTTP hops),
     gym/ (Gym's request shapes, and Gym's failure facts -> minirl's lanes)
  1  config (typed dataclasses and their checks; imports no runtime code)
  2  the processes' own code: generation/ (engine, servers, router, fleet watch), agents/,
     trainer/ (policy worker, checkpoints, weight sync)
  3  data (prompt rows)
  4  rollout/ (evidence -> rollouts, the rollout manager, its failure policy, the sync step source)
  5  async_rl/ (buffer, samplers, the train pump and its step source), validation
  6  controller (one optimizer step: source -> check_step -> ledger -> assemble -> stats)
  7  cluster (the Ray actors and placement)
  8  train, shutdown (what a stopped run says it keeps), evaluate, experiments/ (entry points, the
     sweep and its statistics), gym_servers/ (a Gym deployment's processes: minirl's generation
     side, and the Gym-venv servers `make gym-check` runs)
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "minirl"

FLOORS = {
    "minirl.wire": 0, "minirl.types": 0, "minirl.faults": 0, "minirl.metrics": 0, "minirl.timeline": 0,
    "minirl.algo": 0, "minirl.runtime": 0, "minirl.gym": 0,
    "minirl.config": 1,
    "minirl.generation": 2, "minirl.agents": 2, "minirl.trainer": 2,
    "minirl.data": 3,
    "minirl.rollout": 4,
    "minirl.async_rl": 5, "minirl.validation": 5,
    "minirl.controller": 6,
    "minirl.cluster": 7,
    "minirl.train": 8, "minirl.shutdown": 8, "minirl.evaluate": 8, "minirl.experiments": 8,
    "minirl.gym_servers": 8,  # entry points: a Gym deployment's generation side and Gym-venv servers
    "minirl": 8,  # the package's own __init__
}


def modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The minirl modules `name` imports anywhere in its body, outside `if TYPE_CHECKING:`."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                for other in child.orelse:
                    visit_one(other)
                continue
            visit_one(child)

    def visit_one(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known]
            found.update(subs if len(subs) == len(node.names) else [base, *subs])
        visit(node)

    visit(ast.parse(path.read_text(), str(path)))
    return {m for m in found if m in known and m != name}


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports_of(name, path, set(mods)) for name, path in mods.items()}


def floor(name: str) -> int:
    prefix = max((p for p in FLOORS if name == p or name.startswith(p + ".")), key=len, default=None)
    assert prefix is not None, f"{name} has no floor: add it to FLOORS (and to the docstring)"
    return FLOORS[prefix]


def test_the_graph_is_read():
    g = graph()
    assert "minirl.wire" in g["minirl.rollout.manager"]  # a module-level import
    assert "minirl.trainer.policy_worker" in g["minirl.cluster"]  # `from minirl.trainer import policy_worker`
    assert g["minirl.types"] == {"minirl.wire"} and g["minirl.wire"] == set()


def test_every_module_has_a_floor_and_no_arrow_runs_up():
    g = graph()
    up = [f"{a} (floor {floor(a)}) imports {b} (floor {floor(b)})" for a, deps in g.items() for b in deps
          if floor(b) > floor(a)]
    assert not up, "imports from a lower floor to a higher one:\n" + "\n".join(sorted(up))


def test_no_import_circle():
    g = graph()
    state: dict[str, int] = {}  # 1 on the path, 2 done
    path: list[str] = []
    circles: list[str] = []

    def walk(node: str) -> None:
        state[node] = 1
        path.append(node)
        for dep in sorted(g[node]):
            if state.get(dep) == 1:
                circles.append(" -> ".join(path[path.index(dep):] + [dep]))
            elif dep not in state:
                walk(dep)
        path.pop()
        state[node] = 2

    for node in sorted(g):
        if node not in state:
            walk(node)
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_every_folder_is_on_one_floor():
    """A floor is given to a top-level module or folder of minirl/ as a whole: a module deeper down on
    another floor than its folder would draw, folder by folder, as an arrow back up (and importing it
    runs its package's __init__ first)."""
    nested = [name for name in FLOORS if name.count(".") > 1]
    assert not nested, f"FLOORS gives a floor to a module inside a folder: {nested}"


def test_the_top_level_stays_small():
    """minirl/'s top level holds at most 13 modules: a new one goes into the package of its kind."""
    top = sorted(p.stem for p in ROOT.glob("*.py") if p.name != "__init__.py")
    assert len(top) <= 13, f"{len(top)} modules at minirl/'s top level (at most 13): {top}"
