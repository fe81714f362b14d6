"""``stargym up`` lets its engine reload the policies the trainer publishes, wherever the run is."""

from __future__ import annotations

import os
from pathlib import Path

from deploy.train import load_train_config
from deploy.up import engine_env
from rollout_server.engine.settings import EngineSettings

CONFIG = Path("configs/frozenlake-tiny.yaml")


def test_a_run_outside_the_working_directory_is_a_weights_root(tmp_path: Path, monkeypatch) -> None:
    config = load_train_config(CONFIG, [f"run.output_dir={tmp_path / 'elsewhere'}"])
    for name, value in engine_env(config).items():
        monkeypatch.setenv(name, value)
    roots = EngineSettings(model=str(config.model.path)).allowed_weights_roots()
    published = (config.run_dir / "policy-v3").resolve()
    assert any(published.is_relative_to(root) for root in roots), (published, roots)
    assert Path(os.getcwd()).resolve() in roots
