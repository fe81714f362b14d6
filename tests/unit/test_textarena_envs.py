"""The textarena family in-process: per-seed determinism, new feedback beside the whole history, each
game's own randomness, options, rewards, the repaired TextArena bugs, the excluded games' reasons."""

from __future__ import annotations

import importlib
import random
import threading
from collections.abc import Callable
from typing import Any

import nltk
import numpy as np
import pytest
import textarena as ta
from pydantic import ValidationError
from textarena.envs.registration import ENV_REGISTRY
from textarena.wrappers import ActionFormattingWrapper
from textarena_moves import FIRST_MOVES, GARBAGE, SEED

from env_server.core import EnvFailure
from env_server.envs.textarena.env import TextArenaEnv, bracketed
from env_server.envs.textarena.hosted import ENV_CLASSES
from env_server.pool import parse_options
from env_server.registry import load_family, registered_ids
from services.errors import ApiError

GAMES = sorted(ENV_CLASSES)
# Games whose opening is the same for every seed: the secret, if any, is hidden (Minesweeper lays its
# mines on the first move).
FIXED_OPENING = {
    "countdown",
    "cryptarithm",
    "guess_the_number",
    "mastermind",
    "minesweeper",
    "peg_jump",
    "tower_of_hanoi",
}
Play = list[tuple[str, float, bool, bool]]


def make(env_id: str, seed: int = SEED, **options: Any) -> tuple[TextArenaEnv, str]:
    env_class = ENV_CLASSES[env_id]
    env = env_class()
    return env, env.reset(seed, env_class.Options(**options)).observation


def script(env: TextArenaEnv, length: int = 8) -> list[str]:
    """Moves that exercise the game: its legal first move, then its listed actions in turn (which keep
    2048 spawning tiles and Blackjack dealing cards: draws from ``random``), else its legal move,
    example and garbage."""
    game = env.game
    pool = env.available_actions() or [FIRST_MOVES[game.name], game.example, GARBAGE]
    return [FIRST_MOVES[game.name]] + [pool[turn % len(pool)] for turn in range(length - 1)]


def play(env: TextArenaEnv, moves: list[str]) -> Play:
    played = []
    for move in moves:
        step = env.step(move)
        played.append((step.observation, step.reward, step.done, step.info["valid"]))
        if step.done:
            break
    return played


def play_new(env_id: str, seed: int, length: int = 8) -> tuple[str, Play]:
    env, opening = make(env_id, seed)
    return opening, play(env, script(env, length))


def test_entry_points_are_the_generated_classes() -> None:
    assert load_family("textarena") == ENV_CLASSES
    assert [env_id for env_id in registered_ids() if env_id.startswith("textarena/")] == GAMES
    assert sorted(f"textarena/{name}" for name in FIRST_MOVES) == GAMES


def test_the_move_rule_is_textarenas_and_every_variant_uses_it() -> None:
    wrapper = ActionFormattingWrapper(ta.make("GuessTheNumber-v0-raw"))
    for reply in ["5", "[5]", "guess [5]", "5]", "up", ""]:
        assert bracketed(reply) == wrapper.action(reply)
    for env_class in ENV_CLASSES.values():
        for variant in env_class.Options.model_fields["variant"].annotation.__args__:
            assert ActionFormattingWrapper in ENV_REGISTRY[variant].default_wrappers, variant


@pytest.mark.parametrize("env_id", GAMES)
def test_a_seed_replays_its_game(env_id: str) -> None:
    first = play_new(env_id, SEED)
    assert play_new(env_id, SEED) == first
    env, opening = make(env_id, 99)  # a reset of a used instance replays the same seed's game too
    moves = script(env)
    play(env, moves)
    assert (env.reset(SEED, env.Options()).observation, play(env, moves)) == first
    if env.game.name not in FIXED_OPENING:
        assert opening != first[0]


@pytest.mark.parametrize("env_id", GAMES)
def test_an_observation_is_the_new_feedback_and_the_history_everything(env_id: str) -> None:
    env_class = ENV_CLASSES[env_id]
    env = env_class()
    opened = env.reset(SEED, env_class.Options())
    history = opened.info["history"]
    assert history.startswith("[GAME] ") and history.replace("[GAME] ", "") == opened.observation
    prompt = opened.observation.splitlines()[0]
    for move in script(env):
        step = env.step(move)
        said = f"{history}\n[Player] {bracketed(move)}"
        assert step.info["history"].startswith(said)
        assert step.info["history"][len(said) :].replace("\n[GAME] ", "\n") == "\n" + step.observation
        assert step.observation and prompt not in step.observation
        history = step.info["history"]
        if step.done:
            break


