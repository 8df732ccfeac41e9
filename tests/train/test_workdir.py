"""The workdir of a run: any path a user types works, one run at a time (a lock), a resumed run
keeps its config (changes that cannot apply are refused with the diff, the others recorded), a
damaged newest checkpoint falls back, and `--init_from` starts a new run from another's checkpoint.
The subprocess tests run experiments/train.py (and scripts/main.sh) as a user would."""

import json
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import time

import jax
import numpy as np
import pytest

from configs import default as default_config
from longhorizon.eval import provenance as provenance_lib
from longhorizon.train import config as config_lib
from longhorizon.train import workdir as workdir_lib
from longhorizon.train.checkpoints import Checkpointer
from longhorizon.train.metrics import read_metrics

ROOT = pathlib.Path(__file__).resolve().parents[2]
SMOKE = [f"--config={ROOT}/configs/default.py:smoke", "--config.tensorboard=False",
         "--config.eval.num_tasks=8"]


# ------------------------------------------------------------------------------------ in-process

def test_resolve_makes_every_typed_path_absolute(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  assert workdir_lib.resolve("results/default") == str(tmp_path / "results" / "default")
  assert workdir_lib.resolve("~/runs/a") == str(tmp_path / "home" / "runs" / "a")
  assert workdir_lib.resolve("x/../y/./z") == str(tmp_path / "y" / "z")
  assert workdir_lib.resolve("gs://bucket/run") == "gs://bucket/run"
  with pytest.raises(ValueError, match="--workdir"):
    workdir_lib.resolve("")


def test_lock_refuses_a_second_owner_and_names_the_first(tmp_path):
  with workdir_lib.WorkdirLock(str(tmp_path)):
    owner = json.loads((tmp_path / ".lock").read_text())
    assert owner["pid"] == os.getpid() and owner["host"]
    with pytest.raises(workdir_lib.WorkdirLockedError, match=f"pid {os.getpid()} on host"):
      workdir_lib.WorkdirLock(str(tmp_path)).acquire()
  # Released: the next run takes it.
  with workdir_lib.WorkdirLock(str(tmp_path)):
    pass


def test_stale_lock_of_a_killed_run_is_taken_over(tmp_path):
  # A run killed with -9 leaves its lock file behind, but the kernel released its flock.
  child = subprocess.run(
      [sys.executable, "-c", "import os, sys; sys.path.insert(0, 'src');"
       "from longhorizon.train import workdir as w; w.WorkdirLock(sys.argv[1]).acquire();"
       "os.kill(os.getpid(), 9)", str(tmp_path)], cwd=ROOT)
  assert child.returncode == -9
  stale = json.loads((tmp_path / ".lock").read_text())
  assert stale["pid"] != os.getpid()
  with workdir_lib.WorkdirLock(str(tmp_path)):
    assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()


def _config(**changes):
  config = default_config.get_config("smoke")
  config.unlock()
  for path, value in changes.items():
    config_lib.set_path(config, path, value)
  return config


def test_config_check_refuses_fixed_fields_with_the_diff_and_records_allowed_ones(tmp_path):
  work = str(tmp_path)
  assert workdir_lib.check_config(work, _config(), resuming=False) == {}
  workdir_lib.save_config(work, _config(), 0)
  saved = (tmp_path / "config.json").read_text()
  assert (tmp_path / "config.0.json").read_text() == saved

  for changes, line in (({"model.hidden_size": 64}, "model.hidden_size: 128 (saved) -> 64 (now)"),
                        ({"algorithm.name": "rloo"}, "algorithm.name: 'grpo' (saved) -> 'rloo'"),
                        ({"optim.learning_rate": 1e-3}, "optim.learning_rate: 0.0003 (saved)"),
                        ({"seed": 3}, "seed: 0 (saved) -> 3 (now)"),
                        ({"env.params": {"horizon": 4}}, "env.params.horizon: 3 (saved) -> 4")):
    with pytest.raises(workdir_lib.ConfigMismatchError) as info:
      workdir_lib.check_config(work, _config(**changes), resuming=True)
    assert line in str(info.value) and "--init_from" in str(info.value)
    assert (tmp_path / "config.json").read_text() == saved  # nothing written

  changes = workdir_lib.check_config(work, _config(num_updates=9, **{"eval.k": 4}), resuming=True)
  assert changes == {"num_updates": (3, 9), "eval.k": (2, 4)}
  workdir_lib.save_config(work, _config(num_updates=9, **{"eval.k": 4}), 3, changes)
  assert json.loads((tmp_path / "config.json").read_text())["num_updates"] == 9
  assert json.loads((tmp_path / "config.3.json").read_text())["num_updates"] == 9
  assert json.loads((tmp_path / "config.0.json").read_text())["num_updates"] == 3  # history kept
  # An unchanged resume writes nothing new.
  workdir_lib.save_config(work, _config(num_updates=9, **{"eval.k": 4}), 5, {})
  assert not (tmp_path / "config.5.json").exists()


def test_fields_added_since_a_run_started_resume_at_their_old_behaviour(tmp_path):
  """A workdir saved before `model.moe`, `model.lora`, `model.decode_quant`, `model.remat`,
  `eval.greedy`, the turn-level / EMPG algorithm fields, branch rollouts and shared-prefix passes
  existed resumes with their defaults (a dense, fully fine-tuned, float32-sampled model, evaluated
  greedy too, token-level advantages without EMPG, a separate critic, per-row passes), and is refused when a new field asks for something the old run
  did not do."""
  work = str(tmp_path)
  workdir_lib.save_config(work, _config(), 0)
  saved = json.loads((tmp_path / "config.json").read_text())
  del saved["model"]["moe"], saved["model"]["lora"], saved["model"]["decode_quant"]
  del saved["model"]["remat"], saved["eval"]["greedy"]
  for name in ("unit", "vapo_length", "step_lam", "empg", "empg_k", "empg_k_future", "empg_zeta",
               "time_discount", "time_source", "step_verifier", "verifier_weight",
               "part_weights", "critic"):
    del saved["algorithm"][name]
  del saved["loss"]["reuse_behaviour_logprobs"], saved["loss"]["kl_reference"]
  del saved["rollout"]["branch_k"], saved["rollout"]["branch_at"], saved["rollout"]["record_oracle"]
  del saved["curriculum"]["step_budgets"], saved["curriculum"]["grow_at"]
  del saved["rollout"]["share_prompts"], saved["optim"]["share_prefix"]
  del saved["optim"]["skip_zero_grad"]
  for name in ("recovery_groups", "recovery_from", "recovery_capacity", "continue_partial",
               "partial_cache"):
    del saved["rollout"][name]
  del saved["store"], saved["dpo"], saved["sft"]["store"], saved["context"]
  (tmp_path / "config.json").write_text(json.dumps(saved))
  changes = workdir_lib.check_config(work, _config(), resuming=True)
  assert changes["model.moe.num_experts"] == ("<missing>", 0)
  assert set(changes) == set(workdir_lib.ADDED_FIELDS)
  with pytest.raises(workdir_lib.ConfigMismatchError, match=r"model.moe.num_experts: '<missing>'"):
    workdir_lib.check_config(work, _config(**{"model.moe.num_experts": 4}), resuming=True)
  with pytest.raises(workdir_lib.ConfigMismatchError, match=r"algorithm.unit: '<missing>'"):
    workdir_lib.check_config(work, _config(**{"algorithm.unit": "turn"}), resuming=True)


def test_remat_may_change_on_resume(tmp_path):
  """Rematerialisation changes memory and time, not the arithmetic: a run may resume with it."""
  work = str(tmp_path)
  workdir_lib.save_config(work, _config(), 0)
  changes = workdir_lib.check_config(work, _config(**{"model.remat": "full"}), resuming=True)
  assert changes == {"model.remat": ("none", "full")}


def test_unreadable_saved_config_is_named(tmp_path):
  (tmp_path / "config.json").write_text("{not json")
  with pytest.raises(workdir_lib.ConfigMismatchError, match="config.json cannot be read"):
    workdir_lib.check_config(str(tmp_path), _config(), resuming=True)


# ---------------------------------------------------------------------------------- subprocesses

def _env(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu", LONGHORIZON_DATA=str(tmp_path / "data"),
             JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax_cache"),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  env.pop("LONGHORIZON_CRASH_AT", None)
  return env


def _train(tmp_path, workdir, *flags, cwd=ROOT):
  return subprocess.run([sys.executable, str(ROOT / "experiments" / "train.py"),
                         f"--workdir={workdir}", *SMOKE, *flags], cwd=cwd, env=_env(tmp_path),
                        capture_output=True, text=True, timeout=900)


def _comparable(rows):
  timing = lambda k: (k.startswith(("time", "memory", "rollout/")) or k.endswith("_s")
                      or "per_s" in k)
  return [{k: v for k, v in r.items() if not timing(k)} for r in rows]


@pytest.mark.slow
def test_relative_and_home_workdirs(tmp_path):
  (tmp_path / "cwd" / "sub").mkdir(parents=True)
  run = _train(tmp_path, "../runs/rel", "--config.num_updates=1", cwd=tmp_path / "cwd" / "sub")
  assert run.returncode == 0, run.stderr[-3000:]
  assert (tmp_path / "cwd" / "runs" / "rel" / "eval.json").exists()
  assert (tmp_path / "cwd" / "runs" / "rel" / "checkpoints" / "1").exists()
  env = dict(_env(tmp_path), HOME=str(tmp_path / "home"))
  run = subprocess.run([sys.executable, "experiments/train.py", "--workdir=~/w", *SMOKE,
                        "--config.num_updates=0"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=900)
  assert run.returncode == 0, run.stderr[-3000:]
  assert (tmp_path / "home" / "w" / "eval.json").exists()


def _private_venv(path: pathlib.Path) -> None:
  """A venv at `path` that sees this environment's installed packages (a `.pth` line naming its
  site-packages) but none of its `.pth` files, so not this checkout's editable install: what is
  installed into it (a copy of the repository, editable) stays out of the shared environment."""
  subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, capture_output=True,
                 timeout=600)
  shared = sysconfig.get_paths()["purelib"]
  site = pathlib.Path(subprocess.run(
      [str(path / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
      check=True, capture_output=True, text=True).stdout.strip())
  (site / "shared_packages.pth").write_text(shared + "\n")


def _imported_from(python: pathlib.Path) -> pathlib.Path:
  out = subprocess.run([str(python), "-c", "import longhorizon; print(longhorizon.__file__)"],
                       check=True, capture_output=True, text=True, cwd="/")
  return pathlib.Path(out.stdout.strip()).resolve()


@pytest.mark.slow
def test_main_script_exact_command_line_with_its_relative_default_workdir(tmp_path):
  """`bash scripts/main.sh` as the README writes it, in a copy of the repository (its default
  WORKDIR is the relative results/default); shortened by extra flags that take the same path.

  The copy's set-up installs it (editable) into a venv of its own: installed into the shared
  environment, it took this checkout's place for every other test's subprocess until the test
  ended, and those (a copy without `.git`) recorded no commit in their eval.json."""
  repo = tmp_path / "repo"
  shutil.copytree(ROOT, repo, ignore=shutil.ignore_patterns(".venv", "results", ".git", "*.egg-info",
                                                            "__pycache__", ".pytest_cache"))
  _private_venv(repo / ".venv")
  script = (repo / "scripts" / "main.sh").read_text()
  assert 'WORKDIR="${WORKDIR:-results/default}"' in script and '--workdir="$WORKDIR"' in script
  env = _env(tmp_path)
  env.pop("WORKDIR", None)
  try:
    run = subprocess.run(["bash", "scripts/main.sh", "--config.num_updates=1",
                          "--config.sft.steps=4", "--config.eval.num_tasks=8", "--config.eval.k=1",
                          "--config.tasks.train_size=256", "--config.checkpoint_every=1"],
                         cwd=repo, env=env, capture_output=True, text=True, timeout=1200)
  finally:
    shared_imports = _imported_from(pathlib.Path(sys.executable))
    if not shared_imports.is_relative_to(ROOT):
      # Set the shared environment right for the tests after this one, then fail below.
      subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "-e",
                      str(ROOT)], check=True, capture_output=True, timeout=600)
  assert run.returncode == 0, run.stderr[-3000:]
  out = repo / "results" / "default"
  assert (out / "checkpoints" / "0").exists() and (out / "checkpoints" / "1").exists()
  assert json.loads((out / "eval.json").read_text())["num_updates"] == 1
  # The copy ran its own code, and the shared environment still imported this checkout.
  assert _imported_from(repo / ".venv" / "bin" / "python").is_relative_to(repo.resolve())
  assert shared_imports.is_relative_to(ROOT), shared_imports


@pytest.mark.slow
def test_second_run_on_a_workdir_refuses_naming_the_first(tmp_path):
  work = tmp_path / "w"
  first = subprocess.Popen([sys.executable, "experiments/train.py", f"--workdir={work}", *SMOKE,
                            "--config.num_updates=3"], cwd=ROOT, env=_env(tmp_path),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  deadline = time.time() + 300
  while not ((work / ".lock").exists() and (work / ".lock").read_text()) and time.time() < deadline:
    time.sleep(0.2)
  second = _train(tmp_path, work, "--config.num_updates=3")
  _, first_err = first.communicate(timeout=900)
  assert first.returncode == 0, first_err[-3000:]
  assert second.returncode == 2, second.stderr[-3000:]
  assert f"in use by another run (pid {first.pid} on host" in second.stderr
  assert "Traceback" not in second.stderr
  assert [r["update"] for r in read_metrics(str(work))] == [1, 2, 3]  # each update once


@pytest.mark.slow
def test_damaged_newest_checkpoint_falls_back_and_resumes(tmp_path):
  work = tmp_path / "w"
  run = _train(tmp_path, work, "--config.num_updates=4", "--config.checkpoint_every=2")
  assert run.returncode == 0, run.stderr[-3000:]
  straight = read_metrics(str(work))
  for path in (work / "checkpoints" / "4").rglob("*"):  # truncate every file of the newest step
    if path.is_file():
      path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])
  run = _train(tmp_path, work, "--config.num_updates=4", "--config.checkpoint_every=2")
  assert run.returncode == 0, run.stderr[-3000:]
  assert "checkpoint step 4" in run.stderr and "could not be restored" in run.stderr
  assert "Resuming from checkpoint step 2 (update 2 of 4); the newest step 4" in run.stderr
  aside = list((work / "checkpoints.damaged").iterdir())
  assert [p.name.split(".")[0] for p in aside] == ["4"] and any(aside[0].rglob("*"))
  assert (work / "checkpoints" / "4" / "commit_success.txt").exists()  # saved again
  assert _comparable(read_metrics(str(work))) == _comparable(straight)  # 3 and 4 recomputed


@pytest.mark.slow
def test_resume_with_changed_config_and_init_from(tmp_path):
  base = tmp_path / "base"
  run = _train(tmp_path, base, "--config.num_updates=2")
  assert run.returncode == 0, run.stderr[-3000:]
  saved = (base / "config.json").read_text()

  # Fields fixed for the life of a run are refused with the diff, before anything is written.
  for flag, field in (("--config.model.hidden_size=64", "model.hidden_size: 128 (saved) -> 64"),
                      ("--config.algorithm.name=rloo", "algorithm.name: 'grpo' (saved) -> 'rloo'")):
    run = _train(tmp_path, base, "--config.num_updates=2", flag)
    assert run.returncode == 2, run.stderr[-3000:]
    assert field in run.stderr and "Traceback" not in run.stderr
    assert (base / "config.json").read_text() == saved

  # Allowed changes continue the run and are recorded.
  run = _train(tmp_path, base, "--config.num_updates=3")
  assert run.returncode == 0, run.stderr[-3000:]
  assert "num_updates: 2 -> 3" in run.stderr
  assert json.loads((base / "config.2.json").read_text())["num_updates"] == 3
  assert json.loads((base / "config.0.json").read_text())["num_updates"] == 2
  assert [r["update"] for r in read_metrics(str(base))] == [1, 2, 3]

  # Another algorithm from the same run's checkpoint, in its own workdir.
  branch = tmp_path / "branch"
  run = _train(tmp_path, branch, "--config.num_updates=1", "--config.algorithm.name=rloo",
               f"--init_from={base}")
  assert run.returncode == 0, run.stderr[-3000:]
  origin = json.loads((branch / "init_from.json").read_text())
  assert origin == {"workdir": str(base), "step": 3, "update": 3, "algorithm": "grpo"}
  result = json.loads((branch / "eval.json").read_text())
  assert result["algorithm"] == "rloo" and result["init_from"] == origin
  # The code it ran on: this checkout's commit (eval/provenance.py's own test checks it
  # in-process). It was None in full parallel suites while the main-script test's copy was
  # installed in the shared environment (see that test).
  assert result["provenance"]["commit"] == provenance_lib.provenance()["commit"], \
      result["provenance"]
  assert result["provenance"]["packages"]["jax"] == jax.__version__
  # Its starting policy is the base run's final one: the same evaluation as the base's final.
  assert result["warm_start_success_rate"] == json.loads(
      (base / "eval.json").read_text())["success_rate"]
  # Rerunning the same command resumes; a different source is refused.
  run = _train(tmp_path, branch, "--config.num_updates=1", "--config.algorithm.name=rloo",
               f"--init_from={base}")
  assert run.returncode == 0, run.stderr[-3000:]
  run = _train(tmp_path, branch, "--config.num_updates=1", "--config.algorithm.name=rloo",
               f"--init_from={tmp_path / 'other'}")
  assert run.returncode == 2 and "--init_from only starts a new run" in run.stderr
  run = _train(tmp_path, tmp_path / "bad", "--config.model.hidden_size=64", f"--init_from={base}")
  assert run.returncode == 2 and "model.hidden_size: 128 (source) -> 64 (now)" in run.stderr

  # An older checkpoint of the source (which step 0 holds is checked on planted parameters in
  # test_init_from_step_takes_that_checkpoint: this smoke run's updates leave them unchanged).
  older = tmp_path / "older"
  run = _train(tmp_path, older, "--config.num_updates=1", f"--init_from={base}",
               "--init_from_step=2")
  assert run.returncode == 0, run.stderr[-3000:]
  assert json.loads((older / "init_from.json").read_text())["step"] == 2
  assert "checkpoint step 2" in run.stderr
  params = lambda w, step: jax.tree.leaves(Checkpointer(str(w / "checkpoints")).restore(step)[0]
                                           ["params"])
  assert all(np.array_equal(a, b) for a, b in zip(params(older, 0), params(base, 2)))
  # Resuming it with another step is refused; a step the source lacks names the steps there.
  run = _train(tmp_path, older, "--config.num_updates=1", f"--init_from={base}",
               "--init_from_step=3")
  assert run.returncode == 2 and "already holds a run started from step 2" in run.stderr
  run = _train(tmp_path, tmp_path / "missing", "--config.num_updates=1", f"--init_from={base}",
               "--init_from_step=7")
  assert run.returncode == 2 and "no checkpoint step 7" in run.stderr, run.stderr[-3000:]
  assert "steps there: [" in run.stderr and "Traceback" not in run.stderr
  run = _train(tmp_path, tmp_path / "nosource", "--init_from_step=2")
  assert run.returncode == 2 and "--init_from_step needs --init_from" in run.stderr


def test_init_from_step_takes_that_checkpoint(tmp_path):
  """`start_from(..., step)` starts from that checkpoint's parameters, the default from the newest:
  a source workdir with two planted checkpoints whose parameters differ."""
  from longhorizon.train import loop  # pylint: disable=g-import-not-at-top
  from longhorizon.train.learner import Learner  # pylint: disable=g-import-not-at-top
  config = default_config.get_config("smoke")
  config.unlock()
  config.eval.num_tasks, config.eval.k, config.tensorboard = 2, 1, False
  config.lock()
  source = tmp_path / "source"
  source.mkdir()
  workdir_lib.save_config(str(source), config, 0)
  s = Learner.build(config)
  with s.in_mesh():
    state = s.initial_state()
    planted = {1: state.params, 2: jax.tree.map(lambda x: x + 1, state.params)}
    checkpointer = Checkpointer(str(source / "checkpoints"))
    for step, params in planted.items():
      checkpointer.save(step, state.replace(params=params), {"update": step}, force=True)
    checkpointer.close()
    leaves = lambda params: [np.asarray(x) for x in jax.tree.leaves(params)]
    for step, expected in ((1, 1), (None, 2)):
      started, meta = loop.start_from(s, s.initial_state(), str(source), step)
      assert meta["init_from"]["step"] == expected and meta["init_from"]["update"] == expected
      for got, want in zip(leaves(started.params), leaves(planted[expected])):
        np.testing.assert_array_equal(got, want)
    with pytest.raises(workdir_lib.WorkdirError, match=r"no checkpoint step 5 .*steps there: "):
      loop.start_from(s, s.initial_state(), str(source), 5)
