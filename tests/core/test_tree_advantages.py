"""Tests of `longhorizon.core.tree_advantages`: a tree worked out by hand, agreement with slow NumPy
references (representatives found by walking the parents, node means by looping over all rows,
float64) on random nested trees, the identities that pin the conventions (no branches, telescoping,
Q(t) = V(t + 1), invalid rows), no retracing and shape checks."""

import math

import numpy as np
import pytest

from longhorizon.core import advantages as adv
from longhorizon.core import tree_advantages as tree

ATOL = RTOL = 1e-5
EPS = 1e-6
SEEDS = [0, 1, 2, 3, 4, 5]
B, S = 12, 5


def _close(got, want, atol=ATOL):
  np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64), rtol=RTOL,
                             atol=atol)


def random_tree(rng, num_rows=B, num_steps=S, branch_prob=0.6):
  """Roots in three groups with arbitrary labels; a branch forks from a random earlier row (so trees
  nest) before one of that row's steps, and runs at least one step of its own."""
  groups = np.zeros(num_rows, np.int32)
  parent = np.full(num_rows, -1, np.int32)
  branch_step = np.full(num_rows, -1, np.int32)
  length = np.zeros(num_rows, np.int32)
  for i in range(num_rows):
    if i > 0 and rng.random() < branch_prob:
      p = int(rng.integers(0, i))
      b = int(rng.integers(0, length[p]))
      parent[i], branch_step[i], groups[i] = p, b, groups[p]
      length[i] = rng.integers(b + 1, num_steps + 1)
    else:
      groups[i] = rng.choice([-7, 3, 1000])
      length[i] = rng.integers(1, num_steps + 1)
  step_mask = (np.arange(num_steps)[None, :] < length[:, None]).astype(np.int32)
  return groups, parent, branch_step, step_mask


def random_scores(rng, kind, num_rows=B):
  if kind == "binary":  # ties: many nodes of equal scores, where every step advantage must be 0
    return rng.integers(0, 2, num_rows).astype(np.float32)
  if kind == "eighths":
    return (rng.integers(0, 9, num_rows) / 8).astype(np.float32)
  return rng.normal(size=num_rows).astype(np.float32)


def random_case(seed):
  rng = np.random.default_rng(seed)
  groups, parent, branch_step, step_mask = random_tree(rng)
  scores = random_scores(rng, ["binary", "eighths", "normal"][seed % 3])
  valid = (rng.random(B) < 0.75).astype(np.int32)
  return scores, groups, parent, branch_step, step_mask, valid


# ----------------------------------------------------------------------------------------------------
# Slow references.


def ref_rep(parent, branch_step, i, t, inclusive):
  """`rep(i, t)` (inclusive: jump while t <= b) or `arep(i, t)` (t < b), walking up the parents."""
  while parent[i] >= 0 and (t <= branch_step[i] if inclusive else t < branch_step[i]):
    i = parent[i]
  return i


def ref_state_key(groups, parent, branch_step, i, t):
  return ("start", groups[i]) if t == 0 else ("row", ref_rep(parent, branch_step, i, t, True))


def ref_action_key(parent, branch_step, i, t):
  return ref_rep(parent, branch_step, i, t, False)


def ref_members(groups, parent, branch_step, step_mask, valid, i, t, action):
  """Valid rows whose step t shares the state (action=False) or the action node of (i, t)."""
  if action:
    key = lambda j: ref_action_key(parent, branch_step, j, t)
  else:
    key = lambda j: ref_state_key(groups, parent, branch_step, j, t)
  return [j for j in range(len(parent)) if valid[j] and step_mask[j, t] and key(j) == key(i)]


