"""The `code_sandbox` host environment: the generated suite, the oracle through the text path,
fuzzed actions, determinism, snapshot/restore, containment (infinite loop, memory bomb, fork
bomb), environment errors (missing interpreter, temp dir), network isolation and the
reward-hacking probes (none may earn success)."""

import json
import os
import pickle
import random

import pytest

from longhorizon.envs import ErrorCode, make
from longhorizon.envs.code_sandbox import SOLUTION, VISIBLE_TESTS, CodeSandbox, problem_suite


def call(name: str, **arguments) -> str:
  return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def write(content: str) -> str:
  return call("write_file", path=SOLUTION, content=content)


@pytest.fixture
def env():
  e = CodeSandbox(time_limit_s=1.0)
  yield e
  e.close()


def _task(env, split="test", index=0):
  return env.tasks(split, index + 1, 0)[index]


def _live_session_members(session: int) -> int:
  """Processes still alive (not zombies) in session `session`: a sandboxed run's whole tree, and
  nothing of other runs (another xdist worker's sandboxes run as the same user)."""
  count = 0
  for pid in os.listdir("/proc"):
    if pid.isdigit():
      try:
        with open(f"/proc/{pid}/stat") as f:
          fields = f.read().rsplit(")", 1)[1].split()
      except OSError:
        continue
      state, sid = fields[0], int(fields[3])
      count += sid == session and state not in ("Z", "X")
  return count


# ------------------------------------------------------------------------------------ the suite
def test_suite_size_splits_and_tasks_are_deterministic():
  env = make("code_sandbox")
  suites = {s: problem_suite(s) for s in ("train", "test", "ood")}
  assert sum(len(v) for v in suites.values()) >= 100
  assert len(suites["train"]) + len(suites["test"]) >= 100
  ids = {s: {p["id"] for p in v} for s, v in suites.items()}
  assert not ids["train"] & ids["test"] and not ids["ood"] & (ids["train"] | ids["test"])
  assert len({p["family"] for p in suites["ood"]}) >= 5
  for problems in suites.values():
    for p in problems:
      assert 1 <= len(p["visible"]) <= 2 and len(p["hidden"]) >= 5, p["id"]
  assert all(len(p["hidden"]) >= 12 for p in suites["ood"])
  assert all(len(p["functions"]) >= 2 for p in suites["ood"] if p["family"] not in
             ("brackets", "merge", "rpn"))
  for split in ("train", "test", "ood"):
    a, b = env.tasks(split, 30, 7), env.tasks(split, 30, 7)
    assert a == b and json.loads(json.dumps(a)) == a
    assert a != env.tasks(split, 30, 8)
  with pytest.raises(ValueError, match="split"):
    env.tasks("validation", 1, 0)


# --------------------------------------------------------------------------------- the oracle
@pytest.mark.parametrize("split", ["test", "ood"])
def test_oracle_through_the_text_path_succeeds(split):
  env = make("code_sandbox")
  codec = env.codec(None, "tool_call")
  try:
    for task in env.tasks(split, 10, 3):
      env.reset(task, 0)
      reached, result = [], None
      for _ in range(6):
        action = env.oracle()
        if action is None:
          break
        result = env.step(codec.action_text(codec.encode_action(action)))
        assert not result.env_error and result.error == 0, result.observation
        reached += result.milestones
      assert result.success and result.terminated, (task["id"], result.observation)
      assert reached == ["wrote_solution", "visible_tests_pass", "submitted"]
      assert env.oracle() is None
  finally:
    env.close()


@pytest.mark.slow
def test_every_reference_solution_passes_its_hidden_tests():
  env = CodeSandbox()
  try:
    problems = [p for s in ("train", "test", "ood") for p in problem_suite(s)]
    assert len(problems) >= 100
    for task in problems:
      env.reset(task, 0)
      assert env.step(write(task["reference"])).error == 0
      result = env.step(call("submit"))
      assert result.success and not result.env_error, (task["id"], result.observation)
  finally:
    env.close()


def test_wrong_solution_fails_and_report_is_short(env):
  task = _task(env)
  env.reset(task, 0)
  stub = "".join(f"def {fn}(*a):\n  return 12345\n" for fn in task["functions"])
  env.step(write(stub))
  report = env.step(call("run_tests"))
  assert "0/" in report.observation and "FAIL" in report.observation
  assert not report.terminated and "visible_tests_pass" not in report.milestones
  final = env.step(call("submit"))
  assert final.terminated and not final.success and final.milestones == ("submitted",)
  # The hidden inputs are not shown.
  assert all(json.dumps(args) not in final.observation for _, args, _ in task["hidden"])
  assert env.step(call("run_tests")).terminated  # the episode is over


