"""Multi-host training: each process collects its share of the tasks, the shares reassemble the
single-process batch exactly, and a 2-process run of experiments/train.py on this machine
(localhost coordinator, CPU collectives over gloo) gives the single-process run's metrics and
evaluation, writes each log line once, and resumes from its multi-host checkpoint; 2 processes
checkpoint and restore a state sharded over each one's own devices. (Subprocesses: a process joins
one distributed job, and its device count is fixed when JAX starts.)"""

import dataclasses
import importlib.util
import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from longhorizon import envs, rollout
from longhorizon.envs import testing
from longhorizon.models import init_params, tiny_config
from longhorizon.train import learner
from longhorizon.train.metrics import read_metrics

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
_spec = importlib.util.spec_from_file_location("default_config",
                                               os.path.join(ROOT, "configs", "default.py"))
default_config = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(default_config)
# A smoke run with a learning signal (horizon 1, a longer warm start, milestone reward), so the
# losses and gradients being compared are not all zero.
SMOKE = ["--config=configs/default.py:smoke", "--config.tensorboard=False",
         "--config.eval.num_tasks=8", "--config.sft.steps=30", "--config.env.params.horizon=1",
         "--config.reward.milestone=0.5", "--config.checkpoint_every=2"]


# ----------------------------------------------------------------------- the split, in one process

@pytest.mark.slow  # over 24 s on a 2-core AMD EPYC (BUILD_NOTES, the test tiers)
def test_process_shares_reassemble_the_single_process_batch():
  env = envs.TimeLimit(envs.make("pointer_chain", horizon=2), 5)
  codec = env.codec(style="compact")
  config = dataclasses.replace(tiny_config(), vocab_size=len(codec.tokenizer))
  params = init_params(config, jax.random.key(0))
  rc = rollout.RolloutConfig(group_size=2, context_length=128, max_steps=5, turn_tokens=5)
  keys = jax.random.split(jax.random.key(1), 4)
  tasks = testing.tasks_from_keys(env, keys)
  whole, _ = rollout.collect(params, config, env, codec, tasks, keys, rc, sampling_seed=7,
                             group_offset=10)
  # What processes 0 and 1 of 2 run (`collect_across_processes`), concatenated as the gather does.
  shares = [rollout.collect(params, config, env, codec, jax.tree.map(lambda a: a[lo:lo + 2], tasks),
                            keys[lo:lo + 2], rc, sampling_seed=7, group_offset=10 + lo,
                            row_offset=lo * rc.group_size)[0] for lo in (0, 2)]
  joined = jax.tree.map(lambda *xs: np.concatenate(xs), *shares)
  assert not np.array_equal(shares[0].tokens, shares[1].tokens[:2])  # the shares differ
  for name, a, b in zip([f.name for f in dataclasses.fields(whole)], jax.tree.leaves(whole),
                        jax.tree.leaves(joined)):
    if np.asarray(a).dtype.kind == "f":
      np.testing.assert_allclose(b, a, atol=1e-5, err_msg=name)
    else:
      np.testing.assert_array_equal(b, a, err_msg=name)


def test_allgather_rows_is_the_identity_in_one_process():
  tree = {"a": np.arange(6).reshape(3, 2), "b": (np.ones(3, bool),)}
  out = rollout.allgather_rows(tree)
  jax.tree.map(np.testing.assert_array_equal, out, tree)
  with pytest.raises(ValueError, match="scalar leaf"):
    rollout.allgather_rows({"s": np.float32(1.0)})


def test_uneven_split_names_the_field():
  config = default_config.get_config("smoke")  # rollout.num_tasks = 4
  learner.check_process_split(config, eval_size=16, process_count=2)
  with pytest.raises(ValueError, match=r"config.rollout.num_tasks=4 .* 3 JAX processes.*"
                                       r"--config.rollout.num_tasks=6"):
    learner.check_process_split(config, eval_size=12, process_count=3)
  with pytest.raises(ValueError, match=r"config.eval.num_tasks=15 .* --config.eval.num_tasks=16"):
    learner.check_process_split(config, eval_size=15, process_count=2)
  assert rollout.process_share(8) == (0, 8)  # one process: everything


# -------------------------------------------------------------------- 2 processes of train.py

def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _env(data_dir):
  env = dict(os.environ, JAX_PLATFORMS="cpu", LONGHORIZON_DATA=str(data_dir))
  for name in ("XLA_FLAGS", "LONGHORIZON_CRASH_AT", "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES",
               "JAX_PROCESS_ID"):
    env.pop(name, None)  # one CPU device per process, no inherited cluster
  return env


def _run_all(commands, env, timeout):
  """Starts every command at once (the processes of one job); returns their stdouts."""
  runs = [subprocess.Popen(c, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True) for c in commands]
  outputs = []
  try:
    for i, run in enumerate(runs):
      out, err = run.communicate(timeout=timeout)
      assert run.returncode == 0, f"process {i}:\n{err[-4000:]}"
      outputs.append(out)
  finally:
    for run in runs:
      if run.poll() is None:
        run.kill()
  return outputs


