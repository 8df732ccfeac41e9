"""A learnability curriculum: which difficulty bucket the next training tasks come from.

    buckets = bucket_indices(difficulties, num_buckets=4)   # [M] task_difficulty of the train split
    curriculum = Curriculum(4, alpha=1.0, floor=0.05, ema=0.1)
    if "curriculum" in meta:                                # resuming
      curriculum.load_state_dict(meta["curriculum"])
    for update in range(start, num_updates):
      rng = np.random.default_rng([seed, update])           # deterministic, and exact on resume
      tasks, task_buckets, curriculum.cursor = draw_tasks(curriculum, buckets, rng, num_tasks,
                                                          curriculum.cursor)
      ...                                                   # roll out G episodes per task
      curriculum.update(np.repeat(task_buckets, G), success)  # [num_tasks * G], task-major
      meta = dict(meta, curriculum=curriculum.state_dict())

Group-relative RL (GRPO/RLOO) learns nothing from a group whose episodes all succeed or all fail,
and a bucket of tasks solved with probability p gives a mixed group with probability
1 - p^G - (1 - p)^G, largest at p = 1/2. The sampler therefore weights bucket b by its
learnability `p_b (1 - p_b)` (the variance of its success), from running estimates p_b, and mixes
in a uniform floor so buckets that are (currently) too easy or too hard are still visited and their
estimates stay fresh. This is learnability sampling as in Rutherford et al. 2024, "No Regrets:
Investigating and Improving Regret Approximations for Curriculum Discovery" (the level score
p (1 - p)), and Foster & Foerster 2025, "Learning to Reason at the Frontier of Learnability"; it
is prioritized level replay (Jiang et al. 2021) with that score over buckets rather than levels.

The sampler holds no random state: every draw takes a NumPy Generator (or an int seed), so a run
that derives it from `(seed, update)` draws the same tasks whether or not it was resumed.
"""

from __future__ import annotations

import logging
import numbers
import operator
from typing import Any, Mapping, Sequence

import numpy as np

__all__ = ["Curriculum", "HorizonCurriculum", "bucket_indices", "draw_tasks"]

logger = logging.getLogger(__name__)

# Keys of `Curriculum.state_dict()`: the hyperparameters, then the running state.
_HYPERPARAMETERS = ("num_buckets", "alpha", "floor", "ema", "prior", "pseudo_count")
_STATE = ("successes", "counts", "cursor")


def _as_rng(rng) -> np.random.Generator:
  """`rng` itself, or `np.random.default_rng(rng)` for an int seed."""
  if isinstance(rng, np.random.Generator):
    return rng
  if isinstance(rng, numbers.Integral) and not isinstance(rng, bool):
    if rng < 0:
      raise ValueError(f"rng = {rng} is a negative seed; pass a seed >= 0 or a "
                       f"np.random.Generator.")
    return np.random.default_rng(int(rng))
  raise TypeError(f"rng = {rng!r} ({type(rng).__name__}) is neither a np.random.Generator nor an "
                  f"int seed; pass e.g. np.random.default_rng([seed, update]).")


def _count(name: str, n) -> int:
  """`n` as a Python int >= 0, or a ValueError naming `name`."""
  try:
    n = operator.index(n)
  except TypeError:
    raise TypeError(f"{name} = {n!r} ({type(n).__name__}) is not an integer.") from None
  if n < 0:
    raise ValueError(f"{name} = {n} is negative; pass a count >= 0.")
  return n


def _categorical(rng: np.random.Generator, probs: np.ndarray, n: int) -> np.ndarray:
  """[n] int64 draws from `probs` ([B], >= 0, positive sum) by inverting the CDF of `rng.random`.

  A bucket of probability 0 is never drawn (its CDF step is empty)."""
  cdf = np.cumsum(probs)
  cdf /= cdf[-1]  # x / x == 1.0 exactly, so a uniform draw in [0, 1) always lands in a bucket
  return np.searchsorted(cdf, rng.random(n), side="right").astype(np.int64)


