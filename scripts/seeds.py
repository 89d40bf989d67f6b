"""Run a CPU demo's config at several trainer.seed values and print one table of what each seed learnt.

    python scripts/seeds.py configs/tiny_tools.yaml --seeds 1-5            # this CPU's widest vector paths
    python scripts/seeds.py configs/tiny_tools.yaml --seeds 1-5 --avx2     # the arithmetic of an AVX2-only CPU
    python scripts/seeds.py configs/tiny.yaml --seeds 1,3 actor.lr=2e-3    # extra overrides go to every run
    python scripts/seeds.py --pytest "tests/test_families.py -k learn" --seeds 1-5   # a learning test at each seed

Each seed is one `torchrun --standalone --nproc_per_node=2 train_grpo.py CONFIG trainer.seed=S ...` (OMP_NUM_THREADS=1,
as `make demo*` and the tests run it), one after the other. The tiny model and data are built as the Makefile's demo
targets build them (the demo's config names which: tiny.yaml, tiny_vision.yaml, tiny_video.yaml, tiny_tools.yaml),
under outputs/seeds/assets/, unless --model, --train and --val name them. The runs write to
outputs/seeds/CONFIG_NAME[-avx2]/seedS. The table: per seed, the mean of reward/accuracy (and reward/overall, and for
tool runs tool/call_share) over the first 5 and the last 5 training steps, the last greedy validation, and the run's
wall time.

--pytest runs tests instead of a config: the pytest arguments given, once per seed, with TEST_SEED set, which
tests/launch.py turns into trainer.seed=S on every launch of a config that sets no seed of its own. Per seed: passed
or failed, and the figures the tests print (their lines with "first 5"; run with -s).

--avx2 runs with the arithmetic an AVX2-only x86 CPU gets (no AVX-512), on a CPU that has AVX-512: every library that
picks a vector path at run time is held to AVX2: ATen's kernels (ATEN_CPU_CAPABILITY=avx2), oneDNN
(ONEDNN_MAX_CPU_ISA=AVX2), MKL's GEMMs (MKL_ENABLE_INSTRUCTIONS=AVX2) and vLLM's CPU kernels (vLLM loads its
_C_AVX2 build when torch.cpu._is_avx512_supported() is False: a sitecustomize written next to the runs makes it, and
the AVX-512-BF16 / AMX probes, say False). The thread count is the other input to the rounding: every run has one
thread per rank, as the demos and the tests have.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# What each demo config trains on, as the Makefile's targets build it: (make_tiny_model.py flags, the task maker in
# scripts/make_synthetic_data.py or None for the Geometry3K-shaped rows, train rows, val rows)
DEMOS = {
    "tiny": ([], None, 256, 32),
    "tiny_vision": ([], "make_colour_task", 128, 32),
    "tiny_video": ([], "make_video_count_task", 128, 32),
    "tiny_tools": (["--tools"], "make_tool_task", 128, 32),
}

AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
AVX2_SITE = """\
# scripts/seeds.py --avx2: vLLM picks its CPU kernels' build with these probes; answer as an AVX2-only CPU would.
import torch.cpu

for _probe in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_avx512_vnni_supported",
               "_is_amx_tile_supported", "_is_amx_fp16_supported"):
    if hasattr(torch.cpu, _probe):
        setattr(torch.cpu, _probe, lambda: False)