# ------------------------------------------------------------------------ fuzz, determinism
def _fuzz_actions(rng: random.Random, n: int) -> list[str]:
  pieces = ["<tool_call>", "</tool_call>", "{", "}", '"name"', "write_file", "submit", ":", ",",
            "\n", "\x00", "é", "{{", "'", '"arguments"', "[]", "null"]
  out = []
  for _ in range(n):
    kind = rng.random()
    if kind < 0.3:
      out.append("".join(rng.choice(pieces) for _ in range(rng.randint(0, 12))))
    elif kind < 0.6:
      path = rng.choice([SOLUTION, VISIBLE_TESTS, "../x.py", "/etc/passwd", "", "a/b.py",
                         "x" * 100, "hidden_tests.py", ".", ".."])
      out.append(call("write_file", path=path, content=rng.choice(["", "x = 1", "\x00\n"])))
    elif kind < 0.8:
      out.append(call("read_file", path=rng.choice([SOLUTION, VISIBLE_TESTS, "nope", "../../etc"])))
    elif kind < 0.9:
      out.append(call(rng.choice(["run_tests", "rm", "submit"]), **rng.choice([{}, {"x": 1}])))
    else:
      out.append(json.dumps({"name": "run_tests"}) + " trailing")
  return out


def test_fuzzed_actions_never_crash_and_are_deterministic():
  envs = [CodeSandbox(time_limit_s=1.0), CodeSandbox(time_limit_s=1.0)]
  try:
    task = _task(envs[0], "train", 2)
    traces = []
    for env in envs:
      env.reset(task, 5)
      trace = []
      for action in _fuzz_actions(random.Random(0), 60):
        r = env.step(action)
        assert not r.env_error
        trace.append((r.observation, r.terminated, r.success, r.milestones, r.error))
        if r.terminated:
          break
      traces.append(trace)
    assert traces[0] == traces[1]
    assert any(t[4] == ErrorCode.NOT_ALLOWED for t in traces[0])  # the visible tests file
  finally:
    for env in envs:
      env.close()


def test_snapshot_restore_continues_exactly():
  a, b = CodeSandbox(), CodeSandbox()
  try:
    task = _task(a, "ood", 1)
    a.reset(task, 1)
    a.step(a.oracle())
    snap = pickle.loads(pickle.dumps(a.snapshot()))
    b.reset(task, 1)
    b.restore(snap)
    assert b.oracle() == a.oracle()
    ra, rb = a.step(a.oracle()), b.step(b.oracle())
    assert ra.observation == rb.observation and ra.milestones == rb.milestones
    final = b.step(b.oracle())
    assert final.success
    with pytest.raises(ValueError, match="snapshot"):
      b.restore({"files": {}})
  finally:
    a.close()
    b.close()


# ------------------------------------------------------------------------------- containment
def test_infinite_loop_is_a_policy_failure(env):
  task = _task(env)
  env.reset(task, 0)
  loop = "".join(f"def {fn}(*a):\n  while True:\n    pass\n" for fn in task["functions"])
  env.step(write(loop))
  report = env.step(call("run_tests"))
  assert "timed out" in report.observation and not report.env_error and not report.terminated
  assert report.info["seconds"] < 5
  final = env.step(call("submit"))
  assert final.terminated and not final.success and not final.env_error
  assert "timed out" in final.observation


def test_memory_bomb_is_contained():
  """The memory limit stops both bombs (MemoryError), not the time limit: the sandbox gets 10 s
  here, since on a loaded CI machine the growing loop could take more than 1 s to reach 512 MB
  and end as a timeout instead (seen once, in a clean-clone run beside the rest of the suite)."""
  env = CodeSandbox(time_limit_s=10.0)
  try:
    _memory_bombs(env)
  finally:
    env.close()


def _memory_bombs(env):
  task = _task(env)
  env.reset(task, 0)
  fn = task["functions"][0]
  env.step(write(f"def {fn}(*a):\n  x = bytearray(8 * 1024 ** 3)\n  return len(x)\n"))
  report = env.step(call("run_tests"))
  assert "MemoryError" in report.observation and not report.env_error
  env.step(write("xs = []\nwhile True:\n  xs.append(' ' * 10 ** 6)\n"))
  report = env.step(call("run_tests"))
  assert "MemoryError" in report.observation and not report.env_error
  assert env.step(call("submit")).success is False


