"""TextWorldGames: oracle success through the text path, fuzzing, determinism, snapshots, cache.

Games are generated into a temporary cache (about a second each on first use), shared by the
module's tests.
"""

from __future__ import annotations

import concurrent.futures
import pickle
import random
import subprocess
import sys

import pytest

textworld = pytest.importorskip(
    "textworld", reason="TextWorld is optional; to run these tests install the [textworld] extra: "
                        "pip install -e .[textworld]")

from longhorizon.envs import make  # noqa: E402
from longhorizon.envs.textworld_games import TextWorldGames, game_file, normalize_text  # noqa: E402
from longhorizon.envs.types import ErrorCode  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def data_dir(tmp_path_factory):
  path = tmp_path_factory.mktemp("longhorizon_data")
  with pytest.MonkeyPatch.context() as mp:
    mp.setenv("LONGHORIZON_DATA", str(path))
    yield path


def _play(env, task, codec, max_steps=60):
  """Plays the oracle through the codec; returns (success, observations, unknown words, steps)."""
  obs = env.reset(task, 0)
  texts, unknown = [obs.text], codec.unknown_words(obs.text)
  for steps in range(1, max_steps + 1):
    action = env.oracle()
    assert action, "the oracle has no command before the end"
    ids = codec.encode_action(action)
    unknown += codec.unknown_words(action)
    result = env.step(codec.action_text(ids))
    texts.append(result.observation)
    unknown += codec.unknown_words(result.observation)
    assert result.error == 0, result.observation
    if result.terminated:
      return result.success, texts, unknown, steps
  return False, texts, unknown, max_steps


@pytest.mark.parametrize("family,length", [("quest", 3), ("coin", 3)])
def test_oracle_solves_test_and_ood_through_the_codec(family, length):
  env = make("textworld", family=family, quest_length=length, ood_quest_length=length + 2)
  codec = env.codec()
  tasks = env.tasks("test", 2, 0) + env.tasks("ood", 1, 0)
  for task in tasks:
    success, texts, unknown, steps = _play(env, task, codec)
    assert success, (task, texts)
    assert unknown == [], (task, unknown)
    assert steps <= task["quest_length"]
    assert "textworld" in texts[0] and "$$" not in texts[0]  # objective kept, banner stripped
  env.close()


def test_milestones_count_the_score():
  env = TextWorldGames(family="quest", quest_length=3)
  assert env.milestone_names == tuple(f"score_{k}" for k in range(1, 7))
  env.reset(env.tasks("train", 1, 1)[0], 0)
  reached = []
  while True:
    result = env.step(env.oracle())
    reached += result.milestones
    if result.terminated:
      break
  assert result.success and result.info["score"] == result.info["max_score"]
  scores = [int(name.split("_")[1]) for name in reached]
  assert scores == sorted(set(scores)) and scores[-1] == result.info["score"]
  assert env.step("look").terminated  # stepping after the end does not touch the engine
  env.close()


def test_fuzzed_actions_never_crash():
  env = TextWorldGames(family="quest", quest_length=3, list_commands=True)
  task = env.tasks("train", 1, 0)[0]
  obs = env.reset(task, 0)
  assert "actions :" in obs.text and obs.info["admissible_commands"]
  rng = random.Random(0)
  actions = ["", "   ", "\n\t", "\u00e9t\u00e9 \u2603 \U0001F600", "x" * 10_000, "go " * 3000,
             "undo", "restart", "quit", "save", "go north. go south", "take; drop", "'", "- -",
             "\x00\x01\x02", "LOOK", "  Inventory  ", "<eot>", "examine examine examine"]
  actions += ["".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(rng.randrange(1, 40)))
              for _ in range(30)]
  for action in actions:
    result = env.step(action)
    assert isinstance(result.observation, str) and result.observation, repr(action)
    assert not result.terminated
  assert env.step("").error == ErrorCode.GARBAGE
  assert env.step("undo").error == ErrorCode.NOT_ALLOWED
  assert env.step("look").error == 0
  # The game still works after the fuzz: the oracle finishes it.
  for _ in range(40):
    result = env.step(env.oracle())
    if result.terminated:
      break
  assert result.success
  env.close()


