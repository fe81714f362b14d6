"""Where a FrozenLake run's one-turn stage leaves its policy: P(first move) of its published policies.

The recipe's drift trap is set in its one-turn stage. While that stage teaches valid replies, a
move is pushed only in the groups that sampled it, so the expected push grows with the move's
probability and an early lead decides the mix the stage ends on; a mix short of Down never
reaches the goal, and with every group then scoring 0 nothing more is learnt (README,
Performance, "Why the trap survives the shared advantage"). This reads that mix off the policies
themselves: ``bench/learning.py --keep-runs DIR`` keeps every policy a run published
(``policy-vN``), and for each version asked for, the policy's next-token distribution after the
first prompt of the run's held-out episodes (``eval-after/trajectories.jsonl``: the token ids the
engine saw) is summed per move over its one-token spellings (``Right`` and `` Right``); the rest
is the share of invalid first replies.

    python bench/first_moves.py /work/runs/learning/learning-main-0 --versions 10,30,50
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
# Run as a script, bench/ is first on sys.path and bench/env_server.py would shadow the package.
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != REPO_ROOT / "bench"]
sys.path.insert(0, str(REPO_ROOT))

from bench.lake_references import trajectories  # noqa: E402
from env_server.envs.game.frozenlake import ACTION_NAMES  # noqa: E402
from rollout_server.actions import plain_stop_token_ids  # noqa: E402

HELD_OUT = Path("eval-after") / "trajectories.jsonl"
INVALID = "invalid"


def first_prompts(run_dir: Path, count: int) -> list[list[int]]:
    """The token ids before the first sampled token of up to ``count`` held-out episodes."""
    prompts = []
    for trajectory in trajectories(run_dir / HELD_OUT):
        if 1 in trajectory.loss_mask:
            prompts.append(trajectory.token_ids[: trajectory.loss_mask.index(1)])
        if len(prompts) == count:
            break
    if not prompts:
        raise ValueError(f"{run_dir / HELD_OUT}: no held-out episode with a sampled token")
    return prompts


def move_token_ids(tokenizer: Any) -> dict[str, list[int]]:
    """Each move's one-token spellings (bare and after a space): the ids the engine stops on."""
    return {move: plain_stop_token_ids(tokenizer, [move]) for move in ACTION_NAMES}


def first_move_probabilities(policy_dir: Path, prompts: list[list[int]]) -> dict[str, float]:
    """Mean over ``prompts`` of P(each move) for the next token, and of P(anything else).

    The prompts are left-padded into one batch with position ids counted from each prompt's
    first token, so every prompt is read as it would be alone.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    model = AutoModelForCausalLM.from_pretrained(policy_dir).eval()
    width = max(map(len, prompts))
    input_ids = torch.zeros((len(prompts), width), dtype=torch.long)
    attention = torch.zeros_like(input_ids)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        attention[row, width - len(prompt) :] = 1
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention, position_ids=positions).logits
    probabilities = logits[:, -1].float().softmax(-1)
    shares = {
        move: probabilities[:, ids].sum(-1).mean().item() for move, ids in move_token_ids(tokenizer).items()
    }
    shares[INVALID] = max(0.0, 1.0 - sum(shares.values()))
    return shares


def published_versions(run_dir: Path) -> list[int]:
    return sorted(int(path.name.removeprefix("policy-v")) for path in run_dir.glob("policy-v*"))


def held_out_success(run_dir: Path) -> float | None:
    """The run's end-of-run held-out success (``demo-report.json``), if it got that far."""
    report = run_dir / "demo-report.json"
    return json.loads(report.read_text())["after"]["success"] if report.exists() else None


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("runs", type=Path, nargs="+", help="Run directories kept by bench/learning.py.")
    parser.add_argument(
        "--versions",
        default="10,30,50",
        help="Comma-separated policy versions to read (the recipe's one-turn stage ends at 50).",
    )
    parser.add_argument("--prompts", type=int, default=128, help="Held-out first prompts per policy.")
    parser.add_argument("--out", type=Path, default=None, help="Also write the table as JSON here.")
    return parser.parse_args()


def main() -> int:
    import torch

    torch.set_num_threads(1)  # one small forward per policy; leaves the other core to a running bench
    args = parse_args()
    versions = [int(version) for version in args.versions.split(",") if version.strip()]
    table: dict[str, Any] = {}
    for run_dir in args.runs:
        prompts = first_prompts(run_dir, args.prompts)
        missing = sorted(set(versions) - set(published_versions(run_dir)))
        if missing:
            print(f"{run_dir}: no policy-v{missing[0]} (bench/learning.py --keep-runs keeps every one)")
            return 2
        rows = {
            version: first_move_probabilities(run_dir / f"policy-v{version}", prompts) for version in versions
        }
        success = held_out_success(run_dir)
        table[run_dir.name] = {"held_out_success": success, "first_moves": rows}
        cells = " | ".join(
            f"v{version}: " + " ".join(f"{move} {share:.2f}" for move, share in row.items())
            for version, row in rows.items()
        )
        ending = "unfinished" if success is None else f"{success:.2f}"
        print(f"{run_dir.name}  held-out {ending} | {cells}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(table, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
