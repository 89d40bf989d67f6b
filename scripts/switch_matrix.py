"""Every pair of the trainer's main switches, two steps each on the tiny models (2 CPU ranks): each pair either
trains, or is refused at `--dry-run` with a message naming a key of each switch. A pair that passes its dry run and
then fails is the one outcome that must never appear: a run that dies hours in, after loading, on a combination the
checks let through.

    .venv/bin/python scripts/switch_matrix.py                 # every switch alone and every pair (~1.5 h on 2 cores)
    .venv/bin/python scripts/switch_matrix.py --quick         # every dry run; trains only QUICK_PAIRS (~20 min)
    .venv/bin/python scripts/switch_matrix.py --pairs sp+hf,lora+partial
    .venv/bin/python scripts/switch_matrix.py --resume        # keep the last run's settled pairs, run the rest

It prints each pair's outcome as it finishes, then the table (docs/algorithm.md holds the last one) and the
refusals' messages; results go to OUT/results.json. Exit 1 when a pair crashed after its dry run passed.

The base is configs/tiny.yaml (vLLM, packed, shared prefixes, image rows) for 2 steps, validated at the second. A
switch is a few overrides plus what it needs built: the MoE model for routing replay (tiny Qwen3.5-MoE), the model
with tool tokens and the tool task for tools, a teacher of the student's own kind for distillation, a clip added to
every row for videos. So `r3+lora` trains LoRA on the MoE model and `tools+video` calls the tool on rows with clips.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STEPS = 2


@dataclass(frozen=True)
class Switch:
    overrides: tuple[str, ...]
    moe: bool = False  # on the MoE model
    tools: bool = False  # on the model with tool tokens and the tool task
    teacher: bool = False  # with a teacher of the student's kind
    video: bool = False  # every row with a clip
    keys: tuple[str, ...] = field(default=())  # the keys a refusal names (default: the overrides' keys)

    def names(self) -> tuple[str, ...]:
        return self.keys or tuple(o.split("=")[0] for o in self.overrides)


SWITCHES = {
    "sp": Switch(("actor.sequence_parallel_size=2",)),
    "hf": Switch(("rollout.engine=hf",)),
    "lora": Switch(("actor.lora_rank=8", "actor.lora_alpha=16")),
    # (partial rollouts train older tokens: decoupled PPO's weights against their recorded log-probs)
    "partial": Switch(("rollout.partial=true", "algorithm.rollout_is=token"), keys=("rollout.partial",)),
    # groups scoring 0 are dropped: on the digits reward about one in six at the start, so refills happen; on the
    # tool task's most (the untrained model is rarely right), so it gets rounds enough to fill its batch
    "dynamic": Switch(
        (
            "algorithm.online_filtering=true",
            "algorithm.filter_key=overall",
            "algorithm.filter_low=0.0",
            "algorithm.filter_high=1.0",
            "algorithm.max_filter_rounds=32",
        )
    ),  # fmt: skip
    "distill": Switch(("distill.coef=1.0",), teacher=True, keys=("distill.model_path", "distill.coef")),
    "offload": Switch(("actor.offload_params=true", "actor.offload_optimizer=true")),
    "bf16": Switch(("actor.master_dtype=bf16",)),
    "tp2": Switch(("rollout.tensor_parallel_size=2",)),
    "bypass": Switch(("algorithm.rollout_bypass=true",)),
    "r3": Switch(("algorithm.routing_replay=r3",), moe=True, keys=("algorithm.routing_replay", "actor.model_path")),
    "tools": Switch(
        (
            "rollout.tools=[scripts/make_synthetic_data.py:reveal]",
            "rollout.max_turns=2",
            "rollout.max_images_per_prompt=2",
            "rollout.tool_prompt=Call <tool_call></tool_call> to see the picture.",
            "data.max_response_length=76",
            "data.format_prompt=",
            "reward.reward_fn=reward.py:leading_digit",
        ),
        tools=True,
        keys=("rollout.tools",),
    ),  # fmt: skip
    "video": Switch(
        ("data.max_frames=8", "data.video_min_pixels=3136", "data.video_max_pixels=3136"),
        video=True,
        keys=("data.video_key", "data.max_frames"),
    ),  # fmt: skip
    "unshared": Switch(("actor.shared_prefix=false",)),
}

# --quick trains these (and dry-runs every pair): the pairs whose parts meet in one code path -- the engine and the
# sequence-parallel cut, the tool turns and clips in one prompt, refills of dynamic sampling carried by partial
# rollouts, a teacher beside adapters, replayed routes through offloaded experts -- and the suite's subset
# (tests/test_switch_matrix.py) is taken from them.
QUICK_PAIRS = [
    ("sp", "hf"), ("tools", "video"), ("partial", "dynamic"), ("distill", "lora"), ("r3", "offload"), ("sp", "video"),
    ("hf", "tools"), ("bf16", "offload"), ("partial", "tools"), ("tp2", "lora"),
]  # fmt: skip


# ----------------------------------------------------------------------------------------------------------------
# What the switches need built, once per kind, under OUT/assets


def model(out: Path, moe: bool, tools: bool, teacher: bool = False) -> str:
    from scripts.make_tiny_model import build_tiny_model

    name = f"{'moe' if moe else 'dense'}{'_tools' if tools else ''}{'_teacher' if teacher else ''}"
    path = out / "assets" / name
    if not (path / "config.json").exists():
        family = "qwen3_5_moe" if moe else "qwen2_5_vl"
        build_tiny_model(str(path), seed=0, family=family, tools=tools, digit_logit=5.0 if teacher else 0.0)
    return str(path)


def dataset(out: Path, tools: bool, video: bool) -> tuple[str, str]:
    """(train, val) files: the tool task or the geo3k-like rows, with a clip added to every row for video."""
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq

    from scripts.make_synthetic_data import make_geo3k_like, make_tool_task, video_count_row

    paths = []
    for split, rows, seed in (("train", 32, 0), ("val", 8, 1)):
        path = out / "assets" / f"{'tools' if tools else 'geo3k'}{'_video' if video else ''}_{split}.parquet"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            (make_tool_task if tools else make_geo3k_like)(str(path), rows, seed)
            if video:  # one 8-frame clip a row, its mark prepended by the loader after the images' marks
                rng, table = random.Random(seed), pq.read_table(path)
                clips = [[video_count_row(rng, 1 + i % 4, 56)] for i in range(table.num_rows)]
                pq.write_table(table.append_column("videos", pa.array(clips)), path)
        paths.append(str(path))
    return paths[0], paths[1]


def switch_overrides(names: tuple[str, ...]) -> list[str]:
    """The switches' own overrides together. Partial rollouts' older tokens need decoupled PPO's weights or the
    bypass; with the bypass on they take that (both would correct the mismatch twice, which the check refuses)."""
    overrides = [o for n in names for o in SWITCHES[n].overrides]
    if "bypass" in names:
        overrides = [o for o in overrides if o != "algorithm.rollout_is=token"]
    return overrides


def pair_overrides(names: tuple[str, ...], out: Path, run_dir: Path) -> list[str]:
    """The command line's overrides for configs/tiny.yaml with the switches `names` on."""
    switches = [SWITCHES[n] for n in names]
    moe, tools = any(s.moe for s in switches), any(s.tools for s in switches)
    train, val = dataset(out, tools, any(s.video for s in switches))
    args = [f"actor.model_path={model(out, moe, tools)}", f"data.train_files={train}", f"data.val_files={val}",
            f"trainer.output_dir={run_dir}", f"trainer.max_steps={STEPS}", f"trainer.val_freq={STEPS}",
            "trainer.val_before_train=false", "trainer.save_freq=0", "trainer.export_hf=false",
            "trainer.n_gpus_per_node=2"]  # fmt: skip
    if any(s.teacher for s in switches):
        args.append(f"distill.model_path={model(out, moe, tools, teacher=True)}")
    return args + switch_overrides(names)


