"""Metrics of a training run: a JSONL log (plus TensorBoard), a progress bar and a phase timer.

    writer = MetricsWriter(workdir, is_primary=jax.process_index() == 0, resume_from=start + 1)
    progress = Progress(num_updates, initial=start, keys=("success", "loss"),
                        enabled=jax.process_index() == 0)
    timer = Timer()
    for update in range(start, num_updates):
      with timer("generation"):
        batch = jax.block_until_ready(rollout(...))
      with timer("learner"):
        state, metrics = jax.block_until_ready(train_step(state, batch))
      metrics = {**metrics, **timer.split()}
      timer.reset()
      writer.write(update + 1, metrics)
      progress.update(**metrics)
    writer.close(); progress.close()

`workdir/metrics.jsonl` holds one JSON object per `write`, keys sorted, `update` the step (the
training loop numbers updates from 1): `{"loss": 0.12, "success": 0.5, "update": 10}`;
`read_metrics` reads it back. Opening a writer repairs the log it appends to:
- **Damaged lines are quarantined, never deleted.** A line that is not a JSON object with an integer
  `update` (a line cut by a crash, a corrupted one anywhere in the file) is moved to
  `metrics.jsonl.corrupt` as `{"line": <its line number>, "text": <the line>}`, with a warning naming
  the lines and that file.
- **A resumed run** passes the update it continues from as `resume_from`: lines of updates >= it
  (written after the checkpoint it resumed from) are dropped, so no update appears twice; and a log
  *behind* the checkpoint (updates `first_update .. resume_from - 1` missing, e.g. the last line lost
  while its checkpoint was saved) gets a warning naming the missing updates: their metrics cannot be
  recomputed, the run goes on without them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import operator
import os
import pathlib
import time
from typing import Any, Callable, Iterator, Mapping, Sequence

import jax
import numpy as np
import tensorboardX
import tqdm

__all__ = ["METRICS_FILE", "QUARANTINE_SUFFIX", "MetricsWriter", "read_metrics", "Progress", "Timer"]

logger = logging.getLogger(__name__)

PathLike = str | os.PathLike

METRICS_FILE = "metrics.jsonl"
QUARANTINE_SUFFIX = ".corrupt"  # damaged lines of metrics.jsonl go to metrics.jsonl.corrupt
_TB_DIR = "tb"
_STEP_KEY = "update"


# ------------------------------------------------------------------------------------------- JSONL

def _to_number(name: str, value) -> int | float | None:
  """A scalar metric as a Python int (ints, bools) or float (None when NaN/inf or None)."""
  if value is None:
    return None
  if isinstance(value, (bool, int)):
    return int(value)
  if isinstance(value, float):
    return value if math.isfinite(value) else None
  if isinstance(value, (np.generic, np.ndarray)):
    array = value
  else:
    raise TypeError(f"metric {name!r} = {value!r} ({type(value).__name__}) is not a number; write "
                    f"Python/NumPy/JAX scalars.")
  if array.shape:
    raise ValueError(f"metric {name!r} has shape {array.shape}; write scalars (reduce it first).")
  if array.dtype == bool or np.issubdtype(array.dtype, np.integer):
    return int(array)
  try:
    number = float(array)
  except TypeError:
    raise TypeError(f"metric {name!r} has dtype {array.dtype}; write real numbers.") from None
  return number if math.isfinite(number) else None


def _parse_lines(path: pathlib.Path) -> Iterator[tuple[int, str, dict | None]]:
  """`(line number, text, record or None if not a JSON object with an int "update")` per line.

  Bytes that are not UTF-8 (a corrupted block) come back as surrogate escapes, and their line as
  not a record."""
  with open(path, encoding="utf-8", errors="surrogateescape") as f:
    for number, text in enumerate(f, start=1):
      try:
        text.encode("utf-8")
        record = json.loads(text)
      except (UnicodeEncodeError, json.JSONDecodeError):
        record = None
      if not (isinstance(record, dict) and isinstance(record.get(_STEP_KEY), int)):
        record = None
      yield number, text, record


def read_metrics(path: PathLike) -> list[dict]:
  """The records of a metrics file (or of `<path>/metrics.jsonl` when `path` is a folder)."""
  path = pathlib.Path(path)
  if path.is_dir():
    path = path / METRICS_FILE
  records = []
  for number, text, record in _parse_lines(path):
    if record is None:
      raise ValueError(f"{path}:{number} is not a JSON object with an integer {_STEP_KEY!r}: "
                       f"{text[:200]!r}.")
    records.append(record)
  return records


def _ranges(numbers: Sequence[int], limit: int = 20) -> str:
  """`[3, 5, 6, 7]` -> `"3, 5-7"` (the first `limit` runs, then how many numbers in all)."""
  runs = []
  for n in sorted(numbers):
    if runs and n == runs[-1][1] + 1:
      runs[-1][1] = n
    else:
      runs.append([n, n])
  text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs[:limit])
  return text if len(runs) <= limit else f"{text}, ... ({len(numbers)} in all)"


def _quarantine(path: pathlib.Path, damaged: list[tuple[int, str]]) -> pathlib.Path:
  """Appends the damaged `(line number, text)` lines to `<path>.corrupt`, synced; returns its path."""
  quarantine = path.with_name(path.name + QUARANTINE_SUFFIX)
  with open(quarantine, "a", encoding="utf-8") as f:
    for number, text in damaged:
      f.write(json.dumps({"line": number, "text": text.rstrip("\n")}) + "\n")
    f.flush()
    os.fsync(f.fileno())
  return quarantine


def _repair(path: pathlib.Path, resume_from: int | None) -> set[int]:
  """Moves damaged lines of `path` to its quarantine file and drops the lines of updates >=
  `resume_from`; returns the updates the log keeps."""
  kept, kept_updates, dropped, damaged = [], set(), 0, []
  for number, text, record in _parse_lines(path):
    if record is None:
      damaged.append((number, text))
    elif resume_from is not None and record[_STEP_KEY] >= resume_from:
      dropped += 1
    else:
      kept.append(text if text.endswith("\n") else text + "\n")
      kept_updates.add(record[_STEP_KEY])
  if damaged:
    # Written (and synced) before the log is rewritten without them: nothing is lost on a crash.
    quarantine = _quarantine(path, damaged)
    which = (f"line {damaged[0][0]} is not a JSON object" if len(damaged) == 1 else
             f"lines {_ranges([n for n, _ in damaged])} are not JSON objects")
    logger.warning("%s: %s with an integer %r (a line cut by a crash, or a corrupted one); moved, "
                   "with line numbers, to %s.", path, which, _STEP_KEY, quarantine)
  if dropped:
    # Written after the checkpoint the run continues from (a run killed between a metrics line and
    # its checkpoint): the run computes these updates again, with the same numbers.
    logger.warning("%s: removing %d line(s) of update(s) >= %d, logged after the checkpoint this run "
                   "continues from; those updates are computed again.", path, dropped, resume_from)
  if damaged or dropped:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    os.replace(tmp, path)
  return kept_updates


def _warn_missing(path: pathlib.Path, logged: set[int], first_update: int, resume_from: int):
  """Warns when the log lacks updates `first_update .. resume_from - 1` (it is behind the
  checkpoint the run resumes from)."""
  missing = sorted(set(range(first_update, resume_from)) - logged)
  if not missing:
    return
  quarantine = path.with_name(path.name + QUARANTINE_SUFFIX)
  damaged = f"; damaged lines are kept in {quarantine}" if quarantine.exists() else ""
  logger.warning(
      "%s is behind the checkpoint: the run resumes after update %d, but the log has no record of "
      "update(s) %s (lost in a crash after their checkpoint was saved, or damaged%s). Their metrics "
      "cannot be recomputed (the checkpoint holds the parameters, not the rollouts); the run "
      "continues and the log will lack them.", path, resume_from - 1, _ranges(missing), damaged)


class MetricsWriter:
  """Appends one JSON line per update to `workdir/metrics.jsonl`, and scalars to TensorBoard.

  Args:
    workdir: run folder (created if missing); the log is `metrics.jsonl`, TensorBoard events go to
      `tb/`.
    tensorboard: also write scalars with tensorboardX (`add_scalar(name, value, update)`).
    is_primary: False on every JAX process but one (`jax.process_index() != 0`): the writer then
      writes nothing and touches no file.
    resume_from: the update a resumed run continues from: lines of updates >= it are removed from an
      existing log, TensorBoard hides their events (`purge_step`), and missing updates
      `first_update .. resume_from - 1` are named in a warning. None keeps every record of the log.
      Damaged lines are moved to `metrics.jsonl.corrupt` in both cases (see the module docstring).
    first_update: the number of a run's first update (the training loop's are 1, 2, ...); only
      used to name the updates a resumed log lacks.
  """

  def __init__(self, workdir: PathLike, *, tensorboard: bool = True, is_primary: bool = True,
               resume_from: int | None = None, first_update: int = 1):
    self.workdir = pathlib.Path(workdir)
    self.path = self.workdir / METRICS_FILE
    self.is_primary = is_primary
    self._file = None
    self._tb = None
    if not is_primary:
      return
    if resume_from is not None:
      resume_from = operator.index(resume_from)
    self.workdir.mkdir(parents=True, exist_ok=True)
    logged = _repair(self.path, resume_from) if self.path.exists() else set()
    if resume_from is not None:
      _warn_missing(self.path, logged, operator.index(first_update), resume_from)
    self._file = open(self.path, "a", encoding="utf-8")
    if tensorboard:
      self._tb = tensorboardX.SummaryWriter(str(self.workdir / _TB_DIR), purge_step=resume_from)

  def write(self, step: int, metrics: Mapping[str, Any]):
    """Writes `{"update": step, **metrics}`; values are Python/NumPy/JAX scalars or None.

    Integers and bools are written as ints, floats as floats, NaN/inf and None as null (and left out
    of TensorBoard). JAX values are fetched from the devices in one transfer.
    """
    if not self.is_primary:
      return
    if self._file is None:
      raise ValueError(f"MetricsWriter for {self.path} is closed.")
    step = operator.index(step)
    if _STEP_KEY in metrics:
      raise ValueError(f"metrics hold the key {_STEP_KEY!r}, which is reserved for the step; "
                       f"rename it.")
    host = jax.device_get(dict(metrics))
    record = {str(k): _to_number(str(k), v) for k, v in host.items()}
    record[_STEP_KEY] = step
    self._file.write(json.dumps(record, sort_keys=True, allow_nan=False) + "\n")
    self._file.flush()
    if self._tb is not None:
      for name, value in record.items():
        if name != _STEP_KEY and value is not None:
          self._tb.add_scalar(name, value, global_step=step)

  def flush(self):
    if self._file is not None:
      self._file.flush()
    if self._tb is not None:
      self._tb.flush()

  def close(self):
    if self._file is not None:
      self._file.close()
      self._file = None
    if self._tb is not None:
      self._tb.close()
      self._tb = None

  def __enter__(self) -> MetricsWriter:
    return self

  def __exit__(self, *exc):
    self.close()


# ---------------------------------------------------------------------------------------- Progress

def _format(value) -> str:
  if isinstance(value, (bool, np.bool_)):
    return str(bool(value))
  if isinstance(value, (int, np.integer)):
    return str(int(value))
  try:
    return f"{float(value):.4g}"
  except (TypeError, ValueError):
    return str(value)


class Progress:
  """A tqdm bar over `total` updates with rate and ETA, showing a few metrics after the count.

  Args:
    total: number of updates of the whole run.
    initial: updates already done (a resumed run); the ETA counts only this run's speed.
    keys: names of the metrics `update` shows (others passed to it are ignored); None shows all.
    enabled: False (e.g. on non-primary JAX processes) prints nothing.
    desc: label before the bar.
    file: stream to write to (tqdm's default: stderr).
  """

  def __init__(self, total: int, *, initial: int = 0, keys: Sequence[str] | None = None,
               enabled: bool = True, desc: str | None = None, file=None):
    self.keys = None if keys is None else tuple(keys)
    self.enabled = enabled
    self._bar = tqdm.tqdm(total=total, initial=initial, desc=desc, unit="update", file=file,
                          disable=not enabled, dynamic_ncols=True)

  def update(self, n: int = 1, **metrics):
    """Advances by `n` updates and shows the chosen `metrics` (scalars; JAX values are fetched)."""
    if not self.enabled:
      return
    shown = {k: v for k, v in metrics.items() if self.keys is None or k in self.keys}
    if shown:
      host = jax.device_get(shown)
      self._bar.set_postfix({k: _format(host[k]) for k in shown}, refresh=False)
    self._bar.update(n)

  def close(self):
    self._bar.close()

  def __enter__(self) -> Progress:
    return self

  def __exit__(self, *exc):
    self.close()


# ------------------------------------------------------------------------------------------- Timer

class Timer:
  """Wall time per named phase: `with timer("generation"): ...`, read with `split()`.

  JAX dispatches asynchronously: end a timed block with `jax.block_until_ready` on its outputs, or
  the time lands in whichever later phase first waits for them.

  Args:
    clock: seconds as a float, monotonic (default `time.perf_counter`; tests pass a fake one).
  """

  def __init__(self, clock: Callable[[], float] = time.perf_counter):
    self._clock = clock
    self._running: set[str] = set()
    self.reset()

  def reset(self):
    """Starts a new window: zero totals, wall time counted from now."""
    self._start = self._clock()
    self._totals: dict[str, float] = {}

  @contextlib.contextmanager
  def __call__(self, phase: str) -> Iterator[None]:
    if phase in self._running:
      raise RuntimeError(f"phase {phase!r} is already being timed; a phase cannot nest in itself.")
    self._running.add(phase)
    begin = self._clock()
    try:
      yield
    finally:
      # A phase that began before a `reset()` counts only from the reset on.
      elapsed = self._clock() - max(begin, self._start)
      self._totals[phase] = self._totals.get(phase, 0.0) + elapsed
      self._running.discard(phase)

  def split(self) -> dict[str, float]:
    """Seconds since `reset()`: `time/<phase>` per finished phase block, `time/total` of wall time,
    and `time_frac/<phase>` = `time/<phase> / time/total` (the rest is untimed overhead)."""
    total = self._clock() - self._start
    out = {f"time/{phase}": seconds for phase, seconds in self._totals.items()}
    out.update({f"time_frac/{phase}": seconds / total if total > 0 else 0.0
                for phase, seconds in self._totals.items()})
    out["time/total"] = total
    return out
