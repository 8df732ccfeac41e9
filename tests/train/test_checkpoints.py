"""Checkpointer: round trips (typed PRNG keys, dtypes, shardings), step bookkeeping, and recovery
from damaged or incomplete step folders."""

import gc
import logging
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longhorizon.train.checkpoints import Checkpointer, CheckpointError

_LOGGER = "longhorizon.train.checkpoints"


@flax.struct.dataclass
class _TrainState:
  step: jax.Array  # [] int32
  params: dict
  rng: jax.Array  # [] key<fry>


def _state(offset=0):
  key = jax.random.key(7)
  return {
      "train": _TrainState(step=jnp.int32(3 + offset),
                           params={"w": jnp.arange(6.0).reshape(2, 3) + offset,
                                   "b": jnp.full((3,), 0.5 + offset, jnp.bfloat16)},
                           rng=key),
      "sampler_keys": jax.random.split(jax.random.fold_in(key, offset), 4),  # [4] key<fry>
      "mask": np.array([True, False, True]),
      "counts": np.array([1, 2, 3], np.int64) + offset,
      "pair": (jnp.array(False), np.float32(2.5)),
  }


def _assert_same(restored, expected):
  flat_r, tree_r = jax.tree_util.tree_flatten(restored)
  flat_e, tree_e = jax.tree_util.tree_flatten(expected)
  assert tree_r == tree_e
  for r, e in zip(flat_r, flat_e):
    assert r.dtype == e.dtype, (r.dtype, e.dtype)
    assert type(r) is type(e) or (isinstance(r, jax.Array) and isinstance(e, jax.Array)), (
        type(r), type(e))
    if jax.dtypes.issubdtype(e.dtype, jax.dtypes.prng_key):
      assert jax.random.key_impl(r) == jax.random.key_impl(e)
      np.testing.assert_array_equal(jax.random.key_data(r), jax.random.key_data(e))
    else:
      np.testing.assert_array_equal(np.asarray(r), np.asarray(e))


def _save_steps(directory, steps, **kwargs):
  with Checkpointer(directory, **kwargs) as ckpt:
    for s in steps:
      assert ckpt.save(s, _state(s), {"step": s})


def test_round_trip_with_template(tmp_path):
  state = _state()
  meta = {"step": 3, "lr": np.float32(0.25), "name": "run", "env_steps": np.int64(1280),
          "hist": [1, 2]}
  with Checkpointer(tmp_path / "ckpt") as ckpt:
    assert ckpt.save(3, state, meta)
  # A fresh Checkpointer, as after a restart.
  with Checkpointer(tmp_path / "ckpt") as ckpt:
    restored, restored_meta = ckpt.restore(template=state)
    assert ckpt.restored_step == 3
  _assert_same(restored, state)
  assert restored_meta == {"step": 3, "lr": 0.25, "name": "run", "env_steps": 1280, "hist": [1, 2]}
  assert type(restored_meta["step"]) is int
  # The restored keys draw the same numbers as the saved ones.
  np.testing.assert_array_equal(jax.random.uniform(restored["train"].rng, (3,)),
                                jax.random.uniform(state["train"].rng, (3,)))


def test_restore_from_abstract_template_and_without_template(tmp_path):
  state = _state()
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(0, state, {"step": 0})
    # `jax.eval_shape` gives ShapeDtypeStructs (typed keys included, int64 as int32 without x64).
    abstract = jax.eval_shape(lambda: state)
    restored, _ = ckpt.restore(template=abstract)
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    leaves = zip(jax.tree.leaves(restored), jax.tree.leaves(abstract), jax.tree.leaves(state))
    for r, a, e in leaves:
      assert r.shape == a.shape and r.dtype == a.dtype
      if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
        np.testing.assert_array_equal(jax.random.key_data(r), jax.random.key_data(e))
      else:
        np.testing.assert_array_equal(np.asarray(r), np.asarray(e))
    assert jax.dtypes.issubdtype(restored["sampler_keys"].dtype, jax.dtypes.prng_key)

    # Without a template the structure is orbax's (dicts and lists), keys still typed.
    raw, meta = ckpt.restore(0)
  assert meta == {"step": 0}
  assert raw["train"]["rng"].dtype == state["train"].rng.dtype
  np.testing.assert_array_equal(jax.random.key_data(raw["sampler_keys"]),
                                jax.random.key_data(state["sampler_keys"]))
  np.testing.assert_array_equal(raw["counts"], state["counts"])
  assert isinstance(raw["pair"], list)


def test_restore_into_template_sharding(tmp_path):
  mesh = jax.make_mesh((1,), ("data",))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  state = {"x": jnp.arange(4.0), "keys": jax.random.split(jax.random.key(0), 4)}
  template = jax.tree.map(lambda x: jax.device_put(x, sharding), state)
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(1, state, {})
    restored, _ = ckpt.restore(template=template)
  for r in jax.tree.leaves(restored):
    assert r.sharding == sharding
  _assert_same(restored, state)


