"""``make demo``: train the tiny policy from random weights on FrozenLake, on this CPU, and show it learn.

1. the held-out seeds are played by the untrained policy (``stargym eval`` machinery, sampled);
2. ``stargym up configs/frozenlake-tiny.yaml`` brings up Redis, the game env server, the CPU engine,
   a rollout worker and the trainer, which trains for a time budget while a progress bar shows the
   update step, the reward, the success rate and the max turns of the current horizon;
3. the held-out seeds are played again by the newest published policy, and a table compares the two.

Everything runs as the real services over HTTP and Redis; the run directory (metrics, checkpoints,
every service's log) is ``runs/demo-<timestamp>/``. :func:`train_and_evaluate` is the same run
without the console, for the end-to-end learning tests.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from deploy.evaluation import EnvResult, EvalPlan, run_eval
from deploy.train import ensure_model, load_train_config
from deploy.up import ROLLOUT_NICENESS, EnginePlace, bring_up
from services.policy import latest_policy
from services.rollout_protocol import SamplingParams, Trajectory
from trainer.config import TrainConfig
from trainer.metrics import read_metrics

DEMO_CONFIG = Path("configs/frozenlake-tiny.yaml")
DEMO_MINUTES = 9.0
"""Training budget of the demo; with start-up and the two evaluations it ends in about 12 minutes."""


@dataclass
class EvalSummary:
    """One evaluation of a policy on the held-out seeds."""

    policy: str
    results: list[EnvResult]
    trajectories: Path
    first_actions: dict[str, int] = field(default_factory=dict)
    """How often each first action was chosen (the bandit's arm), over all episodes."""

    @property
    def episodes(self) -> int:
        return sum(r.episodes for r in self.results)

    @property
    def success(self) -> float:
        return sum(r.successes for r in self.results) / max(self.episodes, 1)

    @property
    def invalid_rate(self) -> float:
        turns = sum(r.total_turns for r in self.results)
        return sum(r.invalid_turns for r in self.results) / max(turns, 1)

    @property
    def mean_return(self) -> float:
        episodes = sum(r.episodes for r in self.results)
        return sum(r.total_return for r in self.results) / max(episodes, 1)

    def action_share(self, action: str) -> float:
        total = sum(self.first_actions.values())
        return self.first_actions.get(action.lower(), 0) / max(total, 1)


@dataclass
class DemoReport:
    config: TrainConfig
    before: EvalSummary
    after: EvalSummary
    steps: int
    train_minutes: float
    curve: list[dict[str, Any]]
    """Per update: step, minutes since the start of training, sampled success and reward."""


def evaluate(config: TrainConfig, model_dir: Path, out_dir: Path) -> EvalSummary:
    """Play the config's held-out seeds, with each env's held-out options, with ``model_dir`` (a CPU
    engine and env servers of its own)."""
    episodes = config.eval.episodes or len(config.envs.eval_seeds)
    sampling = SamplingParams(
        temperature=config.eval.temperature,
        top_p=config.rollout.sampling.top_p,
        max_tokens=config.rollout.sampling.max_tokens,
    )
    out = out_dir / "trajectories.jsonl"
    eval_config = EvalPlan(
        envs=[env.id for env in config.envs.mix],
        episodes=min(episodes, len(config.envs.eval_seeds)),
        max_turns=config.eval_max_turns,
        sampling=sampling,
        seed=config.envs.eval_seeds.start,
        concurrency=64,
        out=out,
        model=model_dir.resolve(),
        action_format=config.rollout.action_format,
        history_turns=config.rollout.history_turns,
        options={env.id: env.held_out_options for env in config.envs.mix if env.held_out_options},
    )
    results = run_eval(eval_config, Console(stderr=True, quiet=True))
    first: dict[str, int] = {}
    for line in out.read_text().splitlines():
        trajectory = Trajectory.model_validate_json(line)
        action = (
            trajectory.turns[0].actions[0].lower() if trajectory.turns and trajectory.turns[0].actions else ""
        )
        valid = bool(trajectory.turns) and trajectory.turns[0].valid
        key = action if valid else "<invalid>"
        first[key] = first.get(key, 0) + 1
    return EvalSummary(str(model_dir), results, out, first)


def learning_curve(run_dir: Path, started: float | None = None) -> list[dict[str, Any]]:
    records = read_metrics(run_dir)
    if not records:
        return []
    origin = started if started is not None else records[0]["time"]
    return [
        {
            "step": record["step"],
            "minutes": (record["time"] - origin) / 60.0,
            "success": record.get("rollout/success"),
            "reward": record.get("rollout/reward_mean"),
            "invalid": record.get("rollout/invalid_rate"),
        }
        for record in records
    ]


def train_and_evaluate(
    config_path: Path,
    overrides: list[str] | None = None,
    *,
    minutes: float,
    redis_url: str | None = None,
    console: Console | None = None,
    show_progress: bool = False,
    evaluate_before: bool = True,
    trainer_threads: int = 1,
    private: bool = False,
    rollout_niceness: int = ROLLOUT_NICENESS,
    engine_place: EnginePlace = EnginePlace.SERVER,
) -> DemoReport:
    """Evaluate the untrained policy, train for ``minutes`` with everything up, evaluate the result.

    ``private``: every service on a free port (``bring_up``'s), for callers that may run beside
    another stack, such as tests on several workers; ``rollout_niceness``, ``engine_place``:
    ``bring_up``'s."""
    console = console or Console(stderr=True, quiet=not show_progress)
    config = load_train_config(config_path, overrides)
    ensure_model(config)
    run_dir = config.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    model_dir = Path(config.model.path)
    if evaluate_before:
        console.print(f"Evaluating the untrained policy on {config.eval.episodes} held-out seeds …")
        before = evaluate(config, model_dir, run_dir / "eval-before")
    else:
        before = EvalSummary(str(model_dir), [], run_dir)
    console.print(f"Training for up to {minutes:g} minutes (total_steps {config.optim.total_steps}) …")
    started = time.time()
    with bring_up(
        config_path,
        overrides,
        trainer_args=["--max-minutes", str(minutes)],
        trainer_threads=trainer_threads,
        console=console,
        redis_url=redis_url,
        private=private,
        rollout_niceness=rollout_niceness,
        engine_place=engine_place,
    ) as stack:
        console.print(f"Watch it live: the dashboard is at {stack.trainer.url}/", highlight=False)
        if show_progress:
            _progress(stack, config, console)
        code = stack.wait_trainer()
        if code != 0:
            raise RuntimeError(f"the trainer exited with {code}:\n{stack.trainer.log()[-4000:]}")
    train_minutes = (time.time() - started) / 60.0
    published = latest_policy(run_dir)
    if published is None:
        raise RuntimeError(f"the run published no policy in {run_dir}")
    version, policy_dir = published
    console.print(f"Evaluating policy-v{version} on the same held-out seeds …")
    after = evaluate(config, policy_dir, run_dir / "eval-after")
    report = DemoReport(config, before, after, version, train_minutes, learning_curve(run_dir, started))
    (run_dir / "demo-report.json").write_text(json.dumps(report_dict(report), indent=2) + "\n")
    return report


def report_dict(report: DemoReport) -> dict[str, Any]:
    def summary(s: EvalSummary) -> dict[str, Any]:
        return {
            "policy": s.policy,
            "success": s.success,
            "episodes": s.episodes,
            "invalid_rate": s.invalid_rate,
            "mean_return": s.mean_return,
            "first_actions": s.first_actions,
        }

    return {
        "run": report.config.run.name,
        "steps": report.steps,
        "train_minutes": report.train_minutes,
        "before": summary(report.before),
        "after": summary(report.after),
        "curve": report.curve,
    }


def _progress(stack: Any, config: TrainConfig, console: Console) -> None:
    """A progress bar over update steps until the trainer process exits."""
    with Progress(
        TextColumn("[bold]training[/]"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn(
            "reward {task.fields[reward]}  success {task.fields[success]}  max turns {task.fields[turns]}"
        ),
        TimeElapsedColumn(),
        console=console,
    ) as progress:
        task = progress.add_task("train", total=config.optim.total_steps, reward="-", success="-", turns="-")
        while stack.trainer.process.poll() is None:
            status = stack.trainer_status(timeout_s=2.0)
            if status:
                metrics = status.get("metrics", {})
                progress.update(
                    task,
                    completed=status["step"],
                    reward=_fmt(metrics.get("rollout/reward_mean")),
                    success=_fmt(metrics.get("rollout/success")),
                    turns=str(status.get("max_turns", "-")),
                )
            time.sleep(1.0)


def _fmt(value: float | None) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.2f}"


def comparison_table(report: DemoReport) -> Table:
    table = Table(
        title=f"{report.config.run.name}: held-out seeds {report.config.envs.eval_seeds.start}.."
        f"{report.config.envs.eval_seeds.start + report.config.eval.episodes - 1}, sampled "
        f"(temperature {report.config.eval.temperature:g})",
        caption=f"{report.steps} updates in {report.train_minutes:.1f} minutes",
    )
    for column in ("policy", "success", "mean return", "invalid replies"):
        table.add_column(column, justify="left" if column == "policy" else "right")
    for name, summary in (("before (random weights)", report.before), ("after training", report.after)):
        table.add_row(
            name,
            f"{100 * summary.success:.1f}%",
            f"{summary.mean_return:.3f}",
            f"{100 * summary.invalid_rate:.1f}%",
        )
    return table


def main() -> None:
    console = Console()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    overrides = [f"run.name=frozenlake-tiny-demo-{stamp}", f"run.output_dir=runs/demo-{stamp}"]
    report = train_and_evaluate(
        DEMO_CONFIG, overrides, minutes=DEMO_MINUTES, console=console, show_progress=True
    )
    console.print(comparison_table(report))
    curve = report.curve
    if curve:
        marks = sorted(
            {0, *(i for i in range(len(curve)) if i % max(len(curve) // 8, 1) == 0), len(curve) - 1}
        )
        points = "  ".join(
            f"step {curve[i]['step']} ({curve[i]['minutes']:.1f} min): {_fmt(curve[i]['success'])}"
            for i in marks
        )
        console.print(f"sampled success during training: {points}", highlight=False)
    console.print(f"run directory: {report.config.run_dir}", highlight=False)


if __name__ == "__main__":
    main()
