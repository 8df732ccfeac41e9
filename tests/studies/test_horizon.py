"""The horizon sweep: step-accuracy aggregation, budgets that fit the oracle, summaries, plots, and
an end-to-end smoke sweep that resumes."""

import importlib.util
import json
import math
import os
import pathlib

import jax
import numpy as np
import pytest

from longhorizon.studies import horizon

ROOT = pathlib.Path(__file__).parents[2]


def _config(variant):
  spec = importlib.util.spec_from_file_location("hs_config", ROOT / "configs" / "horizon_sweep.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(variant)


def test_step_probabilities_hand_case():
  # Row 0: step 0 has two sampled tokens (0.5 * 0.5), step 1 one token (0.8); the prompt and the
  # observation token (not in the loss mask) do not count. Row 1: one step of 0.9; step 1 absent.
  logp = np.log([[1.0, 0.5, 0.5, 0.3, 0.8], [1.0, 0.9, 0.2, 1.0, 1.0]])
  turn = np.array([[-1, 0, 0, 0, 1], [-1, 0, 0, -1, -1]])
  loss = np.array([[0, 1, 1, 0, 1], [0, 1, 0, 0, 0]], bool)
  steps = np.array([[1, 1], [1, 0]], bool)
  prob = horizon.step_probabilities(logp, turn, loss, steps)
  np.testing.assert_allclose(prob[0], [0.25, 0.8])
  np.testing.assert_allclose(prob[1, 0], 0.9)
  assert np.isnan(prob[1, 1])


def test_step_probabilities_match_a_loop_reference():
  rng = np.random.default_rng(0)
  b, l, s = 5, 23, 4
  logp = -rng.exponential(0.3, (b, l))
  turn = np.sort(rng.integers(-1, s, (b, l)), axis=1)
  loss = rng.random((b, l)) < 0.6
  steps = rng.random((b, s)) < 0.8
  expected = np.full((b, s), np.nan)
  for i in range(b):
    for t in range(s):
      if steps[i, t]:
        expected[i, t] = math.exp(sum(logp[i, j] for j in range(l) if loss[i, j] and turn[i, j] == t))
  np.testing.assert_allclose(horizon.step_probabilities(logp, turn, loss, steps), expected)


def test_summarize_mean_and_std_over_seeds():
  rows = []
  for seed, final in enumerate([0.2, 0.4, 0.6]):
    row = {k: 0.0 for k in horizon.RESULT_FIELDS}
    row.update(env="pointer_chain", horizon=4, actions=5, algorithm="grpo", seed=seed,
               final_success=final, gain=final - 0.1)
    rows.append(row)
  (entry,) = horizon.summarize(rows)
  assert entry["seeds"] == 3
  assert entry["final_success"] == pytest.approx(0.4)
  assert entry["final_success_std"] == pytest.approx(0.2)  # sample std of 0.2, 0.4, 0.6
  assert entry["gain"] == pytest.approx(0.3)
  assert "| pointer_chain | 4 | 5 | grpo | 3 |" in horizon.markdown_table([entry])


def test_actions_needed_and_unknown_env():
  assert horizon.actions_needed("pointer_chain", 8) == 9
  assert horizon.actions_needed("gridworld", 8) == 8
  with pytest.raises(ValueError, match="horizon_settings"):
    horizon.actions_needed("retail", 4)
  with pytest.raises(ValueError, match="unknown algorithm label"):
    horizon.cell_config(_config("smoke"), "gridworld", 2, "ppo_vtrace", 0)


@pytest.mark.parametrize("env_name,n", [("pointer_chain", 16), ("gridworld", 8), ("gridworld", 2)])
@pytest.mark.slow  # over 24 s on a 2-core AMD EPYC (BUILD_NOTES, the test tiers)
def test_cpu_budgets_hold_an_oracle_episode_of_exactly_the_horizon(env_name, n):
  """The step limit and context budget of the CPU sweep's longest cells fit the oracle's
  episodes, and every task needs exactly N moves (gridworld) or N hops (pointer_chain)."""
  from longhorizon import rollout
  from longhorizon.train.learner import make_env
  from longhorizon.train.options import RolloutOptions
  config = horizon.cell_config(_config("cpu"), env_name, n, "grpo", 0)
  env = make_env(config)
  codec = env.codec(None, config.env.style)
  tasks = jax.vmap(lambda k: env.generate_task(k, "test"))(jax.random.split(jax.random.key(3), 16))
  assert np.all(np.asarray(jax.vmap(env.task_difficulty)(tasks)) == n)
  batch, _ = rollout.collect(None, None, env, codec, tasks, jax.random.split(jax.random.key(4), 16),
                             RolloutOptions.from_config(config).collect_config(
                                 config.env.max_steps, group_size=1), sampling_seed=0,
                             scripted=rollout.oracle_turns(env, codec, 0.0))
  assert np.all(batch.success) and not np.any(batch.truncated)
  assert np.all(np.asarray(batch.num_steps) == horizon.actions_needed(env_name, n))


@pytest.mark.slow  # over 24 s on a 2-core AMD EPYC (BUILD_NOTES, the test tiers)
def test_smoke_sweep_writes_results_and_resumes(tmp_path):
  config = _config("smoke")
  cells = [horizon.Cell("pointer_chain", 2, 0)]
  lines = []
  rows = horizon.run_sweep(config, cells, ["grpo", "gigpo"], str(tmp_path), log=lines.append)
  assert [r["algorithm"] for r in rows] == ["grpo", "gigpo"]
  for row in rows:
    assert row["episodes"] == config.num_updates * config.rollout.num_tasks * config.rollout.group_size
    assert row["tokens"] > row["episodes"] * 10
    assert 0.0 <= row["final_step_accuracy"] <= 1.0
    assert row["final_predicted"] == pytest.approx(row["final_step_accuracy"] ** 3, rel=1e-5)
    assert row["mean_task_length"] == 2
  # Both algorithms start from the same warm start.
  assert rows[0]["warm_success"] == rows[1]["warm_success"]
  _, curves = horizon.read_results(str(tmp_path))
  assert len(curves) == 2 * config.num_updates
  # Each update's diagnostics, in step with its curve row: the same episodes' success, a policy
  # entropy, a share of signal-free groups.
  diagnostics = horizon.read_update_metrics(str(tmp_path))
  assert [(d["algorithm"], d["update"]) for d in diagnostics] == [
      (c["algorithm"], c["update"]) for c in curves]
  for d, c in zip(diagnostics, curves):
    assert d["termination/success"] == pytest.approx(c["train_success"])
    assert d["entropy"] > 0 and 0 <= d["zero_advantage_group_rate"] <= 1
    assert d["episode_steps"] >= 1 and d["grad_norm"] >= 0
  # A rerun skips the finished cell.
  lines.clear()
  horizon.run_sweep(config, cells, ["grpo", "gigpo"], str(tmp_path), log=lines.append)
  assert any("already in results.csv" in line for line in lines)
  assert len(horizon.read_results(str(tmp_path))[0]) == 2
  # A sweep killed after grpo's run resumes with gigpo alone, from the same warm start, and gives
  # the row the uninterrupted sweep gave.
  results = tmp_path / "results.csv"
  full = results.read_text().splitlines()
  results.write_text("\n".join(full[:2]) + "\n")
  lines.clear()
  resumed = horizon.run_sweep(config, cells, ["grpo", "gigpo"], str(tmp_path), log=lines.append)
  assert any("(resumed: gigpo)" in line for line in lines)
  assert [r["algorithm"] for r in resumed] == ["grpo", "gigpo"]
  for key in ("warm_success", "warm_step_accuracy", "final_success", "final_step_accuracy",
              "tokens"):
    assert resumed[1][key] == rows[1][key], key
  assert len(horizon.read_results(str(tmp_path))[1]) == 2 * config.num_updates
  assert len(horizon.read_update_metrics(str(tmp_path))) == 2 * config.num_updates
  paths = horizon.plot_all(str(tmp_path))
  for path in paths.values():
    assert os.path.getsize(path) > 5000
  assert "| pointer_chain | 2 | 3 | grpo | 1 |" in (tmp_path / "summary.md").read_text()


@pytest.mark.slow
def test_a_killed_run_continues_from_its_checkpoint(tmp_path, monkeypatch):
  """`checkpoint_every`: a run killed after its checkpoint at update 2 continues from there (only
  updates 3 and 4 are run again) and gives the uninterrupted run's row and curve; the checkpoint
  folder goes once the run is recorded, and a checkpoint of other settings is refused by name."""
  config = _config("smoke")
  config.unlock()
  config.num_updates = 4
  cell, setups = horizon.Cell("pointer_chain", 2, 0), {}
  straight_rows, straight_curves = horizon.run_cell(
      config, cell, ["grpo"], log=lambda _: None, setups=setups,
      partial_dir=str(tmp_path / "straight"), checkpoint_every=2)
  assert not os.path.exists(horizon.run_path(str(tmp_path / "straight"), cell, "grpo"))

  calls, real_step = [], horizon.Learner.step

  def step(self, state, update, *args, **kwargs):
    calls.append(update)
    if update == kill_at[0]:
      raise KeyboardInterrupt  # the sweep is stopped during update 4
    return real_step(self, state, update, *args, **kwargs)

  kill_at = [3]
  monkeypatch.setattr(horizon.Learner, "step", step)
  partial = str(tmp_path / "partial")
  lines = []
  with pytest.raises(KeyboardInterrupt):
    horizon.run_cell(config, cell, ["grpo"], log=lines.append, setups=setups,
                     partial_dir=partial, checkpoint_every=2)
  assert calls == [0, 1, 2, 3]
  assert os.path.isdir(os.path.join(horizon.run_path(partial, cell, "grpo"), "2"))
  saved = [l for l in lines if "checkpoint saved" in l]  # the progress line of update 2 only
  assert len(saved) == 1 and "grpo" in saved[0] and "update 2/4" in saved[0], lines
  calls.clear()
  kill_at = [None]
  lines.clear()
  rows, curves = horizon.run_cell(config, cell, ["grpo"], log=lines.append, setups=setups,
                                  partial_dir=partial, checkpoint_every=2)
  assert calls == [2, 3]  # continued from the checkpoint at update 2
  assert any("continues from its checkpoint at update 2/4" in l for l in lines), lines
  assert not any("checkpoint saved" in l for l in lines)  # none after the last update
  for key in ("warm_success", "final_success", "final_greedy_success", "final_step_accuracy",
              "episodes", "tokens"):
    assert rows[0][key] == straight_rows[0][key], key
  assert curves == straight_curves
  assert not os.path.exists(horizon.run_path(partial, cell, "grpo"))

  # A checkpoint left by a run of other settings is not continued.
  kill_at = [3]
  with pytest.raises(KeyboardInterrupt):
    horizon.run_cell(config, cell, ["grpo"], log=lambda _: None, setups=setups,
                     partial_dir=partial, checkpoint_every=2)
  config.optim.learning_rate *= 2
  with pytest.raises(ValueError, match=r"pointer_chain_N2_s0_grpo: a checkpoint of another run"):
    horizon.run_cell(config, cell, ["grpo"], log=lambda _: None, setups=setups,
                     partial_dir=partial, checkpoint_every=2)
  with pytest.raises(ValueError, match=r"sweep.checkpoint_every must be >= 0 .* got -1"):
    horizon.run_cell(config, cell, ["grpo"], partial_dir=partial, checkpoint_every=-1)


def test_every_algorithm_label_gives_a_valid_config_with_its_settings():
  """Each label of the study (the v1 six, the turn-level and the branch ones) validates and sets
  what it names; the turn_credit and branch_credit variants run on pointer_chain N = 8 only."""
  base = _config("turn_credit")
  assert tuple(base.sweep.pointer_chain) == (8,) and tuple(base.sweep.gridworld) == ()
  assert set(base.sweep.algorithms) <= set(horizon.ALGORITHMS)
  for label, settings in horizon.ALGORITHMS.items():
    config = horizon.cell_config(base, "pointer_chain", 8, label, seed=1)
    for path, value in settings.items():
      node = config
      for part in path.split("."):
        node = node[part]
      assert node == value, (label, path)
  turn = horizon.cell_config(base, "pointer_chain", 8, "ppo_turn_lagae", seed=0)
  assert (turn.algorithm.unit, turn.algorithm.vapo_length, turn.algorithm.vapo_alpha) == (
      "turn", "turns", 1.0)
  branched = _config("branch_credit")
  assert set(branched.sweep.algorithms) <= set(horizon.ALGORITHMS)
  vine = horizon.cell_config(branched, "pointer_chain", 8, "vine", seed=0)
  # 8 episodes per task either way: 2 roots, each forked into 3 continuations.
  assert (vine.rollout.group_size, vine.rollout.branch_k) == (8, 3)
  # Issue 19's study: the hard cells at 3x the cpu budget, 5 seeds, first errors recorded.
  study, cpu = _config("credit_study"), _config("cpu")
  assert set(study.sweep.algorithms) <= set(horizon.ALGORITHMS)
  assert study.num_updates == 3 * cpu.num_updates and len(study.sweep.seeds) == 5
  assert (tuple(study.sweep.pointer_chain), tuple(study.sweep.gridworld)) == ((8, 16), (8,))
  combo = horizon.cell_config(study, "pointer_chain", 16, "tree_grpo_milestone_verifier", seed=4)
  assert (combo.algorithm.name, combo.algorithm.step_verifier, combo.rollout.branch_k,
          combo.rollout.record_oracle) == ("tree_grpo", "milestone", 3, True)
  # ... and on TextWorld quest length 8 at the same episodes per run, with enough distinct games
  # that no RL game repeats and none was seen by SFT.
  tw, tw_cells = _config("credit_study_textworld"), _config("textworld")
  assert tuple(tw.sweep.algorithms) == tuple(study.sweep.algorithms)
  episodes = lambda c: c.num_updates * c.rollout.num_tasks * c.rollout.group_size
  assert episodes(tw) == episodes(study) == 3 * episodes(cpu) and tuple(tw.sweep.textworld) == (8,)
  assert tw.tasks.train_size >= tw.sft.episodes + tw.num_updates * tw.rollout.num_tasks
  assert tw.sweep.checkpoint_every > 0 and tw.sweep.keep_warm_starts
  for name in ("sft", "optim", "reward", "pool", "eval"):
    assert tw[name].to_dict() == tw_cells[name].to_dict(), name


REFERENCE = ROOT / "experiments" / "results" / "horizon_sweep_smoke_reference"


@pytest.mark.slow
def test_committed_smoke_cell_reproduces_exactly(tmp_path):
  """The committed reference cell (its README) rerun here gives the same row, every column but
  the wall time, when this machine's CPU model and package versions are the ones it was made with;
  otherwise the reference is stale for this machine and the test says how to refresh it."""
  import csv  # pylint: disable=g-import-not-at-top
  import json  # pylint: disable=g-import-not-at-top
  from longhorizon.eval import provenance  # pylint: disable=g-import-not-at-top
  session = json.loads((REFERENCE / "sweep.json").read_text())["sessions"][-1]
  made, here = session["provenance"], provenance.provenance()
  # The model name alone can hide another CPU (two "AMD EPYC" machines, and two "Intel Xeon
  # Processor" ones, gave other numbers): a reference without the CPU's id is stale everywhere.
  made_id = made.get("cpu_id")
  if (made["cpu"], made_id, made["packages"]) != (here["cpu"], here["cpu_id"], here["packages"]):
    pytest.skip(f"the reference was made on {made['cpu']!r} {made.get('cpu_id', '')} with "
                f"{made['packages']}, "
                f"this machine is {here['cpu']!r} {here['cpu_id']} with {here['packages']}: "
                f"stale here; refresh it with the command in {REFERENCE / 'README.md'}")
  # The README's command in a process of its own, with XLA's default code generation: the tests'
  # -O0 (tests/conftest.py) rounds differently on some CPUs (the 2-core family-6 model-167 Xeon).
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "").replace(
      "--xla_backend_optimization_level=0", "").strip())
  subprocess.run([sys.executable, "experiments/horizon_sweep.py",
                  "--config=configs/horizon_sweep.py:smoke", "--config.sweep.pointer_chain=()",
                  "--config.sweep.gridworld=(2,)", f"--out={tmp_path}"], cwd=ROOT, env=env,
                 check=True, timeout=1200, stdout=subprocess.DEVNULL)
  read = lambda path: [{k: v for k, v in row.items() if k != "wall_s"}
                       for row in csv.DictReader(open(path, encoding="utf-8"))]
  want, got = read(REFERENCE / "results.csv"), read(tmp_path / "results.csv")
  assert [r["algorithm"] for r in want] == ["grpo", "gigpo"]
  assert got == want, "the cell's numbers changed: see experiments/results/horizon_sweep_smoke_reference/README.md"