def ref_tree_values(scores, groups, parent, branch_step, step_mask, valid):
  num_rows, num_steps = step_mask.shape
  v, q, nv, nq = (np.zeros((num_rows, num_steps)) for _ in range(4))
  for i in range(num_rows):
    for t in range(num_steps):
      if not (valid[i] and step_mask[i, t]):
        continue
      state = ref_members(groups, parent, branch_step, step_mask, valid, i, t, action=False)
      action = ref_members(groups, parent, branch_step, step_mask, valid, i, t, action=True)
      v[i, t] = np.mean([float(scores[j]) for j in state])
      q[i, t] = np.mean([float(scores[j]) for j in action])
      nv[i, t], nq[i, t] = len(state), len(action)
  return v, q, nv, nq


def ref_std(values):
  return math.sqrt(sum((x - np.mean(values))**2 for x in values) / max(len(values) - 1, 1))


def ref_grpo(scores, groups, valid, normalize_std, eps=EPS):
  out = np.zeros(len(scores))
  for i in range(len(scores)):
    members = [float(scores[j]) for j in range(len(scores)) if valid[j] and groups[j] == groups[i]]
    if valid[i] and len(members) > 1:
      out[i] = (scores[i] - np.mean(members)) / (ref_std(members) + eps if normalize_std else 1.0)
  return out


def ref_tree_grpo(scores, groups, parent, branch_step, step_mask, valid, step_weight, normalize_std,
                  eps=EPS):
  num_rows, num_steps = step_mask.shape
  v, q, nv, nq = ref_tree_values(scores, groups, parent, branch_step, step_mask, valid)
  episode = ref_grpo(scores, groups, valid, normalize_std, eps)
  out = np.zeros((num_rows, num_steps))
  for i in range(num_rows):
    for t in range(num_steps):
      if not (valid[i] and step_mask[i, t]):
        continue
      step = 0.0
      if nv[i, t] >= 2 and nq[i, t] < nv[i, t]:
        state = ref_members(groups, parent, branch_step, step_mask, valid, i, t, action=False)
        scale = ref_std([float(scores[j]) for j in state]) + eps if normalize_std else 1.0
        step = (q[i, t] - v[i, t]) / scale
      out[i, t] = episode[i] + step_weight * step
  return out


def ref_own_steps(parent, branch_step, step_mask):
  out = np.zeros(step_mask.shape, bool)
  for i in range(step_mask.shape[0]):
    for t in range(step_mask.shape[1]):
      out[i, t] = bool(step_mask[i, t]) and (parent[i] < 0 or t >= branch_step[i])
  return out


def _first_own_step(parent, branch_step, i):
  return int(branch_step[i]) if parent[i] >= 0 else 0


# ----------------------------------------------------------------------------------------------------
# By hand.

# One group, two roots of 3 steps; root 0 has branches 2, 3 forked before its step 1 and branch 4
# forked before its step 2. Scores s = [1, 0, 0, 1, 0.5].
#   state nodes:  t=0 {0,1,2,3,4} (one group);  t=1 {0,2,3,4} {1};  t=2 {0,4} {1} {2} {3}
#   action nodes: t=0 {0,2,3,4} {1};  t=1 {0,4} {1} {2} {3};  t=2 all single
#   V: t=0 2.5/5 = 0.5;  t=1 {0,2,3,4}: 2.5/4 = 0.625, {1}: 0;  t=2 {0,4}: 1.5/2 = 0.75, else s_i
#   Q: t=0 {0,2,3,4}: 0.625, {1}: 0;  t=1 {0,4}: 0.75, {2}: 0, {3}: 1, {1}: 0;  t=2 s_i
HAND_SCORES = np.array([1.0, 0.0, 0.0, 1.0, 0.5], np.float32)
HAND_TREE = (np.zeros(5, np.int32), np.array([-1, -1, 0, 0, 0], np.int32),
             np.array([-1, -1, 1, 1, 2], np.int32), np.ones((5, 3), np.int32))
HAND_V = [[0.5, 0.625, 0.75], [0.5, 0.0, 0.0], [0.5, 0.625, 0.0], [0.5, 0.625, 1.0],
          [0.5, 0.625, 0.75]]
