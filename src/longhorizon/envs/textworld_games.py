"""TextWorld games: text adventures generated offline, played with free-text commands.

`TextWorldGames` is a host environment (`envs/host.py`) over games made by TextWorld's own
generator (PyPI `textworld`, an optional dependency: `pip install -e .[textworld]`; it is imported
inside functions, so this module imports without it). Nothing is downloaded: TextWorld ships its
Inform 7 compiler, and a game is generated and compiled on first use, then cached on disk.

Families (`family`):
  - "coin": coin-collector navigation (`textworld.challenges.tw_coin_collector.make_game`): a chain
    of `quest_length` rooms, the coin in the last one, distractor rooms (dead ends) beside the
    chain up to `nb_rooms`. The walkthrough is `quest_length - 1` moves and `take coin`.
  - "quest": TextWorld's custom quests (`textworld.generator.make_game`): a world of `nb_rooms`
    rooms and `nb_objects` objects and a quest sampled by backward chaining of `quest_length`
    actions (doors to unlock, containers to open, food to eat, things to put somewhere). The
    optimal plan (the walkthrough) is at most `quest_length` actions, usually exactly that.

Splits (`tasks`): train and test use the same generator settings on disjoint game seeds (seed
mod 3 is 0 for train, 1 for test), ood uses `ood_quest_length` / `ood_nb_rooms` (longer quests,
larger worlds) on seeds that are 2 mod 3. A task is a JSON dict naming the family, the generator
settings and `game_seed`; `reset` generates or loads that game and starts it (`seed` is unused:
TextWorld games are deterministic).

Cache: `$LONGHORIZON_DATA/textworld/` (default `~/.cache/longhorizon/textworld/`), one
`<family>-<params>-<seed>.z8` and `.json` per game. A game is generated into a private temporary
folder and moved into place with `os.replace` (the json first, the story file last, so a present
`.z8` means a complete pair): concurrent threads and processes may generate the same game, the
last rename wins with identical content. A cache entry that does not validate (a Z-machine
header whose length disagrees with the file, a json that does not parse, or a game that fails to
start) is regenerated once; if the fresh one fails too, the error names the files.

Milestones: each game gets, besides its quest, optional TextWorld quests (reward 1 each) for the
postconditions of every walkthrough action but the last, so the in-game score counts progress
along the plan; the last action (winning) brings the score to `max_score = len(walkthrough)`.
`milestone_names` are `score_1 ... score_K`, `K` the longest configured quest (max of
`quest_length` and `ood_quest_length`); a step that raises the score to `s` reports the names of
the points newly reached.

Oracle: the next command of TextWorld's winning policy from the current state (`policy_commands`,
which TextWorld recomputes every step, so it recovers after a deviation).

Text: observations are normalised for a word-level tokenizer: lowercase, words and punctuation
marks separated by single spaces (`"You see a coin."` -> `"you see a coin ."`). The reset
observation is the objective and the room description (no banner, no intro); a step's observation
is the game's reply without the prompt and status line, and the end-of-game text replaced by
`you won .` / `you lost .`. With `list_commands=True` each observation ends with
`actions : cmd | cmd | ...` (the admissible commands); they are always in `info`.
`vocabulary()` lists the words of TextWorld's text grammars and logic files (all names, room and
object descriptions, objectives, command templates), of the Inform 7 source it generates, and of
the Inform 7 library replies these games use, plus this module's own words: every word of the
normalised texts and oracle commands of these games (unknown words, e.g. in fuzzed or library
replies not listed, become `<unk>`; the oracle path never needs them).

Actions: free text (`tools = None`); the command is lowercased, stripped of characters other than
letters, digits, spaces, `'` and `-`, its whitespace collapsed; empty text is an invalid action
(GARBAGE), Inform meta commands (undo, restart, save, quit, ...), which would desynchronise the
quest tracking, are NOT_ALLOWED; anything else goes to the game, whose reply ("that's not a verb
i recognise .") is the observation.

Snapshots are the commands sent so far: `restore` restarts the game and replays them.

Backend: `default_backend = "process"`: the Z-machine interpreter (Jericho) and TextWorld's
quest tracking are CPU-bound Python/C, and Jericho keeps global state, so episodes in one
process's threads would serialise on the GIL and share the interpreter; a process per slot runs
them in parallel and isolates a crash.
"""

