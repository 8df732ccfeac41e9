"""The sweep launcher (longhorizon.studies.sweeps, experiments/sweep.py) and the TPU pod launcher
(experiments/launch_tpu_pod.sh). Nothing here trains: runs are fake commands or dry runs."""

import json
import pathlib
import shlex
import subprocess
import sys

from absl import flags
from ml_collections import config_flags
import pytest

from longhorizon.studies import sweeps

ROOT = pathlib.Path(__file__).parents[2]
SWEEP_CONFIG = ROOT / "configs" / "algorithm_sweep.py"
ALGORITHMS = ["grpo", "drgrpo", "rloo", "reinforce_pp", "gigpo", "ppo"]


# ---------------------------------------------------------------------------------------------
# Helpers: product, zip_, names.


def test_product_crosses_axes_first_axis_slowest():
  runs = sweeps.product({"config.a": [1, 2]}, {"config.b": ["x", "y"]})
  assert runs == [{"config.a": 1, "config.b": "x"}, {"config.a": 1, "config.b": "y"},
                  {"config.a": 2, "config.b": "x"}, {"config.a": 2, "config.b": "y"}]


def test_keys_in_one_axis_vary_together_and_axes_nest():
  runs = sweeps.product({"config.lr": [1e-3, 1e-4], "config.steps": [10, 20]}, {"config.seed": [0]})
  assert runs == [{"config.lr": 1e-3, "config.steps": 10, "config.seed": 0},
                  {"config.lr": 1e-4, "config.steps": 20, "config.seed": 0}]
  inner = sweeps.zip_({"config.a": [1, 2]}, {"config.b": [3, 4]})
  assert sweeps.product(inner, {"config.c": [5, 6]}) == [
      {"config.a": 1, "config.b": 3, "config.c": 5}, {"config.a": 1, "config.b": 3, "config.c": 6},
      {"config.a": 2, "config.b": 4, "config.c": 5}, {"config.a": 2, "config.b": 4, "config.c": 6}]


def test_zip_pairs_axes_and_rejects_unequal_lengths():
  assert sweeps.zip_({"config.a": [1, 2]}, {"config.b": ["x", "y"]}) == [
      {"config.a": 1, "config.b": "x"}, {"config.a": 2, "config.b": "y"}]
  with pytest.raises(ValueError, match=r"equal length, got lengths \[2, 3\]"):
    sweeps.zip_({"config.a": [1, 2]}, {"config.b": [1, 2, 3]})


@pytest.mark.parametrize("axes, message", [
    (({"config.a": 1},), "expected a list of values"),
    (({"config.a": "abc"},), "expected a list of values"),
    (({"config.a": [1, 2], "config.b": [1]},), "equal lengths"),
    (({"config.a": [1]}, {"config.a": [2]}), "set by two axes"),
    (({},), "empty axis"),
])
def test_bad_axes_name_the_problem(axes, message):
  with pytest.raises(ValueError, match=message):
    sweeps.product(*axes)


def test_run_names_readable_safe_and_short():
  assert sweeps.run_name({"config.algorithm.name": "gigpo", "config.seed": 1}) == (
      "algorithm.name=gigpo,seed=1")
  assert sweeps.run_name({}) == "base"
  assert sweeps.run_name({"config.model.checkpoint": "/a b/c"}) == "model.checkpoint=_a_b_c"
  assert sweeps.run_name({"config.tensorboard": False, "config.x": (1, 2)}) == (
      "tensorboard=False,x=_1,_2_")
  long = {f"config.field_{i}": "v" * 20 for i in range(10)}
  name = sweeps.run_name(long)
  assert len(name) <= 120 and name == sweeps.run_name(dict(long))  # stable
  assert name != sweeps.run_name({**long, "config.field_9": "w" * 20})


def test_expand_gives_unique_names_and_commands_that_parse_back(tmp_path):
  sweep = sweeps.product({"config.algorithm.name": ALGORITHMS}, {"config.seed": [0, 1, 2]})
  runs = sweeps.expand(sweep, f"{SWEEP_CONFIG}:smoke", str(tmp_path / "my root"),
                       python="python", extra_flags=["--config.tensorboard=False"])
  assert [r.index for r in runs] == list(range(18))
  assert len({r.name for r in runs}) == 18 and len({r.workdir for r in runs}) == 18
  for run, overrides in zip(runs, sweep):
    argv = shlex.split(run.shell)
    assert argv == list(run.command)
    assert argv[:4] == ["python", "experiments/train.py", f"--config={SWEEP_CONFIG}:smoke",
                        f"--workdir={tmp_path / 'my root' / run.name}"]
    assert argv[4:] == [f"--config.algorithm.name={overrides['config.algorithm.name']}",
                        f"--config.seed={overrides['config.seed']}", "--config.tensorboard=False"]


