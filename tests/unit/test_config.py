"""Run configs: every recipe in configs/ validates, errors name the key path, the preset switch."""

from __future__ import annotations

from importlib.metadata import entry_points
from pathlib import Path

import pytest
import yaml

from trainer.config import PRESETS, ConfigError, TrainConfig, load_config
from trainer.evaluation import make_eval_jobs

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))
ENV_CLASSES = {ep.name: ep for ep in entry_points(group="stargym.envs")}


def problems_of(data: dict, tmp_path: Path) -> dict[str, str]:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert str(path) in str(caught.value)
    return dict(caught.value.problems)


def test_the_expected_recipes_exist() -> None:
    names = {path.stem for path in CONFIGS}
    assert {
        "bandit-tiny",
        "frozenlake-tiny",
        "sokoban-tiny",
        "textcraft-qwen2.5-7b-gpu",
        "sokoban-qwen2.5-0.5b-gpu",
        "babyai-tiny",
        "babyai-qwen2.5-7b-gpu",
        "sciworld-qwen2.5-7b-gpu",
        "searchqa-qwen2.5-7b-gpu",
        "searchqa-tiny",
        "webshop-qwen2.5-7b-gpu",
        "webshop-tiny",
        "textarena-frozenlake-tiny",
        "reasoning-countbits-tiny",
    } <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda path: path.stem)
def test_every_config_file_validates(path: Path) -> None:
    config = load_config(path)
    assert config.run.name
    assert config.hardware.strip()
    if path.stem.endswith("-gpu"):  # a GPU recipe says which GPUs, and never makes a tiny model
        assert any(gpu in config.hardware for gpu in ("A100", "H100", "GPU"))
        assert not config.model.init_tiny_if_missing
    else:
        assert "CPU" in config.hardware
    for env in config.envs.mix:  # env options are checked against the env's own model
        assert env.id in ENV_CLASSES, f"{path.name}: unknown env {env.id}"
        ENV_CLASSES[env.id].load().Options.model_validate(env.options or {})
        ENV_CLASSES[env.id].load().Options.model_validate(env.held_out_options or {})
    # round trip: the dump of a validated config is itself a valid config with the same values
    assert TrainConfig.from_dict(yaml.safe_load(config.to_yaml())) == config


def test_recipes_say_what_the_issue_says() -> None:
    by_name = {path.stem: load_config(path) for path in CONFIGS}
    bandit = by_name["bandit-tiny"]
    assert bandit.algorithm.norm_adv == "batch"
    lake = by_name["frozenlake-tiny"]
    assert (lake.rollout.groups_per_batch, lake.rollout.group_size) == (32, 4)
    assert (lake.rollout.max_staleness, lake.rollout.max_inflight) == (3, 512)
    assert lake.algorithm.advantage == "grpo" and lake.optim.lr == pytest.approx(2e-3)
    assert lake.envs.mix[0].options == {"size": 4} and lake.curriculum.schedule.max_turns(10_000) == 8
    assert lake.rollout.action_format == "plain" and lake.model.path == "models/tiny-frozenlake"
    craft = by_name["textcraft-qwen2.5-7b-gpu"]
    assert craft.curriculum.horizon_schedule == [(0, 10), (100, 20), (200, 30)]
    turns = [craft.curriculum.schedule.max_turns(step) for step in (0, 99, 100, 199, 200, 10_000)]
    assert turns == [10, 10, 20, 20, 30, 30]
    assert craft.algorithm.advantage == "grpo" and craft.optim.lr == pytest.approx(1e-6)
    assert craft.rollout.group_size == 8 and craft.algorithm.kl_coef == pytest.approx(0.001)
    assert "7B" in craft.model.path
    # AgentGym-RL's ScalingInter schedules: BabyAI 6/13/20, SciWorld 10/20/30, widened every 100 updates
    babyai, sciworld = by_name["babyai-qwen2.5-7b-gpu"], by_name["sciworld-qwen2.5-7b-gpu"]
    assert babyai.curriculum.horizon_schedule == [(0, 6), (100, 13), (200, 20)]
    assert sciworld.curriculum.horizon_schedule == [(0, 10), (100, 20), (200, 30)]
    assert (babyai.rollout.group_size, babyai.rollout.groups_per_batch) == (4, 32)
    assert (sciworld.rollout.group_size, sciworld.rollout.groups_per_batch) == (8, 16)
    assert babyai.envs.mix[0].options == {"level": "agentgym"}  # AgentGym's 40 levels
    assert by_name["babyai-tiny"].envs.mix[0].id == "embodied/babyai"
    searchqa = by_name["searchqa-qwen2.5-7b-gpu"]  # SearchQA 5/8/10
    assert searchqa.curriculum.horizon_schedule == [(0, 5), (100, 8), (200, 10)]
    assert (searchqa.rollout.group_size, searchqa.rollout.groups_per_batch) == (4, 32)
    for name in ("searchqa-tiny", "searchqa-qwen2.5-7b-gpu"):  # eval on held-out questions, never train's
        assert (by_name[name].envs.mix[0].held_out_options or {}).get("split", "train") != "train", name
    webshop = by_name["webshop-qwen2.5-7b-gpu"]  # AgentGym-RL's web schedule 8/12/15 every 80; WebShop's 15
    assert webshop.curriculum.horizon_schedule == [(0, 8), (80, 12), (160, 15)]
    assert webshop.envs.mix[0].held_out_options == {"split": "dev"}
    assert by_name["webshop-tiny"].envs.mix[0].options == {"split": "train", "start": "results"}
    sokoban = by_name["sokoban-qwen2.5-0.5b-gpu"]
    assert sokoban.preset == "starpo_s" and sokoban.starpo_s.filter.enabled
    assert (sokoban.rollout.groups_per_batch, sokoban.rollout.group_size) == (8, 16)
    assert tuple(sokoban.envs.mix[0].options["dim"]) == (6, 6)


