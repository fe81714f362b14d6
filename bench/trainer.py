"""Trainer update benchmark (``make bench``): PolicyUpdater.update against a bare training loop.

It makes the tiny default policy in a temp dir and samples one update batch shaped like the
``frozenlake-tiny`` recipe's: 16 groups x 8 episodes, 1-8 turns each (the horizon after the
schedule's one-turn stage), a 125-token first prompt (FrozenLake's instruction and map,
chat-formatted), 33-token observations and replies of the recipe's ``max_tokens`` that stop at an
action token, sampled from the model itself at the recipe's temperature (real behaviour log-probs). Sampling runs on one torch thread (one-token forwards). Then, in this same run and on the same batch, alternating:

* bare: the same micro-batches (``optim.micro_batch_tokens``), each ``model(...)`` -> mean
  cross-entropy of the trainable tokens -> ``backward()``, then one ``optimizer.step()`` (AdamW);
* updater: ``PolicyUpdater.update`` with the recipe's config (GRPO advantages, PPO loss against
  the behaviour log-probs, entropy bonus, the log-prob gap, gradient clipping, LR schedule, metrics).

Throughput is real (unpadded) tokens per second of update; the overhead is
``bare tokens/s / updater tokens/s - 1`` (target <= 15%). It is negative since the updater
computes each group's shared first prompt once (``trainer/shared_prefix.py``), which the bare
loop, one ordinary pass per micro-batch, does not: on this batch that is 125 of ~240 tokens an
episode. Results go to ``bench/results/trainer.json``.

``--device cuda``: the batch is still sampled on the CPU, then the batch, both models and both
timed loops are on the GPU, and every timer is read after ``torch.cuda.synchronize()``. The
updater's ``bf16: auto`` autocasts to bfloat16 there, so the bare loop runs its forwards under the
same autocast. On the CPU both are float32, except on a CPU with AMX, where ``auto`` autocasts too:
there the same update in float32 is timed in the same rounds as well, and its ratio printed. Results go to ``bench/results/trainer-cuda.json``
(with the GPU's name), so the CPU numbers stay. ``deploy/gpu/check_trainer.sh`` runs it.

``--shape qwen2.5-0.5b``: the same batch through a model of Qwen2.5-0.5B's architecture (24 layers,
hidden 896, 14 query and 2 key-value heads, a 151,936-token vocabulary; random weights, since no
weights can be fetched here) instead of the tiny one, to see where an update's time goes at a real
model's size. Results then go to ``trainer-<shape>[-cuda].json``.

``--run RUN_DIR``: instead of a sampled batch, the newest whole batch that run trained (its
``trajectories.jsonl``, the dashboard's record of every kept trajectory), with the run's config and
its newest checkpoint's policy: the update timed on what a run really trains on, e.g. one with a
``rollout.history_turns`` window, whose every turn is a row. Results go to ``trainer-run.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# Run as a script, bench/ is first on sys.path and bench/env_server.py would shadow the package.
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT))

import orjson  # noqa: E402
import torch  # noqa: E402

from deploy.model_init import init_tiny_model  # noqa: E402
from services.policy import load_policy  # noqa: E402
from services.rollout_protocol import Trajectory  # noqa: E402
from tests.synthetic import synthetic_trajectories  # noqa: E402
from trainer.batch import TrainBatch, collate, micro_batches  # noqa: E402
from trainer.checkpoint import CheckpointStore  # noqa: E402
from trainer.config import TrainConfig, load_config  # noqa: E402
from trainer.dashboard.samples import TRAJECTORIES_FILE  # noqa: E402
from trainer.update import PolicyUpdater  # noqa: E402

CONFIG = ROOT / "configs" / "frozenlake-tiny.yaml"
RESULTS = ROOT / "bench" / "results" / "trainer.json"
CUDA_RESULTS = ROOT / "bench" / "results" / "trainer-cuda.json"
RUN_RESULTS = ROOT / "bench" / "results" / "trainer-run.json"
# By class path, not the registered id "game/frozenlake": the same env and tiny model, without
# needing the package's entry-point metadata (`pip install -e .`), which a GPU machine may lack.
FROZENLAKE = "env_server.envs.game.frozenlake:FrozenLakeEnv"
ACTIONS = ["Left", "Right", "Up", "Down"]
SHAPES: dict[str, dict[str, object]] = {
    "tiny": {},
    # Qwen2.5-0.5B's config.json (the architecture only: the weights stay random).
    "qwen2.5-0.5b": {
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": 151936,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "max_window_layers": 24,
        "layer_types": ["full_attention"] * 24,
    },
}


def shaped_model(tiny_dir: Path, shape: str, out: Path) -> Path:
    """``tiny_dir``'s tokenizer and config with ``SHAPES[shape]`` on top, random weights (seed 0)."""
    if not SHAPES[shape]:
        return tiny_dir
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(tiny_dir)
    config.update(SHAPES[shape])
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_dir).save_pretrained(out)
    return out


