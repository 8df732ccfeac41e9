"""Properties every registered environment must have: parsing never raises (hypothesis), actions
round-trip through text, chat framing with a real tokenizer, finished rows stay finished, jitted
steps do not retrace, wrappers compose and flag what they should, task suites are deterministic."""

import json
import re

import gguf
import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from longhorizon import envs
from longhorizon.envs import tasks as task_suites
from longhorizon.envs import testing
from longhorizon.envs.pointer_chain import PointerChain
from longhorizon.models import checkpoint
from longhorizon.text import tokenizer_from_gguf

NAMES = envs.registered("jax")  # host environments: tests/envs/test_host_*.py
STYLES = ("compact", "tool_call")
END_MARKERS = ("<eot>", "<|endoftext|>")


@pytest.fixture(scope="module", params=NAMES)
def env(request):
  return envs.make(request.param)


@pytest.fixture(scope="module")
def smollm2_tokenizer():
  return tokenizer_from_gguf(gguf.GGUFReader(str(checkpoint.resolve("smollm2"))))


# --------------------------------------------------------------------------------------- parsing

def _tool_call_text(draw_name, draw_args):
  return "<tool_call>" + json.dumps({"name": draw_name, "arguments": draw_args}) + "</tool_call>"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6)


def _texts(env):
  names = st.sampled_from([t.name for t in env.tools] + ["nope", "", "LOOKUP"])
  arg_names = st.sampled_from(sorted({a.name for t in env.tools for a in t.args} | {"x"}))
  structured = st.builds(_tool_call_text, names, st.dictionaries(arg_names, json_values, max_size=4))
  words = st.lists(st.sampled_from([t.name for t in env.tools] + ["1", "-3", "99999999999999", "up",
                                                                  "<eot>", "x", "{", "</tool_call>",
                                                                  "\uff13", "\u0663", "-0", "007"]),
                   max_size=5).map(" ".join)
  separators = st.sampled_from([" ", "  ", "\t", "\u00a0", "\n"])
  spaced = st.lists(st.sampled_from([t.name for t in env.tools] + ["0", "1", "up"]), min_size=1,
                    max_size=3).flatmap(lambda ws: st.lists(separators, min_size=len(ws) - 1,
                                                            max_size=len(ws) - 1).map(
      lambda seps: ws[0] + "".join(s + w for s, w in zip(seps, ws[1:]))))
  return st.one_of(st.text(max_size=60), structured, words, spaced,
                   st.builds(lambda a, b: a + b, structured, st.text(max_size=10)),
                   st.binary(max_size=20).map(lambda b: b.decode("latin-1")))


@pytest.mark.parametrize("style", STYLES)
def test_parse_action_never_raises(env, style):
  codec = env.codec(style=style)

  @hypothesis.settings(max_examples=150, deadline=None, derandomize=True,
                       suppress_health_check=list(hypothesis.HealthCheck))
  @hypothesis.given(_texts(env))
  def check(text):
    action, ok, message = codec.parse_action(text)
    assert np.asarray(action.args).shape == (env.num_args,)
    if ok:
      assert int(action.error) == 0 and 0 <= int(action.tool) < len(env.tools) and message == ""
      # A parsed action formats back to text that parses to the same action.
      again, ok2, _ = codec.parse_action(codec.format_action(action))
      assert ok2 and int(again.tool) == int(action.tool)
      np.testing.assert_array_equal(again.args, action.args)
      if style == "compact":
        # Accepted text is the formatted action, up to surrounding whitespace, end-of-turn markers
        # and runs of ASCII spaces: never a differently spelled (or different) action.
        core = text.strip()
        while any(core.endswith(m) for m in END_MARKERS):
          core = core[:-len(next(m for m in END_MARKERS if core.endswith(m)))].strip()
        assert re.sub(" +", " ", core) == codec.format_action(action), repr(text)
    else:
      assert int(action.error) != 0 and message
      assert envs.ErrorCode(int(action.error)).is_parse_error

  check()
  for bad in (None, 3, b"lookup", ["x"]):
    action, ok, _ = codec.parse_action(bad)
    assert not ok and int(action.error) == envs.ErrorCode.GARBAGE


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.slow  # over 10 s on a 2-core AMD EPYC with the test compile settings (BUILD_NOTES)
def test_malformed_action_gets_named_error_observation(env, style):
  codec = env.codec(style=style)
  state, _ = env.reset(jax.random.key(0))
  cases = {"": envs.ErrorCode.GARBAGE, "frobnicate 3": envs.ErrorCode.UNKNOWN_TOOL}
  if style == "tool_call":
    cases = {"hello": envs.ErrorCode.GARBAGE, "<tool_call>{oops</tool_call>": envs.ErrorCode.BAD_JSON,
             '<tool_call>{"name": "frobnicate", "arguments": {}}</tool_call>': envs.ErrorCode.UNKNOWN_TOOL,
             codec.format_action(env.oracle(state)) + " and more": envs.ErrorCode.EXTRA_TEXT}
  for text, code in cases.items():
    action, ok, message = codec.parse_action(text)
    assert not ok and int(action.error) == code, (text, message)
    new_state, ts = env.step(state, action)
    assert bool(ts.invalid_action) and int(ts.observation["error"]) == code
    assert not bool(ts.done) and int(new_state.step) == 1
    rendered = codec.observation_text(ts, message)
    assert envs.ERROR_MESSAGES[code] in rendered


