"""The rollout service: engines, the episode loop, the queue worker (docs/architecture.md)."""
