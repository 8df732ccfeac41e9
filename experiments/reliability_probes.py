r"""Runs the reliability probes: the entry points as a careful user and a hostile environment would
drive them, each outcome classified. Writes `probes.json` and `probes.md` (the table in
docs/reliability.md) to --out.

    python experiments/reliability_probes.py --out=/tmp/lh_probes [--only=workdir,config]

Every probe runs a real command (train.py, evaluate.py, generate.py) in a subprocess with a
timeout, after optional set-up (a finished smoke run to damage, a corrupt file, ...), and is
classified from what it left:
- `ok`: the expected success (exit 0) and, where the probe says so, the expected files/warnings;
- `clear error`: a non-zero exit whose output ends in a message naming the problem (the probe's
  expected text), with no Python traceback;
- `traceback`: a Python traceback in the output (a crash, even when the message is right);
- `hang`: killed at the timeout;
- `silent`: exit 0 where an error or a warning was expected, or the wrong message;
- `data lost`: the probe's check of what must survive (metrics lines, checkpoints, config) failed.
The summary counts them; the last four must be 0.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time
from typing import Callable

from absl import app
from absl import flags

_OUT = flags.DEFINE_string("out", None, "Folder for probes.json, probes.md and the probes' workdirs.",
                           required=True)
_ONLY = flags.DEFINE_list("only", [], "Run only these groups (default: all).")
_TIMEOUT = flags.DEFINE_integer("timeout", 600, "Seconds before a probe counts as a hang.")

ROOT = pathlib.Path(__file__).resolve().parents[1]
SMOKE = [f"--config={ROOT}/configs/default.py:smoke", "--config.tensorboard=False",
         "--config.eval.num_tasks=8"]
OUTCOMES = ("ok", "clear error", "traceback", "hang", "silent", "data lost")


@dataclasses.dataclass
class Probe:
  group: str  # the issue item it belongs to, e.g. "workdir"
  name: str  # what is tried, in words
  argv: list[str]  # the command (python entry points are run with this interpreter)
  expect: str  # "ok" or "error"
  text: str = ""  # a substring the output must contain (the clear message, or a warning)
  setup: Callable[[pathlib.Path], None] | None = None  # prepares the probe's folder
  check: Callable[[pathlib.Path], str] | None = None  # "" when what must survive did
  cwd: str | None = None  # relative to the probe's folder (default: the repository)
  env: dict | None = None


def _python(script: str, *args: str) -> list[str]:
  return [sys.executable, str(ROOT / "experiments" / script), *args]


def classify(probe: Probe, returncode: int | None, output: str, folder: pathlib.Path) -> str:
  lost = probe.check(folder) if probe.check is not None else ""  # always run: it may clean up
  if returncode is None:
    return "hang"
  if "Traceback (most recent call last)" in output:
    return "traceback"
  if lost:
    return "data lost"
  if probe.expect == "ok":
    return "ok" if returncode == 0 and probe.text in output else "silent"
  return "clear error" if returncode != 0 and probe.text in output else "silent"


def run_probe(probe: Probe, root: pathlib.Path, env: dict) -> dict:
  folder = root / f"{probe.group}-{probe.name}".replace(" ", "_").replace("/", "_")[:80]
  shutil.rmtree(folder, ignore_errors=True)
  folder.mkdir(parents=True)
  if probe.setup is not None:
    probe.setup(folder)
  argv = [a.replace("{dir}", str(folder)) for a in probe.argv]
  cwd = folder / probe.cwd if probe.cwd else ROOT
  cwd.mkdir(parents=True, exist_ok=True)
  started = time.time()
  try:
    extra = {k: v.replace("{dir}", str(folder)) for k, v in (probe.env or {}).items()}
    run = subprocess.run(argv, cwd=cwd, env={**env, **extra}, capture_output=True, text=True,
                         timeout=_TIMEOUT.value)
    returncode, output = run.returncode, run.stdout + run.stderr
  except subprocess.TimeoutExpired as e:
    returncode, output = None, (e.stdout or b"").decode() + (e.stderr or b"").decode()
  outcome = classify(probe, returncode, output, folder)
  lines = [l for l in output.strip().splitlines() if l.strip()]
  message = next((l for l in reversed(lines) if probe.text and probe.text in l),
                 lines[-1] if lines else "")
  return {"group": probe.group, "probe": probe.name, "expect": probe.expect, "outcome": outcome,
          "returncode": returncode, "seconds": round(time.time() - started, 1),
          "message": message[-300:], "command": " ".join(argv)}


# ------------------------------------------------------------------------------------- the probes

def _smoke_run(folder: pathlib.Path, *flags: str):
  """A finished smoke run in folder/w (2 updates, a checkpoint after each)."""
  run = subprocess.run(_python("train.py", f"--workdir={folder / 'w'}", *SMOKE,
                               "--config.num_updates=2", "--config.checkpoint_every=1", *flags),
                       cwd=ROOT, env=_ENV, capture_output=True, text=True, timeout=900)
  if run.returncode:
    raise RuntimeError(f"set-up run failed:\n{run.stderr[-3000:]}")


_BASE: dict[str, pathlib.Path] = {}


def _copy_of_base(folder: pathlib.Path):
  """folder/w: a copy of one shared finished smoke run (made once)."""
  if "smoke" not in _BASE:
    base = folder.parent / "_base"
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir()
    _smoke_run(base)
    _BASE["smoke"] = base / "w"
  shutil.copytree(_BASE["smoke"], folder / "w")
  (folder / "w" / ".lock").unlink(missing_ok=True)


def _damage(kind: str):
  def setup(folder):
    _copy_of_base(folder)
    step = folder / "w" / "checkpoints" / "2"
    files = sorted(p for p in step.rglob("*") if p.is_file())
    if kind == "truncate":
      for p in files:
        p.write_bytes(p.read_bytes()[: p.stat().st_size // 3])
    elif kind == "scramble":
      data = [p for p in files if p.parent.name == "d"]
      raw = bytearray(data[0].read_bytes())
      raw[len(raw) // 2:] = bytes(255 - b for b in raw[len(raw) // 2:])
      data[0].write_bytes(bytes(raw))
    else:
      shutil.rmtree(step / kind)
  return setup


def _metrics_complete(n: int):
  def check(folder):
    lines = (folder / "w" / "metrics.jsonl").read_text().splitlines()
    updates = [json.loads(l)["update"] for l in lines]
    return "" if updates == list(range(1, n + 1)) else f"metrics.jsonl updates {updates}"
  return check


def _set_aside(folder):
  aside = folder / "w" / "checkpoints.damaged"
  if not aside.exists() or not any(aside.iterdir()):
    return "the damaged step was not kept in checkpoints.damaged/"
  return _metrics_complete(2)(folder)


def _config_unchanged(folder):
  saved = json.loads((folder / "w" / "config.json").read_text())
  return "" if saved["model"]["hidden_size"] == 128 and saved["algorithm"]["name"] == "grpo" \
      else "config.json was overwritten by a refused run"


def _train(*flags: str) -> list[str]:
  return _python("train.py", "--workdir={dir}/w", *SMOKE, *flags)


def _config_probes() -> list[Probe]:
  bad = [("optim.max_grad_norm", "-1", "config.optim.max_grad_norm=-1"),
         ("algorithm.gamma", "1.5", "config.algorithm.gamma=1.5"),
         ("algorithm.lam", "-0.5", "config.algorithm.lam=-0.5"),
         ("algorithm.step_gamma", "2.0", "config.algorithm.step_gamma=2.0"),
         ("curriculum.ema", "1.5", "config.curriculum.ema=1.5"),
         ("loss.clip_low", "1.0", "config.loss.clip_low=1.0"),
         ("alarm.min_entropy", "-1.0", "config.alarm.min_entropy=-1.0"),
         ("sft.episodes", "0", "config.sft.episodes=0"),
         ("rollout.group_size", "1", "config.rollout.group_size=1"),
         ("rollout.temperature", "0.0", "config.rollout.temperature=0.0"),
         ("optim.learning_rate", "-0.1", "config.optim.learning_rate=-0.1"),
         ("rollout.top_p", "1.5", "config.rollout.top_p=1.5"),
         ("mesh.data", "64", "config.mesh.data=64"),
         ("algorithm.name", "ppo2", "config.algorithm.name='ppo2'"),
         ("env.name", "chess", "config.env.name='chess'")]
  return [Probe("config", f"{field}={value}", _train(f"--config.{field}={value}"), "error", text)
          for field, value, text in bad]


def _workdir_probes() -> list[Probe]:
  return [
      Probe("workdir", "relative workdir", _python("train.py", "--workdir=../runs/w", *SMOKE,
                                                   "--config.num_updates=0"),
            "ok", cwd="cwd/sub",
            check=lambda f: "" if (f / "cwd" / "runs" / "w" / "eval.json").exists()
            else "no eval.json in the relative workdir"),
      Probe("workdir", "~ workdir", _python("train.py", "--workdir=~/w", *SMOKE,
                                            "--config.num_updates=0"),
            "ok", env={"HOME": "{dir}/home"},
            check=lambda f: "" if (f / "home" / "w" / "eval.json").exists()
            else "no eval.json under ~"),
      Probe("workdir", "workdir with ..", _python("train.py", "--workdir={dir}/a/../w", *SMOKE,
                                                  "--config.num_updates=0"),
            "ok", check=lambda f: "" if (f / "w" / "eval.json").exists() else "no eval.json"),
      Probe("checkpoint", "newest step truncated", _train("--config.num_updates=2",
                                                          "--config.checkpoint_every=1"),
            "ok", "could not be restored", setup=_damage("truncate"), check=_set_aside),
      Probe("checkpoint", "newest step scrambled", _train("--config.num_updates=2",
                                                          "--config.checkpoint_every=1"),
            "ok", "could not be restored", setup=_damage("scramble"), check=_set_aside),
      Probe("checkpoint", "newest step without prng_keys/", _train(
          "--config.num_updates=2", "--config.checkpoint_every=1"),
            "ok", "could not be restored", setup=_damage("prng_keys"), check=_set_aside),
      Probe("checkpoint", "newest step without state/", _train(
          "--config.num_updates=2", "--config.checkpoint_every=1"),
            "ok", "could not be restored", setup=_damage("state"), check=_set_aside),
      Probe("resume", "model size changed", _train("--config.num_updates=2",
                                                   "--config.checkpoint_every=1",
                                                   "--config.model.hidden_size=64"),
            "error", "model.hidden_size: 128 (saved) -> 64 (now)", setup=_copy_of_base,
            check=_config_unchanged),
      Probe("resume", "algorithm changed", _train("--config.num_updates=2",
                                                  "--config.checkpoint_every=1",
                                                  "--config.algorithm.name=rloo"),
            "error", "algorithm.name: 'grpo' (saved) -> 'rloo' (now)", setup=_copy_of_base,
            check=_config_unchanged),
      Probe("resume", "learning rate changed", _train("--config.num_updates=2",
                                                      "--config.checkpoint_every=1",
                                                      "--config.optim.learning_rate=0.001"),
            "error", "optim.learning_rate: 0.0003 (saved) -> 0.001 (now)", setup=_copy_of_base,
            check=_config_unchanged),
      Probe("resume", "num_updates raised", _train("--config.num_updates=3",
                                                   "--config.checkpoint_every=1"),
            "ok", "num_updates: 2 -> 3", setup=_copy_of_base,
            check=lambda f: _metrics_complete(3)(f) or (
                "" if (f / "w" / "config.2.json").exists() else "no config.2.json")),
      Probe("resume", "--init_from another algorithm", _python(
          "train.py", "--workdir={dir}/branch", *SMOKE, "--config.num_updates=1",
          "--config.algorithm.name=rloo", "--init_from={dir}/w"),
            "ok", setup=_copy_of_base,
            check=lambda f: "" if json.loads((f / "branch" / "eval.json").read_text())
            ["init_from"]["workdir"] == str(f / "w") else "init_from not recorded"),
  ]


def _evaluate(*flags: str) -> list[str]:
  return _python("evaluate.py", "--out={dir}/eval", *flags)


def _evaluate_probes() -> list[Probe]:
  same_as_run = lambda f: "" if {k: v for k, v in json.loads(
      (f / "eval" / "eval.json").read_text()).items() if k == "success_rate"} == {
          "success_rate": json.loads((f / "w" / "eval.json").read_text())["success_rate"]} \
      else "evaluate.py's success differs from the run's eval.json"
  return [
      Probe("evaluate", "--k=0", _evaluate("--checkpoint=oracle", "--env=pointer_chain", "--k=0"),
            "error", "--k=0 is not allowed"),
      Probe("evaluate", "--num_tasks=0", _evaluate("--checkpoint=oracle", "--env=pointer_chain",
                                                   "--num_tasks=0"),
            "error", "--num_tasks=0 is not allowed"),
      Probe("evaluate", "--env_params bad JSON", _evaluate(
          "--checkpoint=oracle", "--env=pointer_chain", "--env_params={bad"),
            "error", "is not valid JSON"),
      Probe("evaluate", "--env unknown", _evaluate("--checkpoint=oracle", "--env=chess"),
            "error", "chess"),
      Probe("evaluate", "workdir evaluated on the run's tasks", _evaluate("--checkpoint={dir}/w"),
            "ok", setup=_copy_of_base, check=same_as_run),
      Probe("evaluate", "workdir without a checkpoint", _evaluate("--checkpoint={dir}/w"),
            "error", "no checkpoint", setup=_config_only),
  ]


def _config_only(folder):
  """folder/w with the smoke config.json of a run that never reached its first checkpoint."""
  sys.path.insert(0, str(ROOT))
  from configs import default  # the repository's config module (not a package import)
  (folder / "w").mkdir()
  (folder / "w" / "config.json").write_text(default.get_config("smoke").to_json_best_effort())


def _generate_probes() -> list[Probe]:
  long_chat = json.dumps([{"role": "user", "content": "word " * 9001}])
  return [
      Probe("generate", "9,001-token prompt", _python(
          "generate.py", "--checkpoint=smollm2", f"--messages={long_chat}"),
            "error", "the model's context is 8192 tokens"),
      Probe("generate", "--max_new_tokens=1000000000", _python(
          "generate.py", "--checkpoint=smollm2", "--prompt=Hello", "--max_new_tokens=1000000000"),
            "error", "--max_new_tokens"),
      Probe("generate", "--temperature=-1", _python(
          "generate.py", "--checkpoint=smollm2", "--prompt=Hello", "--temperature=-1"),
            "error", "--temperature"),
      Probe("generate", "unknown chat role", _python(
          "generate.py", "--checkpoint=smollm2", '--messages=[{"role":"robot","content":"hi"}]'),
            "error", "allowed roles"),
      Probe("generate", "--messages bad JSON", _python(
          "generate.py", "--checkpoint=smollm2", "--messages=[{"), "error", "not valid JSON"),
  ]


def _cut_last_metrics_line(folder):
  _copy_of_base(folder)
  path = folder / "w" / "metrics.jsonl"
  path.write_text("".join(path.read_text().splitlines(keepends=True)[:-1]))


def _corrupt_first_metrics_line(folder):
  _copy_of_base(folder)
  path = folder / "w" / "metrics.jsonl"
  lines = path.read_text().splitlines(keepends=True)
  path.write_text("{garbage\n" + "".join(lines[1:]))


def _metrics_probes() -> list[Probe]:
  resume = _train("--config.num_updates=3", "--config.checkpoint_every=1")
  return [
      Probe("metrics", "last line lost, its checkpoint kept", resume, "ok",
            "the log has no record of update(s) 2", setup=_cut_last_metrics_line),
      Probe("metrics", "middle line corrupt", resume, "ok", "metrics.jsonl.corrupt",
            setup=_corrupt_first_metrics_line,
            check=lambda f: "" if "{garbage" in (f / "w" / "metrics.jsonl.corrupt").read_text()
            else "the corrupt line was not kept"),
  ]


def _damage_suite(folder):
  """A finished run whose test-split task file (in a copy of the task data) has 16 bytes flipped."""
  _copy_of_base(folder)
  shutil.copytree(folder.parent / "data", folder / "data")
  target = sorted((folder / "data").rglob("*test.array_record*"))[0]
  raw = bytearray(target.read_bytes())
  raw[100:116] = bytes(255 - b for b in raw[100:116])
  target.write_bytes(bytes(raw))


def _suite_probes() -> list[Probe]:
  return [Probe("tasks", "task suite file corrupted", _evaluate("--checkpoint={dir}/w"), "error",
                "delete the folder", setup=_damage_suite, env={"LONGHORIZON_DATA": "{dir}/data"})]


def _sharded_probes() -> list[Probe]:
  return [Probe("sharded", "default config on a 2x2x2 mesh", _python(
      "train.py", "--workdir={dir}/w", f"--config={ROOT}/configs/default.py",
      "--config.num_updates=2", "--config.mesh.data=2", "--config.mesh.fsdp=2",
      "--config.mesh.tensor=2", "--config.eval.num_tasks=16", "--config.tensorboard=False",
      "--config.progress=False"), "ok",
      env={"XLA_FLAGS": "--xla_force_host_platform_device_count=8"})]


def _read_only_checkpoints(folder):
  """A finished 2-update run whose checkpoints folder cannot be written (immutable)."""
  _copy_of_base(folder)
  subprocess.run(["chattr", "+i", str(folder / "w" / "checkpoints")], check=True)


def _kept_after_failed_save(folder):
  subprocess.run(["chattr", "-i", str(folder / "w" / "checkpoints")], check=True)
  steps = sorted(p.name for p in (folder / "w" / "checkpoints").iterdir())
  if steps != ["0", "1", "2"]:
    return f"checkpoints left: {steps}"
  return _metrics_complete(3)(folder)


_HELD_LOCKS = []


def _locked_by_a_live_run(folder):
  """A finished run whose workdir lock is held by a live process (this one)."""
  sys.path.insert(0, str(ROOT / "src"))
  from longhorizon.train import workdir as workdir_lib  # the library under probe
  _copy_of_base(folder)
  _HELD_LOCKS.append(workdir_lib.WorkdirLock(str(folder / "w")).acquire())


def _metrics_untouched(folder):
  for lock in _HELD_LOCKS:
    lock.release()
  _HELD_LOCKS.clear()
  return _metrics_complete(2)(folder)


def _failure_probes() -> list[Probe]:
  return [Probe("failure", "second run on a workdir in use",
                _train("--config.num_updates=3", "--config.checkpoint_every=1"), "error",
                f"is in use by another run (pid {os.getpid()} on host", setup=_locked_by_a_live_run,
                check=_metrics_untouched),
          Probe("failure", "checkpoint save fails (read-only folder)",
                _train("--config.num_updates=3", "--config.checkpoint_every=1"), "error",
                "training failed: PermissionError", setup=_read_only_checkpoints,
                check=_kept_after_failed_save)]


GROUPS: dict[str, Callable[[], list[Probe]]] = {
    "failure": _failure_probes,
    "config": _config_probes,
    "workdir": _workdir_probes,
    "evaluate": _evaluate_probes,
    "generate": _generate_probes,
    "metrics": _metrics_probes,
    "tasks": _suite_probes,
    "sharded": _sharded_probes,
}


def main(argv):
  del argv
  out = pathlib.Path(_OUT.value).resolve()
  out.mkdir(parents=True, exist_ok=True)
  global _ENV
  _ENV = dict(os.environ, JAX_PLATFORMS="cpu", LONGHORIZON_DATA=str(out / "data"),
              JAX_COMPILATION_CACHE_DIR=str(out / "jax_cache"),
              JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  _ENV.pop("LONGHORIZON_CRASH_AT", None)
  results = []
  for group, make in GROUPS.items():
    if _ONLY.value and group not in _ONLY.value:
      continue
    for probe in make():
      result = run_probe(probe, out, _ENV)
      results.append(result)
      print(f"{result['outcome']:12s} {result['seconds']:6.1f}s  {group}: {probe.name}  "
            f"| {result['message'][:140]}", flush=True)
  counts = {o: sum(r["outcome"] == o for r in results) for o in OUTCOMES}
  (out / "probes.json").write_text(json.dumps({"counts": counts, "probes": results}, indent=2))
  rows = ["| group | probe | expected | outcome | message |", "|---|---|---|---|---|"]
  rows += [f"| {r['group']} | {r['probe']} | {r['expect']} | {r['outcome']} | "
           f"{r['message'][:160].replace('|', '/')} |" for r in results]
  summary = ", ".join(f"{o}: {n}" for o, n in counts.items())
  (out / "probes.md").write_text(f"{len(results)} probes; {summary}\n\n" + "\n".join(rows) + "\n")
  print(f"{len(results)} probes; {summary}")
  if any(counts[o] for o in OUTCOMES[2:]):
    sys.exit(1)


_ENV: dict = {}

if __name__ == "__main__":
  app.run(main)