def _baseline_values(tool):
  """In-range values for each of `tool`'s arguments (enum index 0, int `low`)."""
  return [0 if a.kind == "enum" else a.low for a in tool.args]


def _compact_text(tool, values):
  return " ".join([tool.name] + [a.choices[v] if a.kind == "enum" and 0 <= v < len(a.choices)
                                 else str(v) for a, v in zip(tool.args, values)])


def test_compact_refuses_unicode_digits_non_canonical_numbers_and_odd_separators(env):
  codec = env.codec(style="compact")
  tool = next(t for t in env.tools if t.args)
  good = _compact_text(tool, _baseline_values(tool))
  # The documented leniency: whitespace and end-of-turn tokens around the action, runs of spaces.
  action, ok, message = codec.parse_action("\t " + good.replace(" ", "   ") + " \n<eot>")
  assert ok and codec.format_action(action) == good, message
  for separator in ("\t", "\u00a0", "\n", "\u3000"):
    action, ok, message = codec.parse_action(good.replace(" ", separator, 1))
    assert not ok and int(action.error) == envs.ErrorCode.BAD_ARGUMENT, (separator, message)
    assert f"U+{ord(separator):04X}" in message, message
  for t, tool in enumerate(env.tools):
    for i, arg in enumerate(tool.args):
      if arg.kind != "int":
        continue
      for word in ("\uff13", "\u0663", "-0", f"0{arg.low}", f"+{arg.low}", f"{arg.low}.0"):
        words = _compact_text(tool, _baseline_values(tool)).split(" ")
        words[1 + i] = word
        action, ok, message = codec.parse_action(" ".join(words))
        assert not ok and int(action.error) == envs.ErrorCode.BAD_ARGUMENT, (word, message)
        assert arg.name in message and "ASCII digits" in message, message


def test_tool_call_refuses_duplicate_keys_and_negative_zero(env):
  codec = env.codec(style="tool_call")
  tool = next(t for t in env.tools if t.args)
  values = {a.name: a.choices[0] if a.kind == "enum" else a.low for a in tool.args}
  first = tool.args[0]
  other = first.choices[-1] if first.kind == "enum" else first.high
  body = json.dumps({"name": tool.name, "arguments": values})
  # The last of two values for one key would win silently; it is refused, naming the key.
  opening = f'"arguments": {{"{first.name}": '
  repeated = body.replace(opening, f"{opening}{json.dumps(other)}, \"{first.name}\": ")
  for text, key in ((repeated, first.name),
                    (body.replace('"name": ', '"name": "nope", "name": ', 1), "name")):
    action, ok, message = codec.parse_action(f"<tool_call>{text}</tool_call>")
    assert not ok and int(action.error) == envs.ErrorCode.BAD_JSON, (text, message)
    assert f"duplicate key {key!r}" in message, message
  for t, tool in enumerate(env.tools):
    for arg in tool.args:
      if arg.kind == "int":
        values = {a.name: a.choices[0] if a.kind == "enum" else a.low for a in tool.args}
        text = json.dumps({"name": tool.name, "arguments": values}).replace(
            f'"{arg.name}": {arg.low}', f'"{arg.name}": -0')
        action, ok, message = codec.parse_action(f"<tool_call>{text}</tool_call>")
        assert not ok and int(action.error) == envs.ErrorCode.BAD_ARGUMENT, (text, message)
        assert f"{arg.name} must be an integer, got -0" in message, message