HAND_Q = [[0.625, 0.75, 1.0], [0.0, 0.0, 0.0], [0.625, 0.0, 0.0], [0.625, 1.0, 1.0],
          [0.625, 0.75, 0.5]]
# vine = Q - V; e.g. row 0: 0.125 + 0.125 + 0.25 = 0.5 = s_0 - V(0, 0).
HAND_VINE = [[0.125, 0.125, 0.25], [-0.5, 0.0, 0.0], [0.125, -0.625, 0.0], [0.125, 0.375, 0.0],
             [0.125, 0.125, -0.25]]
# branch = s_i - V.
HAND_BRANCH = [[0.5, 0.375, 0.25], [-0.5, 0.0, 0.0], [-0.5, -0.625, 0.0], [0.5, 0.375, 0.0],
               [0.0, -0.125, -0.25]]


def test_tree_values_by_hand():
  v, q, nv, nq = tree.tree_values(HAND_SCORES, *HAND_TREE)
  _close(v, HAND_V)
  _close(q, HAND_Q)
  _close(nv, [[5, 4, 2], [5, 1, 1], [5, 4, 1], [5, 4, 1], [5, 4, 2]])
  _close(nq, [[4, 2, 1], [1, 1, 1], [4, 1, 1], [4, 1, 1], [4, 2, 1]])


def test_node_ids_and_own_steps_by_hand():
  state_ids, action_ids = map(np.asarray, tree.tree_node_ids(*HAND_TREE))
  def partition(ids, t):
    return sorted(sorted(np.flatnonzero(ids[:, t] == x).tolist()) for x in set(ids[:, t]))
  assert [partition(state_ids, t) for t in range(3)] == [
      [[0, 1, 2, 3, 4]], [[0, 2, 3, 4], [1]], [[0, 4], [1], [2], [3]]]
  assert [partition(action_ids, t) for t in range(3)] == [
      [[0, 2, 3, 4], [1]], [[0, 4], [1], [2], [3]], [[0], [1], [2], [3], [4]]]
  # Branches 2, 3 sampled steps 1-2 themselves, branch 4 only step 2.
  np.testing.assert_array_equal(tree.own_steps(*HAND_TREE[1:]),
                                [[1, 1, 1], [1, 1, 1], [0, 1, 1], [0, 1, 1], [0, 0, 1]])


def test_vine_and_branch_advantages_by_hand():
  _close(tree.vine_advantages(HAND_SCORES, *HAND_TREE), HAND_VINE)
  _close(tree.branch_advantages(HAND_SCORES, *HAND_TREE), HAND_BRANCH)


def test_tree_grpo_by_hand():
  # Episode level (no std): s - 0.5 = [0.5, -0.5, -0.5, 0.5, 0]. Step level = vine where the state
  # node has >= 2 rows and more than one action: all of t=0; rows 0, 2, 3, 4 at t=1; rows 0, 4 at
  # t=2 (row 1's nodes after t=0 and rows 2, 3 at t=2 are alone: 0).
  episode = np.array([0.5, -0.5, -0.5, 0.5, 0.0])[:, None]
  got = tree.tree_grpo_advantages(HAND_SCORES, *HAND_TREE, normalize_std=False, step_weight=1.0)
  _close(got, episode + np.array(HAND_VINE))
  half = tree.tree_grpo_advantages(HAND_SCORES, *HAND_TREE, normalize_std=False, step_weight=0.5)
  _close(half, episode + 0.5 * np.array(HAND_VINE))
  # With the std: group std of [1, 0, 0, 1, 0.5] = sqrt(1 / 4) = 0.5; node t=1 {1, 0, 1, 0.5}:
  # squares .140625 + .390625 + .140625 + .015625 = .6875 -> std sqrt(.6875 / 3); node {1, 0.5}:
  # std sqrt(2 * 0.25^2) = sqrt(0.125).
  g, n1, n2 = 0.5 + EPS, math.sqrt(0.6875 / 3) + EPS, math.sqrt(0.125) + EPS
  want = [[0.5 / g + 0.125 / g, 0.5 / g + 0.125 / n1, 0.5 / g + 0.25 / n2],
          [-0.5 / g - 0.5 / g, -0.5 / g, -0.5 / g],
          [-0.5 / g + 0.125 / g, -0.5 / g - 0.625 / n1, -0.5 / g],
          [0.5 / g + 0.125 / g, 0.5 / g + 0.375 / n1, 0.5 / g],
          [0.125 / g, 0.125 / n1, -0.25 / n2]]
  _close(tree.tree_grpo_advantages(HAND_SCORES, *HAND_TREE, eps=EPS), want)