from __future__ import annotations

import functools
import json
import os
import random
import re
import shutil
import string
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any

from longhorizon.envs.host import HostEnvironment, Observation, StepResult, invalid_action
from longhorizon.envs.types import ErrorCode

__all__ = ["TextWorldGames", "normalize_text", "cache_dir"]

_INSTALL = "install the [textworld] extra: pip install -e .[textworld]"
_FAMILIES = ("coin", "quest")
_MAX_QUEST = 32
_GEN_VERSION = "v1"  # part of the cache file names: bump when the generation changes
# Inform meta commands: they act on the interpreter, not the world, and would desynchronise
# TextWorld's quest tracking (undo, restart, restore) or end the story (quit).
_META = frozenset({"undo", "restart", "restore", "save", "quit", "q", "script", "unscript",
                   "transcript", "noscript", "verbose", "brief", "superbrief", "notify",
                   "pronouns", "version", "again", "g", "oops", "o", "score", "full",
                   "fullscore"})
_MAX_COMMAND_CHARS = 180  # Jericho truncates input past 198 bytes
_TOKEN = re.compile(r"[a-z0-9]+|[^\sa-z0-9]")
_ROOM_TITLE = re.compile(r"-=\s*(.*?)\s*=-")
_gen_lock = threading.Lock()

# Replies of the Inform 7 library (parser errors, defaults of verbs) seen in these games; their
# words complete the vocabulary taken from TextWorld's data files.
_LIBRARY_TEXT = """
That's not a verb I recognise. I didn't understand that sentence. You can't see any such thing.
You can't go that way. You only understood as far as wanting to. I beg your pardon? That noun did
not make sense in this context. You need to be holding it before you can put it into something
else. You can't use multiple objects with that verb. Nothing is on sale. You are carrying nothing.
You are carrying: You see nothing special about it. It is closed. It is locked. It is empty. That
isn't available. That's fixed in place. That's hardly portable. You already have that. You can't
reach into it. You lack the nerve. Taken. Dropped. Opened. Closed. Locked. Unlocked. That's not
something you can open. That's not something you can close. That's already open. That's already
closed. That doesn't seem to be something you can lock. That doesn't seem to be something you can
unlock. It seems to be locked. That doesn't seem to fit the lock. You can't see any such thing
here. You'll have to say which compass direction to go in. What do you want to take? What do you
want to examine? Which do you mean, the a or the b? You'll have to be more specific. You can only
do that to something animate. That's plainly inedible. You have nothing to put there. That's not
something you can enter. You must name something more substantial. Putting things on that would
achieve nothing. That can't contain things. You can't put something inside itself. There is
nothing on it. It's empty. In it you see: On it you see: You eat the thing. Not bad. You pick up
the thing from the ground. You drop the thing on the ground. You put the thing on the thing. You
put the thing into the thing. You open the thing, revealing a thing. You unlock the thing. You
lock the thing. You close the thing. You open the thing. Your score has just gone up by one point.
Your score has just gone up by two points. Your score has just gone down by one point. (first
taking the thing) (first opening the thing) (first unlocking the thing) (the thing) You're now in
a room. There is nothing here. Nothing obvious happens. Time passes. You are carrying nothing.
Oops! You said that on the first try. I only understood you as far as wanting to go. You seem to
want to talk to someone, but I can't see whom. Please answer the question. You can hardly repeat
that. Sorry, that can't be corrected. There are none at all available! You don't have that. You
can see a thing here. The thing is open. The thing is closed. The thing is locked. you won. you
lost. the game is over. actions: not available here, try another command. a 0 1 2 3 4 5 6 7 8 9
"""


