"""A user's environment outside the library, named by import path (`package.module:Class`): built by
`envs.make`, accepted by config validation, given task suites in a filesystem-safe folder; a wrong
path says what is missing."""

import importlib.util
import os
import re
import shutil

import numpy as np
import pytest

from longhorizon import envs
from longhorizon.envs import tasks
from longhorizon.train import config as config_lib

USER_ENV = os.path.join(os.path.dirname(__file__), "..", "data", "user_env_keypad.py")
SIZES = {"train": 48, "test": 8, "ood": 8}


@pytest.fixture
def user_module(tmp_path, monkeypatch):
  """The keypad environment as a module of a folder outside the library (a unique module name per
  test, so no test sees another's import)."""
  name = f"user_env_{os.path.basename(tmp_path).replace('-', '_')}"
  shutil.copy(USER_ENV, tmp_path / f"{name}.py")
  with open(tmp_path / f"{name}.py", "a") as f:
    f.write("\n\nclass Renamed(Keypad):\n  name = 'my keypad/v2:beta'\n\n\n"
            "def not_a_factory(**params):\n  return params\n\nCOUNT = 3\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  return name


def test_make_builds_an_environment_named_by_import_path(user_module):
  env = envs.make(f"{user_module}:Keypad", length=3)
  assert isinstance(env, envs.Environment) and type(env).__module__ == user_module
  assert env.length == 3 and env.name == "keypad"
  assert f"{user_module}:Keypad" not in envs.registered()  # nothing was registered


@pytest.mark.parametrize("attribute,message", [
    ("Keypadd", r"has no attribute 'Keypadd'; Environment classes in it: \['Keypad', 'Renamed'\]"),
    ("NotAnEnvironment", r"NotAnEnvironment is not a subclass of longhorizon.envs.Environment"),
    ("COUNT", r"'COUNT' is a int, not an Environment class or a factory"),
    ("not_a_factory", r"the factory returned a dict, not a longhorizon.envs.Environment"),
])
def test_a_wrong_attribute_says_what_is_wrong(user_module, attribute, message):
  with pytest.raises(ValueError, match=re.escape(f"environment '{user_module}:{attribute}'") + ".*"
                     + message):
    envs.make(f"{user_module}:{attribute}")


@pytest.mark.parametrize("name,message", [
    ("no_such_user_module:Env", r"cannot import module 'no_such_user_module'.*PYTHONPATH"),
    ("no_such_pkg.sub:Env", r"cannot import module 'no_such_pkg.sub'.*PYTHONPATH"),
    (":Env", r"both parts non-empty"),
    ("keypadd", r"unknown environment 'keypadd'.*'package.module:Class'"),
])
def test_a_missing_module_or_name_says_what_is_missing(name, message):
  with pytest.raises(ValueError, match=message):
    envs.make(name)


def test_registering_an_import_path_is_refused(user_module):
  with pytest.raises(ValueError, match="contains ':'"):
    envs.register(f"{user_module}:Keypad", lambda **p: None)


def test_config_validation_accepts_import_paths_that_resolve(user_module):
  spec = importlib.util.spec_from_file_location(
      "default_config", os.path.join(os.path.dirname(__file__), "..", "..", "configs", "default.py"))
  default_config = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(default_config)
  config = default_config.get_config("smoke")
  with config.unlocked():
    config.env.name = f"{user_module}:Keypad"
    config.env.params = {"length": 2}
  config_lib.validate(config)
  with config.unlocked():
    config.env.name = f"{user_module}:Keypadd"
  with pytest.raises(ValueError, match=re.escape(f"config.env.name='{user_module}:Keypadd'")
                     + ".*has no attribute 'Keypadd'"):
    config_lib.validate(config)


def test_suite_names_are_one_safe_folder_name():
  for name in ("my keypad/v2:beta", "../up", "a.b:C", "", "ünïcode"):
    folder = tasks.suite_name(name, {"length": 2}, 0, SIZES, "1", source="pkg.mod:C")
    assert re.fullmatch(r"[A-Za-z0-9_]+", folder), folder
  same = lambda source: tasks.suite_name("keypad", {}, 0, SIZES, "1", source=source)
  assert len({same("a:Keypad"), same("b:Keypad"), same(None)}) == 3  # classes never share a suite


def test_task_suite_of_an_import_path_environment(user_module, tmp_path):
  data_dir = str(tmp_path / "data")
  for cls in ("Keypad", "Renamed"):
    source = tasks.load(f"{user_module}:{cls}", "test", env_params={"length": 2}, sizes=SIZES,
                        data_dir=data_dir)
    batch = tasks.stack(source, range(len(source)))
    assert len(source) == SIZES["test"] and batch["code"].shape == (SIZES["test"], 2)
  folders = sorted(os.listdir(os.path.join(data_dir, "longhorizon_tasks")))
  assert len(folders) == 2, folders  # one suite per class, although both are 100-code keypads
  assert folders[0].startswith("keypad_s0_") and folders[1].startswith("my_keypad_v2_beta_s0_")
  # The test tasks are distinct and none is a train task (only 100 codes exist).
  train = tasks.load(f"{user_module}:Keypad", "train", env_params={"length": 2}, sizes=SIZES,
                     data_dir=data_dir)
  codes = lambda src: {tuple(c) for c in np.asarray(tasks.stack(src, range(len(src)))["code"])}
  test = tasks.load(f"{user_module}:Keypad", "test", env_params={"length": 2}, sizes=SIZES,
                    data_dir=data_dir)
  assert len(codes(train)) == SIZES["train"] and len(codes(test)) == SIZES["test"]
  assert not codes(train) & codes(test)
