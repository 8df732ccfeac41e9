"""Monte-Carlo credit assignment on branch-rollout trees (VinePPO, Tree-GRPO, exact GiGPO steps).

A batch holds `B` episodes (rows) of at most `S` environment steps. Some rows are *branches*: row
`i` with `parent[i] = p >= 0` and `branch_step[i] = b >= 0` was forked from row `p` just before
`p`'s step `b`. It shares `p`'s states `s_0..s_b` and actions `a_0..a_{b-1}` (its steps `t < b`
are copies of `p`'s), and from step `b` on it sampled its own actions: its action at `b` is a fresh
sample in the state `s_b`. Roots have `parent = branch_step = -1`.

Preconditions (not checked inside jit: the kernels see values only when traced):
  * `parent[i] < i`: a parent comes before its children; parents may themselves be branches.
  * a branch is in its parent's task group (`groups[i] == groups[parent[i]]`); all rows of a group
    share the initial state `s_0`.
  * `step_mask` is a prefix of each row and includes a branch's copied steps `t < b`; the parent
    took step `b` (`step_mask[p, b] = 1`) and the branch did too (it has at least `b + 1` steps).

Nodes of the tree, per step `t` (only cells with `step_mask[i, t] = 1` are nodes):
  * state node: `rep(i, t) = rep(parent[i], t)` if `parent[i] >= 0` and `t <= branch_step[i]`,
    else `i`; `(i, t)` and `(j, t)` share a state iff `t == 0` and same group, or
    `rep(i, t) == rep(j, t)`.
  * action node: `arep(i, t) = arep(parent[i], t)` if `parent[i] >= 0` and `t < branch_step[i]`,
    else `i`; `(i, t)` and `(j, t)` share an action iff `arep(i, t) == arep(j, t)` (two roots of
    one group took different samples at `t = 0`).
Since the jump conditions agree (`t + 1 <= b` iff `t < b`), the rows through the action node of
`(i, t)` are exactly the rows through the state node of `(i, t + 1)` when that step exists.

Monte-Carlo values (VinePPO; Kazemnejad et al. 2024, "VinePPO: Unlocking RL Potential for LLM
Reasoning through Refined Credit Assignment"), over valid rows only:
    V(i, t) = mean of `scores` over the rows sharing the state node of (i, t),
    Q(i, t) = mean of `scores` over the rows sharing the action node of (i, t).

Every `[B, S]` output is float32 (node ids int32, `own_steps` bool) and 0 where `step_mask` is 0
or the row is invalid (`valid[i] = 0`: left out of every statistic). Outputs cover a branch's
copied steps too (they are its parent's decisions); train on `own_steps` only. Node statistics are
segment sums over ids `t * B + representative`, so there is no Python loop over rows, steps or
groups.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp

from longhorizon.core.advantages import (_as_bool, _as_f32, _dense_ids, _group_moments,
                                         _valid_weight, grpo)

__all__ = [
    "own_steps",
    "tree_node_ids",
    "tree_values",
    "vine_advantages",
    "branch_advantages",
    "tree_grpo_advantages",
]

_F32 = jnp.float32


class _NodeMoments(NamedTuple):
  count: jax.Array  # [B, S] float32 valid rows of the cell's node
  centred: jax.Array  # [B, S] float32 scores[i] - node mean (0 off the members)
  std: jax.Array  # [B, S] float32 unbiased std of the node's scores


def _check_branches(parent, branch_step, step_mask):
  chex.assert_rank(step_mask, 2)
  chex.assert_shape([parent, branch_step], (step_mask.shape[0],))
  chex.assert_type([parent, branch_step], int)


def _check_tree(groups, parent, branch_step, step_mask, scores=None, valid=None):
  _check_branches(parent, branch_step, step_mask)
  num_rows = step_mask.shape[0]
  chex.assert_shape(groups, (num_rows,))
  chex.assert_type(groups, int)
  if scores is not None:
    chex.assert_shape(scores, (num_rows,))
  if valid is not None:
    chex.assert_shape(valid, (num_rows,))


def _representatives(parent, branch_step, num_steps, *, inclusive):
  """`[B, S]` int32 `rep(i, t)` (`inclusive`: jump while `t <= b`) or `arep(i, t)` (`t < b`).

  Pointer doubling: each round replaces every pointer by its target's pointer, so after `k` rounds
  it has moved `2^k` links up (or stopped at a row that keeps its step). A chain has fewer than `B`
  links (parent < child), so `ceil(log2(B))` rounds reach every representative.
  """
  num_rows = parent.shape[0]
  steps = jnp.arange(num_steps)[None, :]
  bound = branch_step[:, None]
  jumps = (parent[:, None] >= 0) & ((steps <= bound) if inclusive else (steps < bound))
  pointer = jnp.where(jumps, parent[:, None], jnp.arange(num_rows)[:, None]).astype(jnp.int32)
  rounds = max(1, (num_rows - 1).bit_length())
  return jax.lax.fori_loop(0, rounds, lambda _, p: jnp.take_along_axis(p, p, axis=0), pointer)


def _node_ids(groups, parent, branch_step, num_steps):
  """`(state_ids, action_ids)`, `[B, S]` int32 in `[0, B*S)`: `t * B + representative`, where the
  representative of a step-0 state is the group's dense id (every row of a group shares `s_0`)."""
  num_rows = parent.shape[0]
  steps = jnp.arange(num_steps)[None, :]
  group_ids = jnp.broadcast_to(_dense_ids(groups)[:, None], (num_rows, num_steps))
  state_rep = _representatives(parent, branch_step, num_steps, inclusive=True)
  state_rep = jnp.where(steps == 0, group_ids, state_rep)
  action_rep = _representatives(parent, branch_step, num_steps, inclusive=False)
  return steps * num_rows + state_rep, steps * num_rows + action_rep


