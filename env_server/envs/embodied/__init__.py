"""Embodied envs: BabyAI grid worlds (minigrid) and ScienceWorld."""