def test_out_of_range_arguments_are_refused_alike(env):
  """Every environment refuses a hand-built action with an argument outside its `Arg` range the
  same way (INVALID_ARGUMENT, counted invalid, state unchanged, the episode goes on); the codec
  refuses the same value in text as BAD_ARGUMENT in both styles."""
  step = jax.jit(env.step)
  state, first = env.reset(jax.random.key(0))
  codecs = {style: env.codec(style=style) for style in STYLES}
  for t, tool in enumerate(env.tools):
    for i, arg in enumerate(tool.args):
      outside = (-1, len(arg.choices)) if arg.kind == "enum" else (arg.low - 1, arg.high + 1)
      for bad in outside:
        values = _baseline_values(tool)
        values[i] = bad
        where = f"{env.name}: {tool.name} {arg.name}={bad}"
        new, ts = step(state, envs.Action.make(t, values, env.num_args))
        assert int(ts.observation["error"]) == envs.ErrorCode.INVALID_ARGUMENT, where
        assert bool(ts.invalid_action) and not bool(ts.done), where
        assert int(ts.anchor) == int(first.anchor), where
        jax.tree.map(np.testing.assert_array_equal, envs.to_numpy(new.inner),
                     envs.to_numpy(state.inner))
        for codec in codecs.values():
          assert codec.observation_text(ts), where
        word = "sideways" if arg.kind == "enum" else bad
        compact = _compact_text(tool, values).split(" ")
        compact[1 + i] = str(word)
        arguments = {a.name: a.choices[v] if a.kind == "enum" else v
                     for a, v in zip(tool.args, _baseline_values(tool))}
        arguments[arg.name] = word
        texts = {"compact": " ".join(compact),
                 "tool_call": "<tool_call>" + json.dumps({"name": tool.name,
                                                          "arguments": arguments}) + "</tool_call>"}
        for style, text in texts.items():
          action, ok, message = codecs[style].parse_action(text)
          assert not ok and int(action.error) == envs.ErrorCode.BAD_ARGUMENT, (where, style)
          assert arg.name in message, (where, style, message)


def test_random_actions_round_trip_through_text(env):
  keys = jax.random.split(jax.random.key(1), 32)
  state, _ = env.reset(jax.random.key(0))
  for style in STYLES:
    codec = env.codec(style=style)
    for k in keys:
      action = testing.random_action(env, state, k)
      parsed, ok, message = codec.parse_action(codec.format_action(action) + " " + codec.end_of_turn)
      assert ok, message
      assert int(parsed.tool) == int(action.tool)
      n = len(env.tools[int(action.tool)].args)
      np.testing.assert_array_equal(np.asarray(parsed.args)[:n], np.asarray(action.args)[:n])


# ----------------------------------------------------------------------------- chat framing

@pytest.mark.parametrize("style", STYLES)
def test_oracle_with_chat_tokenizer(env, style, smollm2_tokenizer):
  """With SmolLM2's tokenizer the prompt is a chat, observations are the template's next turn, and
  the oracle still succeeds through the text path; the ids equal the whole conversation rendered
  at once only up to tokenisation boundaries, which is why observations are encoded on their own."""
  codec = env.codec(smollm2_tokenizer, style)
  assert codec.chat and codec.stop_token_ids == (smollm2_tokenizer.convert_tokens_to_ids("<|im_end|>"),)
  keys = jax.random.split(jax.random.key(2), 3)
  for k in keys:
    episode = testing.text_episode(env, codec, k)
    assert bool(episode["final"].success), episode["actions"]
  text = codec.decode(episode["ids"])
  assert text.startswith("<|im_start|>system\n")
  assert text.count("<|im_start|>assistant\n") == len(episode["actions"]) + 1
  if style == "tool_call":
    assert "<tool_response>" in text and '"name": "' + env.tools[0].name in text


# ------------------------------------------------------------------------- batching and no-ops

