"""The import graph of `src/longhorizon`: no cycles, and the layering of shared/DESIGN.md.

The graph is read from the source with `ast` (nothing is imported): every `import` and `from ...
import` statement, at module level or inside a function, with relative imports resolved against the
importing module's package. An edge `a -> b` means module `a` names module `b` in an import:
`from longhorizon.models import checkpoint` is an edge to `longhorizon.models.checkpoint` (a
submodule), `from longhorizon.models import ModelConfig` an edge to the package `longhorizon.models`.
Parent packages a dotted import initialises on the way are not edges of their own; a package's
`__init__` is a module like any other and its own imports are its edges.

Layering (the separation DESIGN.md's "Layout" section fixes):
  - `core` (math) imports nothing from `models`, `envs`, `rollout`, `train`, `sampling`;
  - `text` (tokenizers, chat templates, tool calls) imports nothing from `models`, `envs`, `train`,
    `rollout`, `sampling`;
  - `envs` imports nothing from `models`;
  - `cli` (what the entry points share) may import any layer, and only the entry points
    (`experiments/*.py`) import it: no module of the package outside `cli` does;
  - no module at the package root but `__init__.py`: every module belongs to a layer.

Function-local imports (shared/STYLE.md rule 14) only for an optional dependency (not in
`install_requires`) or to break a cycle listed in `ALLOWED_CYCLE_EDGES`: each names a dependency of
`OPTIONAL_DEPENDENCIES` or carries a `# optional: <dependency>` / `# cycle: <why>` comment on its line
or in the comment block just above it.
"""

import ast
import pathlib

import pytest

SRC = pathlib.Path(__file__).resolve().parents[1] / "src"
PACKAGE = "longhorizon"

# Layer -> the layers it must not import from.
FORBIDDEN = {
    "core": ("models", "envs", "rollout", "train", "sampling"),
    "text": ("models", "envs", "train", "rollout", "sampling"),
    "envs": ("models",),
}

# Layers only the entry points import (they may import any layer themselves).
ENTRY_POINT_LAYERS = ("cli",)

# Edges left out of the cycle check, each with the reason (`test_allowed_edges_still_exist` fails
# once an edge is gone, so the list cannot go stale). None: the async pipeline's cycle with the loop
# went with the learner object (issue 16), which the loop hands to the pipeline.
ALLOWED_CYCLE_EDGES: set[tuple[str, str]] = set()


# Optional dependencies (setup.cfg extras, or none): a function-local import of one of them is allowed
# as is, its name says which. Everything in `install_requires` is imported at module level.
OPTIONAL_DEPENDENCIES = {"torch", "accelerate", "nbclient", "nbformat", "ipykernel", "ray", "textworld"}

# The comments that mark an allowed function-local import (rule 14: the comment names the reason).
LOCAL_IMPORT_MARKERS = ("# optional:", "# cycle:")

def module_name(path: pathlib.Path) -> str:
  """`src/longhorizon/models/checkpoint.py` -> `longhorizon.models.checkpoint` (`__init__` -> package)."""
  parts = list(path.relative_to(SRC).with_suffix("").parts)
  if parts[-1] == "__init__":
    parts.pop()
  return ".".join(parts)


def modules() -> dict[str, pathlib.Path]:
  """Every module of the package: dotted name -> source file."""
  return {module_name(p): p for p in sorted((SRC / PACKAGE).rglob("*.py"))}