def test_a_node_that_shares_one_action_has_no_step_advantage():
  # Row 1 branches from row 0 before step 2: at steps 0 and 1 both rows are one state node and one
  # action node (the same sampled actions), so only the episode level remains there.
  parent, branch_step = np.array([-1, 0], np.int32), np.array([-1, 2], np.int32)
  args = (np.array([1.0, 0.0], np.float32), np.zeros(2, np.int32), parent, branch_step,
          np.ones((2, 3), np.int32))
  got = np.asarray(tree.tree_grpo_advantages(*args, normalize_std=False))
  _close(got, [[0.5, 0.5, 1.0], [-0.5, -0.5, -1.0]])
  _close(tree.vine_advantages(*args), [[0.0, 0.0, 0.5], [0.0, 0.0, -0.5]])


# ----------------------------------------------------------------------------------------------------
# Against the references.


@pytest.mark.parametrize("seed", SEEDS)
def test_node_ids_match_reference(seed):
  _, groups, parent, branch_step, step_mask, _ = random_case(seed)
  ids = tree.tree_node_ids(groups, parent, branch_step, step_mask)
  state_ids, action_ids = map(np.asarray, ids)
  assert state_ids.dtype == action_ids.dtype == np.int32
  for t in range(S):
    for i in range(B):
      if not step_mask[i, t]:
        assert state_ids[i, t] == action_ids[i, t] == -1
        continue
      for j in range(B):
        if step_mask[j, t]:
          same_state = (ref_state_key(groups, parent, branch_step, i, t) ==
                        ref_state_key(groups, parent, branch_step, j, t))
          same_action = (ref_action_key(parent, branch_step, i, t) ==
                         ref_action_key(parent, branch_step, j, t))
          assert (state_ids[i, t] == state_ids[j, t]) == same_state, (i, j, t)
          assert (action_ids[i, t] == action_ids[j, t]) == same_action, (i, j, t)
  on = step_mask > 0  # different steps never share a node
  for ids in (state_ids, action_ids):
    steps_of = {}
    for (i, t) in zip(*np.nonzero(on)):
      assert steps_of.setdefault(int(ids[i, t]), t) == t


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("with_valid", [True, False])
def test_values_and_advantages_match_reference(seed, with_valid):
  scores, groups, parent, branch_step, step_mask, valid = random_case(seed)
  tree_args = (scores, groups, parent, branch_step, step_mask, valid if with_valid else None)
  valid = valid if with_valid else np.ones(B, np.int32)
  v, q, nv, nq = ref_tree_values(scores, groups, parent, branch_step, step_mask, valid)
  for got, want in zip(tree.tree_values(*tree_args), (v, q, nv, nq)):
    _close(got, want)
  _close(tree.vine_advantages(*tree_args), q - v)
  _close(tree.branch_advantages(*tree_args),
         np.where((step_mask > 0) & (valid[:, None] > 0), scores[:, None] - v, 0.0))
  np.testing.assert_array_equal(tree.own_steps(parent, branch_step, step_mask),
                                ref_own_steps(parent, branch_step, step_mask))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("normalize_std", [True, False])
