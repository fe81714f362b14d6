"""TextArena's single-player games as stargym envs: ids ``textarena/<game>``, one class per game (hosted.py)."""