@pytest.mark.parametrize("env_id", GAMES)
def test_legal_and_garbage_first_moves(env_id: str) -> None:
    name = ENV_CLASSES[env_id].game.name
    env, _ = make(env_id)
    garbage = env.step(GARBAGE)
    assert (garbage.reward, garbage.done, garbage.info["valid"]) == (0.0, False, False)
    assert "invalid move" in garbage.observation
    legal = env.step(FIRST_MOVES[name])
    assert legal.info["valid"], legal.observation
    actions = env.available_actions()
    assert actions is None or FIRST_MOVES[name] in actions


def test_a_second_invalid_move_in_a_row_ends_the_game_with_textarenas_reward() -> None:
    env, _ = make("textarena/guess_the_number")
    env.step("[10]")  # too low: the secret is 13, 3 away on a range of 19
    env.step(GARBAGE)
    end = env.step(GARBAGE)
    assert (end.done, end.info["valid"], end.info["success"]) == (True, False, False)
    assert end.reward == pytest.approx(1 - 3 / 19)
    assert end.observation == end.info["reason"] and end.observation.startswith("Invalid Move:")


def test_winning_scores_one() -> None:
    env, _ = make("textarena/tower_of_hanoi")
    moves = ["A C", "A B", "C B", "A C", "B A", "B C", "A C"]  # the 7-move solution, brackets added
    steps = [env.step(move) for move in moves]
    assert [step.reward for step in steps] == [0.0] * 6 + [1.0]
    assert [step.done for step in steps] == [False] * 6 + [True]
    assert steps[-1].info["success"] and "Congratulations" in steps[-1].observation


def test_a_solved_fifteen_puzzle_is_a_win_not_a_crash() -> None:
    # TextArena's FifteenPuzzle ends a solved puzzle with set_winners, a two-player method (fixes.py).
    env, _ = make("textarena/fifteen_puzzle")
    env._arena.board = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, None, 15]]
    solved = env.step("[left]")
    assert (solved.reward, solved.done, solved.info["success"]) == (1.0, True, True)


def test_arguments_out_of_order_are_put_back() -> None:
    # Countdown calls set_invalid_move(progress, reason): its warning would read "Reason: 0.568"
    # and its end reward be the reason's text.
    env, _ = make("textarena/countdown")
    warned = env.step(GARBAGE)
    assert "Reason: Invalid action format" in warned.observation
    end = env.step(GARBAGE)
    assert end.done and end.reward == pytest.approx(1 - 432 / 1000)  # best 100 for the target 532


def test_textarena_crashes_are_env_failures() -> None:
    # LightsOut's completion fraction divides by the lights on at the start: none, for this seed.
    with pytest.raises(EnvFailure, match=r"LightsOut-v0 raised ZeroDivisionError"):
        make("textarena/lights_out", seed=10067)


@pytest.mark.parametrize("env_id", GAMES)
def test_rewards_come_at_the_end_within_the_range(env_id: str) -> None:
    env_class = ENV_CLASSES[env_id]
    low, high = env_class.reward_range
    for seed in range(3):
        env, _ = make(env_id, seed)
        rng = random.Random(seed)
        pool = env.available_actions() or [FIRST_MOVES[env_class.game.name], env_class.game.example, GARBAGE]
        for _ in range(env_class.default_max_turns):
            step = env.step(rng.choice([*pool, GARBAGE]))
            if step.done:
                assert low <= step.reward <= high and isinstance(step.info["success"], bool)
                break
            assert step.reward == 0.0 and "success" not in step.info


def interleaved(runs: list[tuple[str, int]], length: int) -> list[tuple[str, Play]]:
    """Reset every game, then step them in turn, one move each, until each script is played out."""
    envs = [make(env_id, seed) for env_id, seed in runs]
    scripts = [script(env, length) for env, _ in envs]
    played: list[Play] = [[] for _ in runs]
    for turn in range(length):
        for index, (env, _) in enumerate(envs):
            if not (played[index] and played[index][-1][2]):  # not done yet
                played[index] += play(env, [scripts[index][turn]])
    return [(opening, moves) for (_, opening), moves in zip(envs, played, strict=True)]


# 2048 and Blackjack draw from `random` at every move, Minesweeper lays its mines on the first.
MIXED = [
    ("textarena/2048", 1),
    ("textarena/2048", 2),
    ("textarena/blackjack", 1),
    ("textarena/minesweeper", 3),
    ("textarena/secretary", 4),
    ("textarena/blackjack", 5),
]


def test_interleaved_games_play_as_they_do_alone() -> None:
    alone = [play_new(env_id, seed, 12) for env_id, seed in MIXED]
    assert interleaved(MIXED, 12) == alone


