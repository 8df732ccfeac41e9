"""Pure math of longhorizon: jitted kernels for log-probs, advantages and losses, and the data model.

Nothing here knows about models, samplers or environments, and nothing does I/O.
"""

from longhorizon.core import advantages, episode, logprobs, losses
from longhorizon.core.episode import EpisodeBatch, Termination

__all__ = ["advantages", "episode", "logprobs", "losses", "EpisodeBatch", "Termination"]
