"""Training on stargym envs from other frameworks, through OpenEnv's protocol (env_server/openenv.py)."""