"""


def parse_seeds(text: str) -> list[int]:
    """'1-5' -> [1, 2, 3, 4, 5]; '1,3,7' -> [1, 3, 7]; '1-3,9' -> [1, 2, 3, 9]."""
    seeds = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        seeds += list(range(int(lo), int(hi or lo) + 1))
    return seeds


def build_assets(name: str, out: Path, python: str) -> tuple[str, str, str]:
    """The tiny model and the train/val parquet files of demo `name`, built as its Makefile target does."""
    flags, task, n_train, n_val = DEMOS[name]
    model = out / ("tiny_tools_model" if "--tools" in flags else "tiny_model")
    if not (model / "model.safetensors").exists():
        subprocess.run([python, "scripts/make_tiny_model.py", str(model), *flags], cwd=REPO, check=True)
    data = out / f"{name}_data"
    train, val = data / "train.parquet", data / "val.parquet"
    if not (train.exists() and val.exists()):
        if task is None:
            for path, rows, seed in ((train, n_train, 0), (val, n_val, 1)):
                cmd = [python, "scripts/make_synthetic_data.py", str(path), "--rows", str(rows), "--seed", str(seed)]
                subprocess.run(cmd, cwd=REPO, check=True)
        else:
            code = (f"from scripts.make_synthetic_data import {task} as m; "
                    f"m({str(train)!r}, {n_train}, 0); m({str(val)!r}, {n_val}, 1)")  # fmt: skip
            subprocess.run([python, "-c", code], cwd=REPO, check=True)
    return str(model), str(train), str(val)


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def summarize(metrics: Path) -> dict:
    """First-5 / last-5 step means of the run's accuracy, reward and call share, and its last greedy validation."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    train = [r for r in rows if r.get("step", 0) > 0 and "reward/accuracy" in r]
    vals = [r["val/accuracy"] for r in rows if "val/accuracy" in r]
    out = {"steps": len(train), "val": vals[-1] if vals else float("nan")}
    for key, name in (("reward/accuracy", "acc"), ("reward/overall", "reward"), ("tool/call_share", "calls")):
        if train and key in train[0]:
            series = [r[key] for r in train]
            out[name] = (mean(series[:5]), mean(series[-5:]), min(series))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", help="the demo's config (or --pytest)")
    parser.add_argument("--pytest", help="pytest arguments, e.g. 'tests/test_families.py -k learn', run per seed")
    parser.add_argument("--seeds", default="1-5", help="trainer.seed values: 1-5, 1,3,7 or 1-3,9 (default 1-5)")
    parser.add_argument("--avx2", action="store_true", help="hold ATen, oneDNN, MKL and vLLM to AVX2 (see above)")
    parser.add_argument("--model", help="the model directory (default: built as the demo's make target does)")
    parser.add_argument("--train", help="the train parquet (default: built as the demo's make target does)")
    parser.add_argument("--val", help="the validation parquet (default: built as the demo's make target does)")
    parser.add_argument("--out", default="outputs/seeds", help="where the assets and the runs go")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per run")
    parser.add_argument("overrides", nargs="*", help="config overrides for every run (key=value)")
    args = parser.parse_intermixed_args()

    python = sys.executable
    out = (REPO / args.out).resolve()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if args.avx2:
        site = out / "avx2_site"
        site.mkdir(parents=True, exist_ok=True)
        (site / "sitecustomize.py").write_text(AVX2_SITE)
        env.update(AVX2_ENV, PYTHONPATH=os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")])))
    if args.pytest:
        return run_tests(args.pytest, parse_seeds(args.seeds), env, args.avx2)
    if not args.config:
        parser.error("a config, or --pytest")
    name = Path(args.config).stem
    model, train, val = args.model, args.train, args.val
    if not (model and train and val):
        if name not in DEMOS:
            parser.error(f"no asset recipe for {name}; pass --model, --train and --val (known: {sorted(DEMOS)})")
        built = build_assets(name, out / "assets", python)
        model, train, val = (given or default for given, default in zip((model, train, val), built))

    tag = name + ("-avx2" if args.avx2 else "")

    results = []
    for seed in parse_seeds(args.seeds):
        run_dir = out / tag / f"seed{seed}"
        cmd = [python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
               "train_grpo.py", args.config, f"actor.model_path={model}", f"data.train_files={train}",
               f"data.val_files={val}", f"trainer.output_dir={run_dir}", f"trainer.seed={seed}",
               *args.overrides]  # fmt: skip
        (run_dir / "metrics.jsonl").unlink(missing_ok=True)
        run_dir.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        with open(run_dir / "seeds.log", "w") as log:
            proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout)
        wall = time.perf_counter() - start
        metrics = run_dir / "metrics.jsonl"
        if proc.returncode or not metrics.exists():
            print(f"seed {seed}: exit code {proc.returncode}, see {run_dir / 'seeds.log'}", flush=True)
            results.append((seed, None, wall))
            continue
        summary = summarize(metrics)
        results.append((seed, summary, wall))
        print(f"seed {seed}: {format_row(summary)} | {wall:.0f} s", flush=True)

    print(f"\n{args.config}{' (AVX2)' if args.avx2 else ''}{' ' + ' '.join(args.overrides) if args.overrides else ''}")
    print(table(results))


def run_tests(pytest_args: str, seeds: list[int], env: dict, avx2: bool) -> None:
    """pytest_args once per seed (TEST_SEED=S), one after the other: each seed's outcome and printed figures."""
    lines = []
    for seed in seeds:
        cmd = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", *pytest_args.split()]
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, env={**env, "TEST_SEED": str(seed)}, capture_output=True, text=True)
        wall = time.perf_counter() - start
        summary = (proc.stdout.strip().splitlines() or ["no output"])[-1]
        figures = [line.strip() for line in proc.stdout.splitlines() if "first 5" in line]
        lines.append(f"seed {seed}: {'passed' if proc.returncode == 0 else 'FAILED'} ({summary}, {wall:.0f} s)")
        lines += [f"    {f}" for f in figures]
        print("\n".join(lines[-1 - len(figures) :]), flush=True)
    print(f"\n{pytest_args}{' (AVX2)' if avx2 else ''}")
    print("\n".join(lines))


def format_row(s: dict) -> str:
    parts = [f"{k} {s[k][0]:.3f} -> {s[k][1]:.3f}" for k in ("acc", "reward") if k in s]
    if "calls" in s:
        parts.append(f"calls {s['calls'][0]:.2f} -> {s['calls'][1]:.2f} (lowest {s['calls'][2]:.2f})")
    return " | ".join(parts + [f"val {s['val']:.2f}", f"{s['steps']} steps"])


def table(results: list) -> str:
    """A markdown table: one row per seed."""
    keys = [k for k in ("acc", "reward", "calls") if any(s and k in s for _, s, _ in results)]
    heads = {"acc": "accuracy", "reward": "reward", "calls": "call share"}
    header = ["seed"] + [f"{heads[k]} first 5 -> last 5" for k in keys] + ["greedy val (last)", "steps", "wall"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for seed, s, wall in results:
        if s is None:
            cells = [str(seed)] + ["failed"] * (len(header) - 2) + [f"{wall:.0f} s"]
        else:
            cells = [str(seed)] + [f"{s[k][0]:.3f} -> {s[k][1]:.3f}" for k in keys]
            cells += [f"{s['val']:.2f}", str(s["steps"]), f"{wall:.0f} s"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