def _require_textworld():
  try:
    import textworld  # noqa: F401
  except ImportError as e:
    raise ImportError(f"TextWorldGames needs the optional package 'textworld' ({e}); "
                      f"{_INSTALL}.") from e
  return textworld


def normalize_text(text: str) -> str:
  """Lowercase, words and punctuation marks as space-separated tokens (`"A coin."` ->
  `"a coin ."`); a room title `-= Vault =-` becomes `vault :`."""
  text = _ROOM_TITLE.sub(lambda m: f" {m.group(1)} : ", text)
  return " ".join(_TOKEN.findall(text.lower()))


def cache_dir() -> Path:
  """Where generated games are kept: `$LONGHORIZON_DATA/textworld` (default under
  `~/.cache/longhorizon`)."""
  root = os.environ.get("LONGHORIZON_DATA") or os.path.join(os.path.expanduser("~"), ".cache",
                                                            "longhorizon")
  return Path(root) / "textworld"


# ------------------------------------------------------------------------------ generation
def _game_stem(task: dict) -> str:
  if task["family"] == "coin":
    params = f"{_GEN_VERSION}-l{task['quest_length']}-r{task['nb_rooms']}"
  else:
    params = (f"{_GEN_VERSION}-l{task['quest_length']}-r{task['nb_rooms']}"
              f"-o{task['nb_objects']}")
  return f"{task['family']}-{params}-{task['game_seed']}"


def _with_progress_quests(game):
  """Adds an optional quest (reward 1) for the postconditions of each walkthrough action but the
  last, so the score counts progress along the plan (see the module docstring)."""
  from textworld.generator.game import Event, GameProgression, Quest
  policy = GameProgression(game).winning_policy
  if not policy:
    raise RuntimeError("textworld: the generated game has no winning policy.")
  progress = [Quest(win_events=[Event(actions=policy[:i])], optional=True, reward=1)
              for i in range(1, len(policy))]
  game.quests = (*game.quests, *progress)
  game.change_grammar(game.grammar)  # regenerates the commands, walkthrough and objective
  return game


def _make_game(task: dict):
  """Builds the TextWorld `Game` of `task` (deterministic in the task)."""
  from textworld import GameOptions
  options = GameOptions()
  options.seeds = int(task["game_seed"])
  options.quest_length = int(task["quest_length"])
  options.nb_rooms = int(task["nb_rooms"])
  if task["family"] == "coin":
    from textworld.challenges.tw_coin_collector import coin_collector
    from textworld.generator.data import KnowledgeBase
    options.kb = KnowledgeBase.load(coin_collector.KB_PATH)
    options.grammar.allowed_variables_numbering = True
    options.nb_objects = 1
    mode = "simple" if options.nb_rooms <= 4 * options.quest_length else "random"
    game = coin_collector.make_game(mode, options)
  else:
    from textworld.generator import make_game
    options.nb_objects = int(task["nb_objects"])
    game = make_game(options)
  return _with_progress_quests(game), options


def _valid_story(path: Path) -> bool:
  """A complete Z-machine v8 story: version byte 8 and the header's length (in units of 8 bytes)
  within the file."""
  try:
    data = path.read_bytes()
  except OSError:
    return False
  if len(data) < 64 or data[0] != 8:
    return False
  declared = int.from_bytes(data[0x1A:0x1C], "big") * 8
  return 64 < declared <= len(data)


def _valid_json(path: Path) -> bool:
  try:
    with open(path) as f:
      data = json.load(f)
  except (OSError, ValueError):
    return False
  return isinstance(data, dict) and "quests" in data and "world" in data