def test_eval_options_override_the_mix_options_key_by_key_in_eval_jobs_only() -> None:
    config = TrainConfig.from_dict(
        {
            "envs": {
                "mix": [
                    {
                        "id": "search/searchqa",
                        "options": {"split": "train", "top_k": 5},
                        "eval_options": {"split": "dev"},
                    },
                    {"id": "game/frozenlake", "options": {"size": 4}},
                ]
            },
            "eval": {"episodes": 2},
        }
    )
    search, lake = config.envs.mix
    assert search.held_out_options == {"split": "dev", "top_k": 5}
    assert lake.held_out_options == {"size": 4}
    jobs = make_eval_jobs(config, "run", "l0", step=10, version=3)
    assert [(job.env, job.options) for job in jobs] == [
        ("search/searchqa", {"split": "dev", "top_k": 5}),
        ("search/searchqa", {"split": "dev", "top_k": 5}),
        ("game/frozenlake", {"size": 4}),
        ("game/frozenlake", {"size": 4}),
    ]
    assert search.options == {"split": "train", "top_k": 5}  # training jobs keep the mix's options


def test_held_out_episodes_play_the_last_stage_unless_eval_sets_a_turn_limit() -> None:
    schedule = {"curriculum": {"horizon_schedule": [[0, 1], [50, 8]]}, "eval": {"episodes": 1}}
    assert [
        job.max_turns for job in make_eval_jobs(TrainConfig.model_validate(schedule), "r", "l", 1, 1)
    ] == [8]
    fixed = TrainConfig.model_validate(schedule | {"eval": {"episodes": 1, "max_turns": 16}})
    assert [job.max_turns for job in make_eval_jobs(fixed, "r", "l", 1, 1)] == [16]


def test_defaults_follow_the_design() -> None:
    config = TrainConfig()
    algorithm = config.algorithm
    assert (algorithm.clip_low, algorithm.clip_high, algorithm.dual_clip) == (0.2, 0.28, 3.0)
    assert (algorithm.entropy_coef, algorithm.kl_coef, algorithm.loss_agg) == (0.001, 0.0, "token-mean")
    assert config.starpo_s.filter.ratio == 0.25 and config.starpo_s.filter.mode == "std"
    assert config.dashboard.port == 8300 and config.model.path == "models/tiny"
    assert config.metrics.wandb.mode == "offline"
    assert config.run_dir == Path("checkpoints") / config.run.name
    assert config.envs.url_for("game/frozenlake") == "http://127.0.0.1:8101"
    assert config.envs.url_for("web/shop") == "http://127.0.0.1:8104"


def test_unknown_keys_are_named_with_their_path(tmp_path: Path) -> None:
    problems = problems_of(
        {
            "algorithm": {"clip_hgih": 0.3},
            "rollout": {"sampling": {"temprature": 0.7}},
            "envs": {"mix": [{"id": "game/bandit"}, {"id": "game/frozenlake", "wieght": 2}]},
            "bogus": 1,
        },
        tmp_path,
    )
    expected = {"algorithm.clip_hgih", "rollout.sampling.temprature", "envs.mix[1].wieght", "bogus"}
    assert set(problems) == expected
    assert "did you mean 'clip_high'" in problems["algorithm.clip_hgih"]
    assert "did you mean 'temperature'" in problems["rollout.sampling.temprature"]
    assert "unknown key" in problems["bogus"]


def test_wrong_types_are_named_with_their_path(tmp_path: Path) -> None:
    problems = problems_of(
        {
            "rollout": {"group_size": "eight", "action_format": "xml"},
            "optim": {"bf16": "yes", "lr": -1},
            "algorithm": {"norm_adv": "grup"},
        },
        tmp_path,
    )
    assert set(problems) == {
        "rollout.group_size",
        "rollout.action_format",
        "optim.bf16",
        "optim.lr",
        "algorithm.norm_adv",
    }
    assert "'eight'" in problems["rollout.group_size"]