def sampled_batch(
    model: torch.nn.Module, tokenizer: Any, config: TrainConfig, *, one_thread: bool
) -> list[Trajectory]:
    """One batch of ``config``'s shape sampled from ``model``: see the module doc. ``one_thread``:
    for the tiny model, whose one-token forwards threads only slow down."""
    vocab = [i for i in range(len(tokenizer)) if i not in tokenizer.all_special_ids]
    stops = [tokenizer.convert_tokens_to_ids(tokenizer.tokenize(action))[0] for action in ACTIONS]
    threads = torch.get_num_threads()
    if one_thread:
        torch.set_num_threads(1)
    sampled_groups = config.rollout.groups_per_batch
    sampled = synthetic_trajectories(
        model,
        groups=sampled_groups,
        group_size=config.rollout.group_size,
        vocab_ids=vocab,
        first_prompt_len=125,
        observation_len=33,
        # The horizon after the schedule's one-turn stage, where the demo spends most updates:
        # 1-8 turns, ~280 tokens an episode, ~35k a batch, as its live updates have. (The first
        # stage's cap, 1, gave one-turn episodes of 126 tokens: a batch the demo rarely trains on.)
        turns=(1, config.curriculum.schedule.final_max_turns),
        sampling=config.rollout.sampling,
        stop_token_ids=stops,
        seed=0,
    )
    torch.set_num_threads(threads)
    copies = -(-config.rollout.groups_per_batch // sampled_groups)
    return [
        t.model_copy(update={"group_id": f"{t.group_id}-copy{copy}", "job_id": f"{t.job_id}-copy{copy}"})
        for copy in range(copies)
        for t in sampled
    ][: config.rollout.batch_size]


def recorded_batch(run_dir: Path, config: TrainConfig) -> tuple[int, list[Trajectory]]:
    """``(step, trajectories)``: the newest update of ``run_dir`` whose whole batch is in its
    ``trajectories.jsonl`` (older updates may have rotated out; a multi-rank run records each
    rank's share, so any rank's file lacks the others')."""
    kept: dict[int, list[dict[str, object]]] = {}
    for line in (run_dir / TRAJECTORIES_FILE).read_bytes().splitlines():
        record = orjson.loads(line)
        if record["status"] == "kept":
            kept.setdefault(record["step"], []).append(record)
    whole = [step for step, records in kept.items() if len(records) >= config.rollout.batch_size]
    if not whole:
        raise SystemExit(
            f"{run_dir / TRAJECTORIES_FILE}: no update with all {config.rollout.batch_size} of its "
            "trajectories recorded"
        )
    step = max(whole)
    fields = Trajectory.model_fields.keys()
    return step, [
        Trajectory.model_validate({key: value for key, value in record.items() if key in fields})
        for record in kept[step]
    ]


def bare_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: TrainBatch,
    budget: int,
    autocast: bool = False,
) -> None:
    """forward + backward per micro-batch, one optimizer step: the floor an update cannot beat.
    ``autocast``: the forwards in bfloat16 autocast, as the updater's are on a GPU."""
    total = batch.response_mask.sum().clamp(min=1.0)
    device_type = batch.input_ids.device.type
    for micro in micro_batches(batch, budget):
        with torch.autocast(device_type=device_type, dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=micro.input_ids, attention_mask=micro.attention_mask).logits
        positions = micro.response_mask[:, 1:].bool()
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1][positions].float(), micro.input_ids[:, 1:][positions], reduction="sum"
        )
        (loss / total).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="Timed rounds of each (after one warm-up).")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's).")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny", help="The model's architecture.")
    parser.add_argument(
        "--device",
        default="cpu",
        help="Where both loops run: cpu, or cuda (results then go to bench/results/trainer-cuda.json).",
    )
    parser.add_argument(
        "--run",
        type=Path,
        default=None,
        help="A run directory: time the update on its newest recorded batch, with its config and policy.",
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type not in ("cpu", "cuda"):
        parser.error(f"--device must be cpu or cuda, not {args.device!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: torch {torch.__version__} sees no CUDA GPU")
    if args.run is not None and args.shape != "tiny":
        parser.error("--run times the run's own policy: --shape does not apply")
    results_path = CUDA_RESULTS if device.type == "cuda" else RESULTS
    if args.run is not None:
        results_path = RUN_RESULTS
    if args.shape != "tiny":
        results_path = results_path.with_name(results_path.name.replace("trainer", f"trainer-{args.shape}"))
    if args.threads:
        torch.set_num_threads(args.threads)

    def now() -> float:
        """``perf_counter`` once the GPU's queued work is done: a timer read waits for the kernels."""
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    config = load_config(CONFIG if args.run is None else args.run / "config.yaml")
    budget = config.optim.micro_batch_tokens
    source = "sampled"
    sample_s = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        if args.run is None:
            tiny_dir = init_tiny_model(Path(tmp) / "tiny", 0, [FROZENLAKE], 20, 8)
            model_dir = shaped_model(tiny_dir, args.shape, Path(tmp) / args.shape)
        else:
            store = CheckpointStore(args.run, read_only=True)
            latest = store.latest()
            if latest is None:
                parser.error(f"--run {args.run}: no checkpoint to take the policy from")
            model_dir = store.step_dir(latest) / "policy"
        model, tokenizer = load_policy(model_dir)
        if args.run is None:
            started = time.perf_counter()
            trajectories = sampled_batch(model, tokenizer, config, one_thread=args.shape == "tiny")
            sample_s = time.perf_counter() - started
        else:
            step, trajectories = recorded_batch(args.run, config)
            source = f"{args.run} (update {step}, policy of step {latest})"
        batch = collate(trajectories, tokenizer.pad_token_id).to(device)
        bare_model, _ = load_policy(model_dir)
        bare_model.to(device).train()
        bare_optimizer = torch.optim.AdamW(
            bare_model.parameters(),
            lr=config.optim.lr,
            betas=config.optim.betas,
            weight_decay=0.0,
            foreach=True,
        )
        updater = PolicyUpdater(model, config, device=device)  # moves the sampling model there
        # On an AMX CPU `bf16: auto` autocasts: time the float32 update in the same rounds too, so
        # the gain is a ratio from one run (a GPU's float32 Qwen-size update may not fit beside it).
        float32_updater = None
        if device.type == "cpu" and updater.autocast:
            float32_config = config.model_copy(
                update={"optim": config.optim.model_copy(update={"bf16": False})}
            )
            float32_updater = PolicyUpdater(load_policy(model_dir)[0], float32_config, device=device)

    tokens = batch.num_tokens
    bare_times: list[float] = []
    update_times: list[float] = []
    float32_times: list[float] = []
    metrics: dict[str, float] = {}
    for round_index in range(args.rounds + 1):
        started = now()
        bare_step(bare_model, bare_optimizer, batch, budget, autocast=updater.autocast)
        bare_s = now() - started
        started = now()
        metrics = updater.update(batch)
        update_s = now() - started
        if float32_updater is not None:
            started = now()
            float32_updater.update(batch)
            float32_s = now() - started
        if round_index > 0:  # the first round warms them up
            bare_times.append(bare_s)
            update_times.append(update_s)
            if float32_updater is not None:
                float32_times.append(float32_s)
    bare_tps = tokens / statistics.median(bare_times)
    update_tps = tokens / statistics.median(update_times)
    overhead = bare_tps / update_tps - 1.0
    float32_tps = tokens / statistics.median(float32_times) if float32_times else None
    result = {
        "batch": {
            "source": source,
            "episodes": len(trajectories),
            "rows": batch.size,
            "tokens": tokens,
            "trainable_tokens": batch.num_trainable_tokens,
            "padded_len": batch.seq_len,
            "micro_batches": len(micro_batches(batch, budget)),
            "micro_batch_tokens": budget,
            "sampled_in_s": round(sample_s, 2),
        },
        "bare_tokens_per_s": round(bare_tps, 1),
        "updater_tokens_per_s": round(update_tps, 1),
        "overhead_pct": round(100 * overhead, 1),
        "target_overhead_pct": 15.0,
        "rounds": args.rounds,
        "bare_s": [round(t, 4) for t in bare_times],
        "update_s": [round(t, 4) for t in update_times],
        "float32_updater_tokens_per_s": round(float32_tps, 1) if float32_tps else None,
        "float32_update_s": [round(t, 4) for t in float32_times],
        "last_metrics": {k: round(v, 6) for k, v in metrics.items()},
        "shape": args.shape,
        "parameters": sum(p.numel() for p in bare_model.parameters()),
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "bf16_autocast": updater.autocast,
        "gpu_max_memory_mib": (
            round(torch.cuda.max_memory_allocated(device) / 2**20, 1) if device.type == "cuda" else None
        ),
        "torch_threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    results_path.parent.mkdir(parents=True, exist_ok=True)
    results_path.write_text(json.dumps(result, indent=1) + "\n")
    where = result["gpu"] or platform.machine()
    print(
        f"device: {device} ({where}), model: {args.shape} ({result['parameters']:,} parameters), "
        f"bf16 autocast: {'on' if updater.autocast else 'off'}"
    )
    print(
        f"batch ({source}): {len(trajectories)} episodes in {batch.size} rows, {tokens} tokens "
        f"({batch.num_trainable_tokens} trainable), {result['batch']['micro_batches']} micro-batch(es)"
    )
    print(f"bare forward+backward+step: {bare_tps:,.0f} tokens/s")
    print(f"PolicyUpdater.update:       {update_tps:,.0f} tokens/s")
    if float32_tps:
        print(
            f"the same update in float32: {float32_tps:,.0f} tokens/s (bf16 autocast {update_tps / float32_tps:.2f}x)"
        )
    print(f"overhead: {100 * overhead:.1f}% (target <= 15%)  -> {results_path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
