"""MetricsWriter (JSONL + TensorBoard), read_metrics, Progress and Timer."""

import io
import json
import logging
import struct

import jax.numpy as jnp
import numpy as np
import pytest

from longhorizon.train.metrics import MetricsWriter, Progress, Timer, read_metrics


def _lines(path):
  return path.read_text().splitlines()


def test_jsonl_content_and_types(tmp_path):
  with MetricsWriter(tmp_path, tensorboard=False) as writer:
    writer.write(0, {"loss": jnp.float32(0.5), "success": np.float64(0.25), "tokens": jnp.int32(7),
                     "episodes": np.int64(3), "done": jnp.array(True), "lr": 1e-3, "n": 2,
                     "bf16": jnp.bfloat16(1.5)})
    writer.write(1, {"loss": jnp.float32(jnp.nan), "kl": float("inf"), "skipped": None,
                     "b": np.float32(-np.inf)})
  lines = _lines(tmp_path / "metrics.jsonl")
  assert lines[0] == ('{"bf16": 1.5, "done": 1, "episodes": 3, "loss": 0.5, "lr": 0.001, "n": 2, '
                      '"success": 0.25, "tokens": 7, "update": 0}')
  assert lines[1] == '{"b": null, "kl": null, "loss": null, "skipped": null, "update": 1}'
  records = read_metrics(tmp_path / "metrics.jsonl")
  assert records == read_metrics(tmp_path)  # a folder reads its metrics.jsonl
  assert [r["update"] for r in records] == [0, 1]
  assert type(records[0]["tokens"]) is int and type(records[0]["loss"]) is float
  assert records[1]["loss"] is None


def test_write_rejects_bad_values(tmp_path):
  with MetricsWriter(tmp_path, tensorboard=False) as writer:
    with pytest.raises(ValueError, match=r"'loss' has shape \(2,\)"):
      writer.write(0, {"loss": np.zeros(2)})
    with pytest.raises(TypeError, match="'name' .* is not a number"):
      writer.write(0, {"name": "x"})
    with pytest.raises(ValueError, match="reserved"):
      writer.write(0, {"update": 3})
  assert _lines(tmp_path / "metrics.jsonl") == []


def test_resume_truncates_later_updates(tmp_path, caplog):
  with MetricsWriter(tmp_path, tensorboard=False) as writer:
    for step in range(6):
      writer.write(step, {"loss": float(step)})
  # A crash mid-write leaves a cut line at the end.
  with open(tmp_path / "metrics.jsonl", "a") as f:
    f.write('{"loss": 6.0, "upd')

  with caplog.at_level(logging.WARNING):
    writer = MetricsWriter(tmp_path, tensorboard=False, resume_from=4)
  damaged, removed = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
  assert "line 7 is not a JSON object" in damaged and "metrics.jsonl.corrupt" in damaged
  # Updates 4 and 5 were logged after the checkpoint: said so (not "resuming from update 4").
  assert "removing 2 line(s) of update(s) >= 4, logged after the checkpoint" in removed
  with writer:
    writer.write(4, {"loss": 40.0})
  records = read_metrics(tmp_path)
  assert [r["update"] for r in records] == [0, 1, 2, 3, 4]
  assert records[-1]["loss"] == 40.0

  # Without resume_from the log is kept (appended to).
  with MetricsWriter(tmp_path, tensorboard=False) as writer:
    writer.write(5, {"loss": 50.0})
  assert [r["update"] for r in read_metrics(tmp_path)] == [0, 1, 2, 3, 4, 5]



def _write_updates(path, updates):
  path.write_text("".join(json.dumps({"loss": float(u), "update": u}) + "\n" for u in updates))