def imported_names(tree: ast.Module, name: str, is_package: bool) -> list[str]:
  """The dotted names `tree` (module `name`) imports, relative imports resolved, in source order.

  `from a import b` yields `a.b` (which `resolve` maps to the submodule if there is one, else to `a`).
  """
  package = name if is_package else name.rpartition(".")[0]
  names = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names.extend(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
      if node.level:
        base = package.split(".")
        base = base[:len(base) - (node.level - 1)]
        prefix = ".".join(base + ([node.module] if node.module else []))
      else:
        prefix = node.module
      names.extend(f"{prefix}.{alias.name}" for alias in node.names)
  return names


def resolve(dotted: str, known: set[str]) -> str | None:
  """The longest prefix of `dotted` that is a module of the package (None outside it)."""
  parts = dotted.split(".")
  for end in range(len(parts), 0, -1):
    candidate = ".".join(parts[:end])
    if candidate in known:
      return candidate
  return None


def import_graph() -> dict[str, set[str]]:
  """module -> the package modules it imports (self-imports dropped)."""
  files = modules()
  known = set(files)
  graph = {}
  for name, path in files.items():
    tree = ast.parse(path.read_text(), filename=str(path))
    targets = (resolve(d, known) for d in imported_names(tree, name, path.name == "__init__.py"))
    graph[name] = {t for t in targets if t is not None and t != name}
  return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """One cycle (`[a, b, ..., a]`) per strongly connected component with more than one module.

  Tarjan's algorithm (iterative), then a shortest path back to the start inside each component.
  """
  index, low, on_stack, stack, components = {}, {}, set(), [], []
  for root in sorted(graph):
    if root in index:
      continue
    work = [(root, iter(sorted(graph[root])))]
    index[root] = low[root] = len(index)
    stack.append(root)
    on_stack.add(root)
    while work:
      node, children = work[-1]
      child = next(children, None)
      if child is None:
        work.pop()
        if work:
          low[work[-1][0]] = min(low[work[-1][0]], low[node])
        if low[node] == index[node]:
          component = []
          while True:
            member = stack.pop()
            on_stack.discard(member)
            component.append(member)
            if member == node:
              break
          if len(component) > 1:
            components.append(sorted(component))
      elif child not in index:
        index[child] = low[child] = len(index)
        stack.append(child)
        on_stack.add(child)
        work.append((child, iter(sorted(graph.get(child, ())))))
      elif child in on_stack:
        low[node] = min(low[node], index[child])
  return [_cycle_through(component, graph) for component in components]


def _cycle_through(component: list[str], graph: dict[str, set[str]]) -> list[str]:
  """A shortest cycle from the first module of a strongly connected component back to itself."""
  start, members = component[0], set(component)
  parents, frontier = {start: None}, [start]
  while frontier:
    following = []
    for node in frontier:
      for child in sorted(graph[node] & members):
        if child == start:
          path = [node]
          while parents[path[-1]] is not None:
            path.append(parents[path[-1]])
          return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, node, start]
        if child not in parents:
          parents[child] = node
          following.append(child)
    frontier = following
  raise AssertionError(f"{component} is not strongly connected")


def function_local_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
  """The `import` / `from ... import` statements inside a function or method body (any depth)."""
  found = []

  def visit(node: ast.AST, in_function: bool) -> None:
    for child in ast.iter_child_nodes(node):
      if in_function and isinstance(child, (ast.Import, ast.ImportFrom)):
        found.append(child)
      visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                        ast.Lambda)))

  visit(tree, False)
  return found


def _marker(lines: list[str], lineno: int) -> str | None:
  """The marker (`# optional:` / `# cycle:`) on line `lineno` (1-based) or in the comment block
  just above it, else None."""
  for marker in LOCAL_IMPORT_MARKERS:
    if marker in lines[lineno - 1]:
      return marker
  above = lineno - 2
  while above >= 0 and lines[above].lstrip().startswith("#"):
    for marker in LOCAL_IMPORT_MARKERS:
      if lines[above].lstrip().startswith(marker):
        return marker
    above -= 1
  return None


def unmarked_local_imports(source: str, name: str, is_package: bool) -> list[str]:
  """`line: statement` for each function-local import of `source` (module `name`) that neither
  names an optional dependency nor carries a marker comment."""
  lines = source.splitlines()
  bad = []
  for node in function_local_imports(ast.parse(source)):
    roots = ({alias.name.split(".")[0] for alias in node.names} if isinstance(node, ast.Import)
             else {node.module.split(".")[0]} if node.module and not node.level else set())
    if roots and roots <= OPTIONAL_DEPENDENCIES:
      continue
    if _marker(lines, node.lineno) is None:
      bad.append(f"{node.lineno}: {lines[node.lineno - 1].strip()}")
  return bad


def cycle_marked_edges(source: str, name: str, is_package: bool, known: set[str]) -> set[tuple]:
  """`(name, target)` for each package module a `# cycle:`-marked function-local import names."""
  lines = source.splitlines()
  edges = set()
  for node in function_local_imports(ast.parse(source)):
    if _marker(lines, node.lineno) == "# cycle:":
      for dotted in imported_names(ast.Module(body=[node], type_ignores=[]), name, is_package):
        target = resolve(dotted, known)
        edges.add((name, target))
  return edges