@pytest.mark.parametrize(
    ("schedule", "fragment"),
    [
        ([[0, 6], [100, 13], [100, 20]], "steps must increase"),
        ([[5, 6]], "start at step 0"),
        ([], "at least one stage"),
        ([[0, 0]], "max turns must be >= 1"),
    ],
)
def test_bad_horizon_schedules(tmp_path: Path, schedule: list, fragment: str) -> None:
    problems = problems_of({"curriculum": {"horizon_schedule": schedule}}, tmp_path)
    assert fragment in problems["curriculum.horizon_schedule"]


def test_bad_schedule_shape_names_the_entry(tmp_path: Path) -> None:
    problems = problems_of({"curriculum": {"horizon_schedule": [[0, 6], [100, "many"]]}}, tmp_path)
    assert list(problems) == ["curriculum.horizon_schedule[1][1]"]


def test_cross_field_problems_name_the_key(tmp_path: Path) -> None:
    problems = problems_of(
        {"envs": {"train_seeds": [0, 100], "eval_seeds": [50, 150], "mix": [{"id": "game/bandit"}] * 2}},
        tmp_path,
    )
    assert set(problems) == {"envs.eval_seeds", "envs.mix[1].id"}
    problems = problems_of({"algorithm": {"advantage": "gae"}}, tmp_path)
    assert list(problems) == ["algorithm.critic.enabled"]
    problems = problems_of({"eval": {"stop_at_success": 0.5, "every": 0}}, tmp_path)
    assert list(problems) == ["eval.stop_at_success"] and "eval.every" in problems["eval.stop_at_success"]
    problems = problems_of({"rollout": {"history_turns": 0, "agent": "my_agents:play"}}, tmp_path)
    assert (
        list(problems) == ["rollout.history_turns"] and "rollout.agent" in problems["rollout.history_turns"]
    )


def test_unreadable_and_non_mapping_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("run: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(bad)


def test_overrides_use_dotted_keys(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("run: {name: x}\n")
    config = load_config(path, {"optim.lr": 1e-4, "metrics.wandb.enabled": True})
    assert config.optim.lr == 1e-4 and config.metrics.wandb.enabled


VANILLA = {"filter": False, "kl_coef": 0.001, "clip_low": 0.2, "clip_high": 0.2}
STARPO_S = {"filter": True, "kl_coef": 0.0, "clip_low": 0.2, "clip_high": 0.28}


def switched(config: TrainConfig) -> dict:
    return {
        "filter": config.starpo_s.filter.enabled,
        "kl_coef": config.algorithm.kl_coef,
        "clip_low": config.algorithm.clip_low,
        "clip_high": config.algorithm.clip_high,
    }


def test_the_preset_switch_gives_vanilla_starpo_in_one_key() -> None:
    recipe = yaml.safe_load(next(p for p in CONFIGS if p.stem == "sokoban-qwen2.5-0.5b-gpu").read_text())
    assert switched(TrainConfig.from_dict(recipe)) == STARPO_S
    recipe["preset"] = "starpo"
    vanilla = TrainConfig.from_dict(recipe)
    assert switched(vanilla) == VANILLA
    # everything the preset does not own is unchanged
    assert vanilla.starpo_s.filter.ratio == 0.25 and vanilla.algorithm.advantage == "gae"
    assert set(PRESETS["starpo"]) == set(PRESETS["starpo_s"])


def test_a_preset_refuses_conflicting_explicit_values() -> None:
    assert switched(TrainConfig.from_dict({"preset": "starpo", "algorithm": {"kl_coef": 0.001}})) == VANILLA
    with pytest.raises(ConfigError) as caught:
        TrainConfig.from_dict(
            {"preset": "starpo", "algorithm": {"clip_high": 0.28}, "starpo_s": {"filter": {"enabled": True}}}
        )
    problems = dict(caught.value.problems)
    assert set(problems) == {"algorithm.clip_high", "starpo_s.filter.enabled"}
    assert "preset 'starpo'" in problems["algorithm.clip_high"]


def test_custom_preset_leaves_the_keys_alone() -> None:
    config = TrainConfig.from_dict({"algorithm": {"kl_coef": 0.05, "clip_high": 0.3}})
    assert (config.algorithm.kl_coef, config.algorithm.clip_high) == (0.05, 0.3)


def test_inflight_limit_is_derived_from_what_a_batch_needs() -> None:
    # preset starpo_s with defaults: 16 groups kept of ceil(16 / 0.25) = 64 candidates of 8 jobs.
    starpo_s = TrainConfig(preset="starpo_s")
    assert starpo_s.candidate_groups == 64
    assert starpo_s.rollout.max_inflight >= 64 * 8
    plain = TrainConfig()
    assert plain.candidate_groups == 16 and plain.rollout.max_inflight >= 16 * 8


def test_an_inflight_limit_below_one_batch_of_candidates_names_both_keys(tmp_path: Path) -> None:
    problems = problems_of({"preset": "starpo_s", "rollout": {"max_inflight": 256}}, tmp_path)
    assert list(problems) == ["rollout.max_inflight"]
    message = problems["rollout.max_inflight"]
    assert "512" in message and "starpo_s.filter.ratio" in message and "rollout.groups_per_batch" in message
