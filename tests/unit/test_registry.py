"""Finding env classes: entry-point families, dotted paths, file paths, and the errors for each."""

from __future__ import annotations

from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

from env_server import registry
from env_server.core import Env
from env_server.envs.game.bandit import BanditEnv
from env_server.registry import EnvLoadError, load_env_path, load_envs, load_family, registered_ids

REPO_ROOT = Path(__file__).resolve().parents[2]
CUSTOM_FILE = REPO_ROOT / "tests" / "integration" / "custom_env.py"
BANDIT_PATH = "env_server.envs.game.bandit:BanditEnv"


def fake_entry_points(monkeypatch: pytest.MonkeyPatch, mapping: dict[str, str]) -> None:
    points = [EntryPoint(name, value, registry.ENTRY_POINT_GROUP) for name, value in mapping.items()]

    def entry_points(group: str) -> list[EntryPoint]:
        assert group == registry.ENTRY_POINT_GROUP
        return points

    monkeypatch.setattr(registry, "entry_points", entry_points)


def test_the_game_family_is_registered() -> None:
    game = [env_id for env_id in registered_ids() if env_id.startswith("game/")]
    assert {"game/bandit", "game/frozenlake", "game/sokoban", "game/textcraft"} <= set(game)
    classes = load_family("game")
    assert list(classes) == sorted(game)
    assert classes["game/bandit"] is BanditEnv
    for env_id, env_class in classes.items():
        assert issubclass(env_class, Env) and env_class.env_id() == env_id


def test_family_selects_by_id_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    # the other family's module does not exist: selecting 'game' must not import it
    fake_entry_points(monkeypatch, {"game/bandit": BANDIT_PATH, "gamey/x": "no_such_module_xyz:X"})
    assert load_family("game") == {"game/bandit": BanditEnv}
    assert registered_ids() == ["game/bandit", "gamey/x"]


def test_unknown_family_lists_the_known_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_entry_points(monkeypatch, {"game/bandit": BANDIT_PATH, "web/shop": "x:Y"})
    with pytest.raises(
        EnvLoadError, match="no registered env in family 'embodied'; known families: game, web"
    ):
        load_family("embodied")


def test_entry_point_whose_class_has_another_id(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_entry_points(monkeypatch, {"game/dragon": BANDIT_PATH})
    with pytest.raises(EnvLoadError, match=r"'game/dragon' loads .*whose id is 'game/bandit'"):
        load_family("game")


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("no_such_module_xyz:X", "entry point 'game/x' .*fails to load: ModuleNotFoundError"),
        ("env_server.envs.game.bandit:Missing", "fails to load: AttributeError"),
        ("env_server.envs.game.bandit:BanditOptions", "is not a subclass of env_server.Env"),
    ],
)
def test_broken_entry_points(monkeypatch: pytest.MonkeyPatch, value: str, message: str) -> None:
    fake_entry_points(monkeypatch, {"game/x": value})
    with pytest.raises(EnvLoadError, match=message):
        load_family("game")


def test_dotted_path() -> None:
    assert load_env_path(BANDIT_PATH) is BanditEnv


def test_file_path() -> None:
    env_class = load_env_path(f"{CUSTOM_FILE}:MyEnv")
    assert env_class.env_id() == "custom/guess" and issubclass(env_class, Env)
    assert load_env_path(f"{CUSTOM_FILE}:SlowEnv").env_id() == "test/slow"


def test_dotted_path_from_the_working_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO_ROOT)
    assert load_env_path("tests.integration.custom_env:MyEnv").env_id() == "custom/guess"


def test_load_envs_combines_families_and_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_entry_points(monkeypatch, {"game/bandit": BANDIT_PATH})
    classes = load_envs(["game"], [f"{CUSTOM_FILE}:MyEnv", f"{CUSTOM_FILE}:SlowEnv"])
    assert list(classes) == ["game/bandit", "custom/guess", "test/slow"]
    assert load_envs([], [BANDIT_PATH]) == {"game/bandit": BanditEnv}
    with pytest.raises(EnvLoadError, match="nothing to serve"):
        load_envs([], [])


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("env_server.envs.game.bandit", "must look like 'package.module:Class' or 'file.py:Class'"),
        (":BanditEnv", "must look like"),
        ("env_server.envs.game.bandit:", "must look like"),
        ("no_such_module_xyz.sub:X", "cannot import 'no_such_module_xyz.sub': ModuleNotFoundError"),
        ("env_server.envs.game.bandit:Missing", "'env_server.envs.game.bandit' has no attribute 'Missing'"),
        ("env_server.envs.game.bandit:BanditOptions", "is not a subclass of env_server.Env"),
        ("env_server.envs.game.bandit:random", "is not a subclass of env_server.Env"),
        ("/no/such/dir/env.py:MyEnv", "env file '/no/such/dir/env.py' does not exist"),
        (f"{CUSTOM_FILE}:NotAnEnv", "is not a subclass of env_server.Env"),
        (
            f"{CUSTOM_FILE}:NoMetadataEnv",
            "lacks class metadata: name, family, instruction, action_format, default_max_turns, reward_range",
        ),
        (f"{CUSTOM_FILE}:Nope", "has no attribute 'Nope'"),
    ],
)
def test_env_path_errors(spec: str, message: str) -> None:
    with pytest.raises(EnvLoadError) as raised:
        load_env_path(spec)
    assert message in str(raised.value)
    assert isinstance(raised.value, ValueError)


def test_env_files_that_fail_to_import(tmp_path: Path) -> None:
    broken = tmp_path / "broken_env.py"
    broken.write_text("class Broken(:\n")
    with pytest.raises(EnvLoadError, match=r"cannot load env file .*broken_env.py.*SyntaxError"):
        load_env_path(f"{broken}:Broken")
    raising = tmp_path / "raising_env.py"
    raising.write_text("import no_such_module_xyz\n")
    with pytest.raises(EnvLoadError, match=r"cannot load env file .*ModuleNotFoundError.*no_such_module_xyz"):
        load_env_path(f"{raising}:X")
    # fixed on disk, the same file loads on the next try
    raising.write_text(CUSTOM_FILE.read_text())
    assert load_env_path(f"{raising}:MyEnv").env_id() == "custom/guess"


def test_a_module_that_raises_on_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "exploding_env_mod.py").write_text("raise RuntimeError('kaboom')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(EnvLoadError, match="cannot import 'exploding_env_mod': RuntimeError: kaboom"):
        load_env_path("exploding_env_mod:X")
