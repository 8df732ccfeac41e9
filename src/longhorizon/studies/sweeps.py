"""Sweeps beside configs: override dicts, run names, `experiments/train.py` commands, a runner.

A config module may define, next to `get_config(arg=None)`,

    def get_sweep(arg=None) -> list[dict[str, Any]]:
      return sweeps.product({"config.algorithm.name": ["grpo", "gigpo"]},
                            {"config.seed": [0, 1, 2]})

Each dict is one run: `{"config.seed": 1, "config.algorithm.name": "gigpo"}` becomes the flags
`--config.seed=1 --config.algorithm.name=gigpo` of `experiments/train.py` (big_vision style). The
same `:arg` suffix of `--config=path.py:arg` is passed to both `get_config` and `get_sweep`.

An *axis* is either a dict `{key: [v1, v2, ...]}` (several keys in one dict vary together, so they
must have equal lengths) or a list of override dicts (e.g. the result of another `product`/`zip_`).

`experiments/sweep.py` is the entry point; everything here takes its inputs as arguments.
"""

import copy
import dataclasses
import hashlib
import importlib.util
import itertools
import json
import os
import re
import shlex
import subprocess
import sys
import time
from typing import Any, Sequence

from absl import logging

Overrides = dict[str, Any]
Axis = dict[str, Sequence[Any]] | Sequence[Overrides]

_UNSAFE = re.compile(r"[^A-Za-z0-9._=,+-]")
_MAX_NAME = 120  # characters of a run name before it is shortened with a hash


def _axis_runs(axis: Axis) -> list[Overrides]:
  """One axis as a list of override dicts."""
  if isinstance(axis, dict):
    if not axis:
      raise ValueError("an empty axis {} has no values; drop it or give {key: [values]}.")
    lengths = {}
    for key, values in axis.items():
      if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise ValueError(f"axis {key!r}: expected a list of values, got {values!r}; "
                         f"write {{{key!r}: [{values!r}]}} for a single value.")
      lengths[key] = len(values)
    if len(set(lengths.values())) != 1:
      raise ValueError(f"keys in one axis vary together and need equal lengths, got {lengths}; "
                       "use product() to cross them instead.")
    return [dict(zip(axis, values)) for values in zip(*axis.values())]
  runs = list(axis)
  for run in runs:
    if not isinstance(run, dict):
      raise ValueError(f"an axis is a dict {{key: [values]}} or a list of override dicts, got an "
                       f"entry {run!r}.")
  return [dict(run) for run in runs]


def _merge(parts: Sequence[Overrides]) -> Overrides:
  merged = {}
  for part in parts:
    for key, value in part.items():
      if key in merged:
        raise ValueError(f"key {key!r} is set by two axes ({merged[key]!r} and {value!r}); "
                         "each key belongs to one axis.")
      merged[key] = value
  return merged


def product(*axes: Axis) -> list[Overrides]:
  """Cartesian product of axes; the first axis varies slowest.

  `product({"config.a": [1, 2]}, {"config.b": ["x", "y"]})` ->
  `[{a: 1, b: x}, {a: 1, b: y}, {a: 2, b: x}, {a: 2, b: y}]` (keys `config.`-prefixed).
  """
  return [_merge(parts) for parts in itertools.product(*(_axis_runs(a) for a in axes))]


def zip_(*axes: Axis) -> list[Overrides]:
  """Element-wise combination of axes of equal length.

  `zip_({"config.a": [1, 2]}, {"config.b": ["x", "y"]})` -> `[{a: 1, b: x}, {a: 2, b: y}]`.
  """
  expanded = [_axis_runs(a) for a in axes]
  lengths = [len(runs) for runs in expanded]
  if len(set(lengths)) > 1:
    raise ValueError(f"zip_ needs axes of equal length, got lengths {lengths}; use product() to "
                     "cross axes of different lengths.")
  return [_merge(parts) for parts in zip(*expanded)]


def format_value(value: Any) -> str:
  """The text of a `--config.x=` flag that `ml_collections.config_flags` parses back to `value`."""
  if isinstance(value, bool):
    return "True" if value else "False"
  if isinstance(value, str):
    return value
  if isinstance(value, (int, float, tuple, list)):
    return repr(value)
  raise ValueError(f"override value {value!r} of type {type(value).__name__} cannot be passed as "
                   "a flag; use a bool, int, float, str or tuple.")