def _node_moments(scores, ids, member):
  """Per cell: its node's valid-row count, `scores[i] - node mean` and unbiased std."""
  x = jnp.broadcast_to(scores[:, None], ids.shape).reshape(-1)
  moments = _group_moments(x, ids.reshape(-1), member.reshape(-1).astype(_F32))
  return _NodeMoments(*(m.reshape(ids.shape) for m in moments))


def _tree_moments(scores, groups, parent, branch_step, step_mask, valid):
  """Checks the inputs; returns `(member [B, S] bool, state moments, action moments)`."""
  scores, groups, parent, branch_step, step_mask = map(
      jnp.asarray, (scores, groups, parent, branch_step, step_mask))
  _check_tree(groups, parent, branch_step, step_mask, scores=scores, valid=valid)
  scores = _as_f32(scores)
  member = _as_bool(step_mask) & (_valid_weight(valid, scores)[:, None] > 0)
  state_ids, action_ids = _node_ids(groups, parent, branch_step, step_mask.shape[1])
  return (member, _node_moments(scores, state_ids, member),
          _node_moments(scores, action_ids, member))


@jax.jit
def own_steps(parent: chex.Array, branch_step: chex.Array, step_mask: chex.Array) -> jax.Array:
  """`[B, S]` bool: the steps a row sampled itself, `step_mask & (t >= branch_step)` for a branch
  or a recovery episode and `step_mask` for a root. Only these train: a branch's copied prefix is
  its parent's (a recovery episode's, its source episode's).

  Args:
    parent: `[B]` int parent row (-1 for a root, -2 for a recovery episode).
    branch_step: `[B]` int step the branch was forked (the recovery episode started) before; -1
      for a root.
    step_mask: `[B, S]` 1 on steps that happened (a branch's copied steps included).
  """
  parent, branch_step, step_mask = map(jnp.asarray, (parent, branch_step, step_mask))
  _check_branches(parent, branch_step, step_mask)
  steps = jnp.arange(step_mask.shape[1])[None, :]
  sampled = steps >= branch_step[:, None]  # every step of a root (branch step -1)
  return _as_bool(step_mask) & sampled


@jax.jit
def tree_node_ids(groups: chex.Array, parent: chex.Array, branch_step: chex.Array,
                  step_mask: chex.Array):
  """Ids of the state and action nodes of every step (see the module docstring).

  `(i, t)` and `(j, t)` share a state id iff `t == 0` and `groups[i] == groups[j]`, or
  `rep(i, t) == rep(j, t)`; they share an action id iff `arep(i, t) == arep(j, t)`. Ids of different
  steps differ. Representatives come from `ceil(log2 B)` rounds of vectorised pointer doubling.

  Args:
    groups: `[B]` int task-group labels (arbitrary integers).
    parent: `[B]` int parent row (-1 for a root; `parent[i] < i`).
    branch_step: `[B]` int step the branch was forked before (-1 for a root).
    step_mask: `[B, S]` 1 on steps that happened (a branch's copied steps included).

  Returns:
    `(state_ids, action_ids)`, both `[B, S]` int32 in `[0, B*S)` (not contiguous), -1 where
    `step_mask` is 0.
  """
  groups, parent, branch_step, step_mask = map(jnp.asarray,
                                               (groups, parent, branch_step, step_mask))
  _check_tree(groups, parent, branch_step, step_mask)
  state_ids, action_ids = _node_ids(groups, parent, branch_step, step_mask.shape[1])
  happened = _as_bool(step_mask)
  return jnp.where(happened, state_ids, -1), jnp.where(happened, action_ids, -1)