@pytest.mark.slow  # over 24 s on a 2-core AMD EPYC (BUILD_NOTES, the test tiers)
def test_finished_rows_stay_finished_and_step_does_not_retrace(env, assert_no_retrace):
  keys = jax.random.split(jax.random.key(3), 8)
  states, _ = jax.vmap(lambda k: env.reset(k))(keys)
  step = jax.jit(jax.vmap(env.step))
  oracle = jax.jit(jax.vmap(env.oracle))
  for _ in range(64):
    states, ts = step(states, oracle(states))
  assert bool(states.done.all())
  again, ts2 = step(states, oracle(states))
  jax.tree.map(np.testing.assert_array_equal, envs.to_numpy(again), envs.to_numpy(states))
  assert float(jnp.abs(ts2.reward).sum()) == 0.0 and not bool(ts2.milestones.any())
  np.testing.assert_array_equal(ts2.success, states.last.success)
  assert_no_retrace(step, ((states, oracle(states)), {}), ((again, oracle(again)), {}))


def test_vocabulary_covers_compact_text(env):
  codec = env.codec(style="compact")
  keys = jax.random.split(jax.random.key(4), 16)
  unk = codec.tokenizer.unk_token_id
  for split in ("train", "ood"):
    tasks = testing.tasks_from_keys(env, keys, split)
    for i in range(4):
      episode = testing.text_episode(env, codec, keys[i], envs.row(tasks, i),
                                     policy=lambda s, k: testing.random_action(env, s, k),
                                     max_steps=6)
      assert unk not in episode["ids"], codec.decode(episode["ids"])


class _MissingWord(PointerChain):
  """pointer_chain whose vocabulary() misses one word (a gap a user's environment may have)."""

  def __init__(self, missing: str, **params):
    super().__init__(**params)
    self.missing = missing

  def vocabulary(self):
    return [w for w in super().vocabulary() if w != self.missing]


@pytest.mark.parametrize("missing,where", [("hops", "prompt"), ("->", "observation after action 0")])
def test_text_checks_raise_on_a_vocabulary_gap(missing, where):
  """The oracle's success through the text path is blind to a word missing from vocabulary() (it
  acts on the state, not on the `<unk>` the policy would see); the text checks are not."""
  env = _MissingWord(missing, horizon=2)
  codec = env.codec(style="compact")
  episode = testing.text_episode(env, codec, jax.random.key(0), check_text=False)
  assert bool(episode["final"].success)  # blind
  assert codec.tokenizer.unk_token_id in episode["ids"]
  with pytest.raises(ValueError, match=re.escape(where) + ".*: the tokenizer does not know "
                                       + re.escape(f"[{missing!r}]")):
    testing.text_episode(env, codec, jax.random.key(0))
  task = env.generate_task(jax.random.key(0))
  text = codec.prompt_text(task)
  if missing == "hops":
    with pytest.raises(ValueError, match="add them to pointer_chain.vocabulary"):
      testing.check_text_round_trip(codec, text, "prompt")
  else:
    ids = testing.check_text_round_trip(codec, text, "prompt")
    assert ids == codec.render_prompt(task) and codec.decode(ids).split() == text.split()
  assert codec.unknown_words(f"start 3 {missing} 2 , lookup {missing}") == [missing] * 2
  # A byte-level tokenizer (tool_call style) has no unknown words: the same environment passes.
  assert bool(testing.text_episode(env, env.codec(style="tool_call"), jax.random.key(0))["final"].success)


# ---------------------------------------------------------------------------------- wrappers

def test_time_limit_truncates_not_terminates():
  env = envs.TimeLimit(envs.make("pointer_chain", horizon=4), max_steps=3)
  lookup = envs.Action.make(0, [0], env.num_args)
  state, _ = env.reset(jax.random.key(0))
  for t in range(3):
    state, ts = env.step(state, lookup)
  assert bool(ts.truncated) and not bool(ts.terminated) and bool(state.done)
  state2, ts2 = env.step(state, lookup)
  assert int(ts2.step) == 3 and bool(ts2.truncated)