def test_games_in_threads_play_as_they_do_alone() -> None:
    chunks = [[(env_id, seed + 10 * copy) for env_id, seed in MIXED] for copy in range(3)]
    alone = [[play_new(env_id, seed, 12) for env_id, seed in chunk] for chunk in chunks]
    results: list[list[tuple[str, Play]]] = [[] for _ in chunks]
    barrier = threading.Barrier(len(chunks))

    def worker(index: int) -> None:
        barrier.wait()
        results[index] = interleaved(chunks[index], 12)

    threads = [threading.Thread(target=worker, args=(index,)) for index in range(len(chunks))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == alone


def test_playing_leaves_the_global_generators_alone() -> None:
    random.seed(7)
    python_state = random.getstate()
    numpy_state = np.random.get_state()
    for env_id in GAMES:
        play_new(env_id, SEED, 4)
    assert random.getstate() == python_state
    after = np.random.get_state()
    assert after[0] == numpy_state[0] and (after[1] == numpy_state[1]).all() and after[2:] == numpy_state[2:]


def test_textarenas_prints_are_silenced(capsys: pytest.CaptureFixture[str]) -> None:
    env, _ = make("textarena/logic_puzzle")  # TextArena prints "Correct: 0, Total: 18" every move
    env.step(FIRST_MOVES["logic_puzzle"])
    assert capsys.readouterr().out == ""


def test_a_variant_is_chosen_by_option() -> None:
    assert ENV_CLASSES["textarena/guess_the_number"].Options().variant == "GuessTheNumber-v0"
    _, opening = make("textarena/guess_the_number", variant="GuessTheNumber-v0-hardcore")
    assert "between 1 and 50" in opening
    env, _ = make("textarena/tower_of_hanoi", variant="TowerOfHanoi-v0-medium")
    assert len(env.available_actions() or []) == 6
    assert (
        env.reset(SEED, env.Options(variant="TowerOfHanoi-v0-hard")).info["variant"] == "TowerOfHanoi-v0-hard"
    )


@pytest.mark.parametrize(
    "options",
    [
        {"variant": "GuessTheNumber-v1"},
        {"variant": "GuessTheNumber-v0-raw"},  # a wrapper alias, not a variant
        {"variant": "GuessTheNumber-v0-train"},
        {"variant": "TowerOfHanoi-v0"},  # another game's
        {"variant": 3},
        {"seed": 3},
    ],
)
def test_bad_options_are_rejected(options: dict[str, Any]) -> None:
    env_class = ENV_CLASSES["textarena/guess_the_number"]
    with pytest.raises(ValidationError):
        env_class.Options(**options)
    with pytest.raises(ApiError) as raised:
        parse_options(env_class, options)
    assert raised.value.status == 422


def test_metadata() -> None:
    for env_id, env_class in ENV_CLASSES.items():
        assert env_class.env_id() == env_id and env_class.family == "textarena"
        assert not env_class.runs_inline and env_class.default_max_turns >= 1
        assert (
            env_class.game.example in env_class.instruction
            and env_class.game.example in env_class.action_format
        )


def test_bandit_scores_the_best_button_zero() -> None:
    # Why games.py leaves TextArena's Bandit out: its reward points the wrong way.
    bandit = ta.make("Bandit-v0-raw")
    bandit.reset(num_players=1, seed=5)
    means = bandit.state.game_state["ground_truth"]
    best = max(means, key=means.get)
    done = False
    while not done:
        done, _ = bandit.step(f"[{best}]")
    rewards, game_info = bandit.close()
    assert rewards == {0: 0.0} and game_info[0]["reason"] == "You chose an incorrect button."


@pytest.mark.parametrize(
    ("load", "error", "message"),
    [
        (lambda: importlib.import_module("textarena.envs.Klondike.env"), SyntaxError, "invalid syntax"),
        (lambda: importlib.import_module("textarena.envs.UltimateTexasHoldem.env"), SyntaxError, "f-string"),
        (lambda: importlib.import_module("textarena.envs.BabyAiText.env"), ImportError, "'gym'"),
        # what Hangman, WordLadder, WordSearch and Wordle load (here, without trying to download it)
        (lambda: nltk.data.find("corpora/words"), LookupError, "words"),
        (lambda: ta.make("GuessWho-v0"), ValueError, "OpenRouter API key"),
        (lambda: ta.make("TwentyQuestions-v0"), ValueError, "OpenRouter API key"),
    ],
)
def test_the_excluded_games_fail_as_games_py_says(
    load: Callable[[], object], error: type[Exception], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OPENROUTER_API_KEY", raising=False)
    with pytest.raises(error, match=message):
        load()
