"""Plain-Python `gridworld` (one episode per object): the speed baseline of
`experiments/benchmarks/envs.py` and an independent implementation the tests compare against."""

# Cell codes, directions and events as in `longhorizon.envs.gridworld`.
FLOOR, WALL, HOLE, KEY, DOOR, GOAL, OPEN_DOOR = range(7)
MOVES = ((-1, 0), (1, 0), (0, -1), (0, 1))  # up, down, left, right
(EV_START, EV_MOVED, EV_KEY, EV_DOOR, EV_HOLE, EV_GOAL, EV_EDGE, EV_WALL, EV_LOCKED,
 EV_BAD_DIRECTION, EV_ERROR) = range(11)
INVALID_ARGUMENT, UNKNOWN_TOOL = 6, 3


class PlainGridWorld:
  """Same dynamics, observations and rewards as `longhorizon.envs.gridworld.GridWorld` (layout
  parameters only matter to task generation, which this class does not do)."""

  def __init__(self, size=5, num_walls=2, num_holes=2, key_door=True, max_length=None,
               ood_num_walls=None, ood_num_holes=None, ood_min_length=None, success=1.0,
               milestone=0.0, invalid=0.0, violation=1.0):
    del num_walls, num_holes, key_door, max_length, ood_num_walls, ood_num_holes, ood_min_length
    del violation  # gridworld has no safety gate
    self.size = size
    self.success_reward, self.milestone_reward = success, milestone
    self.invalid_penalty = invalid

  def reset(self, task):
    self.grid = [[int(v) for v in line] for line in task["grid"]]
    self.row, self.col = int(task["start"][0]), int(task["start"][1])
    self.has_key = self.door_open = False
    self.reached = [False, False, False]
    self.done = False
    self.view = [line[:] for line in self.grid]
    return self._observation(EV_START, 0)

  def _observation(self, event, error):
    return {"grid": self.view, "pos": [self.row, self.col], "has_key": self.has_key,
            "event": event, "error": error}

  def _pick_up_key(self):
    self.has_key = True
    self.view = [[FLOOR if v == KEY else OPEN_DOOR if v == DOOR else v for v in line]
                 for line in self.grid]

  def step(self, tool, args, error=0):
    if self.done:
      return dict(self.last, reward=0.0, milestones=[False, False, False])
    if error or tool != 0:
      out = {"reward": -self.invalid_penalty, "terminated": False, "success": False,
             "violation": False, "invalid": True, "milestones": [False, False, False],
             "observation": self._observation(EV_ERROR, error or UNKNOWN_TOOL)}
      self.last = out
      return out
    direction = args[0]
    event = EV_MOVED
    if not 0 <= direction < 4:
      event = EV_BAD_DIRECTION
    else:
      row, col = self.row + MOVES[direction][0], self.col + MOVES[direction][1]
      if not (0 <= row < self.size and 0 <= col < self.size):
        event = EV_EDGE
      elif self.grid[row][col] == WALL:
        event = EV_WALL
      elif self.grid[row][col] == DOOR and not self.has_key:
        event = EV_LOCKED
    rejected = event != EV_MOVED
    terminated = success = False
    if not rejected:
      self.row, self.col = row, col
      cell = self.grid[row][col]
      if cell == HOLE:
        event, terminated = EV_HOLE, True
      elif cell == GOAL:
        event, terminated, success = EV_GOAL, True, True
      elif cell == KEY and not self.has_key:
        event = EV_KEY
        self._pick_up_key()
      elif cell == DOOR:
        event = EV_DOOR
        self.door_open = True
    holds = [self.has_key, self.door_open, success]
    new = [h and not r for h, r in zip(holds, self.reached)]
    self.reached = [h or r for h, r in zip(holds, self.reached)]
    self.done = terminated
    reward = (self.success_reward * success + self.milestone_reward * sum(new)
              - self.invalid_penalty * rejected)
    out = {"reward": reward, "terminated": terminated, "success": success, "violation": False,
           "invalid": rejected, "milestones": new,
           "observation": self._observation(event, INVALID_ARGUMENT if rejected else 0)}
    self.last = out
    return out