def test_tree_grpo_matches_reference(seed, normalize_std):
  scores, groups, parent, branch_step, step_mask, valid = random_case(seed)
  weight = float(np.random.default_rng(seed).uniform(0.2, 2.0))
  got = tree.tree_grpo_advantages(scores, groups, parent, branch_step, step_mask, valid,
                                  step_weight=weight, normalize_std=normalize_std, eps=EPS)
  _close(got, ref_tree_grpo(scores, groups, parent, branch_step, step_mask, valid, weight,
                            normalize_std))


def test_deep_chain_is_followed_to_its_root():
  """A chain 0 <- 1 <- ... <- 15, each forked before step 1: every row shares the state of step 1
  with row 0 (15 links: needs all ceil(log2 16) = 4 doubling rounds)."""
  num_rows = 16
  parent = np.arange(-1, num_rows - 1, dtype=np.int32)
  branch_step = np.where(parent >= 0, 1, -1).astype(np.int32)
  state_ids, action_ids = map(np.asarray, tree.tree_node_ids(
      np.zeros(num_rows, np.int32), parent, branch_step, np.ones((num_rows, 3), np.int32)))
  assert len(set(state_ids[:, 1])) == 1 and len(set(state_ids[:, 2])) == num_rows
  assert len(set(action_ids[:, 0])) == 1 and len(set(action_ids[:, 1])) == num_rows


# ----------------------------------------------------------------------------------------------------
# Identities.


@pytest.mark.parametrize("seed", SEEDS)
def test_without_branches_vine_and_branch_are_group_centred_on_step_zero(seed):
  rng = np.random.default_rng(seed)
  groups, parent, branch_step, step_mask = random_tree(rng, branch_prob=0.0)
  scores, valid = random_scores(rng, "normal"), (rng.random(B) < 0.75).astype(np.int32)
  args = (scores, groups, parent, branch_step, step_mask, valid)
  centred = np.asarray(adv.grpo(scores, groups, normalize_std=False, valid=valid))
  live = (step_mask > 0) & (valid[:, None] > 0)
  v, q, _, _ = map(np.asarray, tree.tree_values(*args))
  _close(v[:, 1:], np.where(live[:, 1:], scores[:, None], 0.0))
  _close(q, np.where(live, scores[:, None], 0.0))
  for got in (tree.vine_advantages(*args), tree.branch_advantages(*args)):
    got = np.asarray(got)
    _close(got[:, 0], centred)
    assert np.all(got[:, 1:] == 0.0)
  # Tree-GRPO: its step-0 nodes are the task groups with one action per row, so A^S = A^E there.
  episode = np.asarray(adv.grpo(scores, groups, valid=valid, eps=EPS))
  got = np.asarray(tree.tree_grpo_advantages(*args, step_weight=0.5, eps=EPS))
  _close(got, np.where(live, episode[:, None], 0.0) + np.where(live, 0.5, 0.0) *
         (np.arange(S) == 0)[None, :] * episode[:, None])


@pytest.mark.parametrize("seed", SEEDS)
def test_action_value_is_next_state_value_and_vine_telescopes(seed):
  """Q(i, t) = V(i, t + 1) wherever step t + 1 happened, so along a row the vine advantages of its
  own steps sum to scores[i] - V(i, first own step)."""
  scores, groups, parent, branch_step, step_mask, valid = random_case(seed)
  args = (scores, groups, parent, branch_step, step_mask, valid)
  v, q, _, _ = map(np.asarray, tree.tree_values(*args))
  vine = np.asarray(tree.vine_advantages(*args))
  own = np.asarray(tree.own_steps(parent, branch_step, step_mask))
  nxt = (step_mask[:, 1:] > 0) & (valid[:, None] > 0)
  _close(np.where(nxt, q[:, :-1], 0.0), v[:, 1:])
  for i in np.flatnonzero(valid):
    first = _first_own_step(parent, branch_step, i)
    _close(np.sum(vine[i][own[i]]), scores[i] - v[i, first])