# ----------------------------------------------------------------------------------------------------------------
# One pair: its dry run, then (when that passes) two steps under torchrun


def refusal(output: str) -> str:
    """The dry run's reason: its config error, or its failed checks' lines (else its last line)."""
    lines = [line for line in output.splitlines() if line.startswith(("config error", "error:", "FAIL"))]
    return " | ".join(lines) or (output.strip().splitlines() or ["no output"])[-1]


def names_both(message: str, names: tuple[str, ...]) -> bool:
    """Whether a refusal names a key of each switch (one switch: its own)."""
    return all(any(key in message for key in SWITCHES[n].names()) for n in names)


def run_pair(names: tuple[str, ...], out: Path, train: bool = True, launch=None, timeout: int = 900) -> dict:
    """{"pair", "outcome": trains | refused | CRASH (| dry run passed, with train=False), "detail", "seconds"}.
    `launch(args, timeout)` runs the training (default: torchrun on 2 ranks) and raises on failure."""
    run_dir = out / "runs" / "+".join(names)
    args = ["configs/tiny.yaml", *pair_overrides(names, out, run_dir)]
    t0 = time.perf_counter()
    code, output = dry_run(args)
    if code != 0:
        message = refusal(output)
        named = names_both(message, names)
        outcome = "refused" if named else "refused, without naming both keys"
        return {"pair": names, "outcome": outcome, "detail": message, "seconds": time.perf_counter() - t0}
    if not train:
        return {"pair": names, "outcome": "dry run passed", "detail": "", "seconds": time.perf_counter() - t0}
    try:
        (launch or torchrun)(args, timeout)
    except Exception as e:  # the run's failure, with its output's tail
        return {"pair": names, "outcome": "CRASH", "detail": str(e)[-3000:], "seconds": time.perf_counter() - t0}
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m["step"] for m in metrics if m.get("step", 0) > 0 and "actor/pg_loss" in m]
    if steps != list(range(1, STEPS + 1)):
        return {
            "pair": names,
            "outcome": "CRASH",
            "detail": f"logged steps {steps}",
            "seconds": time.perf_counter() - t0,
        }
    return {"pair": names, "outcome": "trains", "detail": "", "seconds": time.perf_counter() - t0}


