"""Every notebook under notebooks/ executes headless (nbclient) without an error, in its smoke setting.

Notebooks that train read `LONGHORIZON_NOTEBOOK_SMOKE` (default "1": tiny settings, about a minute on
a CPU); the full-size versions run with

    LONGHORIZON_NOTEBOOK_SMOKE=0 pytest tests/test_notebooks.py -m "slow or not slow"

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

# Notebooks that train a policy (about a minute each on an idle 2-core CPU, two when it is busy): run by
# CI, skipped by the fast suite (`scripts/test.sh` deselects `slow`).
SLOW = {"quickstart.ipynb", "custom_environment.ipynb", "credit_assignment_ablation.ipynb"}

# name -> (strings the notebook's stdout must contain, MIME types its display outputs must include).
EXPECTED = {
    "quickstart.ipynb": (
        ["restored checkpoint step", "episode 0 (group 0)", " turn 0 | ",
         render.ANSI_COLORS[render.SAMPLED],  # sampled tokens printed in their colour
         "  oracle     1.00"],  # the evaluation table: the oracle solves every test task
        ["text/html", "image/png"]),
    "credit_assignment_ablation.ipynb": (
        ["runs,", "LIVE_ABLATION_OK", "H=17  p^H=", "grpo_oracle_verifier", "branch_step [-1"],
        ["image/png", "text/markdown"]),
    "custom_environment.ipynb": (
        ["oracle: success 1.000", "oracle success through the text path: 1.00",
         "untrained policy: test success", "SFT warm start", "episode 0 (group 0)",
         "host environments: [", "host keypad test success: SFT warm start"],
        ["image/png"]),
}


def _params():
  return [pytest.param(p, id=p.name, marks=[pytest.mark.slow] if p.name in SLOW else [])
          for p in NOTEBOOKS]


def test_there_are_notebooks():
  assert NOTEBOOKS, "no notebooks found under notebooks/"
  missing = sorted((set(EXPECTED) | SLOW) - {p.name for p in NOTEBOOKS})
  assert not missing, f"tests/test_notebooks.py names notebooks that do not exist: {missing}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_stored_without_outputs(path):
  notebook = nbformat.read(path, as_version=4)
  dirty = [i for i, cell in enumerate(notebook.cells)
           if cell.cell_type == "code" and (cell.get("outputs") or cell.get("execution_count"))]
  assert not dirty, f"{path.name}: cells {dirty} have outputs; clear them before saving"


@pytest.mark.parametrize("path", _params())
def test_notebook_executes(path, tmp_path, monkeypatch):
  if "LONGHORIZON_NOTEBOOK_SMOKE" not in os.environ:
    monkeypatch.setenv("LONGHORIZON_NOTEBOOK_SMOKE", "1")
  monkeypatch.setenv("TMPDIR", str(tmp_path))  # workdirs and task suites the notebook creates
  notebook = nbformat.read(path, as_version=4)
  started = time.perf_counter()
  NotebookClient(notebook, timeout=600, kernel_name="python3",
                 resources={"metadata": {"path": str(tmp_path)}}).execute()
  seconds = time.perf_counter() - started
  outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
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