@pytest.mark.parametrize("seed", SEEDS)
def test_invalid_rows_get_zero_and_change_nothing_else(seed):
  """An invalid leaf row: every output equals the batch without it (parents re-indexed), and the
  row's own outputs are 0."""
  scores, groups, parent, branch_step, step_mask, valid = random_case(seed)
  leaves = [i for i in range(B) if i not in set(parent.tolist())]
  drop = leaves[seed % len(leaves)]
  valid[drop] = 0
  keep = np.array([i for i in range(B) if i != drop])
  kept_parent = np.where(parent[keep] > drop, parent[keep] - 1, parent[keep]).astype(np.int32)
  full = (scores, groups, parent, branch_step, step_mask, valid)
  kept = (scores[keep], groups[keep], kept_parent, branch_step[keep], step_mask[keep], valid[keep])
  fns = [tree.vine_advantages, tree.branch_advantages, tree.tree_grpo_advantages,
         lambda *a: tree.tree_values(*a)[0], lambda *a: tree.tree_values(*a)[1],
         lambda *a: tree.tree_values(*a)[2]]
  for fn in fns:
    got_full, got_kept = np.asarray(fn(*full)), np.asarray(fn(*kept))
    assert np.all(got_full[drop] == 0.0)
    _close(got_full[keep], got_kept)


def test_equal_scores_give_exactly_zero():
  rng = np.random.default_rng(7)
  groups, parent, branch_step, step_mask = random_tree(rng)
  args = (np.full(B, 0.7, np.float32), groups, parent, branch_step, step_mask)
  for fn in (tree.vine_advantages, tree.branch_advantages, tree.tree_grpo_advantages):
    assert np.all(np.asarray(fn(*args)) == 0.0)


# ----------------------------------------------------------------------------------------------------
# No retracing, shapes.


def test_traced_once_for_same_shapes(assert_no_retrace):
  cases = [random_case(seed) for seed in (10, 11)]
  trees = [c[1:5] for c in cases]
  assert_no_retrace(tree.tree_node_ids, *[(t, {}) for t in trees])
  assert_no_retrace(tree.own_steps, *[(t[1:], {}) for t in trees])
  for fn in (tree.tree_values, tree.vine_advantages, tree.branch_advantages):
    assert_no_retrace(fn, *[(c, {}) for c in cases])
  assert_no_retrace(tree.tree_grpo_advantages,
                    *[(c, dict(step_weight=w, eps=e)) for c, w, e in zip(cases, (0.5, 1.0),
                                                                          (1e-6, 1e-5))])


def test_bad_shapes_raise():
  scores, groups, parent, branch_step, step_mask, valid = random_case(0)
  bad = [
      (scores[:-1], groups, parent, branch_step, step_mask, valid),  # scores [B-1]
      (scores, groups, parent[:-1], branch_step, step_mask, valid),  # parent [B-1]
      (scores, groups, parent, branch_step, step_mask[:, 0], valid),  # step_mask rank 1
      (scores, groups.astype(np.float32), parent, branch_step, step_mask, valid),  # float groups
      (scores, groups, parent, branch_step.astype(np.float32), step_mask, valid),  # float steps
      (scores, groups, parent, branch_step, step_mask, valid[:-1]),  # valid [B-1]
  ]
  for args in bad:
    for fn in (tree.tree_values, tree.vine_advantages, tree.branch_advantages,
               tree.tree_grpo_advantages):
      with pytest.raises((AssertionError, ValueError, TypeError)):
        fn(*args)
  with pytest.raises((AssertionError, ValueError, TypeError)):
    tree.tree_node_ids(groups, parent, branch_step[:-1], step_mask)
  with pytest.raises((AssertionError, ValueError, TypeError)):
    tree.own_steps(parent, branch_step, step_mask[:-1])
