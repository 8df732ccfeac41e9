"""`gridworld`: walk a text-rendered grid past walls and holes, fetch a key, open a door, reach G.

A square `size x size` grid (FrozenLake/Sokoban-like) holds floor `.`, walls `#`, holes `O`, a key
`k`, a locked door `D` (shown `d` once the key is held) and the goal `G`; the agent `A` starts on a
floor cell. The one tool is `move(direction)` with `direction` in (up, down, left, right).

Dynamics of one move (the target cell is the neighbour in `direction`):
* off the grid, into a wall, into the door without the key, or an unknown direction index: the move
  is rejected (`Transition.rejected`: counted invalid, the `invalid` penalty), the agent stays and the
  observation carries `INVALID_ARGUMENT` and the reason (`event`);
* otherwise the agent moves there. Entering the key cell picks the key up (it disappears; the door
  is unlocked from then on, the key is never used up); entering a hole ends the episode (terminated,
  not a success, not a violation); entering the goal ends it, and the verifier accepts exactly the
  final states with the agent on the goal.

Task layout (`generate_task`): with `key_door` (default), a full row or column of walls (never on
the border) cuts the grid in two with the door as its only opening; the start and the key lie on
one side, the goal on the other, so every solution fetches the key and passes the door. A route
start -> waypoint -> key -> door -> waypoint -> goal (random waypoints, each leg a random monotone
lattice path) is kept free, and `num_walls` extra walls and `num_holes` holes go on random cells off
it: every layout is solvable by construction. Without `key_door` there is no barrier, key or door
(route start -> waypoint -> goal). The shortest solution length comes from a BFS under jit (a
min-plus relaxation of a distance field, `size**2` rounds of `lax.fori_loop`; without the key, the
field continues through the key cell with the distances of the unlocked grid). 32 candidate
layouts are drawn at once and the first whose obstacles all fit off the route and whose shortest
solution is in the split's length range is kept, else candidate 0 (solvable all the same, but
maybe out of range or with fewer obstacles: at the default parameters this happened to none of
65,536 tasks per split).

Splits: `train` and `test` (one distribution; the split is folded into the key, so one key gives
different tasks in each split) place `num_walls`/`num_holes` and keep the shortest solution at
most `max_length` moves; `ood` places `ood_num_walls`/`ood_num_holes` (more, by default) and needs
at least `ood_min_length` (default `max_length + 1`) moves: denser grids and longer routes than
any train task. The grid shape is the same in every split, so one environment runs them all.

Oracle: steps down the distance field of the current state (goal distances if the key is held,
else the field through the key), first of the best directions in (up, down, left, right) order:
a shortest solution from any reachable state.

State: `pos` ([2] row, column), `has_key`, `door_open` (the door was entered). The canonical state
is the layout, `pos`, `has_key` and `door_open` (not the step count): the same cell with the same
key status is the same state in every rollout of a task, which step-level credit assignment uses.

Milestones: `key` (holding the key), `door` (went through the door), `goal` (on the goal). `goal`
holds at reset when a (hand-made) task starts the agent on the goal; it is then marked reached at
reset (`milestones_at_reset`) and never fires. (The agent never starts holding the key, even on the
key's cell: it picks the key up by entering the cell.)

Observation: `grid` ([size, size] int32 cell codes as currently seen: the key removed and the door
shown open once the key is held), `pos`, `has_key`, `event` (what the last action did, `EV_*`) and
`error`. `task_difficulty(task)` is the shortest solution length (-1 if unsolvable).

Text: compact style writes the event, the key status and one word per cell with `/` between rows,
`moved , key no , grid : # . A . G / . . . . . / ...`; tool_call style writes sentences and one
line of symbols per row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from longhorizon.envs.base import SPLITS, Environment, Transition
from longhorizon.envs.types import Action, Arg, ErrorCode, Tool

__all__ = ["GridWorld", "FLOOR", "WALL", "HOLE", "KEY", "DOOR", "GOAL", "OPEN_DOOR", "SYMBOLS",
           "DIRECTIONS", "MOVES"]

# Cell codes of a task's grid; OPEN_DOOR appears only in observations (a door once the key is held).
FLOOR, WALL, HOLE, KEY, DOOR, GOAL, OPEN_DOOR = range(7)
SYMBOLS = (".", "#", "O", "k", "D", "G", "d")
AGENT = "A"
ROW_SEPARATOR = "/"
DIRECTIONS = ("up", "down", "left", "right")
MOVES = ((-1, 0), (1, 0), (0, -1), (0, 1))  # (row, column) step of each direction

# Events: what the last action did (observation["event"]).
(EV_START, EV_MOVED, EV_KEY, EV_DOOR, EV_HOLE, EV_GOAL, EV_EDGE, EV_WALL, EV_LOCKED,
 EV_BAD_DIRECTION, EV_ERROR) = range(11)
_EVENT_WORDS = ("start", "moved", "picked up the key", "went through the door", "fell into a hole",
                "reached the goal", "blocked : edge of the grid", "blocked : wall",
                "blocked : the door is locked", "blocked : unknown direction", "error")
_EVENT_SENTENCES = ("You are at the start.", "You moved.", "You picked up the key.",
                    "You went through the door.", "You fell into a hole. The episode is over.",
                    "You reached the goal!", "Blocked: that is the edge of the grid.",
                    "Blocked: a wall is in the way.",
                    "Blocked: the door is locked; pick up the key first.",
                    "Blocked: unknown direction.", "Error.")

_CANDIDATES = 32  # layouts drawn per task; the first acceptable one is kept
_NO_LIMIT = 1 << 20


class GridWorld(Environment):
  """Args:
    size: side of the square grid (>= 3 with `key_door`, else >= 2).
    num_walls: extra walls of train/test tasks (besides the barrier of the door).
    num_holes: holes of train/test tasks.
    key_door: whether tasks have a key and a locked door on every route to the goal.
    max_length: longest shortest solution of train/test tasks (default `2 * size - 1` with
      `key_door`, else `size - 2`: about the median length of unconstrained layouts).
    min_length: shortest shortest solution of train/test tasks (default 0). With
      `min_length == max_length` every task needs exactly that many moves (horizon studies).
    ood_num_walls: extra walls of `ood` tasks (default `num_walls + 2`).
    ood_num_holes: holes of `ood` tasks (default `num_holes + 1`).
    ood_min_length: shortest solution of `ood` tasks is at least this (default `max_length + 1`).
    candidates: layouts drawn per task; the first one meeting the length bounds is kept (if none
      does, the first layout, solvable all the same). Narrow bounds need more candidates.
    **reward: `RewardSpec` fields (success, milestone, cost, invalid, violation; envs/rewards.py).
  """

  name = "gridworld"
  version = "1"
  milestone_names = ("key", "door", "goal")

  @classmethod
  def horizon_settings(cls, horizon: int) -> dict:
    """Tasks whose shortest solutions are exactly N moves, on the smallest square where such
    routes are common; a turn is the move, an event phrase and the whole grid."""
    size = horizon // 2 + 2
    return {"params": {"size": size, "key_door": False, "num_walls": 2, "num_holes": 1,
                       "max_length": horizon, "min_length": horizon, "candidates": 128},
            "actions": horizon, "turn_tokens": 12 + size * (size + 1)}

  def __init__(self, size: int = 5, num_walls: int = 2, num_holes: int = 2, key_door: bool = True,
               max_length: int | None = None, ood_num_walls: int | None = None,
               ood_num_holes: int | None = None, ood_min_length: int | None = None,
               min_length: int = 0, candidates: int = _CANDIDATES, **reward):
    super().__init__(**reward)
    self.size = int(size)
    self.key_door = bool(key_door)
    least = 3 if self.key_door else 2
    if self.size < least:
      raise ValueError(f"gridworld: size must be >= {least} (key_door={self.key_door}), "
                       f"got {size}.")
    self.num_walls, self.num_holes = int(num_walls), int(num_holes)
    self.ood_num_walls = int(ood_num_walls if ood_num_walls is not None else self.num_walls + 2)
    self.ood_num_holes = int(ood_num_holes if ood_num_holes is not None else self.num_holes + 1)
    if max_length is None:
      max_length = 2 * self.size - 1 if self.key_door else self.size - 2
    self.max_length = int(max_length)
    self.min_length = int(min_length)
    if not 0 <= self.min_length <= self.max_length:
      raise ValueError(f"gridworld: min_length must be in [0, max_length={self.max_length}], "
                       f"got {min_length}.")
    self.candidates = int(candidates)
    if self.candidates < 1:
      raise ValueError(f"gridworld: candidates must be >= 1, got {candidates}.")
    self.ood_min_length = int(ood_min_length if ood_min_length is not None else max_length + 1)
    # Cells left for extra walls and holes: all but the barrier, the start, the key and the goal.
    free = self.size * self.size - (self.size + 3 if self.key_door else 2)
    for split, walls, holes in (("train", self.num_walls, self.num_holes),
                                ("ood", self.ood_num_walls, self.ood_num_holes)):
      if walls < 0 or holes < 0 or walls + holes > free:
        raise ValueError(f"gridworld: {split} tasks ask for {walls} walls and {holes} holes, but a "
                         f"{self.size}x{self.size} grid has {free} free cells; use fewer (or a "
                         f"larger size), each >= 0.")

  @property
  def tools(self):
    direction = Arg("direction", "enum", choices=DIRECTIONS, description="where to step")
    return (Tool("move", "Step one cell up, down, left or right.", (direction,)),)

  # ------------------------------------------------------------------------------- tasks
  def generate_task(self, key, split: str = "train"):
    if split not in SPLITS:
      raise ValueError(f"gridworld: split must be one of {SPLITS}, got {split!r}.")
    key = jax.random.fold_in(key, SPLITS.index(split))  # one key gives unrelated tasks per split
    ood = split == "ood"
    walls = self.ood_num_walls if ood else self.num_walls
    holes = self.ood_num_holes if ood else self.num_holes
    low, high = (self.ood_min_length, _NO_LIMIT) if ood else (self.min_length, self.max_length)
    grids, starts, placed = jax.vmap(lambda k: self._candidate(k, walls, holes))(
        jax.random.split(key, self.candidates))
    lengths = jax.vmap(_shortest_length)(grids, starts)
    wanted = placed & (lengths >= low) & (lengths <= high)
    pick = jnp.argmax(wanted)  # the first wanted one, else candidate 0 (solvable all the same)
    return {"grid": grids[pick], "start": starts[pick]}

  def _candidate(self, key, num_walls: int, num_holes: int):
    """One random layout: `(grid, start, all obstacles placed)`. A route through random waypoints
    (start, waypoint, key, door, waypoint, goal; monotone legs) is kept free, so it is solvable."""
    s, n = self.size, self.size * self.size
    rows, cols = np.divmod(np.arange(n), s)
    index = jnp.arange(n)
    slots = 2 * (s - 1)  # moves of the longest monotone leg
    # One draw for everything (each random call costs compile time): 4 scalars, 6 scores per cell
    # and the move orders of 5 route legs.
    u = jax.random.uniform(key, (4 + 6 * n + 5 * slots,))
    scores = u[4:4 + 6 * n].reshape(6, n)
    leg_orders = u[4 + 6 * n:].reshape(5, slots)
    if self.key_door:
      vertical = u[0] < 0.5
      line = 1 + jnp.minimum((u[1] * (s - 2)).astype(jnp.int32), s - 3)  # never on the border
      across = jnp.where(vertical, cols, rows)
      along = jnp.where(vertical, rows, cols)
      barrier = across == line
      door = barrier & (along == jnp.minimum((u[2] * s).astype(jnp.int32), s - 1))
      flip = u[3] < 0.5
      side_start = jnp.where(flip, across > line, across < line)
      side_goal = jnp.where(flip, across < line, across > line)
    else:
      barrier = door = jnp.zeros((n,), bool)
      side_start = side_goal = jnp.ones((n,), bool)
    start = jnp.argmax(jnp.where(side_start, scores[0], -1.0))
    key_cell = jnp.argmax(jnp.where(side_start & (index != start), scores[1], -1.0))
    taken = (index == start) | ((index == key_cell) & self.key_door)
    goal = jnp.argmax(jnp.where(side_goal & ~taken, scores[2], -1.0))
    waypoints = (jnp.argmax(jnp.where(side_start, scores[3], -1.0)),
                 jnp.argmax(jnp.where(side_goal, scores[4], -1.0)))
    if self.key_door:
      door_cell = jnp.argmax(door)
      # The door's neighbours on the start side and on the goal side.
      step = jnp.where(vertical, 1, s) * jnp.where(flip, 1, -1)
      legs = jnp.stack([jnp.stack([start, waypoints[0], key_cell, door_cell - step, waypoints[1]]),
                        jnp.stack([waypoints[0], key_cell, door_cell + step, waypoints[1], goal])])
    else:
      legs = jnp.stack([jnp.stack([start, waypoints[0]]), jnp.stack([waypoints[0], goal])])
    route = jax.vmap(lambda order, a, b: _monotone_path(order, a, b, s))(
        leg_orders[:legs.shape[1]], legs[0], legs[1]).any(axis=0)
    grid = jnp.where(barrier, WALL, FLOOR)
    grid = jnp.where(door, DOOR, grid)
    grid = jnp.where((index == key_cell) & self.key_door, KEY, grid)
    grid = jnp.where(index == goal, GOAL, grid).astype(jnp.int32)
    reserved = barrier | route | taken | (index == goal)
    # Obstacles on the free cells of lowest score: walls first, then holes.
    rank = _rank(jnp.where(reserved, 2.0, scores[5]))
    grid = jnp.where(reserved, grid, jnp.where(rank < num_walls, WALL,
                                               jnp.where(rank < num_walls + num_holes, HOLE, grid)))
    placed = (~reserved).sum() >= num_walls + num_holes
    start_rc = jnp.stack([start // s, start % s]).astype(jnp.int32)
    return grid.reshape(s, s), start_rc, placed

  def task_difficulty(self, task):
    return _shortest_length(task["grid"], task["start"])

  # ------------------------------------------------------------------------------- dynamics
  def init(self, task, key):
    del key
    inner = {"pos": jnp.asarray(task["start"], jnp.int32), "has_key": jnp.zeros((), bool),
             "door_open": jnp.zeros((), bool)}
    return inner, self._observation(task, inner, EV_START)

  def _observation(self, task, inner, event, error=ErrorCode.NONE):
    grid, has_key = task["grid"], inner["has_key"]
    view = jnp.where(has_key & (grid == KEY), FLOOR, grid)
    view = jnp.where(has_key & (grid == DOOR), OPEN_DOOR, view)
    return {"grid": view.astype(jnp.int32), "pos": inner["pos"], "has_key": has_key,
            "event": jnp.asarray(event, jnp.int32), "error": jnp.asarray(error, jnp.int32)}

  def transition(self, task, inner, action: Action, key):
    del key
    grid, pos, has_key = task["grid"], inner["pos"], inner["has_key"]
    direction = action.args[0]
    known = (direction >= 0) & (direction < len(DIRECTIONS))
    target = pos + jnp.asarray(MOVES, jnp.int32)[jnp.clip(direction, 0, len(DIRECTIONS) - 1)]
    inside = jnp.all((target >= 0) & (target < self.size))
    row, col = jnp.clip(target, 0, self.size - 1)
    cell = grid[row, col]
    wall = inside & (cell == WALL)
    locked = inside & (cell == DOOR) & ~has_key
    rejected = ~known | ~inside | wall | locked
    new_pos = jnp.where(rejected, pos, target)
    here = grid[new_pos[0], new_pos[1]]
    moved = ~rejected
    picked = moved & (here == KEY) & ~has_key
    entered_door = moved & (here == DOOR)
    new_inner = {"pos": new_pos, "has_key": has_key | picked,
                 "door_open": inner["door_open"] | entered_door}
    fell, arrived = moved & (here == HOLE), moved & (here == GOAL)
    event = jnp.select(
        [~known, ~inside, wall, locked, fell, arrived, picked, entered_door],
        [EV_BAD_DIRECTION, EV_EDGE, EV_WALL, EV_LOCKED, EV_HOLE, EV_GOAL, EV_KEY, EV_DOOR],
        EV_MOVED)
    error = jnp.where(rejected, ErrorCode.INVALID_ARGUMENT, ErrorCode.NONE)
    observation = self._observation(task, new_inner, event, error)
    return Transition(inner=new_inner, observation=observation, terminated=fell | arrived,
                      milestones=self._milestones(task, new_inner), rejected=rejected)

  def milestones_at_reset(self, task, inner):
    return self._milestones(task, inner)

  def _milestones(self, task, inner):
    on_goal = task["grid"][inner["pos"][0], inner["pos"][1]] == GOAL
    return jnp.stack([inner["has_key"], inner["door_open"], on_goal])

  def error_observation(self, task, inner, error):
    return self._observation(task, inner, EV_ERROR, error)

  def canonical_state(self, task, inner):
    return (task["grid"], inner["pos"], inner["has_key"], inner["door_open"])

  def verify(self, task, inner):
    return task["grid"][inner["pos"][0], inner["pos"][1]] == GOAL

  def oracle(self, state):
    field = _distance_to_go(state.task["grid"], state.inner["has_key"])
    padded = jnp.pad(field, 1, constant_values=_NO_LIMIT)
    r, c = state.inner["pos"][0] + 1, state.inner["pos"][1] + 1
    ahead = jnp.stack([padded[r + dr, c + dc] for dr, dc in MOVES])
    direction = jnp.argmin(ahead).astype(jnp.int32)  # first of the best moves
    return Action(tool=jnp.zeros((), jnp.int32), args=direction[None],
                  error=jnp.zeros((), jnp.int32))

  # ------------------------------------------------------------------------------- text
  def system_text(self, style):
    if style == "compact":
      rules = ("you are A on a grid ; move up down left or right to reach the goal G ; # is a wall "
               "; O is a hole that ends the episode ; . is floor")
      if self.key_door:
        rules += " ; D is a door , locked until you pick up the key k , then shown as d"
      return rules + " ; rows are separated by /"
    rules = ("You are the agent A on a grid. Move one cell at a time (up, down, left or right) to "
             "reach the goal G. '#' is a wall, 'O' is a hole that ends the episode in failure, "
             "'.' is floor.")
    if self.key_door:
      rules += (" 'D' is a locked door: step on the key 'k' to pick it up, then the door opens "
                "(shown 'd').")
    return rules + " One move per turn."

  def task_text(self, task, style):
    rows = _render(task["grid"], task["start"], style)
    if style == "compact":
      return f"reach the goal G , grid : {rows}"
    return f"Reach the goal G. The grid:\n{rows}"

  def observation_text(self, observation, style):
    event = int(observation["event"])
    has_key = bool(observation["has_key"])
    rows = _render(observation["grid"], observation["pos"], style)
    if style == "compact":
      return f"{_EVENT_WORDS[event]} , key {'yes' if has_key else 'no'} , grid : {rows}"
    holding = "You have the key." if has_key else "You do not have the key."
    return f"{_EVENT_SENTENCES[event]} {holding}\n{rows}"

  def vocabulary(self):
    words = set(self.system_text("compact").split()) | set(self.task_text(
        {"grid": np.zeros((1, 1), np.int32), "start": np.zeros((2,), np.int32)}, "compact").split())
    for phrase in _EVENT_WORDS:
      words |= set(phrase.split())
    words |= {"key", "yes", "no", ",", ":", "grid", AGENT, ROW_SEPARATOR, *SYMBOLS}
    return sorted(words)


def _render(grid, pos, style: str) -> str:
  """The grid as symbols with the agent `A` drawn over its cell: one word per cell and `/` between
  rows (compact), or one line of symbols per row (tool_call)."""
  rows = [[SYMBOLS[v] for v in line] for line in np.asarray(grid).tolist()]
  rows[int(pos[0])][int(pos[1])] = AGENT
  if style == "compact":
    return f" {ROW_SEPARATOR} ".join(" ".join(cells) for cells in rows)
  return "\n".join("".join(cells) for cells in rows)


def _monotone_path(u, a, b, size: int):
  """[size * size] bool: the cells of a random shortest (monotone) lattice path from cell `a` to
  cell `b` (flat indices), its move order drawn from `u` ([2 * (size - 1)] uniforms); it stays
  inside their bounding box."""
  ar, ac, br, bc = a // size, a % size, b // size, b % size
  vertical, horizontal = jnp.abs(br - ar), jnp.abs(bc - ac)
  slots = 2 * (size - 1)
  t = jnp.arange(slots)
  # Vertical moves at the `vertical` lowest-ranked of the first `vertical + horizontal` slots.
  u = jnp.where(t < vertical + horizontal, u, 2.0)
  rank = _rank(u)
  is_vertical = rank < vertical
  is_horizontal = ~is_vertical & (t < vertical + horizontal)
  r = ar + jnp.sign(br - ar) * jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(is_vertical)])
  c = ac + jnp.sign(bc - ac) * jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(is_horizontal)])
  return (jnp.arange(size * size)[:, None] == (r * size + c)[None, :]).any(axis=1)


def _rank(u):
  """[N] int32 position of each entry of `u` ([N]) in ascending order."""
  order = jnp.argsort(u)
  return jnp.zeros(u.shape, jnp.int32).at[order].set(jnp.arange(u.shape[0], dtype=jnp.int32))


def _relax(passable, field):
  """Distance field: `field[c] = min(field[c], 1 + min over the 4 neighbours)` on passable cells,
  `size**2` rounds (enough for every shortest path). `field` starts at the targets' values
  (`_NO_LIMIT` elsewhere); unreachable cells keep `_NO_LIMIT`."""
  def body(_, d):
    p = jnp.pad(d, 1, constant_values=_NO_LIMIT)
    near = jnp.minimum(jnp.minimum(p[:-2, 1:-1], p[2:, 1:-1]),
                       jnp.minimum(p[1:-1, :-2], p[1:-1, 2:]))
    return jnp.where(passable, jnp.minimum(d, near + 1), d)
  return jax.lax.fori_loop(0, field.size, body, field)


def _distance_to_go(grid, has_key):
  """[S, S] int32 moves from each cell to the goal (`_NO_LIMIT`: no way), for an agent holding the
  key (`has_key`) or not; without the key, entering the key cell continues with the unlocked
  distances."""
  grid = jnp.asarray(grid)
  open_ = (grid != WALL) & (grid != HOLE)
  unlocked = _relax(open_, jnp.where(grid == GOAL, 0, _NO_LIMIT).astype(jnp.int32))
  locked_start = jnp.where(grid == GOAL, 0, jnp.where(grid == KEY, unlocked, _NO_LIMIT))
  locked = _relax(open_ & (grid != DOOR), locked_start.astype(jnp.int32))
  return jnp.where(has_key, unlocked, locked)


def _shortest_length(grid, start):
  """[] int32 moves of the shortest solution from `start` without the key (-1: unsolvable)."""
  d = _distance_to_go(grid, False)[start[0], start[1]]
  return jnp.where(d >= _NO_LIMIT, -1, d).astype(jnp.int32)
