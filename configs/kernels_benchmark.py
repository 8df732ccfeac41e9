"""Benchmark of the `longhorizon.core` kernels (log-probs, advantages, losses) on CPU/GPU/TPU.

Launch (from the repository root; prints one table, writes it to the JSON file):

  python experiments/benchmarks/core_kernels.py --config=configs/kernels_benchmark.py \
      --out=results/kernels.json

Smoke run (every size shrunk; the whole benchmark takes well under 20 s on a 2-core CPU):

  python experiments/benchmarks/core_kernels.py --config=configs/kernels_benchmark.py:smoke

Expected result (full config, 2-core CPU): every kernel timed at B=1024, T=512; GAE >= 5x faster than
a NumPy reverse loop over time vectorised over the batch, and GiGPO >= 20x faster than Python-dict
grouping with per-trajectory loops (the approach of verl-agent) at 256 groups x 8 rollouts x 20 steps
(the performance bars of DESIGN.md). Speedups in the smoke run are not meaningful (tiny sizes) and
carry no target.
"""

import ml_collections


def get_config(arg=None):
  """Returns the benchmark config; `arg='smoke'` shrinks every size for a run of a few seconds."""
  config = ml_collections.ConfigDict()

  # Token-level kernels (log-probs, token advantages, losses): rows x token positions.
  config.batch = 1024  # B: rows (episodes) of every [B, T] input.
  config.length = 512  # T: token positions per row (the padded context length).

  # Multi-turn masks: each row is [prompt][action obs]...[action obs][action][padding]; every span
  # length is drawn uniformly per row/span, so rows differ in their layout and number of turns.
  config.masks = ml_collections.ConfigDict()
  config.masks.prompt_span = (16, 64)  # [lo, hi] tokens of the prompt (loss_mask 0, turn -1).
  config.masks.action_span = (8, 48)  # [lo, hi] tokens of one policy action (loss_mask 1).
  config.masks.obs_span = (8, 64)  # [lo, hi] tokens of one observation (loss_mask 0).
  config.masks.max_steps = 16  # S: most env steps per row (turns), also the width of [B, S] inputs.
  config.masks.min_fill = 0.6  # each row stops adding turns at a length drawn in [min_fill*T, T].

  # Log-prob kernels: [B, T, V] float32 logits must fit in RAM next to their copies; at B=1024, T=512
  # a vocabulary of 128 makes the logits 1024*512*128*4 B = 256 MiB.
  config.vocab = 128  # V: vocabulary of token_logprobs / entropy / token_logprobs_from_hidden.
  config.hidden = 64  # D: hidden width for token_logprobs_from_hidden (hidden [B,T,D] is 128 MiB).
  config.chunk_size = 64  # vocabulary chunk of token_logprobs_from_hidden (V/64 = 2 scan steps).

  # Score-level kernels (grpo, rloo): N = batch scores in groups of this many rollouts.
  config.group_size = 8  # rollouts per task group for grpo / rloo (N = batch, B/8 groups).

  # GiGPO at the DESIGN.md bar: 256 groups x 8 rollouts x 20 steps (N = 2048 trajectories).
  config.gigpo = ml_collections.ConfigDict()
  config.gigpo.groups = 256  # task groups.
  config.gigpo.rollouts = 8  # trajectories per task group.
  config.gigpo.steps = 20  # S: env steps per trajectory (padded; each has 5..S valid steps).
  config.gigpo.min_steps = 5  # fewest valid steps of a trajectory.
  config.gigpo.anchors_per_group = 12  # distinct anchor states per group (< 8*20, so step groups repeat).
  config.gigpo.gamma = 0.95  # step discount (GiGPO's default).
  config.gigpo.step_weight = 1.0  # omega: weight of the step-level advantage.
  config.gigpo.normalize_std = True  # GiGPO "mean_std_norm" (both levels divided by std + eps).

  config.gamma = 1.0  # token discount for gae / reinforce_pp.
  config.lam = 0.95  # GAE lambda.

  # Scaling table: gae at batch * f and gigpo at groups * f for each multiplier f (empty: skipped).
  config.scaling = (0.25, 1.0, 4.0)
  config.repeats = 20  # timed runs per kernel (after one warm-up/compile run); the median is reported.
  config.baseline_repeats = 5  # timed runs per baseline (slow Python/NumPy); the median is reported.
  config.check_atol = 1e-4  # baselines must match the JAX kernels to this tolerance before timing.
  config.targets = True  # judge the DESIGN.md speedup bars (only meaningful at the full sizes).
  config.seed = 0  # NumPy seed of every synthetic input.

  if arg == "smoke":
    config.batch = 64
    config.length = 128
    config.masks.prompt_span = (4, 16)
    config.masks.action_span = (4, 12)
    config.masks.obs_span = (4, 16)
    config.masks.max_steps = 8
    config.vocab = 32
    config.hidden = 16
    config.chunk_size = 16
    config.gigpo.groups = 8
    config.gigpo.steps = 8
    config.gigpo.min_steps = 2
    config.gigpo.anchors_per_group = 4
    config.repeats = 3
    config.baseline_repeats = 2
    config.targets = False
    config.scaling = (0.5, 1.0)
  elif arg not in (None, ""):
    raise ValueError(f"unknown config variant {arg!r}; expected '' or 'smoke'.")
  return config