def test_command_flags_set_the_overrides_through_config_flags(tmp_path):
  """The train flags of a run, parsed the way experiments/train.py parses them, give the config
  with the run's overrides (string, int, float, bool)."""
  overrides = {"config.algorithm.name": "reinforce_pp", "config.seed": 2,
               "config.optim.learning_rate": 1e-5, "config.tensorboard": False,
               "config.env.env_error_kinds": ("unavailable", "timeout")}
  (run,) = sweeps.expand([overrides], f"{SWEEP_CONFIG}:smoke", str(tmp_path))
  argv = ["train.py", *run.command[2:]]
  flag_values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, flag_values=flag_values, lock_config=True,
                                  sys_argv=argv)
  flags.DEFINE_string("workdir", None, "", flag_values=flag_values)
  flag_values(argv)
  config = flag_values.config
  assert (config.algorithm.name, config.seed) == ("reinforce_pp", 2)
  assert config.optim.learning_rate == 1e-5 and config.tensorboard is False
  assert config.env.env_error_kinds == ("unavailable", "timeout")
  assert config.num_updates == 3  # the smoke variant
  assert flag_values.workdir == run.workdir == str(tmp_path / run.name)


def test_expand_rejects_duplicates_and_separates_names_that_collide(tmp_path):
  with pytest.raises(ValueError, match="runs 0 and 2 have the same overrides"):
    sweeps.expand([{"config.seed": 0}, {"config.seed": 1}, {"config.seed": 0}], "c.py", "/r")
  runs = sweeps.expand([{"config.model.checkpoint": "a/b"}, {"config.model.checkpoint": "a_b"}],
                       "c.py", "/r")
  assert runs[0].name != runs[1].name
  assert all(r.name.startswith("model.checkpoint=a_b-") for r in runs)


def test_algorithm_sweep_config_and_overrides_check():
  config, sweep = sweeps.load_sweep(str(SWEEP_CONFIG))
  assert len(sweep) == 18 and config.num_updates == 60
  assert {r["config.algorithm.name"] for r in sweep} == set(ALGORITHMS)
  assert {r["config.seed"] for r in sweep} == {0, 1, 2}
  sweeps.check_overrides(config, sweep)
  smoke_config, smoke = sweeps.load_sweep(f"{SWEEP_CONFIG}:smoke")
  assert smoke == [{"config.algorithm.name": "grpo", "config.seed": 0},
                   {"config.algorithm.name": "gigpo", "config.seed": 0}]
  assert smoke_config.num_updates == 3
  # The seed study of the main job: default.py's config exactly, GRPO, seeds 0-4.
  seeds_config, seeds = sweeps.load_sweep(f"{SWEEP_CONFIG}:grpo_seeds")
  assert seeds == [{"config.algorithm.name": "grpo", "config.seed": s} for s in range(5)]
  default = sweeps.config_module(str(ROOT / "configs" / "default.py")).get_config()
  assert seeds_config.to_dict() == default.to_dict() == config.to_dict()
  # The same study with the warm start it was made with (main_job_seeds/sft_steps_80/): only the
  # SFT budget differs from default.py.
  old_config, old_seeds = sweeps.load_sweep(f"{SWEEP_CONFIG}:grpo_seeds_sft80")
  assert old_seeds == seeds and (old_config.sft.episodes, old_config.sft.steps) == (64, 80)
  old_config.sft.episodes, old_config.sft.steps = default.sft.episodes, default.sft.steps
  assert old_config.to_dict() == default.to_dict()
  with pytest.raises(ValueError, match="unknown config variant 'big'"):
    sweeps.load_sweep(f"{SWEEP_CONFIG}:big")

  with pytest.raises(ValueError, match=r"run 1 .*no field 'config.algorithm.nmae'"):
    sweeps.check_overrides(config, [{"config.seed": 1}, {"config.algorithm.nmae": "x"}])
  with pytest.raises(ValueError, match=r"no field 'config.optimizer'"):
    sweeps.check_overrides(config, [{"config.optimizer.learning_rate": 1.0}])
  with pytest.raises(ValueError, match=r"config.seed='one': the config rejects this value"):
    sweeps.check_overrides(config, [{"config.seed": "one"}])
  with pytest.raises(ValueError, match="keys are 'config.<field>' paths"):
    sweeps.check_overrides(config, [{"seed": 1}])