def layer(module: str) -> str | None:
  """`longhorizon.envs.codec` -> `envs`; a module at the package root belongs to no layer."""
  parts = module.split(".")
  return parts[1] if len(parts) > 1 and ".".join(parts[:2]) in _SUBPACKAGES else None


_SUBPACKAGES = {module_name(p) for p in (SRC / PACKAGE).glob("*/__init__.py")}


# ------------------------------------------------------------------------ the graph builder itself

def test_relative_imports_resolve_against_the_package():
  tree = ast.parse("from . import a\nfrom .b import c\nfrom .. import d\n"
                   "def f():\n  import longhorizon.e.f\n")
  assert sorted(imported_names(tree, "longhorizon.x.y", is_package=False)) == [
      "longhorizon.d", "longhorizon.e.f", "longhorizon.x.a", "longhorizon.x.b.c"]
  assert imported_names(ast.parse("from . import a"), "longhorizon.x", is_package=True) == [
      "longhorizon.x.a"]


def test_resolve_prefers_the_submodule():
  known = {"longhorizon.models", "longhorizon.models.checkpoint"}
  assert resolve("longhorizon.models.checkpoint", known) == "longhorizon.models.checkpoint"
  assert resolve("longhorizon.models.ModelConfig", known) == "longhorizon.models"
  assert resolve("numpy.linalg", known) is None


def test_find_cycles_reports_each_cycle():
  graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"e"}, "e": {"d"}, "f": {"a"}}
  assert sorted(find_cycles(graph)) == [["a", "b", "c", "a"], ["d", "e", "d"]]
  assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_covers_the_package():
  graph = import_graph()
  assert {"longhorizon.text", "longhorizon.models.checkpoint", "longhorizon.envs.codec"} <= set(graph)
  assert "longhorizon.text" in graph["longhorizon.envs.codec"]
  assert {"longhorizon.models", "longhorizon.text.gguf_file",
          "longhorizon.text.tokenizer"} <= graph["longhorizon.models.checkpoint"]


# ----------------------------------------------------------------------------- the package's graph

def test_no_import_cycles():
  graph = {source: {target for target in targets if (source, target) not in ALLOWED_CYCLE_EDGES}
           for source, targets in import_graph().items()}
  cycles = find_cycles(graph)
  assert not cycles, "import cycle(s): " + "; ".join(" -> ".join(c) for c in cycles)


@pytest.mark.parametrize("importer", sorted(FORBIDDEN))
def test_layering(importer):
  graph = import_graph()
  bad = sorted(f"{source} -> {target}" for source, targets in graph.items()
               if layer(source) == importer for target in targets
               if layer(target) in FORBIDDEN[importer])
  assert not bad, (f"`{importer}` must not import from {FORBIDDEN[importer]} (shared/DESIGN.md, "
                   f"Layout): {bad}")


def test_entry_point_layers_are_imported_by_no_library_module():
  assert layer("longhorizon.cli.logs") == "cli"
  bad = sorted(f"{source} -> {target}" for source, targets in import_graph().items()
               if layer(source) not in ENTRY_POINT_LAYERS for target in targets
               if layer(target) in ENTRY_POINT_LAYERS)
  assert not bad, (f"{ENTRY_POINT_LAYERS} are for the entry points (experiments/*.py) only; library "
                   f"modules must not import them: {bad}")


def test_no_module_at_the_package_root():
  root = sorted(p.name for p in (SRC / PACKAGE).glob("*.py"))
  assert root == ["__init__.py"], (
      f"modules at the root of {PACKAGE}: {[n for n in root if n != '__init__.py']}; move each into "
      f"the subpackage (layer) it belongs to (shared/DESIGN.md, Layout), e.g. "
      f"{PACKAGE}.cli for what the entry points share")


def test_allowed_edges_still_exist():
  graph = import_graph()
  gone = sorted(edge for edge in ALLOWED_CYCLE_EDGES if edge[1] not in graph.get(edge[0], ()))
  assert not gone, f"remove these from ALLOWED_CYCLE_EDGES, the imports are gone: {gone}"


# ------------------------------------------------------------------------ function-local imports