def test_determinism_and_snapshot_restore_on_a_fresh_instance():
  env = TextWorldGames(family="quest", quest_length=4)
  task = env.tasks("train", 1, 2)[0]
  script = ["look", "inventory", "dance"]

  def run(e):
    texts = [e.reset(task, 7).text]
    for a in script:
      texts.append(e.step(a).observation)
    return texts

  assert run(env) == run(TextWorldGames(family="quest", quest_length=4))
  env.reset(task, 0)
  env.step("look")
  env.step(env.oracle())
  snap = pickle.loads(pickle.dumps(env.snapshot()))
  after = [env.step(a) for a in ("inventory", env.oracle())]
  after.append(env.step(env.oracle()))
  fresh = TextWorldGames(family="quest", quest_length=4)
  fresh.reset(task, 0)
  fresh.restore(snap)
  again = [fresh.step(a) for a in ("inventory", fresh.oracle())]
  again.append(fresh.step(fresh.oracle()))
  assert [r.observation for r in after] == [r.observation for r in again]
  assert [r.milestones for r in after] == [r.milestones for r in again]
  env.close()
  fresh.close()


def test_cache_is_reused_and_corruption_is_detected(data_dir):
  env = TextWorldGames(family="coin", quest_length=2)
  task = env.tasks("train", 1, 3)[0]
  path = game_file(task)
  assert path.parent == data_dir / "textworld" and path.name.startswith("coin-")
  stamp = path.stat().st_mtime_ns
  assert game_file(task) == path and path.stat().st_mtime_ns == stamp  # reused, not regenerated
  first = env.reset(task, 0).text
  path.write_bytes(path.read_bytes()[:200])  # a truncated story file
  assert env.reset(task, 0).text == first  # detected and regenerated
  path.with_suffix(".json").write_text("{not json")
  assert env.reset(task, 0).text == first
  assert not list(path.parent.glob(".*"))  # no temporary folders left behind
  env.close()


def test_concurrent_generation_of_one_game(data_dir):
  env = TextWorldGames(family="coin", quest_length=1)
  task = env.tasks("test", 1, 9)[0]
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    paths = list(pool.map(lambda _: game_file(task), range(2)))
  assert paths[0] == paths[1] and paths[0].exists()
  env.reset(task, 0)
  assert env.step(env.oracle()).success
  assert not list(paths[0].parent.glob(".*"))
  env.close()


def test_tasks_are_deterministic_and_splits_disjoint():
  env = TextWorldGames(family="quest", quest_length=2)
  assert env.tasks("train", 5, 0) == env.tasks("train", 5, 0)
  assert env.tasks("train", 5, 0) != env.tasks("train", 5, 1)
  many = env.tasks("train", 3000, 0)  # prefix-stable, and no game twice
  assert many[:5] == env.tasks("train", 5, 0)
  assert len({t["game_seed"] for t in many}) == 3000
  train = {t["game_seed"] for t in env.tasks("train", 200, 0)}
  test = {t["game_seed"] for t in env.tasks("test", 200, 0)}
  ood = env.tasks("ood", 5, 0)
  assert not train & test and not train & {t["game_seed"] for t in ood}
  assert all(t["quest_length"] == 4 and t["nb_rooms"] > env.nb_rooms for t in ood)
  with pytest.raises(ValueError, match="split"):
    env.tasks("valid", 1, 0)