@jax.jit
def tree_values(scores: chex.Array, groups: chex.Array, parent: chex.Array, branch_step: chex.Array,
                step_mask: chex.Array, valid: chex.Array | None = None):
  """Monte-Carlo state and action values on the tree (VinePPO; Kazemnejad et al. 2024).

      V(i, t) = mean_{j in state node of (i, t), valid} scores[j],
      Q(i, t) = mean_{j in action node of (i, t), valid} scores[j].

  Args:
    scores: `[B]` episode returns.
    groups: `[B]` int task-group labels.
    parent: `[B]` int parent row (-1 for a root; `parent[i] < i`).
    branch_step: `[B]` int step the branch was forked before (-1 for a root).
    step_mask: `[B, S]` 1 on steps that happened (a branch's copied steps included).
    valid: optional `[B]` 0/1; invalid rows are left out of every mean and get 0.

  Returns:
    `(v, q, state_count, action_count)`, all `[B, S]` float32: the means and the number of valid
    rows each used; 0 where `step_mask` is 0 or the row is invalid.
  """
  member, state, action = _tree_moments(scores, groups, parent, branch_step, step_mask, valid)
  scores = _as_f32(scores)[:, None]
  v = jnp.where(member, scores - state.centred, 0.0)
  q = jnp.where(member, scores - action.centred, 0.0)
  return v, q, jnp.where(member, state.count, 0.0), jnp.where(member, action.count, 0.0)


@jax.jit
def vine_advantages(scores: chex.Array, groups: chex.Array, parent: chex.Array,
                    branch_step: chex.Array, step_mask: chex.Array,
                    valid: chex.Array | None = None) -> jax.Array:
  """VinePPO step advantages from Monte-Carlo values (Kazemnejad et al. 2024), with the outcome
  reward and gamma = 1:

      A(i, t) = Q(i, t) - V(i, t)  =  r_t + V(s_{t+1}) - V(s_t),

  where `Q(i, t) = V(i, t + 1)` is estimated by the rows through the next state. A step whose state
  node has one valid row gets 0. Along a row the advantages telescope: the sum over steps `t >= t0`
  is `scores[i] - V(i, t0)`.

  Args:
    scores, groups, parent, branch_step, step_mask, valid: as in `tree_values`.

  Returns:
    `[B, S]` float32, 0 where `step_mask` is 0 or the row is invalid.
  """
  member, state, action = _tree_moments(scores, groups, parent, branch_step, step_mask, valid)
  # (s - V) - (s - Q): exactly 0 when the two nodes hold the same rows.
  return jnp.where(member, state.centred - action.centred, 0.0)


@jax.jit
def branch_advantages(scores: chex.Array, groups: chex.Array, parent: chex.Array,
                      branch_step: chex.Array, step_mask: chex.Array,
                      valid: chex.Array | None = None) -> jax.Array:
  """The continuation's return against the mean return from the same state:

      A(i, t) = scores[i] - V(i, t)

  (the Monte-Carlo baseline of VinePPO, Kazemnejad et al. 2024, applied to the whole return; at
  `t = 0` without branches it is Dr.GRPO's `s_i - mean_g`). A node of one valid row gives 0.

  Args:
    scores, groups, parent, branch_step, step_mask, valid: as in `tree_values`.

  Returns:
    `[B, S]` float32, 0 where `step_mask` is 0 or the row is invalid.
  """
  member, state, _ = _tree_moments(scores, groups, parent, branch_step, step_mask, valid)
  return jnp.where(member, state.centred, 0.0)


@functools.partial(jax.jit, static_argnames=("normalize_std",))
def tree_grpo_advantages(scores: chex.Array, groups: chex.Array, parent: chex.Array,
                         branch_step: chex.Array, step_mask: chex.Array,
                         valid: chex.Array | None = None, *, step_weight=1.0,
                         normalize_std: bool = True, eps=1e-6) -> jax.Array:
  """Tree-GRPO (Ji et al. 2025, "Tree Search for LLM Agent Reinforcement Learning") / GiGPO with
  exact step groups (Feng et al. 2025, "Group-in-Group Policy Optimization for LLM Agent Training"):
  the step groups are the tree's state nodes, found from the branch structure instead of by hashing
  states.

  Episode level, over the valid rows of each task group (branches included), as `advantages.grpo`:
      A^E_i = (s_i - mean_g) / F_g,            F_g = std_g + eps if normalize_std else 1,
  `std_g` unbiased (n-1); 0 for a group of one. Step level, over the valid rows of the state node:
      A^S(i, t) = (Q(i, t) - V(i, t)) / F(i, t),   F = std_node + eps if normalize_std else 1,
  with `A^S = 0` when the state node has fewer than 2 valid rows or all of them share one action
  node (no alternative action to compare with). Result:
      A(i, t) = A^E_i + step_weight * A^S(i, t).

  Args:
    scores, groups, parent, branch_step, step_mask, valid: as in `tree_values`.
    step_weight: scalar weight `omega` of the step advantage.
    normalize_std: divide both levels by std + eps (static).
    eps: added to the std.

  Returns:
    `[B, S]` float32, 0 where `step_mask` is 0 or the row is invalid.
  """
  member, state, action = _tree_moments(scores, groups, parent, branch_step, step_mask, valid)
  eps = _as_f32(eps)
  episode = grpo(scores, groups, normalize_std=normalize_std, eps=eps, valid=valid)
  step = state.centred - action.centred
  if normalize_std:
    step = step / (state.std + eps)
  step = jnp.where((state.count > 1) & (action.count < state.count), step, 0.0)
  return jnp.where(member, episode[:, None] + _as_f32(step_weight) * step, 0.0)