def test_function_local_imports_are_found_and_judged():
  source = ("import os\n"
            "def f():\n"
            "  import json\n"
            "  import torch\n"
            "  # cycle: b imports this module\n"
            "  from longhorizon import b\n"
            "  from nbclient import NotebookClient  # the notebook runner\n"
            "  def g():\n"
            "    import jax  # optional: not really, but marked\n"
            "  return lambda: __import__('re')\n"
            "class C:\n"
            "  def m(self):\n"
            "    # an unrelated comment\n"
            "    from . import c\n")
  found = function_local_imports(ast.parse(source))
  assert [node.lineno for node in found] == [3, 4, 6, 7, 9, 14]
  assert unmarked_local_imports(source, "longhorizon.a", is_package=False) == [
      "3: import json", "14: from . import c"]
  known = {"longhorizon.a", "longhorizon.b", "longhorizon.c"}
  assert cycle_marked_edges(source, "longhorizon.a", False, known) == {("longhorizon.a",
                                                                        "longhorizon.b")}


def _package_sources():
  for name, path in modules().items():
    yield name, path.read_text(), path.name == "__init__.py"


def test_function_local_imports_only_for_optional_dependencies_or_cycles():
  """shared/STYLE.md rule 14: every other import is at module level."""
  bad = [f"{name}:{entry}" for name, source, is_package in _package_sources()
         for entry in unmarked_local_imports(source, name, is_package)]
  assert not bad, ("function-local imports of required dependencies or package modules; move them "
                   "to module level, or mark an optional dependency (`# optional: torch`) or a "
                   f"cycle listed in ALLOWED_CYCLE_EDGES (`# cycle: ...`): {bad}")


def test_cycle_marked_imports_are_allowed_cycle_edges():
  known = set(modules())
  edges = set().union(*(cycle_marked_edges(source, name, is_package, known)
                        for name, source, is_package in _package_sources()))
  assert edges <= ALLOWED_CYCLE_EDGES, (
      f"`# cycle:` imports whose edge is not in ALLOWED_CYCLE_EDGES: {sorted(edges - ALLOWED_CYCLE_EDGES)}")



# The host loop is the only place model, sampler and environment meet (shared/DESIGN.md, Layout):
# only it runs the sampler, and only the layers that build a run (the host loop, the learner and
# its drivers, the studies) import both a model and an environment.
SAMPLER_USERS = ("rollout",)
MODEL_AND_ENV_USERS = ("rollout", "train", "studies")


def test_only_the_host_loop_runs_the_sampler():
  graph = import_graph()
  bad = sorted(f"{source} -> {target}" for source, targets in graph.items()
               for target in targets if layer(target) == "sampling"
               and layer(source) not in SAMPLER_USERS + ("sampling",))
  assert not bad, f"only {SAMPLER_USERS} may import the sampler: {bad}"


def test_model_and_environment_meet_only_where_a_run_is_built():
  graph = import_graph()
  bad = sorted(source for source, targets in graph.items()
               if {"models", "envs"} <= {layer(t) for t in targets}
               and layer(source) not in MODEL_AND_ENV_USERS)
  assert not bad, f"modules importing both models and envs outside {MODEL_AND_ENV_USERS}: {bad}"


# Every driver (sync loop, async pipeline, studies, notebooks) trains through the one learner
# (`train/learner.py`); only it and the module defining them call the update functions.
UPDATE_FUNCTIONS = {"rl_update", "jit_rl_update", "sft_update", "dpo_update", "compute_advantages"}
UPDATE_OWNERS = {"longhorizon.train.update", "longhorizon.train.learner",
                 "longhorizon.train.algorithms"}


def _names_used(source: str) -> set[str]:
  tree = ast.parse(source)
  names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
  names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
  names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
  return names


def test_every_driver_trains_through_the_learner():
  bad = {}
  for path in sorted((SRC / PACKAGE).rglob("*.py")):
    module = ".".join(path.relative_to(SRC).with_suffix("").parts)
    used = _names_used(path.read_text(encoding="utf-8")) & UPDATE_FUNCTIONS
    if used and module not in UPDATE_OWNERS:
      bad[module] = sorted(used)
  for path in sorted((SRC.parent / "notebooks").glob("*.ipynb")):
    text = path.read_text(encoding="utf-8")
    used = {name for name in UPDATE_FUNCTIONS if f"{name}(" in text}
    if used:
      bad[path.name] = sorted(used)
  assert not bad, f"call the learner (Learner.step / learn / update), not its parts: {bad}"


def test_the_driver_check_sees_a_copied_update(tmp_path):
  assert {"rl_update", "jit_rl_update"} <= _names_used(
      "from longhorizon.train.update import jit_rl_update\nf = jit_rl_update\nrl_update(1)\n")