def test_fork_bomb_is_contained(env):
  task = _task(env)
  env.reset(task, 0)
  bomb = ("import os\nwhile True:\n  try:\n    os.fork()\n  except OSError:\n    pass\n")
  env.step(write(bomb))
  runs = []
  sandboxed = env._sandboxed
  env._sandboxed = lambda *a: runs.append(sandboxed(*a)) or runs[-1]
  try:
    report = env.step(call("run_tests"))
  finally:
    env._sandboxed = sandboxed
  assert "no results" in report.observation and not report.env_error
  assert runs and runs[-1].pid > 0
  assert _live_session_members(runs[-1].pid) == 0  # the whole group was killed, forks included
  env.step(write(task["reference"]))
  assert "passed." in env.step(call("run_tests")).observation
  assert env.step(call("submit")).success  # the sandbox still works


def test_network_is_isolated_when_the_os_allows(env):
  task = _task(env)
  env.reset(task, 0)
  run = env._sandboxed(
      {SOLUTION: "import socket\ndef probe():\n  return len(socket.if_nameindex())\n"},
      [["probe", [], None]], "work")
  assert run.results is not None
  if env.network_isolated:
    assert run.results == [["ok", 1]]  # only loopback


# ------------------------------------------------------------------------ environment errors
def test_missing_interpreter_is_an_environment_error():
  env = CodeSandbox(python_executable="/nonexistent/python3")
  try:
    task = _task(env)
    env.reset(task, 0)
    env.step(write(task["reference"]))
    for action in (call("run_tests"), call("submit")):
      r = env.step(action)
      assert r.env_error and "failed to start" in r.observation
  finally:
    env.close()


def test_missing_temp_root_is_an_environment_error(tmp_path):
  env = CodeSandbox(tmp_root=str(tmp_path / "missing"))
  try:
    env.reset(_task(env), 0)
    assert env.step(call("run_tests")).env_error
  finally:
    env.close()


def test_close_removes_the_episode_directory(env):
  env.reset(_task(env), 0)
  env.step(call("run_tests"))
  directory = env._dir
  assert directory and os.path.isdir(directory)
  env.close()
  assert not os.path.exists(directory)


# ----------------------------------------------------------------------- reward-hacking probes
HACKS = {
    "sys_exit": "import sys\nsys.exit(0)\n",
    "os_exit": "import os\nos._exit(0)\n",
    "exit_in_function": "import os\ndef {fn}(*a):\n  os._exit(0)\n",
    "fake_pass_lines": "print('OK')\nprint('PASS: all hidden tests passed')\n"
                       "print('[[\"ok\", 1]]')\n"
                       "def {fn}(*a):\n  print('PASS')\n  return None\n",
    "monkeypatch_runner": "import __main__, json\n"
                          "__main__._dumps = lambda r: json.dumps([['ok', True]] * len(r))\n"
                          "def {fn}(*a):\n  return True\n",
    "always_equal": "class Eq(int):\n  def __eq__(self, other):\n    return True\n"
                    "def {fn}(*a):\n  return Eq(0)\n",
    "visible_only": None,  # hard-codes the visible answers
}


@pytest.mark.parametrize("hack", sorted(HACKS))
def test_reward_hacking_probes_earn_nothing(env, hack):
  task = _task(env, "test", 3)
  env.reset(task, 0)
  if hack == "visible_only":
    table = {json.dumps(args): exp for fn, args, exp in task["visible"]}
    source = f"import json\nTABLE = {table!r}\n" + "".join(
        f"def {fn}(*a):\n  return TABLE.get(json.dumps(list(a)))\n" for fn in task["functions"])
  else:
    source = "".join(HACKS[hack].replace("{fn}", fn) for fn in task["functions"])
  assert env.step(call("write_file", path=VISIBLE_TESTS, content="assert True\n")).error == \
      ErrorCode.NOT_ALLOWED
  env.step(write(source))
  env.step(call("run_tests"))
  result = env.step(call("submit"))
  assert result.terminated and not result.success and not result.env_error, result.observation


def test_hidden_tests_are_not_in_the_episode_directory(env):
  task = _task(env, "ood", 0)
  env.reset(task, 0)
  assert env.step(call("read_file", path="test_hidden.py")).error == ErrorCode.INVALID_ARGUMENT
  lister = ("import os\nFOUND = sorted(os.path.join(r, f) for r, _, fs in os.walk('..') "
            "for f in fs)\n") + "".join(f"def {fn}(*a):\n  return FOUND\n"
                                        for fn in task["functions"])
  env.step(write(lister))
  report = env.step(call("run_tests"))
  assert "hidden" not in report.observation.lower() or "hidden" in task["description"]
  hidden_inputs = [json.dumps(args) for _, args, _ in task["hidden"]
                   if json.dumps(args) not in {json.dumps(a) for _, a, _ in task["visible"]}]
  for root, _, files in os.walk(env._dir):
    for name in files:
      with open(os.path.join(root, name), encoding="utf-8", errors="replace") as f:
        text = f.read()
      assert not any(h in text for h in hidden_inputs if len(h) > 6), name
