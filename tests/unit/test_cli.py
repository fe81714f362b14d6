"""The ``stargym`` command's top level: services start without torch, every command is still there."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO_ROOT

from deploy.cli import LAZY_COMMANDS

HEAVY = ("torch", "transformers")


def stargym(*args: str, code: str = "") -> subprocess.CompletedProcess[str]:
    """``python -m deploy ARGS`` in a fresh interpreter, ``code`` run after the CLI returns."""
    script = (
        "import sys\nfrom deploy.cli import app\n"
        f"try:\n    app({list(args)!r}, prog_name='stargym')\nexcept SystemExit:\n    pass\n{code}"
    )
    return subprocess.run(
        [sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )


def test_a_service_command_imports_neither_torch_nor_transformers() -> None:
    for args in (["env", "serve", "--help"], ["rollout", "--help"], ["engine", "serve", "--help"]):
        result = stargym(*args, code=f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))")
        assert result.returncode == 0, result.stderr
        assert result.stdout.rstrip().endswith("[]"), (args, result.stdout[-300:])


def test_every_command_is_listed_and_runs_its_own_help() -> None:
    listing = stargym("--help")
    assert listing.returncode == 0, listing.stderr
    for name in ("env", "model", "engine", "rollout", "eval", *LAZY_COMMANDS):
        assert f"│ {name} " in listing.stdout, (name, listing.stdout)
    train = stargym("train", "--help", code="print('torch' in sys.modules)")
    assert "Usage: stargym train [OPTIONS] {CONFIG}" in train.stdout, train.stdout
    assert train.stdout.rstrip().endswith("True")  # the config imports the estimator registry


def test_a_misspelt_command_is_matched_against_every_command() -> None:
    result = stargym("trian")
    assert "No such command 'trian'. Did you mean 'train'?" in result.stdout + result.stderr
