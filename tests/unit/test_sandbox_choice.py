"""Which envs the host sandboxes (env_server/sandbox.py): the untrusted, or all; never a page server."""

from __future__ import annotations

import pytest

from env_server.registry import load_env_path, load_family
from env_server.sandbox import locator, sandboxed_ids

GUESS = load_env_path("tests/integration/custom_env.py:MyEnv")


def test_untrusted_envs_are_sandboxed_and_trusted_ones_stay_in_the_server() -> None:
    classes = {**load_family("game"), GUESS.env_id(): GUESS}
    assert sandboxed_ids(classes, "untrusted") == ["custom/guess"]
    assert sandboxed_ids(classes, "all") == sorted(classes)


def test_an_env_that_serves_pages_from_its_object_cannot_be_sandboxed() -> None:
    with pytest.raises(TypeError, match="trusted = True"):
        sandboxed_ids(load_family("web"), "all")


def test_the_zygote_finds_classes_of_modules_and_of_files() -> None:
    assert locator(load_family("game")["game/bandit"]) == "env_server.envs.game.bandit:BanditEnv"
    assert locator(GUESS).endswith("tests/integration/custom_env.py:MyEnv")
    assert load_env_path(locator(GUESS)).env_id() == "custom/guess"
