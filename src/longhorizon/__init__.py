"""longhorizon: JAX-native online multi-turn agent reinforcement learning for language-model policies."""

__version__ = "0.1.0"