def run_name(overrides: Overrides) -> str:
  """A file-name-safe name from the overrides, in their order: `algorithm.name=gigpo,seed=1`.

  Stable (a rerun of the sweep finds the same workdirs, so runs resume); `base` for no overrides.
  Characters outside `[A-Za-z0-9._=,+-]` become `_`; long names are cut and end in a hash.
  """
  if not overrides:
    return "base"
  parts = [f"{key.removeprefix('config.')}={format_value(value)}"
           for key, value in overrides.items()]
  name = _UNSAFE.sub("_", ",".join(parts))
  if len(name) > _MAX_NAME:
    name = name[:_MAX_NAME - 9] + "-" + _digest(overrides)
  return name


def _digest(overrides: Overrides) -> str:
  text = json.dumps(overrides, sort_keys=True, default=repr)
  return hashlib.sha1(text.encode()).hexdigest()[:8]


def split_config_spec(spec: str) -> tuple[str, str | None]:
  """`configs/x.py:smoke` -> (`configs/x.py`, `smoke`), as `config_flags` splits it."""
  path, _, arg = spec.partition(":")
  return path, (arg or None)


def config_module(path: str):
  """The config file at `path` as a module (configs/ is not a package: a config file that builds
  on another one loads it with `config_module(os.path.join(os.path.dirname(__file__), "x.py"))`)."""
  module_name = "longhorizon_config_" + hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:8]
  module_spec = importlib.util.spec_from_file_location(module_name, path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module


def load_sweep(spec: str) -> tuple[Any, list[Overrides]]:
  """Loads `get_config(arg)` and `get_sweep(arg)` from the config file of `spec` (`path[:arg]`)."""
  path, arg = split_config_spec(spec)
  if not os.path.isfile(path):
    raise ValueError(f"--config={spec}: no config file {path!r} (relative to {os.getcwd()}).")
  module = config_module(path)
  if not hasattr(module, "get_sweep"):
    raise ValueError(f"{path} defines no get_sweep(arg=None); add one returning a list of override "
                     "dicts, e.g. longhorizon.studies.sweeps.product({'config.seed': [0, 1, 2]}).")
  config = module.get_config(arg)
  sweep = module.get_sweep(arg)
  if not isinstance(sweep, list) or not all(isinstance(run, dict) for run in sweep):
    raise ValueError(f"{path}: get_sweep({arg!r}) must return a list of dicts, got {sweep!r}.")
  return config, sweep


def check_overrides(config, sweep: Sequence[Overrides]) -> None:
  """Raises ValueError naming the run and key for an override the config would reject.

  Every key must be `config.<existing field>` and the value must have the field's type (the
  ConfigDict's own type checks on a copy), so a typo fails before any run starts.
  """
  for index, overrides in enumerate(sweep):
    trial = copy.deepcopy(config)
    for key, value in overrides.items():
      where = f"sweep run {index} ({run_name(overrides)}): {key}={value!r}"
      parts = key.split(".")
      if parts[0] != "config" or len(parts) < 2:
        raise ValueError(f"{where}: keys are 'config.<field>' paths, e.g. 'config.seed'.")
      node = trial
      for depth, part in enumerate(parts[1:-1], start=1):
        if not hasattr(node, "keys") or part not in node:
          raise ValueError(f"{where}: no field {'.'.join(parts[:depth + 1])!r}; "
                           f"fields there: {sorted(node.keys()) if hasattr(node, 'keys') else []}.")
        node = node[part]
      leaf = parts[-1]
      if not hasattr(node, "keys") or leaf not in node:
        fields = sorted(node.keys()) if hasattr(node, "keys") else []
        raise ValueError(f"{where}: no field {key!r}; fields there: {fields}.")
      format_value(value)
      try:
        node[leaf] = value
      except (TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"{where}: the config rejects this value ({e}).") from e


@dataclasses.dataclass(frozen=True)
class Run:
  """One run of a sweep."""
  index: int  # position in get_sweep()'s list (what --only selects)
  name: str  # run_name(overrides), unique within the sweep
  overrides: Overrides  # {"config.x": value}
  workdir: str  # <workdir_root>/<name>
  command: tuple[str, ...]  # argv of the train process

  @property
  def shell(self) -> str:
    """The command as one shell-quoted line."""
    return shlex.join(self.command)


def expand(sweep: Sequence[Overrides], config_spec: str, workdir_root: str, *,
           python: str = sys.executable, train_script: str = "experiments/train.py",
           extra_flags: Sequence[str] = ()) -> list[Run]:
  """The runs of `sweep`: one `train_script` command each, with unique names and workdirs."""
  seen = {}
  names = []
  for index, overrides in enumerate(sweep):
    key = json.dumps(overrides, sort_keys=True, default=repr)
    if key in seen:
      raise ValueError(f"sweep runs {seen[key]} and {index} have the same overrides {overrides}; "
                       "remove the duplicate from get_sweep.")
    seen[key] = index
    names.append(run_name(overrides))
  # Names collide only after unsafe characters were replaced; a hash keeps them apart and stable.
  counts = {name: names.count(name) for name in names}
  names = [f"{name}-{_digest(overrides)}" if counts[name] > 1 else name
           for name, overrides in zip(names, sweep)]
  runs = []
  for index, (name, overrides) in enumerate(zip(names, sweep)):
    workdir = os.path.join(workdir_root, name)
    command = (python, train_script, f"--config={config_spec}", f"--workdir={workdir}",
               *(f"--{key}={format_value(value)}" for key, value in overrides.items()),
               *extra_flags)
    runs.append(Run(index, name, dict(overrides), workdir, command))
  return runs


def _write_json(path: str, records: list[dict]) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(records, f, indent=2, default=repr)
    f.write("\n")
  os.replace(tmp, path)


def run_sweep(runs: Sequence[Run], workdir_root: str, *, max_parallel: int = 1,
              env: dict[str, str] | None = None, poll_s: float = 0.2) -> list[dict]:
  """Runs `runs` as subprocesses, at most `max_parallel` at a time; returns their records.

  Each run's stdout and stderr go to `<workdir_root>/logs/<name>.log`. `<workdir_root>/sweep.json`
  lists every run (name, overrides, workdir, command, status, returncode, log, elapsed_s) and is
  rewritten on every change; records of runs not in `runs` (an earlier `--only`) are kept. Status:
  pending -> running -> ok | failed; interrupted if the sweep is stopped (Ctrl-C terminates the
  running processes). Runs are independent: a failed run does not stop the others.
  """
  if max_parallel < 1:
    raise ValueError(f"max_parallel={max_parallel}: need at least 1.")
  if "://" in workdir_root:
    raise ValueError(f"workdir_root={workdir_root!r}: the sweep runs local processes that write "
                     "their workdirs with os/open; give a local directory.")
  log_dir = os.path.join(workdir_root, "logs")
  os.makedirs(log_dir, exist_ok=True)
  sweep_json = os.path.join(workdir_root, "sweep.json")
  records = {}
  if os.path.exists(sweep_json):
    with open(sweep_json) as f:
      records = {r["name"]: r for r in json.load(f)}
  ours = []
  for run in runs:
    record = dict(name=run.name, index=run.index, overrides=run.overrides, workdir=run.workdir,
                  command=run.shell, log=os.path.join(log_dir, run.name + ".log"),
                  status="pending", returncode=None, elapsed_s=None)
    records[run.name] = record
    ours.append(record)
  save = lambda: _write_json(sweep_json, sorted(records.values(), key=lambda r: r["index"]))
  save()

  pending = list(zip(runs, ours))
  running = []  # (Popen, log file, record, start time)
  try:
    while pending or running:
      while pending and len(running) < max_parallel:
        run, record = pending.pop(0)
        log = open(record["log"], "a")
        logging.info("[%d] start %s: %s", run.index, run.name, run.shell)
        process = subprocess.Popen(run.command, stdout=log, stderr=subprocess.STDOUT, env=env)
        record["status"] = "running"
        running.append((process, log, record, time.monotonic()))
        save()
      for item in list(running):
        process, log, record, start = item
        if process.poll() is None:
          continue
        log.close()
        running.remove(item)
        record.update(returncode=process.returncode, elapsed_s=round(time.monotonic() - start, 1),
                      status="ok" if process.returncode == 0 else "failed")
        (logging.info if process.returncode == 0 else logging.error)(
            "[%d] %s exited with code %d after %.0f s (log: %s)", record["index"], record["name"],
            process.returncode, record["elapsed_s"], record["log"])
        save()
      if running:
        time.sleep(poll_s)
  except BaseException:
    for process, log, record, start in running:
      process.terminate()
    for process, log, record, start in running:
      try:
        process.wait(timeout=30)
      except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
      log.close()
      record.update(status="interrupted", returncode=process.returncode,
                    elapsed_s=round(time.monotonic() - start, 1))
    save()
    raise
  return ours
