"""The horizon-cliff sweep: env x horizon x algorithm x seed, same budget per run.

Run (see experiments/horizon_sweep.py for the flags):

  python experiments/horizon_sweep.py --config=configs/horizon_sweep.py \
      --out=experiments/results/horizon_sweep

Variants (`--config=configs/horizon_sweep.py:VARIANT`):
  cpu (default)  sized for a 2-core CPU: pointer_chain N in {2, 4, 8, 16}, gridworld N in {2, 4, 8}
                 (N = 16 needs a 10x10 grid whose ~110-token observations put 20-turn episodes
                 past this budget), 6 algorithms, 3 seeds (run seed-major, so an interrupted
                 sweep has every cell at fewer seeds); the main job's 2-layer d=128 policy; per
                 run 12 RL updates of 8 tasks x 8 rollouts (768 episodes) from a shared SFT warm
                 start (60 passes over 128 demonstrations with epsilon 0.1, minibatches of 16, lr 1e-3: step
                 accuracy ~0.85 at N=2). Measured cost on the 2-core CPU: see "What ran" in
                 docs/horizon_cliff.md (more than the ~2 h first aimed at: gridworld N = 8
                 alone takes ~40 min per seed).
  accelerator    the same sweep at accelerator scale: N up to 32 on both envs, a 4-layer d=256
                 policy, 60 updates of 32 tasks x 8 rollouts (15,360 episodes per run).
  textworld      TextWorld coin-collector quests of length 2, 4 and 8 (a host environment stepped
                 by a process pool; needs the [textworld] extra), grpo and gigpo, one seed.
  smoke          minutes on a CPU: pointer_chain N in {2, 4}, gridworld N=2, grpo and gigpo, one
                 seed, 2 updates.
  turn_credit    the cpu budget on pointer_chain N = 8, 3 seeds, with the turn-level estimators
                 of issue 19 beside the v1 PPO rows and GRPO (PPO with turn-level lambda must
                 not collapse: sampled success at least the warm start's).
  branch_credit  the cpu budget on pointer_chain N = 8, 3 seeds: branch rollouts (2 roots x 4
                 per task, the same 8 episodes per task) with the tree estimators, GRPO on the
                 branched batches, and GRPO on plain batches.
  verifier_credit the cpu budget on pointer_chain N = 8, 3 seeds: GRPO (outcome only) against
                 GRPO plus a rule-based step verifier's step advantages (milestones; oracle
                 agreement).
  recovery_credit the cpu budget on pointer_chain N = 8, 3 seeds: GRPO against GRPO with recovery
                 tasks (2 of the 8 groups per update restart after an earlier failure's first
                 error).
  credit_study   issue 19's study of the hard cells: pointer_chain N = 8 and 16 and gridworld
                 N = 8 at 3x the cpu budget per run (36 updates, 2,304 episodes), 5 seeds, the
                 issue's methods (GRPO, GiGPO, PPO with turn-level GAE and VAPO lambda, EMPG, the
                 three tree estimators, the milestone verifier, and Tree-GRPO plus the milestone
                 verifier), with first-error positions recorded. Sweeps over disjoint seeds may
                 run side by side into one folder (`--config.sweep.seeds=(0,2,4)` and `(1,3)`).
  credit_study_textworld  the credit study's methods and seeds on TextWorld quest length 8 at the
                 study's 2,304 episodes per run (18 updates of 16 games x 8; every other setting
                 the textworld variant's), with mid-run checkpoints. Build the games first:
                 experiments/prepare_textworld.py --config=configs/horizon_sweep.py:credit_study_textworld
                 --splits=train --splits=test.
Every run of a cell (env, N, seed) starts from the same SFT warm start (noisy demonstrator,
epsilon 0.1), so the algorithms differ only in credit assignment; all share every other
hyperparameter (none is tuned per algorithm).
"""

import os

import ml_collections

from longhorizon.studies import sweeps

_DEFAULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "default.py")

ALGORITHMS = ("grpo", "drgrpo", "rloo", "ppo_gae", "ppo_lagae", "gigpo")
VARIANTS = ("cpu", "accelerator", "textworld", "smoke", "turn_credit", "branch_credit",
            "verifier_credit", "recovery_credit", "credit_study", "credit_study_textworld")
TURN_CREDIT = ("grpo", "grpo_empg", "ppo_gae", "ppo_lagae", "ppo_turn_gae", "ppo_turn_lagae",
               "ppo_bilevel")
BRANCH_CREDIT = ("grpo", "grpo_branched", "vine", "branch", "tree_grpo", "tree_grpo_divergence")
VERIFIER_CREDIT = ("grpo", "grpo_milestone_verifier", "grpo_oracle_verifier")
CREDIT_STUDY = ("grpo", "gigpo", "ppo_turn_gae", "ppo_turn_lagae", "grpo_empg", "vine", "branch",
                "tree_grpo", "grpo_milestone_verifier", "tree_grpo_milestone_verifier")