def test_load_sweep_without_get_sweep_says_how_to_add_one():
  with pytest.raises(ValueError, match="defines no get_sweep"):
    sweeps.load_sweep(str(ROOT / "configs" / "default.py"))


# ---------------------------------------------------------------------------------------------
# The runner, on fake commands.


def _fake_run(index, name, code):
  command = (sys.executable, "-c", f"print('hello from {name}'); raise SystemExit({code})")
  return sweeps.Run(index, name, {"config.seed": index}, f"/nowhere/{name}", command)


def test_run_sweep_records_exit_codes_logs_and_keeps_earlier_records(tmp_path):
  records = sweeps.run_sweep([_fake_run(0, "a", 0), _fake_run(1, "b", 3)], str(tmp_path))
  assert [(r["name"], r["status"], r["returncode"]) for r in records] == [
      ("a", "ok", 0), ("b", "failed", 3)]
  assert (tmp_path / "logs" / "b.log").read_text().strip() == "hello from b"
  saved = json.loads((tmp_path / "sweep.json").read_text())
  assert [(r["name"], r["status"]) for r in saved] == [("a", "ok"), ("b", "failed")]
  assert shlex.split(saved[1]["command"])[-1].endswith("raise SystemExit(3)")

  # Rerunning one run (as --only does) updates its record and keeps the other.
  sweeps.run_sweep([_fake_run(1, "b", 0)], str(tmp_path))
  saved = json.loads((tmp_path / "sweep.json").read_text())
  assert [(r["name"], r["status"]) for r in saved] == [("a", "ok"), ("b", "ok")]


def test_run_sweep_runs_up_to_max_parallel_at_once(tmp_path):
  """Run 0 waits for a file that run 1 writes: it can only succeed if both run at the same time."""
  flag = tmp_path / "flag"
  wait = (f"import os, time\nfor _ in range(200):\n  if os.path.exists({str(flag)!r}): break\n"
          "  time.sleep(0.05)\nelse:\n  raise SystemExit(7)")
  runs = [sweeps.Run(0, "waiter", {}, "", (sys.executable, "-c", wait)),
          sweeps.Run(1, "writer", {}, "", (sys.executable, "-c", f"open({str(flag)!r}, 'w')"))]
  records = sweeps.run_sweep(runs, str(tmp_path / "root"), max_parallel=2, poll_s=0.02)
  assert [r["status"] for r in records] == ["ok", "ok"]


def test_run_sweep_refuses_remote_roots():
  with pytest.raises(ValueError, match="give a local directory"):
    sweeps.run_sweep([], "gs://bucket/sweep")


# ---------------------------------------------------------------------------------------------
# experiments/sweep.py, as a subprocess.


def _sweep(*flag_list):
  return subprocess.run([sys.executable, "experiments/sweep.py", *flag_list], cwd=ROOT,
                        capture_output=True, text=True, timeout=60)


def test_sweep_dry_run_prints_one_command_per_run_and_runs_nothing(tmp_path):
  root = tmp_path / "sweep root"
  result = _sweep("--config=configs/algorithm_sweep.py:smoke", f"--workdir_root={root}",
                  "--dry_run", "--", "--config.tensorboard=False")
  assert result.returncode == 0, result.stderr[-3000:]
  lines = result.stdout.splitlines()
  assert len(lines) == 2
  for line, algorithm in zip(lines, ["grpo", "gigpo"]):
    argv = shlex.split(line)
    assert argv[0] == sys.executable and argv[1] == "experiments/train.py"
    assert argv[2:] == ["--config=configs/algorithm_sweep.py:smoke",
                        f"--workdir={root}/algorithm.name={algorithm},seed=0",
                        f"--config.algorithm.name={algorithm}", "--config.seed=0",
                        "--config.tensorboard=False"]
  assert not root.exists()  # no workdir, log or sweep.json


def test_sweep_only_selects_runs_by_index(tmp_path):
  result = _sweep("--config=configs/algorithm_sweep.py", f"--workdir_root={tmp_path}", "--dry_run",
                  "--only=17,1")
  assert result.returncode == 0, result.stderr[-3000:]
  workdirs = [shlex.split(line)[3] for line in result.stdout.splitlines()]
  assert workdirs == [f"--workdir={tmp_path}/algorithm.name=ppo,seed=2",
                      f"--workdir={tmp_path}/algorithm.name=grpo,seed=1"]
  result = _sweep("--config=configs/algorithm_sweep.py:smoke", f"--workdir_root={tmp_path}",
                  "--dry_run", "--only=2")
  assert result.returncode != 0 and result.stdout == ""
  assert "indices [2] out of range; the sweep has 2 runs" in result.stderr