class Curriculum:
  """Samples difficulty buckets with probability rising with their learnability p_b (1 - p_b).

  Bucket probabilities, with B = `num_buckets`, p_b the running success estimate of bucket b,
  a = `alpha` and f = `floor`:

      w_b    = [p_b (1 - p_b)]^a
      prob_b = (1 - B f) w_b / sum_c w_c + f

  so every bucket keeps probability >= f, and f = 1/B is uniform sampling. When every w_b is 0
  (each p_b is 0 or 1) the first term falls back to uniform, 1/B per bucket; a = 0 is uniform.

  Running estimates are discounted Beta-Bernoulli means. Bucket b starts with `pseudo_count`
  pseudo-episodes at success rate `prior` (S_b = prior * c, N_b = c, so an unseen bucket has
  p_b = prior, by default 1/2: the most learnable, hence explored). An `update` in which bucket b
  has n_b > 0 episodes with total success k_b forgets a fraction `ema` of its old evidence:

      S_b <- (1 - ema) S_b + k_b,    N_b <- (1 - ema) N_b + n_b,    p_b = S_b / N_b

  With equal n_b per update this is the exponential moving average of the per-update success rate
  with rate `ema` (after a warm-up in which the prior fades as (1 - ema)^t); ema = 0 keeps every
  episode (the plain Beta posterior mean), ema = 1 keeps only the last update's episodes. Buckets
  absent from an update keep their estimate: stale evidence is replaced, not decayed toward the
  prior.

  Args:
    num_buckets: B >= 1 difficulty buckets (see `bucket_indices`).
    alpha: a >= 0, the sharpness of the preference for learnable buckets.
    floor: f in [0, 1/B], the probability every bucket keeps. None: 0.1 / B (a tenth of the mass
      spread uniformly).
    ema: forgetting rate in [0, 1] per `update` (see above).
    prior: initial success estimate p_b in [0, 1].
    pseudo_count: c > 0, the weight of `prior` in pseudo-episodes.

  Attributes:
    successes: [B] float64, the discounted success counts S_b.
    counts: [B] float64, the discounted episode counts N_b.
    cursor: [B] int64, how many tasks `draw_tasks` has taken from each bucket (its round-robin
      position); kept here so that `state_dict` checkpoints it.
  """

  def __init__(self, num_buckets: int, *, alpha: float = 1.0, floor: float | None = None,
               ema: float = 0.1, prior: float = 0.5, pseudo_count: float = 1.0):
    num_buckets = _count("num_buckets", num_buckets)
    if num_buckets < 1:
      raise ValueError(f"num_buckets = {num_buckets}; a curriculum needs at least 1 bucket.")
    if floor is None:
      floor = 0.1 / num_buckets
    self.num_buckets = num_buckets
    self.alpha = self._real("alpha", alpha, 0.0, np.inf, "alpha >= 0 (0 samples uniformly)")
    self.floor = self._real("floor", floor, 0.0, 1.0 / num_buckets,
                            f"0 <= floor <= 1/num_buckets = {1.0 / num_buckets:.6g} (1/B keeps "
                            f"every bucket at 1/B, i.e. uniform sampling)")
    self.ema = self._real("ema", ema, 0.0, 1.0, "0 <= ema <= 1")
    self.prior = self._real("prior", prior, 0.0, 1.0, "a success rate 0 <= prior <= 1")
    self.pseudo_count = self._real("pseudo_count", pseudo_count, 0.0, np.inf, "pseudo_count > 0")
    if self.pseudo_count == 0:
      raise ValueError("pseudo_count = 0 leaves unseen buckets without an estimate; pass "
                       "pseudo_count > 0 (e.g. 1).")
    self.successes = np.full(num_buckets, self.prior * self.pseudo_count, np.float64)
    self.counts = np.full(num_buckets, self.pseudo_count, np.float64)
    self.cursor = np.zeros(num_buckets, np.int64)

  @staticmethod
  def _real(name: str, value, low: float, high: float, expected: str) -> float:
    """`value` as a float in [low, high], or a ValueError naming `name` and the expected range."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
      raise TypeError(f"{name} = {value!r} ({type(value).__name__}) is not a real number; expected "
                      f"{expected}.")
    value = float(value)
    if not (low <= value <= high):  # also rejects NaN
      raise ValueError(f"{name} = {value!r} is out of range; expected {expected}.")
    return value

  def __repr__(self):
    return (f"Curriculum(num_buckets={self.num_buckets}, alpha={self.alpha}, floor={self.floor}, "
            f"ema={self.ema}, prior={self.prior}, pseudo_count={self.pseudo_count})")

  # ---------------------------------------------------------------------------------- sampling
  def success_estimates(self) -> np.ndarray:
    """[B] float64: the running success estimates p_b = S_b / N_b."""
    return self.successes / self.counts

  def probabilities(self) -> np.ndarray:
    """[B] float64 bucket probabilities (class docstring), >= `floor`, summing to 1."""
    b = self.num_buckets
    learnability = self.success_estimates() * (1.0 - self.success_estimates())
    # p (1 - p) may round to slightly below 0 for p = 1 - eps; clip before the log.
    learnability = np.clip(learnability, 0.0, None)
    if self.alpha == 0 or not np.any(learnability > 0):
      share = np.full(b, 1.0 / b)
    else:
      # w / sum(w) in log space: a large alpha would underflow w = l^alpha to 0 for every bucket.
      with np.errstate(divide="ignore"):
        logits = self.alpha * np.log(learnability)
      share = np.exp(logits - logits.max())
      share /= share.sum()
    return (1.0 - b * self.floor) * share + self.floor

  def sample(self, rng: np.random.Generator | int, n: int) -> np.ndarray:
    """[n] int64 buckets drawn i.i.d. from `probabilities()`; the same `rng` state (or seed) gives
    the same buckets."""
    return _categorical(_as_rng(rng), self.probabilities(), _count("n", n))

  # ---------------------------------------------------------------------------------- learning
  def update(self, buckets, successes):
    """Adds a batch of episodes to the running estimates (class docstring).

    Args:
      buckets: [N] int, the bucket of each episode's task, in [0, B).
      successes: [N] bool (or 0/1, or a success rate in [0, 1]) per episode.
    """
    buckets = np.asarray(buckets)
    successes = np.asarray(successes)
    if buckets.ndim != 1 or successes.shape != buckets.shape:
      raise ValueError(f"buckets {buckets.shape} and successes {successes.shape} must be [N] and "
                       f"[N]; pass one bucket and one success per episode (flatten groups).")
    if buckets.size and not (np.issubdtype(buckets.dtype, np.integer) and buckets.dtype != bool):
      raise ValueError(f"buckets has dtype {buckets.dtype}; pass integer bucket ids.")
    if buckets.size and (buckets.min() < 0 or buckets.max() >= self.num_buckets):
      raise ValueError(f"buckets holds {int(buckets.min())}..{int(buckets.max())}, outside "
                       f"[0, num_buckets = {self.num_buckets}).")
    if not (successes.dtype == bool or np.issubdtype(successes.dtype, np.number)):
      raise ValueError(f"successes has dtype {successes.dtype}; pass bools or 0/1.")
    successes = successes.astype(np.float64)
    if successes.size and not (np.all(successes >= 0) and np.all(successes <= 1)):
      raise ValueError("successes holds values outside [0, 1] (or NaN); pass bools or 0/1.")
    n = np.bincount(buckets, minlength=self.num_buckets).astype(np.float64)
    k = np.bincount(buckets, weights=successes, minlength=self.num_buckets)
    keep = np.where(n > 0, 1.0 - self.ema, 1.0)
    self.successes = keep * self.successes + k
    self.counts = keep * self.counts + n

  def metrics(self, prefix: str = "curriculum") -> dict[str, float]:
    """`{prefix}/p_<b>` (success estimate) and `{prefix}/prob_<b>` (probability) per bucket, for a
    MetricsWriter."""
    out = {}
    for b, (p, prob) in enumerate(zip(self.success_estimates(), self.probabilities())):
      out[f"{prefix}/p_{b}"] = float(p)
      out[f"{prefix}/prob_{b}"] = float(prob)
    return out

  # ------------------------------------------------------------------------------- checkpoints
  def state_dict(self) -> dict[str, Any]:
    """Hyperparameters and running state in JSON types (ints, floats, lists), for a checkpoint's
    JSON meta. Floats survive `json.dumps`/`json.loads` exactly."""
    return {"num_buckets": self.num_buckets, "alpha": self.alpha, "floor": self.floor,
            "ema": self.ema, "prior": self.prior, "pseudo_count": self.pseudo_count,
            "successes": [float(x) for x in self.successes],
            "counts": [float(x) for x in self.counts],
            "cursor": [int(x) for x in self.cursor]}

  @staticmethod
  def _check_keys(d: Mapping[str, Any]):
    if not isinstance(d, Mapping):
      raise TypeError(f"a curriculum state dict is a dict, not {type(d).__name__}.")
    expected = set(_HYPERPARAMETERS + _STATE)
    missing, unexpected = sorted(expected - set(d)), sorted(set(d) - expected)
    if missing or unexpected:
      raise ValueError(f"curriculum state dict: missing keys {missing}, unexpected keys "
                       f"{unexpected}; pass what Curriculum.state_dict() returned.")

  def load_state_dict(self, d: Mapping[str, Any]):
    """Restores the running state (`successes`, `counts`, `cursor`) from `state_dict()`.

    The hyperparameters stay those of the constructor (the run's config), so a resumed run may
    change them; each one that differs from the saved value is logged as a warning. A different
    `num_buckets` raises: the saved estimates would describe other buckets.
    """
    self._check_keys(d)
    if d["num_buckets"] != self.num_buckets:
      raise ValueError(f"curriculum state dict has num_buckets = {d['num_buckets']!r}, this "
                       f"curriculum {self.num_buckets}; build it with the saved num_buckets, or "
                       f"start the curriculum afresh.")
    for name in _HYPERPARAMETERS[1:]:
      if d[name] != getattr(self, name):
        logger.warning("Curriculum: the checkpoint has %s = %r, the config %r; using %r.", name,
                       d[name], getattr(self, name), getattr(self, name))
    b = self.num_buckets
    state = {}
    for name in _STATE:
      value = d[name]
      if not isinstance(value, (list, tuple)) or len(value) != b:
        raise ValueError(f"curriculum state dict[{name!r}] = {value!r} is not a list of "
                         f"num_buckets = {b} numbers.")
      kind = numbers.Integral if name == "cursor" else numbers.Real
      if not all(isinstance(x, kind) and not isinstance(x, bool) for x in value):
        raise ValueError(f"curriculum state dict[{name!r}] = {value!r} holds values that are not "
                         f"{'integers' if name == 'cursor' else 'real numbers'}.")
      array = np.asarray(value, dtype=np.int64 if name == "cursor" else np.float64)
      if not np.all(np.isfinite(array)) or np.any(array < 0):
        raise ValueError(f"curriculum state dict[{name!r}] = {value!r} holds negative or "
                         f"non-finite values.")
      state[name] = array
    if np.any(state["counts"] <= 0) or np.any(state["successes"] > state["counts"]):
      raise ValueError(f"curriculum state dict has successes {d['successes']} and counts "
                       f"{d['counts']}; each count must be > 0 and >= its successes.")
    self.successes, self.counts, self.cursor = state["successes"], state["counts"], state["cursor"]

  @classmethod
  def from_state_dict(cls, d: Mapping[str, Any]) -> Curriculum:
    """A curriculum with the hyperparameters and running state of `state_dict()`."""
    cls._check_keys(d)
    curriculum = cls(d["num_buckets"], **{k: d[k] for k in _HYPERPARAMETERS[1:]})
    curriculum.load_state_dict(d)
    return curriculum


# --------------------------------------------------------------------------------- task buckets

def bucket_indices(difficulties, num_buckets: int) -> list[np.ndarray]:
  """The tasks of a split grouped by difficulty bucket.

  Integer difficulties all in [0, num_buckets) are the buckets themselves (bucket b = difficulty b,
  the same on every split). Otherwise the observed range [lo, hi] is cut into `num_buckets` equal
  bins, bucket = min(floor((d - lo) / (hi - lo) * B), B - 1) (all in bucket 0 when hi == lo); e.g.
  gridworld's -1 (unsolvable) lands in the easiest bin. Buckets may be empty; `draw_tasks` never
  draws from an empty bucket.

  Args:
    difficulties: [M] real, `env.task_difficulty` of each task of the split.
    num_buckets: B >= 1.

  Returns:
    B arrays of int64 task indices (ascending), together a partition of range(M).
  """
  num_buckets = _count("num_buckets", num_buckets)
  if num_buckets < 1:
    raise ValueError(f"num_buckets = {num_buckets}; pass at least 1.")
  d = np.asarray(difficulties)
  if d.ndim != 1:
    raise ValueError(f"difficulties has shape {d.shape}; pass [M], one per task.")
  if d.size and not (np.issubdtype(d.dtype, np.number) and not np.iscomplexobj(d)):
    raise ValueError(f"difficulties has dtype {d.dtype}; pass integers (or reals).")
  d = d.astype(np.float64)
  if not np.all(np.isfinite(d)):
    raise ValueError("difficulties holds NaN or infinite values.")
  if d.size == 0:
    buckets = np.zeros(0, np.int64)
  elif np.all(d == np.round(d)) and d.min() >= 0 and d.max() < num_buckets:
    buckets = d.astype(np.int64)
  else:
    lo, hi = d.min(), d.max()
    scaled = (d - lo) / (hi - lo) * num_buckets if hi > lo else np.zeros_like(d)
    buckets = np.minimum(np.floor(scaled).astype(np.int64), num_buckets - 1)
  order = np.argsort(buckets, kind="stable")
  return np.split(order, np.cumsum(np.bincount(buckets, minlength=num_buckets))[:-1])


def draw_tasks(curriculum: Curriculum, bucket_indices: Sequence[np.ndarray],
               rng: np.random.Generator | int, n: int,
               cursor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """`n` task indices: buckets from `curriculum`, then tasks round-robin within each bucket.

  Buckets are drawn i.i.d. from `curriculum.probabilities()` restricted to non-empty buckets
  (renormalised; uniform over them if they all have probability 0, possible only with floor 0).
  The j-th draw of bucket b in this call takes task
  `bucket_indices[b][(cursor[b] + j) % len(bucket_indices[b])]`, so a bucket's tasks are all used
  once before any repeats (the split's tasks are i.i.d., so their order needs no shuffle). Pure:
  the cursor is returned, not changed in place; keep it in `curriculum.cursor` to checkpoint it:

      tasks, task_buckets, curriculum.cursor = draw_tasks(curriculum, buckets, rng, n,
                                                          curriculum.cursor)

  Args:
    curriculum: the bucket sampler.
    bucket_indices: B arrays of task indices, from `bucket_indices`.
    rng: np.random.Generator or int seed.
    n: how many tasks to draw.
    cursor: [B] int >= 0, tasks taken so far from each bucket.

  Returns:
    `(tasks, buckets, cursor)`: [n] int64 task indices in draw order, [n] int64 their buckets (for
    `curriculum.update`), and the advanced [B] int64 cursor.
  """
  b = curriculum.num_buckets
  n = _count("n", n)
  if isinstance(bucket_indices, np.ndarray) or len(bucket_indices) != b:
    raise ValueError(f"bucket_indices must be a list of num_buckets = {b} index arrays (from "
                     f"bucket_indices(difficulties, {b})).")
  members = [np.asarray(m) for m in bucket_indices]
  for i, m in enumerate(members):
    if m.ndim != 1 or (m.size and not np.issubdtype(m.dtype, np.integer)):
      raise ValueError(f"bucket_indices[{i}] has shape {m.shape} and dtype {m.dtype}; pass 1-D "
                       f"integer task indices.")
  cursor = np.asarray(cursor)
  if cursor.shape != (b,) or not np.issubdtype(cursor.dtype, np.integer) or np.any(cursor < 0):
    raise ValueError(f"cursor = {cursor!r} must be [num_buckets = {b}] integers >= 0 (start from "
                     f"curriculum.cursor, zeros for a new run).")
  sizes = np.array([m.size for m in members])
  if not np.any(sizes):
    raise ValueError("bucket_indices holds no tasks; the split is empty.")
  probs = np.where(sizes > 0, curriculum.probabilities(), 0.0)
  if not probs.sum() > 0:  # floor 0 and only empty buckets have weight: uniform over the others
    probs = (sizes > 0).astype(np.float64)
  buckets = _categorical(_as_rng(rng), probs, n)
  tasks = np.empty(n, np.int64)
  cursor = cursor.astype(np.int64)  # a copy
  for bucket in np.flatnonzero(np.bincount(buckets, minlength=b)):
    draws = np.flatnonzero(buckets == bucket)
    tasks[draws] = members[bucket][(cursor[bucket] + np.arange(draws.size)) % sizes[bucket]]
    cursor[bucket] += draws.size
  return tasks, buckets, cursor


class HorizonCurriculum:
  """Grows the episodes' step budget with the learner's success (ScalingInter-RL; Xi et al. 2025,
  "AgentGym-RL": short interaction horizons first, then longer ones).

  Training starts with `budgets[0]` steps per episode. After every update the running success
  `p <- (1 - ema) p + ema * success_rate` is compared with `grow_at`; once it is reached the next
  budget applies and `p` restarts at 0 (a longer budget makes the task harder to finish: its
  success has to be earned again). The last budget stays.

  Its state (stage, running success) is a dict for the checkpoint meta: a resumed run continues
  at the same stage.
  """

  def __init__(self, budgets, grow_at: float = 0.5, ema: float = 0.3):
    budgets = [int(b) for b in budgets]
    if not budgets or any(b < 1 for b in budgets) or budgets != sorted(set(budgets)):
      raise ValueError(f"step budgets must be increasing integers >= 1, got {budgets}.")
    if not 0.0 < grow_at <= 1.0 or not 0.0 < ema <= 1.0:
      raise ValueError(f"grow_at and ema must be in (0, 1], got {grow_at} and {ema}.")
    self.budgets, self.grow_at, self.ema = budgets, float(grow_at), float(ema)
    self.stage, self.success = 0, 0.0

  @property
  def budget(self) -> int:
    return self.budgets[self.stage]

  def update(self, success_rate: float) -> bool:
    """Folds in one update's training success; returns whether the budget grew."""
    self.success = (1 - self.ema) * self.success + self.ema * float(success_rate)
    if self.success >= self.grow_at and self.stage + 1 < len(self.budgets):
      self.stage, self.success = self.stage + 1, 0.0
      return True
    return False

  def metrics(self) -> dict:
    return {"horizon/step_budget": float(self.budget), "horizon/stage": float(self.stage),
            "horizon/running_success": self.success}

  def state_dict(self) -> dict:
    return {"budgets": list(self.budgets), "grow_at": self.grow_at, "ema": self.ema,
            "stage": self.stage, "success": self.success}

  def load_state_dict(self, state: dict) -> None:
    if list(state["budgets"]) != self.budgets:
      raise ValueError(f"the checkpoint's horizon curriculum has step budgets {state['budgets']}, "
                       f"the config {self.budgets}; resume with the same curriculum.step_budgets.")
    self.stage, self.success = int(state["stage"]), float(state["success"])