@pytest.mark.slow
def test_resharding_on_eight_devices(tmp_path):
  """Saved sharded over 8 devices along one axis, restored replicated / along the other axis."""
  script = textwrap.dedent(f"""
      import jax, jax.numpy as jnp, numpy as np
      from jax.sharding import NamedSharding, PartitionSpec as P
      from longhorizon.train.checkpoints import Checkpointer, CheckpointError
      assert jax.device_count() == 8
      mesh = jax.make_mesh((8,), ("d",))
      put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
      state = {{"w": put(jnp.arange(64.0).reshape(8, 8), P("d")),
               "keys": put(jax.random.split(jax.random.key(1), 8), P("d"))}}
      template = {{"w": put(jnp.zeros((8, 8)), P(None, "d")),
                  "keys": put(jax.random.split(jax.random.key(0), 8), P())}}
      with Checkpointer({str(tmp_path)!r}) as ckpt:
        ckpt.save(5, state, {{"step": 5}})
        restored, meta = ckpt.restore(template=template)
      assert meta == {{"step": 5}}
      for name in ("w", "keys"):
        got, want = restored[name].sharding, template[name].sharding
        assert got.is_equivalent_to(want, restored[name].ndim), (name, got, want)
      assert restored["keys"].dtype == state["keys"].dtype
      np.testing.assert_array_equal(restored["w"], state["w"])
      np.testing.assert_array_equal(jax.random.key_data(restored["keys"]),
                                    jax.random.key_data(state["keys"]))
      print("ok")
  """)
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=8")
  result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=120)
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.strip().endswith("ok")


def test_latest_step_max_to_keep_and_interval(tmp_path):
  with Checkpointer(tmp_path, max_to_keep=2) as ckpt:
    assert ckpt.latest_step() is None
    for s in range(5):
      assert ckpt.save(s, _state(s), {"step": s})
      assert ckpt.latest_step() == s
    ckpt.wait()
    assert not ckpt.save(4, _state(4), {"step": 4})  # not newer than the newest step: skipped
  assert sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit()) == ["3", "4"]

  with Checkpointer(tmp_path / "every2", save_interval_steps=2) as ckpt:
    assert not ckpt.save(1, _state(), {})
    assert ckpt.save(2, _state(), {})
    assert not ckpt.save(3, _state(), {})
    assert ckpt.save(3, _state(), {}, force=True)
    assert ckpt.latest_step() == 3


def test_resume_picks_latest(tmp_path):
  _save_steps(tmp_path, [0, 10, 20], max_to_keep=3)
  with Checkpointer(tmp_path, max_to_keep=3) as ckpt:
    assert ckpt.latest_step() == 20
    state, meta = ckpt.restore(template=_state())
    assert ckpt.restored_step == 20 and meta == {"step": 20}
    _assert_same(state, _state(20))
    # An explicit older step is restored as asked.
    state, meta = ckpt.restore(10, template=_state())
    assert meta == {"step": 10} and ckpt.restored_step == 10
    with pytest.raises(FileNotFoundError, match="no checkpoint step 15"):
      ckpt.restore(15)


def _truncate_files(folder):
  for path in pathlib.Path(folder).rglob("*"):
    if path.is_file():
      path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])


def _delete_array_data(folder):
  data = [p for p in pathlib.Path(folder, "state").rglob("*")
          if p.is_file() and p.parent.name == "d"]
  assert data, "expected OCDBT data files under state/**/d/"
  for p in data:
    p.unlink()


# When a read fails, orbax leaves a coroutine unawaited and a callback on a closed event loop; both
# are reported at garbage collection (forced at the end of the test, so they are reported here) and
# are harmless.
def _orbax_read_error_noise(test):
  test = pytest.mark.filterwarnings("ignore:coroutine .* was never awaited:RuntimeWarning")(test)
  return pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")(test)


@pytest.fixture
def collect_garbage():
  yield
  gc.collect()


def _delete_keys_item(folder):
  shutil.rmtree(pathlib.Path(folder, "prng_keys"))


def _delete_state_files(folder):
  for p in pathlib.Path(folder, "state").rglob("*"):
    if p.is_file():
      p.unlink()