# ---------------------------------------------------------------------------------------------
# experiments/launch_tpu_pod.sh --dry_run.


def _launch(*flag_list):
  return subprocess.run(["bash", "experiments/launch_tpu_pod.sh", *flag_list], cwd=ROOT,
                        capture_output=True, text=True, timeout=30)


def _remote(line):
  """The --command= of one printed gcloud command, split into words as the worker's shell would."""
  argv = shlex.split(line)
  (command,) = [a.removeprefix("--command=") for a in argv if a.startswith("--command=")]
  return argv, shlex.split(command)


def test_tpu_dry_run_prints_setup_and_train_commands_for_all_workers():
  workdir = "gs://bucket/my run"
  result = _launch("--tpu=my-pod", "--zone=us-central2-b", "--project=proj",
                   "--config=configs/default.py:smoke", f"--workdir={workdir}",
                   "--repo=https://example.com/longhorizon.git", "--branch=dev", "--dry_run",
                   "--", "--config.seed=3", "--config.env.style=tool call")
  assert result.returncode == 0, result.stderr
  lines = result.stdout.splitlines()
  assert len(lines) == 2
  for line in lines:
    assert line.startswith(
        "gcloud compute tpus tpu-vm ssh my-pod --zone=us-central2-b --worker=all ")
    assert shlex.split(line)[8] == "--project=proj"

  _, setup = _remote(lines[0])
  setup_text = " ".join(setup)
  assert "clone --quiet --branch dev https://example.com/longhorizon.git longhorizon;" in setup_text
  assert "bash scripts/setup_env.sh;" in setup_text and "jax[tpu]==" in setup_text

  _, train = _remote(lines[1])
  start = train.index("experiments/train.py")
  assert train[start - 1] == ".venv/bin/python"
  assert train[start + 1:] == ["--distributed", "--config=configs/default.py:smoke",
                               f"--workdir={workdir}",
                               "--config.seed=3", "--config.env.style=tool call"]


def test_tpu_dry_run_skip_setup_prints_only_the_train_command():
  result = _launch("--tpu=t", "--zone=z", "--config=configs/default.py", "--workdir=/w",
                   "--repo=r", "--branch=b", "--skip_setup", "--dry_run")
  assert result.returncode == 0, result.stderr
  (line,) = result.stdout.splitlines()
  argv, train = _remote(line)
  assert argv[:8] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "t", "--zone=z", "--worker=all"]
  assert train[-4:] == ["experiments/train.py", "--distributed", "--config=configs/default.py",
                        "--workdir=/w"]


@pytest.mark.parametrize("flag_list, message", [
    (["--zone=z", "--config=c.py", "--workdir=/w", "--repo=r", "--branch=b"], "missing --tpu"),
    (["--tpu=t", "--zone=z", "--config=c.py", "--repo=r", "--branch=b"], "missing --workdir"),
    (["--tpu=t", "--zone=z", "--config=c.py", "--workdir=/w", "--repo=r", "--branch=b",
      "--bogus=1"], "unknown flag '--bogus'"),
])
def test_tpu_missing_or_unknown_flags_print_usage_and_exit_2(flag_list, message):
  result = _launch(*flag_list, "--dry_run")
  assert result.returncode == 2
  assert result.stdout == ""
  assert message in result.stderr
  assert "bash experiments/launch_tpu_pod.sh --tpu=NAME --zone=ZONE" in result.stderr


# ---------------------------------------------------------------------------------------------
# Every config file loads the way experiments/train.py loads it.


_LOAD = """
import sys
from absl import flags
from ml_collections import config_flags
from longhorizon.train import config as config_lib
spec = config_flags.DEFINE_config_file("config", None)
flags.FLAGS(["prog", "--config=" + sys.argv[1]])
if "num_updates" in spec.value:  # a training config (not the kernels benchmark's)
  config_lib.validate(spec.value)
print("loaded")
"""


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "configs").glob("*.py")))
def test_config_file_loads_without_the_repo_on_sys_path(name):
  # `python -I`: neither the working directory nor PYTHONPATH is on sys.path, as for
  # `python experiments/train.py` (whose sys.path[0] is experiments/): a config that builds on
  # default.py must load it by path (sweeps.config_module), not `from configs import default`.
  result = subprocess.run([sys.executable, "-I", "-c", _LOAD, f"configs/{name}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=False)
  assert result.returncode == 0, result.stderr[-2000:]
  assert result.stdout.startswith("loaded")