@pytest.mark.slow
def test_kept_warm_start_is_read_back_and_checked(tmp_path):
  """`keep_warm_starts`: the cell's warm start and its evaluation are saved, a resumed cell reads
  them back (the same parameters, not a recomputation: planted parameters come back as planted),
  and a file of other settings or a corrupt one is refused with its name."""
  config = _config("smoke")
  cell = horizon.Cell("pointer_chain", 2, 0)
  lines = []
  horizon.run_sweep(config, [cell], ["grpo"], str(tmp_path), log=lines.append,
                    keep_warm_starts=True)
  warm_dir = str(tmp_path / "warm_starts")
  path = horizon.warm_start_path(warm_dir, cell)
  assert os.path.exists(path + ".npz") and not any("read from" in line for line in lines)
  info = json.loads(open(path + ".json").read())
  row = horizon.read_results(str(tmp_path))[0][0]
  assert info["warm"]["success"] == row["warm_success"]
  assert info["warm_step_accuracy"] == row["warm_step_accuracy"]
  assert info["provenance"]["packages"]["jax"] == jax.__version__

  saved = dict(np.load(path + ".npz"))
  planted = {k: v + 1.0 for k, v in saved.items()}
  np.savez(path + ".npz", **planted)
  learner, params, got = horizon._warm_start(config, cell, "grpo", {}, warm_dir)
  assert got["warm"] == info["warm"]
  flat = {jax.tree_util.keystr(k): np.asarray(v)
          for k, v in jax.tree_util.tree_leaves_with_path(params)}
  assert flat.keys() == planted.keys()
  for k in flat:
    np.testing.assert_array_equal(flat[k], planted[k])

  lines.clear()  # a resumed cell logs where its warm start came from and keeps its warm numbers
  rows = horizon.run_sweep(config, [cell], ["grpo", "gigpo"], str(tmp_path), log=lines.append,
                           keep_warm_starts=True)
  assert any("read from" in line for line in lines)
  assert rows[1]["warm_success"] == row["warm_success"]

  other = horizon.cell_config(config, "pointer_chain", 2, "grpo", 0)
  other.unlock()
  other.sft.steps += 1
  assert horizon.warm_fingerprint(other) != info["fingerprint"]
  with pytest.raises(ValueError, match=r"pointer_chain_N2_s0.json: a warm start of other settings"
                                       r".* fields that differ .* sft.steps: \d+ -> \d+"):
    horizon.load_warm_start(path, learner.initial_state().params, other)
  data = open(path + ".npz", "rb").read()
  open(path + ".npz", "wb").write(data[:len(data) // 2])
  with pytest.raises(ValueError, match=r"pointer_chain_N2_s0.npz: unreadable warm start"):
    horizon.load_warm_start(path, learner.initial_state().params,
                            horizon.cell_config(config, "pointer_chain", 2, "grpo", 0))


def test_a_config_field_added_later_at_its_old_behaviour_keeps_warm_starts():
  """A field registered in ADDED_FIELDS and left at its registered value is not part of the warm
  start's settings (a kept warm start made before the field existed still matches); set to
  anything else, it is, and the fingerprint changes."""
  from longhorizon.train import workdir  # pylint: disable=g-import-not-at-top
  config = horizon.cell_config(_config("smoke"), "pointer_chain", 2, "grpo", 0)
  settings = horizon.warm_settings(config)
  assert "optim.skip_zero_grad" not in settings and "loss.kl_reference" not in settings
  assert workdir.ADDED_FIELDS["optim.skip_zero_grad"] is False
  assert settings["sft.steps"] == config.sft.steps and "num_updates" not in settings
  changed = horizon.cell_config(_config("smoke"), "pointer_chain", 2, "grpo", 0)
  changed.unlock()
  changed.optim.skip_zero_grad = True
  assert horizon.warm_settings(changed)["optim.skip_zero_grad"] is True
  assert horizon.warm_fingerprint(changed) != horizon.warm_fingerprint(config)


_KEPT_WARM_STARTS = {"horizon_sweep_credit_study": "credit_study",
                     "horizon_sweep_credit_study_textworld": "credit_study_textworld"}


@pytest.mark.parametrize("folder,name", sorted(
    (folder, p.stem) for folder in _KEPT_WARM_STARTS
    for p in (ROOT / "experiments/results" / folder / "warm_starts").glob("*.json")))
def test_committed_warm_starts_match_their_cells_today(folder, name):
  """Each kept warm start of the credit study still matches its cell's settings under today's
  code, so the study's resume command reads it back instead of refusing it."""
  env, rest = name.rsplit("_N", 1)
  horizon_n, seed = rest.split("_s")
  info = json.loads((ROOT / "experiments/results" / folder / "warm_starts"
                     / f"{name}.json").read_text())
  config = horizon.cell_config(_config(_KEPT_WARM_STARTS[folder]), env, int(horizon_n), "grpo",
                               int(seed))
  assert horizon.warm_settings(config) == info["settings"]
  assert horizon.warm_fingerprint(config) == info["fingerprint"]


def test_appending_to_a_csv_with_an_older_header_widens_it(tmp_path):
  # update_metrics.csv gained columns; a sweep resumed into a folder written by the older version
  # rewrites the file under the new header (old rows empty there) before appending.
  path = str(tmp_path / "update_metrics.csv")
  horizon._append(path, ("env", "update", "entropy"), [{"env": "g", "update": 1, "entropy": 0.5}])
  horizon._append(path, ("env", "update", "approx_kl", "entropy"),
                  [{"env": "g", "update": 2, "approx_kl": 0.01, "entropy": 0.25}])
  assert (tmp_path / "update_metrics.csv").read_text().splitlines() == [
      "env,update,approx_kl,entropy", "g,1,,0.5", "g,2,0.01,0.25"]
  rows = horizon._read_csv(path)
  assert rows[0]["approx_kl"] is None and rows[1]["approx_kl"] == 0.01
  with pytest.raises(ValueError, match="update_metrics.csv: its columns"):
    horizon._append(path, ("env", "update"), [{"env": "g", "update": 3}])


def test_a_sweep_of_warm_starts_alone_reports_them(tmp_path):
  # `--config.num_updates=0` evaluates each cell's warm start: final equals warm, no curves, and
  # plot_all draws what it can instead of failing on an empty learning-curve figure.
  config = _config("smoke")
  config.num_updates = 0
  rows = horizon.run_sweep(config, [horizon.Cell("pointer_chain", 2, 0)], ["grpo"], str(tmp_path),
                           log=lambda _: None)
  assert rows[0]["final_success"] == rows[0]["warm_success"] and rows[0]["episodes"] == 0
  assert rows[0]["gain_per_1k_episodes"] == 0.0
  assert horizon.read_results(str(tmp_path))[1] == []
  paths = horizon.plot_all(str(tmp_path))
  assert set(paths) == {"success_vs_horizon"} and os.path.getsize(paths["success_vs_horizon"]) > 5000
