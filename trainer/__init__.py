"""The trainer service: controller, updates, checkpoints, metrics (docs/architecture.md)."""
