"""The env host: serves any :class:`env_server.core.Env` over HTTP, AgentGym-compatible routes included."""

from env_server.core import Env, NoOptions, Observation, Step

__all__ = ["Env", "NoOptions", "Observation", "Step"]