def _generate(task: dict, folder: Path, stem: str) -> Path:
  """Generates and compiles the game into a temporary folder, then moves it into place."""
  from textworld.generator import compile_game
  folder.mkdir(parents=True, exist_ok=True)
  tmp = Path(tempfile.mkdtemp(prefix=f".{stem}-", dir=folder))
  try:
    # TextWorld's generator keeps module-level state (KB, grammar caches); the coin challenge
    # plays its walkthrough in Jericho, which warns that the game is "not fully supported".
    with _gen_lock, warnings.catch_warnings():
      warnings.simplefilter("ignore")
      game, options = _make_game(task)
      options.path = str(tmp / f"{stem}.z8")
      options.force_recompile = True
      built = Path(compile_game(game, options))
    os.replace(built.with_suffix(".json"), folder / f"{stem}.json")
    os.replace(built, folder / f"{stem}.z8")
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  return folder / f"{stem}.z8"


def is_cached(task: dict) -> bool:
  """Whether the compiled game of `task` is in the cache (and validates)."""
  folder, stem = cache_dir(), _game_stem(task)
  story = folder / f"{stem}.z8"
  return story.exists() and _valid_story(story) and _valid_json(folder / f"{stem}.json")


def game_file(task: dict, regenerate: bool = False) -> Path:
  """The compiled story file of `task` (generated on first use, see the module docstring)."""
  folder = cache_dir()
  stem = _game_stem(task)
  story, meta = folder / f"{stem}.z8", folder / f"{stem}.json"
  if not regenerate and is_cached(task):
    return story
  _require_textworld()
  path = _generate(task, folder, stem)
  if not (_valid_story(path) and _valid_json(meta)):
    raise RuntimeError(f"textworld: the freshly generated game {path} (and {meta}) does not "
                       "validate; delete them and check the TextWorld installation.")
  return path


# ------------------------------------------------------------------------------ vocabulary
@functools.lru_cache(maxsize=1)
def _static_vocabulary() -> tuple[str, ...]:
  """Words of TextWorld's data files (text grammars, logic with its Inform 7 texts), of the
  Inform 7 source generator and of the library replies (see the module docstring)."""
  textworld = _require_textworld()
  root = Path(textworld.__file__).parent
  files = sorted([*root.glob("generator/data/**/*.tw[gl]"),
                  *root.glob("challenges/tw_coin_collector/textworld_data/**/*.tw[gl]"),
                  root / "generator" / "inform7" / "world2inform7.py"])
  words: dict[str, None] = dict.fromkeys(string.punctuation)
  texts = [_LIBRARY_TEXT, *(f.read_text(errors="replace") for f in files)]
  for f in files:  # room nouns are also written in the plural ("you've seen better (name-n)s")
    for line in f.read_text(errors="replace").splitlines():
      key, _, values = line.partition(":")
      if f.suffix == ".twg" and "(r)" in key and "noun" in key:
        texts += [value.split()[-1] + "s" for value in values.split(";") if value.split()]
  for text in texts:
    text = re.sub(r"[#_(){}\[\]<>|/\\]", " ", text)  # grammar and template markup
    for word in normalize_text(text).split():
      if word.isascii():
        words[word] = None
  return tuple(sorted(words))