def _scramble_one_file(folder):
  data = sorted(p for p in pathlib.Path(folder, "state").rglob("*") if p.is_file()
                and p.parent.name == "d")
  path = data[0]
  raw = bytearray(path.read_bytes())
  raw[len(raw) // 2:] = bytes(255 - b for b in raw[len(raw) // 2:])
  path.write_bytes(bytes(raw))


@pytest.mark.usefixtures("collect_garbage")
@pytest.mark.parametrize("damage", [_truncate_files, _delete_array_data, _delete_keys_item,
                                    _delete_state_files, _scramble_one_file])
@_orbax_read_error_noise
def test_damaged_latest_falls_back_to_previous_and_is_set_aside(tmp_path, caplog, damage):
  root = tmp_path / "checkpoints"
  _save_steps(root, [1, 2, 3])
  damage(root / "3")
  damaged_files = sorted(str(p.relative_to(root / "3")) for p in (root / "3").rglob("*"))
  with Checkpointer(root) as ckpt:
    assert ckpt.latest_step() == 3  # committed; the damage shows only when reading
    with caplog.at_level(logging.WARNING, logger=_LOGGER):
      state, meta = ckpt.restore(template=_state())
    assert ckpt.restored_step == 2 and meta == {"step": 2}
    _assert_same(state, _state(2))
    warnings = [r.getMessage() for r in caplog.records if r.name == _LOGGER]
    assert len(warnings) == 2, warnings
    assert "step 3" in warnings[0] and "could not be restored" in warnings[0]
    assert "Error" in warnings[0]  # the error's type is named
    assert "step 3" in warnings[1] and "moved it to" in warnings[1] and "not deleted" in warnings[1]

    # The damaged step is kept, whole, beside the checkpoints (not deleted), and no longer a step.
    aside = list((tmp_path / "checkpoints.damaged").iterdir())
    assert len(aside) == 1 and aside[0].name.startswith("3.")
    assert sorted(str(p.relative_to(aside[0])) for p in aside[0].rglob("*")) == damaged_files
    assert ckpt.latest_step() == 2
    with pytest.raises(FileNotFoundError, match="no checkpoint step 3"):
      ckpt.restore(3, template=_state())

    # The resumed run saves step 3 again.
    assert ckpt.save(3, _state(30), {"step": 3})
  with Checkpointer(root) as ckpt:
    state, meta = ckpt.restore(template=_state())
  assert ckpt.restored_step == 3
  _assert_same(state, _state(30))


@pytest.mark.usefixtures("collect_garbage")
@_orbax_read_error_noise
def test_explicit_damaged_step_raises_naming_it(tmp_path):
  _save_steps(tmp_path, [1, 2])
  _truncate_files(tmp_path / "2")
  with Checkpointer(tmp_path) as ckpt:
    with pytest.raises(Exception) as info:
      ckpt.restore(2, template=_state())
    assert any("step 2" in note for note in getattr(info.value, "__notes__", []))


@pytest.mark.usefixtures("collect_garbage")
@_orbax_read_error_noise
def test_every_step_damaged_raises_with_each_error(tmp_path):
  _save_steps(tmp_path, [1, 2])
  _truncate_files(tmp_path / "1")
  _truncate_files(tmp_path / "2")
  with Checkpointer(tmp_path) as ckpt:
    with pytest.raises(CheckpointError, match=r"could be restored \(step 2: .*; step 1: "):
      ckpt.restore(template=_state())


def test_crash_mid_save_leaves_previous_step_restorable(tmp_path, caplog):
  _save_steps(tmp_path, [1, 2])
  # A save that died before its rename: orbax's temporary folder.
  tmp_folder = tmp_path / "3.orbax-checkpoint-tmp-1700000000000000"
  shutil.copytree(tmp_path / "2", tmp_folder)
  (tmp_folder / "commit_success.txt").unlink()
  # A step folder without the commit marker (a copy cut short), holding only part of the items.
  (tmp_path / "4" / "state").mkdir(parents=True)
  shutil.copy(tmp_path / "2" / "state" / "_METADATA", tmp_path / "4" / "state")

  with Checkpointer(tmp_path) as ckpt:
    assert ckpt.latest_step() == 2
    with caplog.at_level(logging.WARNING, logger=_LOGGER):
      state, meta = ckpt.restore(template=_state())
    assert ckpt.restored_step == 2 and meta == {"step": 2}
    _assert_same(state, _state(2))
    assert any("skipping checkpoint step 4" in r.getMessage() and "incomplete" in r.getMessage()
               for r in caplog.records)
    with pytest.raises(ValueError, match="step 4 .* is incomplete"):
      ckpt.restore(4)
    # Saving the next step moves the incomplete folder that would block it aside (kept).
    assert ckpt.save(3, _state(3), {"step": 3})
    ckpt.wait()
    assert not (tmp_path / "4").exists()
    aside = list(ckpt.quarantine.iterdir())
    assert [p.name.split(".")[0] for p in aside] == ["4"]
    assert (aside[0] / "state" / "_METADATA").exists()
    assert not tmp_folder.exists()  # orbax removes it in the background, awaited by the first save
    assert ckpt.latest_step() == 3


def test_missing_directory(tmp_path):
  with Checkpointer(tmp_path / "does" / "not" / "exist") as ckpt:
    assert ckpt.latest_step() is None
    with pytest.raises(FileNotFoundError, match="no committed checkpoint"):
      ckpt.restore()


def test_helpful_errors(tmp_path):
  with pytest.raises(ValueError, match="max_to_keep"):
    Checkpointer(tmp_path, max_to_keep=0)
  with Checkpointer(tmp_path) as ckpt:
    with pytest.raises(TypeError, match=r"meta\['weights'\]"):
      ckpt.save(0, _state(), {"weights": np.zeros(3)})
    ckpt.save(0, _state(), {"step": 0})
    # A template without the saved keys is a caller error: it raises at once, no fallback.
    template = _state()
    template["sampler_keys"] = np.zeros((4, 2), np.uint32)
    with pytest.raises(ValueError, match="typed PRNG keys at"):
      ckpt.restore(template=template)