def get_config(arg=None):
  variant = arg or "cpu"
  if variant not in VARIANTS:
    raise ValueError(f"unknown variant {arg!r} of configs/horizon_sweep.py; use one of {VARIANTS}.")
  config = sweeps.config_module(_DEFAULT).get_config()
  config.unlock()
  config.num_updates = 12
  config.rollout.num_tasks = 8
  config.rollout.group_size = 8
  config.tasks.train_size = 1024
  config.tasks.test_size = 64
  config.tasks.ood_size = 8  # unused here
  # Small minibatches: XLA:CPU attention over a [64, ~130]-token batch costs ~9x a [16, 130] one
  # (cache-bound), so 16-row minibatches make both SFT and RL several times faster per episode.
  config.sft.steps = 60  # each SFT step is one pass over the demonstrations in 8 minibatches
  config.sft.episodes = 128
  config.sft.minibatches = 8
  config.sft.learning_rate = 1e-3  # 3e-3 (the main job's, with 32-row minibatches) is too high here
  config.sft.demo_epsilon = 0.1
  config.optim.minibatches = 4
  config.eval.num_tasks = 64
  config.eval.k = 2  # sampled attempts per test task
  config.tensorboard = False
  config.progress = False
  config.sweep = ml_collections.ConfigDict()
  config.sweep.pointer_chain = (2, 4, 8, 16)
  config.sweep.gridworld = (2, 4, 8)
  config.sweep.textworld = ()  # quest lengths (variant "textworld"; needs the [textworld] extra)
  config.sweep.algorithms = ALGORITHMS
  config.sweep.seeds = (0, 1, 2)
  # Save each cell's warm start (and its evaluation) under OUT/warm_starts/ and read it back on
  # resume, so a cell finished in another session, on another CPU, starts from the same parameters.
  config.sweep.keep_warm_starts = False
  # Save the run under way every this many updates (OUT/partial/), so a killed sweep continues it
  # from there instead of from its first update (0: off; the run restarts).
  config.sweep.checkpoint_every = 0
  if variant == "accelerator":
    config.model.hidden_size = 256
    config.model.num_hidden_layers = 4
    config.model.intermediate_size = 768
    config.num_updates = 60
    config.rollout.num_tasks = 32
    config.tasks.train_size = 4096
    config.tasks.test_size = 256
    config.eval.num_tasks = 256
    config.eval.k = 4
    config.sweep.pointer_chain = (2, 4, 8, 16, 32)
    config.sweep.gridworld = (2, 4, 8, 16, 32)
  elif variant in ("textworld", "credit_study_textworld"):  # TextWorld quests, process pool
    # The settings of the TextWorld learning run (experiments/results/textworld): many distinct
    # games seen once by SFT (a few games are memorised), milestone rewards, 16 games per update
    # at lr 1e-4. Build the games first: experiments/prepare_textworld.py with this config.
    config.sweep.pointer_chain = ()
    config.sweep.gridworld = ()
    config.sweep.textworld = (2, 4, 8)
    config.sweep.algorithms = ("grpo", "gigpo")
    config.sweep.seeds = (0,)
    config.num_updates = 24
    config.rollout.num_tasks = 16
    config.tasks.train_size = 1536  # 1024 SFT games, then 24 x 16 RL games: none seen twice
    config.tasks.test_size = 32
    config.tasks.ood_size = 8
    config.eval.num_tasks = 32
    config.eval.k = 4
    config.sft.steps = 12
    config.sft.episodes = 1024
    config.sft.minibatches = 32
    config.sft.demo_epsilon = 0.2
    config.optim.learning_rate = 1e-4
    config.reward.milestone = 0.5
    config.rollout.turn_tokens = 8
    config.pool.backend = "process"
    config.pool.workers = 2
    config.pool.timeout_s = 60.0  # a game missing from the cache is generated on its first reset
    if variant == "credit_study_textworld":
      # 2,304 episodes per run, as in every cell of the study: 3x the v1 budget (768 episodes).
      config.num_updates = 18
      # SFT games, then RL games, none seen twice; the split holds more games than 18 updates use
      # (room for 72), and its size is part of the kept warm starts' fingerprint.
      config.tasks.train_size = 1024 + 72 * 16
      config.rollout.record_oracle = True  # first-error positions for every method
      config.sweep.textworld = (8,)
      config.sweep.algorithms = CREDIT_STUDY
      config.sweep.seeds = (0, 1, 2, 3, 4)
      config.sweep.keep_warm_starts = True
      config.sweep.checkpoint_every = 6  # a stopped run loses at most 6 updates
  elif variant == "turn_credit":
    config.sweep.pointer_chain = (8,)
    config.sweep.gridworld = ()
    config.sweep.algorithms = TURN_CREDIT
  elif variant == "branch_credit":
    config.sweep.pointer_chain = (8,)
    config.sweep.gridworld = ()
    config.sweep.algorithms = BRANCH_CREDIT
  elif variant == "verifier_credit":
    config.rollout.record_oracle = True  # first-error positions for every method
    config.sweep.pointer_chain = (8,)
    config.sweep.gridworld = ()
    config.sweep.algorithms = VERIFIER_CREDIT
  elif variant == "recovery_credit":
    config.rollout.record_oracle = True  # first-error positions for both
    config.sweep.pointer_chain = (8,)
    config.sweep.gridworld = ()
    config.sweep.algorithms = ("grpo", "grpo_recovery")
  elif variant == "credit_study":
    config.num_updates = 36  # 3x the cpu budget
    config.rollout.record_oracle = True  # first-error positions for every method
    config.sweep.pointer_chain = (8, 16)
    config.sweep.gridworld = (8,)
    config.sweep.algorithms = CREDIT_STUDY
    config.sweep.seeds = (0, 1, 2, 3, 4)
    config.sweep.keep_warm_starts = True  # a seed's ten runs span sessions (and machines)
  elif variant == "smoke":
    config.num_updates = 2
    config.rollout.num_tasks = 4
    config.rollout.group_size = 4
    config.tasks.train_size = 128
    config.tasks.test_size = 8
    config.sft.steps = 8
    config.sft.episodes = 16
    config.eval.num_tasks = 8
    config.sweep.pointer_chain = (2, 4)
    config.sweep.gridworld = (2,)
    config.sweep.algorithms = ("grpo", "gigpo")
    config.sweep.seeds = (0,)
  config.lock()
  return config