def test_parameters_and_texts():
  with pytest.raises(ValueError, match="family"):
    TextWorldGames(family="maze")
  with pytest.raises(ValueError, match="quest_length"):
    TextWorldGames(quest_length=40)
  with pytest.raises(TypeError, match="unknown parameter"):
    TextWorldGames(bogus=1)
  env = TextWorldGames(family="quest", quest_length=2, milestone=0.1)
  assert env.reward_spec.milestone == 0.1
  assert env.params()["family"] == "quest" and env.default_backend == "process"
  assert normalize_text("You see a coin.") == "you see a coin ."
  assert normalize_text("-= Vault =-\nIt's") == "vault : it ' s"
  vocab = env.vocabulary()
  assert len(vocab) == len(set(vocab)) and all(w and " " not in w for w in vocab)
  assert env.vocabulary() == vocab
  settings = TextWorldGames.horizon_settings(8)
  assert settings["params"]["quest_length"] == 8 and settings["actions"] == 8
  with pytest.raises(ValueError, match="lacks"):
    env.reset({"family": "quest"}, 0)


def test_factory_round_trip_and_import_without_textworld():
  from longhorizon.envs.pool import factory_of
  env = TextWorldGames(family="coin", quest_length=2, list_commands=True, milestone=0.5)
  copy = pickle.loads(pickle.dumps(factory_of(env)))()
  assert copy.params() == env.params() and copy.reward_spec == env.reward_spec
  assert copy.milestone_names == ("score_1", "score_2", "score_3", "score_4")
  code = ("import sys; sys.modules['textworld'] = None; "
          "from longhorizon.envs.textworld_games import TextWorldGames as T; "
          "e = T()\n"
          "try:\n  e.vocabulary()\nexcept ImportError as x:\n  assert 'textworld' in str(x)\n"
          "else:\n  raise SystemExit('no ImportError')")
  subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.slow
def test_prepare_script_generates_the_configs_games_and_resumes(data_dir):
  """experiments/prepare_textworld.py builds every game of the config's splits into the cache (the
  learner's own task lists), and a second run finds nothing left to do."""
  import os
  import pathlib
  from longhorizon.envs import textworld_games
  from longhorizon.studies import sweeps
  root = pathlib.Path(__file__).parents[2]
  command = [sys.executable, "experiments/prepare_textworld.py",
             "--config=configs/textworld.py:smoke", "--workers=2"]
  env = dict(os.environ, LONGHORIZON_DATA=str(data_dir))
  first = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=900)
  assert first.returncode == 0, first.stderr[-2000:]
  config = sweeps.config_module(str(root / "configs" / "textworld.py")).get_config("smoke")
  env_obj = make("textworld", **dict(config.env.params))
  tasks = [t for split, n in (("train", 8), ("test", 4), ("ood", 2))
           for t in env_obj.tasks(split, n, config.tasks.seed)]
  assert (config.tasks.train_size, config.tasks.test_size, config.tasks.ood_size) == (8, 4, 2)
  assert all(textworld_games.is_cached(t) for t in tasks)
  assert "14 games (train 8, test 4, ood 2); 14 to generate" in first.stdout
  second = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=300)
  assert second.returncode == 0 and "; 0 to generate" in second.stdout, second.stdout


def test_prepare_script_lists_every_textworld_cell_of_the_horizon_sweep():
  import importlib.util
  import pathlib
  from longhorizon.studies import horizon, sweeps
  root = pathlib.Path(__file__).parents[2]
  spec = importlib.util.spec_from_file_location("prepare_textworld",
                                                root / "experiments" / "prepare_textworld.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = sweeps.config_module(str(root / "configs" / "horizon_sweep.py")).get_config("textworld")
  lists = module.task_lists(config)
  assert sorted({t["quest_length"] for t in lists["train"]}) == [2, 4, 8]
  assert len(lists["train"]) == 3 * config.tasks.train_size
  assert len(lists["test"]) == 3 * config.tasks.test_size
  cell = horizon.cell_config(config, "textworld", 8, "gigpo", 0)  # a cell's own list is included
  env = make("textworld", **dict(cell.env.params))
  assert env.tasks("test", 32, cell.tasks.seed)[0] in lists["test"]