def test_fault_injection_flags_env_errors_apart_from_policy_failures():
  base = envs.make("pointer_chain", horizon=4)
  keys = jax.random.split(jax.random.key(5), 512)
  faulty = envs.FaultInjection(base, {"timeout": 0.2, "unavailable": 0.1},
                               env_error_kinds=("unavailable",))
  ts = testing.structured_rollout(faulty, keys, None, "oracle", 40)
  summary = testing.episode_summary(ts)
  fault = np.asarray(ts.fault)
  env_error = np.asarray(ts.env_error).any(0)
  # Every env-error episode saw an "unavailable" fault, was cut (truncated), and is not a failure
  # of the policy: the oracle succeeds on every episode without one.
  assert env_error.any() and (~env_error).any()
  assert ((fault == envs.ErrorCode.UNAVAILABLE).any(0) == env_error).all()
  assert np.asarray(ts.truncated).any(0)[env_error].all()
  assert summary["success"][~env_error].all() and not summary["success"][env_error].any()
  # Recoverable timeouts happened and were retried to success.
  recovered = (fault == envs.ErrorCode.TIMEOUT).any(0) & summary["success"]
  assert recovered.any()
  rate = (fault[:, ~env_error] != 0).sum() / max(1, (~np.asarray(ts.done)[:, ~env_error]).sum())
  assert 0.1 < rate < 0.35  # about the configured 20% of calls (plus the env-error draws)
  # A policy failure has no env error: a random policy fails without the flag.
  random = testing.structured_rollout(base, keys[:64], None, "random", 40)
  assert not np.asarray(random.env_error).any()


def test_tool_cost_and_loop_detector():
  env = envs.LoopDetector(envs.ToolCost(envs.make("pointer_chain", horizon=4), {"lookup": 0.5}), k=3)
  state, _ = env.reset(jax.random.key(0))
  first = env.oracle(state)
  state, ts = env.step(state, first)
  assert float(ts.cost) == 0.5 and not bool(ts.loop)
  off_chain = envs.Action.make(0, [(int(state.inner["current"]) + 1) % 16], env.num_args)
  for k in range(3):
    state, ts = env.step(state, off_chain)  # the same action in the same (unchanged) state
    assert bool(ts.loop) == (k == 2)
  assert bool(ts.truncated) and not bool(ts.terminated) and bool(state.done)
  with pytest.raises(ValueError, match="unknown tool"):
    envs.ToolCost(envs.make("pointer_chain"), {"search": 1.0})
  with pytest.raises(ValueError, match="fault kind"):
    envs.FaultInjection(envs.make("pointer_chain"), {"meteor": 0.1})


def test_wrappers_compose_under_jit_and_vmap():
  env = envs.LoopDetector(envs.ToolCost(envs.FaultInjection(envs.TimeLimit(
      envs.make("gridworld"), 30), {"timeout": 0.1}), {"move": 0.01}), k=4)
  keys = jax.random.split(jax.random.key(6), 64)
  ts = testing.structured_rollout(env, keys, None, "oracle", 40)
  summary = testing.episode_summary(ts)
  assert summary["done"].all() and summary["success"].mean() > 0.9
  assert np.asarray(ts.cost).sum() > 0


# -------------------------------------------------------------------------------- task suites

def test_task_suites_are_deterministic_and_disjoint(tmp_path):
  sizes = {"train": 256, "test": 64, "ood": 32}
  a = task_suites.load("pointer_chain", "test", {"horizon": 3}, seed=7, sizes=sizes,
                       data_dir=str(tmp_path / "a"))
  b = task_suites.load("pointer_chain", "test", {"horizon": 3}, seed=7, sizes=sizes,
                       data_dir=str(tmp_path / "b"))
  assert len(a) == 64
  jax.tree.map(np.testing.assert_array_equal, task_suites.stack(a, range(64)),
               task_suites.stack(b, range(64)))
  train = task_suites.load("pointer_chain", "train", {"horizon": 3}, seed=7, sizes=sizes,
                           data_dir=str(tmp_path / "a"))
  hashes = lambda src, n: set(np.asarray(jax.vmap(envs.hash_tree)(task_suites.stack(src, range(n)))).tolist())
  assert not hashes(a, 64) & hashes(train, 256)
  ood = task_suites.load("pointer_chain", "ood", {"horizon": 3}, seed=7, sizes=sizes,
                         data_dir=str(tmp_path / "a"))
  ood_tasks = task_suites.stack(ood, range(32))
  assert (np.asarray(ood_tasks["horizon"]) == 6).all()
  env = ood.env
  summary = testing.episode_summary(testing.structured_rollout(
      env, jax.random.split(jax.random.key(0), 32), ood_tasks, "oracle", 12))
  assert summary["success"].all()
  other_seed = task_suites.load("pointer_chain", "test", {"horizon": 3}, seed=8, sizes=sizes,
                                data_dir=str(tmp_path / "a"))
  assert hashes(other_seed, 64) != hashes(a, 64)
