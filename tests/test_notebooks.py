"""Every notebook under notebooks/ is stored executed, opens in a fresh Colab runtime, and executes
headless (nbclient) without an error in its smoke setting.

The notebooks are committed with their outputs and plots, so a reader sees them without running
anything. To re-execute them and store the new outputs (each in place, in the smoke setting):

    python scripts/execute_notebooks.py [notebooks/NAME.ipynb ...]

Their first code cell is one setup cell, the same in all: it installs the package when it is not
importable (from the checkout around the notebook, else by cloning `LONGHORIZON_REPO`) and the jax
build for a GPU / TPU runtime; where the package is installed it only prints the devices.

Notebooks that train read `LONGHORIZON_NOTEBOOK_SMOKE` (default "1": tiny settings, about a minute on
a CPU); the full-size versions run with

    LONGHORIZON_NOTEBOOK_SMOKE=0 pytest tests/test_notebooks.py -m "slow or not slow"

The execution test runs a copy in memory, from cleared outputs, and never writes the file back.
Beyond "no error", a notebook listed in `EXPECTED` must print each of its markers and show each of its
kinds of display output (a plot, an HTML episode), so a feature that silently breaks (an oracle that no
longer solves its tasks through the text path, episodes that no longer render) fails here.
"""

import os
import pathlib
import time

import nbformat
import pytest
from nbclient import NotebookClient

from longhorizon.rollout import render

NOTEBOOKS = sorted((pathlib.Path(__file__).parents[1] / "notebooks").glob("*.ipynb"))

# Notebooks that train a policy (about a minute each on an idle 2-core Xeon; 2-8 min on the AMD EPYC):
# marked `slow`; tests/conftest.py keeps credit_assignment_ablation in CI and marks the other two
# `heavy`, so they run by hand (`scripts/test.sh -m heavy`).
SLOW = {"quickstart.ipynb", "custom_environment.ipynb", "credit_assignment_ablation.ipynb"}

# name -> (strings the notebook's stdout must contain, MIME types its display outputs must include).
EXPECTED = {
    "quickstart.ipynb": (
        ["restored checkpoint step", "episode 0 (group 0)", " turn 0 | ",
         render.ANSI_COLORS[render.SAMPLED],  # sampled tokens printed in their colour
         "  oracle     1.00"],  # the evaluation table: the oracle solves every test task
        ["text/html", "image/png"]),
    "credit_assignment_ablation.ipynb": (
        ["runs,", "LIVE_ABLATION_OK", "H=17  p^H=", "grpo_oracle_verifier", "branch_step [-1",
         "LIVE_STUDY_CELL_OK"],
        ["image/png", "text/markdown"]),
    "custom_environment.ipynb": (
        ["oracle: success 1.000", "oracle success through the text path: 1.00",
         "untrained policy: test success", "SFT warm start", "episode 0 (group 0)",
         "host environments: [", "host keypad test success: SFT warm start"],
        ["image/png"]),
    "credit_assignment_tour.ipynb": (
        ["steps share their state with another step"],
        ["image/png"]),
}

RERUN = "python scripts/execute_notebooks.py"
# Stored outputs above this size are a sign of a runaway print or an oversized figure.
MAX_STORED_BYTES = 3_000_000


def _params():
  return [pytest.param(p, id=p.name, marks=[pytest.mark.slow] if p.name in SLOW else [])
          for p in NOTEBOOKS]


def test_there_are_notebooks():
  assert NOTEBOOKS, "no notebooks found under notebooks/"
  missing = sorted((set(EXPECTED) | SLOW) - {p.name for p in NOTEBOOKS})
  assert not missing, f"tests/test_notebooks.py names notebooks that do not exist: {missing}"


def _code_cells(notebook):
  return [cell for cell in notebook.cells if cell.cell_type == "code"]


def _outputs(notebook):
  return [output for cell in _code_cells(notebook) for output in cell.get("outputs", [])]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_stored_executed(path):
  notebook = nbformat.read(path, as_version=4)
  counts = [cell.get("execution_count") for cell in _code_cells(notebook)]
  assert counts == list(range(1, len(counts) + 1)), (
      f"{path.name}: execution counts {counts}, not one run from top to bottom; run `{RERUN} "
      f"notebooks/{path.name}`")
  outputs = _outputs(notebook)
  errors = [o.get("ename") for o in outputs if o.get("output_type") == "error"]
  assert not errors, f"{path.name}: stored outputs hold errors {errors}; fix them and rerun `{RERUN}`"
  mime_types = {m for o in outputs for m in o.get("data", {})}
  if "image/png" in EXPECTED.get(path.name, ([], []))[1]:
    assert "image/png" in mime_types, f"{path.name}: no plot stored; run `{RERUN} notebooks/{path.name}`"
  assert path.stat().st_size < MAX_STORED_BYTES, (
      f"{path.name}: {path.stat().st_size / 1e6:.1f} MB stored, over {MAX_STORED_BYTES / 1e6:.0f} MB; "
      "shrink its printed output or figures")


def test_every_notebook_starts_with_the_colab_setup_cell():
  first = {p.name: _code_cells(nbformat.read(p, as_version=4))[0].source for p in NOTEBOOKS}
  missing = sorted(name for name, source in first.items() if "LONGHORIZON_REPO" not in source)
  assert not missing, f"{missing}: the first code cell is not the Colab setup cell"
  reference = first[NOTEBOOKS[0].name]
  differ = sorted(name for name, source in first.items() if source != reference)
  assert not differ, f"{differ}: the Colab setup cell differs from the one in {NOTEBOOKS[0].name}"


@pytest.mark.parametrize("path", _params())
def test_notebook_executes(path, tmp_path, monkeypatch):
  if "LONGHORIZON_NOTEBOOK_SMOKE" not in os.environ:
    monkeypatch.setenv("LONGHORIZON_NOTEBOOK_SMOKE", "1")
  monkeypatch.setenv("TMPDIR", str(tmp_path))  # workdirs and task suites the notebook creates
  notebook = nbformat.read(path, as_version=4)
  for cell in _code_cells(notebook):  # only this run's outputs are checked
    cell.outputs, cell.execution_count = [], None
  started = time.perf_counter()
  NotebookClient(notebook, timeout=600, kernel_name="python3",
                 resources={"metadata": {"path": str(tmp_path)}}).execute()
  seconds = time.perf_counter() - started
  outputs = _outputs(notebook)
  errors = [o for o in outputs if o.get("output_type") == "error"]
  assert not errors
  stdout = "".join(o.get("text", "") for o in outputs
                   if o.get("output_type") == "stream" and o.get("name") == "stdout")
  mime_types = {m for o in outputs for m in o.get("data", {})}
  markers, displays = EXPECTED.get(path.name, ([], []))
  missing = [m for m in markers if m not in stdout]
  assert not missing, f"{path.name} ran in {seconds:.0f} s but did not print {missing}"
  missing = [m for m in displays if m not in mime_types]
  assert not missing, f"{path.name} ran in {seconds:.0f} s but displayed no {missing}"