def _train(workdir, data_dir, num_updates, processes=1):
  """Runs train.py in `processes` processes (one JAX process each); returns their stdouts."""
  args = [sys.executable, "experiments/train.py", f"--workdir={workdir}", *SMOKE,
          f"--config.num_updates={num_updates}"]
  if processes == 1:
    return _run_all([args], _env(data_dir), timeout=900)
  port = _free_port()
  return _run_all([args + [f"--coordinator_address=localhost:{port}",
                           f"--num_processes={processes}", f"--process_id={i}"]
                   for i in range(processes)], _env(data_dir), timeout=900)


def _final(stdout: str) -> str:
  return [line for line in stdout.splitlines() if line.startswith("final:")][-1]


def _without_timing(row: dict) -> dict:
  timing = lambda k: (k.startswith(("time", "memory", "rollout/")) or k.endswith("_s")
                      or "per_s" in k)
  return {k: v for k, v in row.items() if not timing(k)}


@pytest.mark.slow
def test_two_processes_match_one_and_resume(tmp_path):
  single_dir, multi_dir = tmp_path / "single", tmp_path / "multi"
  _train(single_dir, tmp_path / "data_single", num_updates=3)
  # 2 processes: updates 1-2 (checkpoint at 2), then a second launch resumes for update 3. The
  # multi-host run generates its own task files (process 0 writes, process 1 waits).
  _train(multi_dir, tmp_path / "data_multi", num_updates=2, processes=2)
  assert sorted(os.listdir(multi_dir / "checkpoints")) == ["0", "2"]
  outputs = _train(multi_dir, tmp_path / "data_multi", num_updates=3, processes=2)

  single, multi = read_metrics(str(single_dir)), read_metrics(str(multi_dir))
  assert [r["update"] for r in multi] == [1, 2, 3]  # process 0 alone writes: no line twice
  assert any(abs(r["loss"]) > 1e-3 for r in single)  # a real learning signal is compared
  for a, b in zip(single, multi):
    a, b = _without_timing(a), _without_timing(b)
    assert b.keys() == a.keys()
    for k in a:
      if "success" in k or "rate" in k or k.startswith(("episode_", "termination/")):
        assert b[k] == a[k], k  # the same episodes
      else:  # losses, gradient norms, entropies: within float tolerance
        np.testing.assert_allclose(b[k], a[k], atol=1e-4, err_msg=k)
  with open(single_dir / "eval.json") as f, open(multi_dir / "eval.json") as g:
    single_eval, multi_eval = json.load(f), json.load(g)
  # Both launches ran the same code (a commit, known) on the same packages.
  single_where, multi_where = single_eval.pop("provenance"), multi_eval.pop("provenance")
  assert single_where["commit"] is not None, single_where
  assert multi_where["commit"] == single_where["commit"]
  assert multi_where["packages"] == single_where["packages"]
  assert multi_eval == single_eval
  # Process 1 evaluated too (the same gathered episodes) but wrote nothing.
  assert _final(outputs[1]) == _final(outputs[0])


_CHECKPOINT_SCRIPT = """
import sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
jax.distributed.initialize(coordinator_address=sys.argv[1], num_processes=2,
                           process_id=int(sys.argv[2]))
from longhorizon.train.checkpoints import Checkpointer
mesh = Mesh(np.array(jax.local_devices()), ("fsdp",))  # each process's own 2 devices
state = {"w": jax.device_put(jnp.arange(8.0).reshape(4, 2), NamedSharding(mesh, P("fsdp"))),
         "b": jnp.ones(3), "rng": jax.random.key(5), "n": 3}
ck = Checkpointer(sys.argv[3])
assert ck.latest_step() is None
ck.save(1, state, {"update": 1})
ck.wait()
assert ck.latest_step() == 1
out, meta = ck.restore(template=state)
assert meta == {"update": 1} and ck.restored_step == 1
assert out["w"].sharding == state["w"].sharding and out["b"].sharding == state["b"].sharding
np.testing.assert_array_equal(out["w"], state["w"])
np.testing.assert_array_equal(jax.random.key_data(out["rng"]), jax.random.key_data(state["rng"]))
ck.close()
print("restored", jax.process_index())
"""


def test_checkpoint_of_process_local_sharded_state_across_two_processes(tmp_path):
  """Each process holds the same state sharded over its own 2 devices (as the multi-host loop
  does): orbax gets it as global arrays replicated over the processes, writes it once, and every
  process restores it into its own placement."""
  port = _free_port()
  env = dict(_env(tmp_path), XLA_FLAGS="--xla_force_host_platform_device_count=2")
  outputs = _run_all([[sys.executable, "-c", _CHECKPOINT_SCRIPT, f"localhost:{port}", str(i),
                       str(tmp_path / "checkpoints")] for i in range(2)], env, timeout=300)
  assert [f"restored {i}" in out for i, out in enumerate(outputs)] == [True, True]
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["1"]
