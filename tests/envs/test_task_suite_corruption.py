"""A damaged task suite on disk fails at `tasks.load`, naming the file and the folder to delete;
deleting that folder regenerates the same tasks."""

import os
import re
import shutil

import jax
import numpy as np
import pytest

from longhorizon.envs import tasks

PARAMS, SIZES = {"horizon": 2}, {"train": 32, "test": 8, "ood": 8}


def _load(data_dir, split="test"):
  return tasks.load("pointer_chain", split, env_params=PARAMS, sizes=SIZES, data_dir=str(data_dir))


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
  """A generated suite, and its test tasks as read from the intact files."""
  data_dir = tmp_path_factory.mktemp("pristine")
  source = _load(data_dir)
  return data_dir, tasks.stack(source, range(len(source)))


@pytest.fixture
def suite(pristine, tmp_path):
  """A private copy of the pristine suite: `(data_dir, suite folder, intact test tasks)`."""
  data_dir = tmp_path / "data"
  shutil.copytree(pristine[0], data_dir)
  (name,) = os.listdir(data_dir / "longhorizon_tasks")
  return data_dir, str(data_dir / "longhorizon_tasks" / name / "1.0.0"), pristine[1]


def _test_file(folder):
  return os.path.join(folder, "longhorizon_tasks-test.array_record-00000-of-00001")


def _flip_record_bytes(path):
  data = bytearray(open(path, "rb").read())
  for i in range(100, 116):  # inside the first chunk (its header and records)
    data[i] ^= 0xFF
  open(path, "wb").write(data)


def _truncate(path):
  data = open(path, "rb").read()
  open(path, "wb").write(data[:500])


@pytest.mark.parametrize("damage", [_flip_record_bytes, _truncate, os.remove],
                         ids=["flipped_bytes", "truncated", "missing"])
def test_damaged_records_fail_at_load_with_path_and_remedy(suite, damage):
  data_dir, folder, _ = suite
  path = _test_file(folder)
  damage(path)
  with pytest.raises(tasks.CorruptSuiteError) as error:
    _load(data_dir)  # the error comes from load itself, not from a later read
  message = str(error.value)
  assert path in message and f"delete the folder {folder} to regenerate it" in message
  _load(data_dir, "train")  # the other splits' files are intact and still load


def test_deleting_the_named_folder_regenerates_the_same_tasks(suite):
  data_dir, folder, intact = suite
  _flip_record_bytes(_test_file(folder))
  with pytest.raises(tasks.CorruptSuiteError):
    _load(data_dir)
  shutil.rmtree(folder)  # the remedy the message gives
  source = _load(data_dir)
  jax.tree.map(np.testing.assert_array_equal, tasks.stack(source, range(len(source))), intact)


@pytest.mark.parametrize("text", ["{not json", "[]", ""])
def test_invalid_dataset_info_fails_at_load_with_path_and_remedy(suite, text):
  data_dir, folder, _ = suite
  info = os.path.join(folder, "dataset_info.json")
  with open(info, "w") as f:
    f.write(text)
  with pytest.raises(tasks.CorruptSuiteError,
                     match=re.escape(info) + r".*" + re.escape(f"delete the folder {folder}")):
    _load(data_dir)


def test_runs_that_build_the_same_new_suite_at_once_take_turns(tmp_path):
  # Two runs started together used to race: both generated the suite and the second rename of the
  # generated folder into place failed (FileExistsError). A build waits for the suite's lock.
  import threading
  data_dir = str(tmp_path / "data")
  env = tasks.envs.make("pointer_chain", **PARAMS)
  name = tasks.suite_name(env.name, PARAMS, 0, {**tasks.DEFAULT_SIZES, **SIZES}, env.version)
  results = []
  with tasks.suite_lock(data_dir, name):  # another run is generating the suite
    thread = threading.Thread(target=lambda: results.append(_load(data_dir)))
    thread.start()
    thread.join(timeout=3.0)
    assert thread.is_alive() and not os.path.exists(tasks.suite_dir(data_dir, name))
  thread.join(timeout=120)
  assert not thread.is_alive() and len(results[0]) == SIZES["test"]
  # Two processes at once, from nothing: both load the same tasks.
  import subprocess, sys
  other = str(tmp_path / "race")
  code = ("import sys; from longhorizon.envs import tasks; "
          f"s = tasks.load('pointer_chain', 'test', env_params={PARAMS!r}, sizes={SIZES!r}, "
          "data_dir=sys.argv[1]); print(len(s))")
  procs = [subprocess.Popen([sys.executable, "-c", code, other], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True) for _ in range(2)]
  outs = [p.communicate(timeout=300) for p in procs]
  assert [p.returncode for p in procs] == [0, 0], [e[-2000:] for _, e in outs]
  assert [o.split()[-1] for o, _ in outs] == [str(SIZES["test"])] * 2
