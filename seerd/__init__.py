"""seerd: a batch rollout daemon for synchronous LLM RL, after the Seer system."""

__version__ = "0.1.0"