def dry_run(args: list[str]) -> tuple[int, str]:
    """`train_grpo.py ARGS --dry-run` in this process (a second each, against seconds of imports in a new one): its
    exit code and everything it printed."""
    import contextlib
    import io
    import traceback

    import train_grpo

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            code = train_grpo.main([*args, "--dry-run"])
        except Exception:  # a dry run that fails in itself: as much a refusal without its reason
            traceback.print_exc()
            code = 1
    return code, out.getvalue()


def torchrun(args: list[str], timeout: int) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train_grpo.py", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, text=True, capture_output=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"exit {proc.returncode}: {(proc.stdout + proc.stderr)[-3000:]}")


# ----------------------------------------------------------------------------------------------------------------
# The table


SYMBOL = {"trains": "ok", "refused": "no", "CRASH": "CRASH", "dry run passed": "dry"}


def table(results: list[dict]) -> str:
    """Markdown: switches down and across, each cell the pair's outcome (the diagonal: the switch alone)."""
    names = list(SWITCHES)
    cell = {}
    for r in results:
        pair = tuple(r["pair"])
        a, b = (pair[0], pair[0]) if len(pair) == 1 else pair
        cell[a, b] = cell[b, a] = SYMBOL.get(r["outcome"], "no*")
    rows = ["| | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for a in names:
        rows.append(f"| {a} | " + " | ".join(cell.get((a, b), "") for b in names) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="dry-run every switch and pair, train only QUICK_PAIRS")
    parser.add_argument("--pairs", default="", help="only these, comma-separated (sp+hf,lora): a name alone is one")
    parser.add_argument("--out", default="outputs/switch_matrix")
    parser.add_argument("--resume", action="store_true",
                        help="keep OUT/results.json's pairs that trained or were refused; run the rest")  # fmt: skip
    args = parser.parse_args(argv)
    out = (ROOT / args.out).resolve()
    if args.pairs:
        pairs = [tuple(p.split("+")) for p in args.pairs.split(",")]
        unknown = {n for p in pairs for n in p} - set(SWITCHES)
        if unknown:
            parser.error(f"unknown switches {sorted(unknown)}; valid: {', '.join(SWITCHES)}")
    else:
        pairs = [(n,) for n in SWITCHES] + list(itertools.combinations(SWITCHES, 2))
    # a full run is hours: what an interrupted one settled is kept with --resume, and only the rest is run again
    done = {}
    if args.resume and (out / "results.json").exists():
        for r in json.loads((out / "results.json").read_text()):
            if r["outcome"] == "trains" or r["outcome"].startswith("refused"):
                done[tuple(r["pair"])] = r
    results = []
    for names in pairs:
        train = not args.quick or names in QUICK_PAIRS or names[::-1] in QUICK_PAIRS
        if names in done and (train or done[names]["outcome"] != "trains"):
            results.append(done[names])
            continue
        result = run_pair(names, out, train)
        results.append(result)
        print(f"{'+'.join(names):20s} {result['outcome']:16s} {result['seconds']:5.0f}s  {result['detail'][:200]}",
              flush=True)  # fmt: skip
        (out / "results.json").write_text(json.dumps(results, indent=1))
    print()
    print(table(results))
    print()
    for r in results:
        if r["outcome"] not in ("trains", "dry run passed"):
            print(f"- {'+'.join(r['pair'])}: {r['outcome']}: {r['detail'][:400]}")
    crashed = [r for r in results if r["outcome"] == "CRASH"]
    print(f"\n{len(results)} runs: {sum(r['outcome'] == 'trains' for r in results)} trained, "
          f"{sum(r['outcome'].startswith('refused') for r in results)} refused at the dry run, {len(crashed)} crashed "
          f"after it")  # fmt: skip
    return 1 if crashed else 0


if __name__ == "__main__":
    sys.exit(main())