# ------------------------------------------------------------------------------ environment
class TextWorldGames(HostEnvironment):
  """TextWorld games as a host environment (see the module docstring).

  Args:
    family: "coin" (find the coin) or "quest" (TextWorld's custom quests).
    quest_length: length of the quest (rooms on the coin's path for "coin"), 1 to 32.
    nb_rooms: rooms in the world (default: quest, `min(8, max(2, quest_length))`; coin,
      `2 * quest_length`, distractor rooms beside the path).
    nb_objects: objects in the world ("quest" only; default `2 * nb_rooms`).
    ood_quest_length, ood_nb_rooms: the ood split's settings (default: twice the train ones,
      capped at 32 and 100); nb_objects for ood scales with the rooms.
    list_commands: append the admissible commands to each observation.
    reward, **reward_kwargs: the `RewardSpec` (see `HostEnvironment`).
  """

  name = "textworld"
  version = "1"
  tools = None
  default_backend = "process"

  @classmethod
  def horizon_settings(cls, horizon: int) -> dict:
    """A coin-collector quest of `horizon` actions (`horizon - 1` moves, then `take coin`); a turn
    is a two-word command and a room description, and the objective spells the route, so the
    prompt grows with the horizon (budgets from the word-level tokenizer's counts)."""
    return {"params": {"family": "coin", "quest_length": horizon, "ood_quest_length": horizon},
            "actions": horizon, "turn_tokens": 72, "prompt_tokens": 64 + 24 * horizon}

  def __init__(self, family: str = "quest", quest_length: int = 4, nb_rooms: int | None = None,
               nb_objects: int | None = None, ood_quest_length: int | None = None,
               ood_nb_rooms: int | None = None, list_commands: bool = False,
               reward=None, **reward_kwargs):
    super().__init__(reward=reward, **reward_kwargs)
    if family not in _FAMILIES:
      raise ValueError(f"textworld: family must be one of {_FAMILIES}, got {family!r}.")
    for key, value in (("quest_length", quest_length), ("ood_quest_length", ood_quest_length)):
      if value is not None and not 1 <= int(value) <= _MAX_QUEST:
        raise ValueError(f"textworld: {key} must be in 1..{_MAX_QUEST}, got {value}.")
    self.family = family
    self.quest_length = int(quest_length)
    self.ood_quest_length = int(ood_quest_length if ood_quest_length is not None
                                else min(_MAX_QUEST, 2 * self.quest_length))
    self.nb_rooms = int(nb_rooms if nb_rooms is not None
                        else self._default_rooms(self.quest_length))
    self.ood_nb_rooms = int(ood_nb_rooms if ood_nb_rooms is not None
                            else min(100, max(self.nb_rooms, 2 * self.nb_rooms)))
    if family == "coin" and self.ood_nb_rooms < self.ood_quest_length:
      self.ood_nb_rooms = self._default_rooms(self.ood_quest_length)
    self.nb_objects = int(nb_objects if nb_objects is not None else 2 * self.nb_rooms)
    self.list_commands = bool(list_commands)
    for split, (length, rooms) in {"train": (self.quest_length, self.nb_rooms),
                                   "ood": (self.ood_quest_length, self.ood_nb_rooms)}.items():
      self._check_world(split, length, rooms)
    self._env = None
    self._task: dict | None = None
    self._commands: list[str] = []
    self._state = None
    self._done = False

  @property
  def milestone_names(self) -> tuple[str, ...]:
    """`score_1 ... score_K`, K the longest configured quest (a property, not a parameter)."""
    return tuple(f"score_{k}" for k in range(1, max(self.quest_length, self.ood_quest_length) + 1))

  def _default_rooms(self, quest_length: int) -> int:
    if self.family == "coin":
      return min(100, 2 * quest_length)
    return min(8, max(2, quest_length))

  def _check_world(self, split: str, length: int, rooms: int) -> None:
    if not 1 <= rooms <= 100:
      raise ValueError(f"textworld: {split} nb_rooms must be in 1..100 (TextWorld's Z-machine "
                       f"limit), got {rooms}.")
    if self.family == "coin" and rooms < length:
      raise ValueError(f"textworld: coin family needs nb_rooms >= quest_length (the path has "
                       f"quest_length rooms); {split} has nb_rooms={rooms}, "
                       f"quest_length={length}.")

  # ------------------------------------------------------------------------------ tasks
  def tasks(self, split: str, num: int, seed: int) -> list[dict]:
    offsets = {"train": 0, "test": 1, "ood": 2}
    if split not in offsets:
      raise ValueError(f"textworld: split must be one of {sorted(offsets)}, got {split!r}.")
    # Prefix-stable: the first n tasks of a longer list are the n-task list (so a larger
    # tasks.train_size reuses the cached games of a smaller one); game seeds never repeat.
    rng = random.Random(f"textworld/{self.family}/{split}/{seed}")
    ood = split == "ood"
    length = self.ood_quest_length if ood else self.quest_length
    rooms = self.ood_nb_rooms if ood else self.nb_rooms
    objects = max(self.nb_objects, 2 * rooms) if ood else self.nb_objects
    out, seen = [], set()
    while len(out) < int(num):
      game_seed = 3 * rng.randrange(1 << 20) + offsets[split]
      if game_seed in seen:
        continue
      seen.add(game_seed)
      task = {"family": self.family, "game_seed": game_seed,
              "quest_length": length, "nb_rooms": rooms, "difficulty": length}
      if self.family == "quest":
        task["nb_objects"] = objects
      out.append(task)
    return out

  def task_difficulty(self, task: dict) -> int:
    return int(task.get("quest_length", 0))

  # ------------------------------------------------------------------------------ episode
  def _check_task(self, task: Any) -> dict:
    if not isinstance(task, dict):
      raise ValueError(f"textworld: a task is a dict from tasks(), got {type(task).__name__}.")
    needed = ["family", "game_seed", "quest_length", "nb_rooms"]
    if task.get("family") == "quest":
      needed.append("nb_objects")
    missing = [k for k in needed if k not in task]
    if missing:
      raise ValueError(f"textworld: task {task!r} lacks {missing}; build tasks with tasks().")
    if task["family"] not in _FAMILIES:
      raise ValueError(f"textworld: task family must be one of {_FAMILIES}, got "
                       f"{task['family']!r}.")
    return dict(task)

  def _start(self, path: Path):
    textworld = _require_textworld()
    infos = textworld.EnvInfos(admissible_commands=True, policy_commands=True, won=True,
                               lost=True, score=True, max_score=True, objective=True,
                               description=True)
    with warnings.catch_warnings():  # Jericho: "not fully supported" (TextWorld tracks score)
      warnings.simplefilter("ignore")
      env = textworld.start(str(path), infos)
    try:
      state = env.reset()
    except Exception:
      env.close()
      raise
    return env, state

  def reset(self, task: dict, seed: int) -> Observation:
    del seed  # TextWorld games are deterministic
    task = self._check_task(task)
    self.close()
    path = game_file(task)
    try:
      env, state = self._start(path)
    except Exception:  # a cache entry that validates but does not run: regenerate once
      path = game_file(task, regenerate=True)
      try:
        env, state = self._start(path)
      except Exception as e:
        raise RuntimeError(f"textworld: the game {path} (regenerated) fails to start: "
                           f"{type(e).__name__}: {e}") from e
    self._env, self._state, self._task = env, state, task
    self._commands, self._done = [], False
    text = normalize_text(f"{state['objective']} {state['description']}")
    return Observation(self._with_commands(text), self._info(state))

  def _with_commands(self, text: str) -> str:
    if not self.list_commands or self._state is None:
      return text
    commands = " | ".join(normalize_text(c) for c in self._state["admissible_commands"] or [])
    return f"{text} actions : {commands}"

  def _info(self, state) -> dict:
    return {"admissible_commands": list(state["admissible_commands"] or []),
            "score": int(state["score"] or 0), "max_score": int(state["max_score"] or 0)}

  @staticmethod
  def _command(action: str) -> str:
    text = re.sub(r"[^a-z0-9' -]", " ", action.lower()[:_MAX_COMMAND_CHARS])
    text = " ".join(text.split())
    return re.sub(r" ?([-']) ?", r"\1", text)  # "non - stick" (word-level decode) -> "non-stick"

  def step(self, action: str) -> StepResult:
    if self._env is None:
      raise RuntimeError("textworld: step() before reset().")
    if not isinstance(action, str):
      return invalid_action(ErrorCode.GARBAGE, f"expected text, got {type(action).__name__}")
    if self._done:
      return StepResult("the game is over .", terminated=True, success=bool(self._state["won"]),
                        info=self._info(self._state))
    command = self._command(action)
    if not command.strip("'-"):
      return invalid_action(ErrorCode.GARBAGE, "empty command ; type a command such as look")
    if command.split()[0] in _META:
      return invalid_action(ErrorCode.NOT_ALLOWED, f"{command.split()[0]} is not available "
                                                   "here , try another command")
    return self._send(command)

  def _send(self, command: str) -> StepResult:
    before = int(self._state["score"] or 0)
    state, _, _ = self._env.step(command)
    self._commands.append(command)
    self._state = state
    won, lost = bool(state["won"]), bool(state["lost"])
    self._done = won or lost
    score = int(state["score"] or 0)
    text = state.feedback or ""
    text = re.split(r"\*\*\*", text)[0]  # the end-of-game text
    text = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith(">"))
    text = normalize_text(text)
    if won:
      text = f"{text} you won ."
    elif lost:
      text = f"{text} you lost ."
    milestones = tuple(f"score_{s}" for s in range(before + 1, score + 1)
                       if s <= len(self.milestone_names))
    return StepResult(self._with_commands(text.strip()), terminated=self._done, success=won,
                      milestones=milestones, info=self._info(state))

  def oracle(self) -> str | None:
    if self._state is None or self._done:
      return None
    plan = self._state["policy_commands"] or []
    return normalize_text(plan[0]) if plan else None

  def random_action(self, seed: int) -> str | None:
    """A uniformly random admissible command (a noisy demonstrator's slip)."""
    if self._state is None or self._done:
      return None
    commands = sorted(normalize_text(c) for c in self._state["admissible_commands"] or [])
    return random.Random(seed).choice(commands) if commands else None

  def state_text(self) -> str:
    """The objective with the steps already scored removed, then the current room's description:
    what a game started from here with the same remaining plan would say (at the start, exactly
    the reset observation's text). The objective spells one clause per walkthrough action,
    sentence by sentence, before a closing sentence ("that ' s it !"); an objective that does not
    split so is kept whole."""
    if self._state is None:
      raise RuntimeError("textworld: state_text() before reset().")
    objective = normalize_text(self._state["objective"] or "")
    sentences = objective.split(" . ")
    steps, score = int(self._state["max_score"] or 0), int(self._state["score"] or 0)
    if 0 < steps < len(sentences) and 0 < score < steps:
      # the last `steps` sentences before the closing one are the plan's clauses (the first may
      # also carry the introduction); drop the first `score` of them
      first = len(sentences) - 1 - steps
      sentences = sentences[:first] + sentences[first + score:]
    text = normalize_text(f"{' . '.join(sentences)} {self._state['description'] or ''}")
    return self._with_commands(text)

  def snapshot(self) -> dict:
    if self._task is None:
      raise RuntimeError("textworld: snapshot() before reset().")
    return {"task": dict(self._task), "commands": list(self._commands)}

  def restore(self, snapshot: dict) -> None:
    if not isinstance(snapshot, dict) or "task" not in snapshot or "commands" not in snapshot:
      raise ValueError("textworld: restore() takes a snapshot() dict with 'task' and 'commands'.")
    self.reset(snapshot["task"], 0)
    for command in snapshot["commands"]:
      self._send(command)

  def close(self) -> None:
    if self._env is not None:
      env, self._env = self._env, None
      env.close()

  def system_text(self, style: str) -> str:
    del style
    return ("you play a text adventure . type one short command per turn , such as go north , "
            "take coin , open door , unlock door with key , eat apple , look or inventory . "
            "complete the objective .")

  def vocabulary(self) -> list[str]:
    extra = normalize_text(self.system_text("compact")).split()
    return list(dict.fromkeys([*_static_vocabulary(), *extra]))