def _warnings(caplog):
  return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_resume_names_the_updates_a_log_behind_the_checkpoint_lacks(tmp_path, caplog):
  # The checkpoint is after update 5 (the loop opens the writer with resume_from=start + 1), but the
  # line of update 5 was lost in a crash between the checkpoint and the flush of the log.
  _write_updates(tmp_path / "metrics.jsonl", [1, 2, 3, 4])
  with caplog.at_level(logging.WARNING):
    writer = MetricsWriter(tmp_path, tensorboard=False, resume_from=6)
  [warning] = _warnings(caplog)
  assert "is behind the checkpoint" in warning and "resumes after update 5" in warning
  assert "no record of update(s) 5 " in warning and "cannot be recomputed" in warning
  with writer:  # the writer still works: the run goes on
    writer.write(6, {"loss": 6.0})
  assert [r["update"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4, 6]

  # Gaps inside the log are named too, as ranges.
  caplog.clear()
  _write_updates(tmp_path / "metrics.jsonl", [1, 2, 5, 9])
  with caplog.at_level(logging.WARNING):
    MetricsWriter(tmp_path, tensorboard=False, resume_from=11).close()
  [warning] = _warnings(caplog)
  assert "no record of update(s) 3-4, 6-8, 10 " in warning


def test_resume_with_no_log_names_every_update_and_a_fresh_run_warns_nothing(tmp_path, caplog):
  with caplog.at_level(logging.WARNING):
    MetricsWriter(tmp_path / "fresh", tensorboard=False, resume_from=1).close()
    _write_updates((tmp_path / "complete").mkdir() or tmp_path / "complete" / "metrics.jsonl", [1, 2])
    MetricsWriter(tmp_path / "complete", tensorboard=False, resume_from=3).close()
  assert _warnings(caplog) == []
  with caplog.at_level(logging.WARNING):
    MetricsWriter(tmp_path / "lost", tensorboard=False, resume_from=4).close()
  [warning] = _warnings(caplog)
  assert "no record of update(s) 1-3 " in warning


def test_a_corrupt_line_anywhere_is_quarantined_not_deleted(tmp_path, caplog):
  log = tmp_path / "metrics.jsonl"
  _write_updates(log, [1, 2, 3, 4])
  lines = log.read_text().splitlines(keepends=True)
  lines[1] = '{"loss": 2.0, "upd\x00\x00ate": 2}\n'  # a corrupted middle line (no "update")
  log.write_text("".join(lines) + '{"loss": 5.0, "upd')  # and a line cut by a crash
  with caplog.at_level(logging.WARNING):
    MetricsWriter(tmp_path, tensorboard=False).close()
  [warning] = _warnings(caplog)
  assert "lines 2, 5 are not JSON objects" in warning
  assert str(tmp_path / "metrics.jsonl.corrupt") in warning
  assert [r["update"] for r in read_metrics(tmp_path)] == [1, 3, 4]
  quarantined = [json.loads(line) for line in _lines(tmp_path / "metrics.jsonl.corrupt")]
  assert quarantined == [{"line": 2, "text": '{"loss": 2.0, "upd\x00\x00ate": 2}'},
                         {"line": 5, "text": '{"loss": 5.0, "upd'}]

  # A later repair appends to the quarantine file (bytes that are not UTF-8 kept as escapes); a
  # resumed run also names the lost update 2.
  caplog.clear()
  with open(log, "ab") as f:
    f.write(b'{"loss": 4.5, "update": 4\xff\xfe}\n')
  with caplog.at_level(logging.WARNING):
    MetricsWriter(tmp_path, tensorboard=False, resume_from=5).close()
  quarantine_warning, behind_warning = _warnings(caplog)
  assert "line 4 is not a JSON object" in quarantine_warning
  assert "no record of update(s) 2 " in behind_warning and "metrics.jsonl.corrupt" in behind_warning
  assert json.loads(_lines(tmp_path / "metrics.jsonl.corrupt")[2]) == {
      "line": 4, "text": '{"loss": 4.5, "update": 4\udcff\udcfe}'}
  assert [r["update"] for r in read_metrics(tmp_path)] == [1, 3, 4]


def test_read_metrics_names_the_bad_line(tmp_path):
  (tmp_path / "metrics.jsonl").write_text('{"update": 0}\nnot json\n')
  with pytest.raises(ValueError, match=r"metrics.jsonl:2 is not a JSON object"):
    read_metrics(tmp_path)


def test_non_primary_writes_nothing(tmp_path):
  workdir = tmp_path / "run"
  writer = MetricsWriter(workdir, is_primary=False, resume_from=3)
  writer.write(0, {"loss": 1.0})
  writer.flush()
  writer.close()
  assert not workdir.exists()


def _read_scalars(event_file):
  """`{tag: [(step, value)]}` of a TensorBoard event file (TFRecord framing, no CRC checks)."""
  from tensorboardX.proto import event_pb2

  data, offset, scalars = event_file.read_bytes(), 0, {}
  while offset < len(data):
    (length,) = struct.unpack("<Q", data[offset:offset + 8])
    offset += 12  # length, its CRC
    event = event_pb2.Event.FromString(data[offset:offset + length])
    offset += length + 4  # data, its CRC
    for value in event.summary.value:
      scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
  return scalars


def test_tensorboard_event_file(tmp_path):
  with MetricsWriter(tmp_path) as writer:
    writer.write(0, {"loss": jnp.float32(1.5), "nan": jnp.nan})
    writer.write(1, {"loss": 0.5, "nan": 1.0})
  events = list((tmp_path / "tb").glob("events.out.tfevents.*"))
  assert len(events) == 1
  scalars = _read_scalars(events[0])
  assert scalars == {"loss": [(0, 1.5), (1, 0.5)], "nan": [(1, 1.0)]}  # non-finite values left out


class _FakeClock:

  def __init__(self):
    self.now = 100.0

  def __call__(self):
    return self.now


def test_timer_split_and_fractions():
  clock = _FakeClock()
  timer = Timer(clock=clock)
  with timer("generation"):
    clock.now += 3.0
  clock.now += 1.0  # untimed
  with timer("learner"):
    clock.now += 4.0
  with timer("generation"):
    clock.now += 2.0
  split = timer.split()
  assert split == pytest.approx({"time/generation": 5.0, "time/learner": 4.0, "time/total": 10.0,
                                 "time_frac/generation": 0.5, "time_frac/learner": 0.4})
  assert timer.split() == split  # split does not reset

  timer.reset()
  assert timer.split() == {"time/total": 0.0}
  with timer("learner"):
    clock.now += 1.0
    with pytest.raises(RuntimeError, match="'learner' is already being timed"):
      with timer("learner"):
        pass
  assert timer.split() == pytest.approx({"time/learner": 1.0, "time/total": 1.0,
                                         "time_frac/learner": 1.0})

  # A phase that raises is still counted.
  timer.reset()
  with pytest.raises(KeyError):
    with timer("env"):
      clock.now += 2.0
      raise KeyError("boom")
  assert timer.split()["time/env"] == 2.0


def test_progress_disabled_prints_nothing(capsys):
  stream = io.StringIO()
  progress = Progress(10, enabled=False, file=stream)
  progress.update(loss=jnp.float32(1.0))
  progress.close()
  default = Progress(10, enabled=False)  # tqdm's default stream, stderr
  default.update(3)
  default.close()
  assert stream.getvalue() == ""
  captured = capsys.readouterr()
  assert captured.out == "" and captured.err == ""


def test_progress_shows_chosen_metrics_from_initial():
  stream = io.StringIO()
  with Progress(10, initial=4, keys=("success", "loss"), file=stream, desc="train") as progress:
    progress.update(loss=0.25, success=1, kl=3.0)
    progress.update(2, loss=jnp.float32(0.123456), success=np.float64(0.5), kl=3.0)
  text = stream.getvalue()
  last = text.replace("\r", "\n").strip().splitlines()[-1]
  assert "train" in last and "7/10" in last
  assert "loss=0.1235" in last and "success=0.5" in last and "kl" not in text


def test_peak_rss_gb_counts_a_fresh_allocation():
  """`memory/peak_rss_gb` (loop.peak_rss_gb): in a fresh process, touching 400 MB raises the peak
  by about that much (a process-wide peak, so it is measured where nothing larger came before;
  the child of a large pytest worker must not report the worker's peak, as `ru_maxrss` does)."""
  import subprocess
  import sys
  code = ("import numpy as np; from longhorizon.train.loop import peak_rss_gb; a = peak_rss_gb(); "
          "x = np.ones(50_000_000); b = peak_rss_gb(); print(a, b)")
  before, after = map(float, subprocess.run([sys.executable, "-c", code], check=True,
                                            capture_output=True, text=True,
                                            timeout=300).stdout.split())
  assert 0.05 < before < after and 0.35 < after - before < 0.45


def test_peak_rss_gb_never_falls_below_an_earlier_answer(monkeypatch):
  """Linux sums resident pages per CPU only approximately, so `VmHWM` can read lower than it did
  (CI saw 5.50552 GB, then 5.50538 GB, on kernel 6.18): the logged peak is the largest reading."""
  from longhorizon.train import loop  # pylint: disable=g-import-not-at-top
  readings = iter([5.50551552, 5.505384448, 5.6])
  monkeypatch.setattr(loop, "_read_peak_rss_gb", lambda: next(readings))
  monkeypatch.setattr(loop, "_PEAK_RSS_GB", 0.0)
  assert [loop.peak_rss_gb() for _ in range(3)] == [5.50551552, 5.50551552, 5.6]
