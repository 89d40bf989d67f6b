"""Rerun the CPU figures of the README's headline table and set each beside the README's value.

    .venv/bin/python scripts/figures.py            # every CPU figure: about an hour on 2 cores
    .venv/bin/python scripts/figures.py --quick    # those that fit in 20 minutes (10 here): the demos of 30 steps,
                                                   # the benches of memory and grading
    .venv/bin/python scripts/figures.py --only load,grading   # the runs named (RUNS' keys)

FIGURES is the one table: each row a figure, the run that measures it (RUNS: a function that runs the command and
returns its output), how to read the value, the README's text for it, and the band the value must fall in: the spread
the linked page states (over seeds and arithmetic for the demos, the bound a bench asserts) or, where it states
none, one given with the row and why. A run is made once for all its figures, one after the other (never two
benches at once: they share the cores). The README's headline table, or its figures in full in docs/performance.md,
must still hold each row's text, so this table and the pages cannot drift apart. Exit status 1 when a figure is
outside its band or its text is gone, 2 when a run failed. The GPU rows (one H100) are bench/gpu_check.py's.

Demos run at the default seed (1) with their assets built as their make targets build them (scripts/seeds.py), into
outputs/figures/NAME; on this machine a demo's run repeats exactly, on another CPU it is another sample of the seeds'
spread. Each run's output is kept in outputs/figures/RUN.log.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from scripts.seeds import build_assets  # noqa: E402

OUT = REPO / "outputs" / "figures"
PY = sys.executable
TORCHRUN = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


def command(*argv: str) -> str:
    """One command from the repository root (one thread per process, as the demos and benches run), its stdout and
    stderr together; a failure raises with the output's tail."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(argv)}: exit code {proc.returncode}\n{proc.stdout[-3000:]}")
    return proc.stdout


def assets(name: str, validate: bool = True) -> list[str]:
    """The overrides that point a run at demo `name`'s tiny model and data, built as its make target builds them."""
    model, train, val = build_assets(name, OUT / "assets", PY)
    return [f"actor.model_path={model}", f"data.train_files={train}"] + [f"data.val_files={val}"] * validate


def demo(config: str, name: str, *overrides: str, data: str = "tiny", validate: bool = True):
    """A run of a demo's config on 2 ranks into outputs/figures/NAME (emptied first: a checkpoint left there would be
    resumed); its figures are read from NAME's metrics.jsonl."""

    def run() -> str:
        shutil.rmtree(OUT / name, ignore_errors=True)
        return command(*TORCHRUN, "train_grpo.py", config, *assets(data, validate), f"trainer.output_dir={OUT / name}",
                       *overrides)  # fmt: skip

    return run


def distill_demo() -> str:
    """make demo-distill's run: its teacher is the tiny model with the digits' logits raised."""
    teacher = OUT / "assets" / "tiny_teacher"
    if not (teacher / "model.safetensors").exists():
        command(PY, "scripts/make_tiny_model.py", str(teacher), "--digit-logit", "5")
    return demo("configs/tiny_distill.yaml", "distill", f"distill.model_path={teacher}", validate=False)()


LORA = ["actor.lora_rank=8", "actor.lora_alpha=16", "actor.lr=3e-3",
        "actor.lora_target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,lm_head]"]  # fmt: skip

# run name -> (its function, minutes on this 2-core machine, in --quick)
RUNS = {
    "demo": (demo("configs/tiny.yaml", "demo"), 2, True),
    "lora": (demo("configs/tiny.yaml", "lora", *LORA), 2, True),
    "distill": (distill_demo, 2, True),
    "vision": (demo("configs/tiny_vision.yaml", "vision", data="tiny_vision"), 5, False),
    "video": (demo("configs/tiny_video.yaml", "video", data="tiny_video"), 8, False),
    "tools": (demo("configs/tiny_tools.yaml", "tools", data="tiny_tools"), 6, False),
    "load": (lambda: command(PY, "bench/bench_load.py"), 3, True),
    "sp": (lambda: command(PY, "bench/bench_sp.py"), 2, True),
    "grading": (lambda: command(PY, "bench/bench_reward.py", "--variants", "guarded"), 1, True),
    "grading_unguarded": (lambda: command(PY, "bench/bench_reward.py", "--variants", "unguarded"), 4, False),
    "engines": (lambda: command(*TORCHRUN, "bench/bench_rollout.py", "configs/tiny.yaml", *assets("tiny"),
                                "data.max_response_length=128"), 3, False),
    "train": (lambda: command(PY, "bench/bench_train.py"), 8, False),
    "shared": (lambda: command(PY, "bench/bench_train.py", "--variants", "packed,shared", "--hidden", "512",
                               "--layers", "8", "--vocab", "4096"), 6, False),
    "partial": (lambda: command(PY, "bench/bench_partial.py"), 5, False),
    "partial_small": (lambda: command(PY, "bench/bench_partial.py", "--prompts", "3", "--n", "5"), 4, False),
}  # fmt: skip


# ------------------------------------------------------------------------------------------------ how values are read
def series(run: str, key: str) -> list[float]:
    """`key` at each training step of a demo run (metrics.jsonl)."""
    rows = [json.loads(line) for line in (OUT / run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r[key] for r in rows if r.get("step", 0) > 0 and key in r]


def first5(key):
    return lambda run, out: sum(series(run, key)[:5]) / 5


def last5(key):
    return lambda run, out: sum(series(run, key)[-5:]) / 5


def rise(key):
    return lambda run, out: last5(key)(run, out) - first5(key)(run, out)


def last(key):
    return lambda run, out: series(run, key)[-1]


def json_field(*path):
    """A field of the run's last output line, a JSON object (the benches' summary)."""

    def read(run, out):
        value = json.loads(out.strip().splitlines()[-1])
        for k in path:
            value = value[k]
        return value

    return read


def match(pattern):
    """The number the pattern's group catches in the run's output (commas dropped)."""
    return lambda run, out: float(re.search(pattern, out).group(1).replace(",", ""))


@dataclass
class Figure:
    name: str
    run: str  # a key of RUNS
    read: object  # (run name, its output) -> the value
    readme: str  # the README's text for it, in the headline table
    low: float  # the band the value must fall in
    high: float
    why: str = ""  # where the band comes from, when the linked page states no spread


AFTER = "seeds 1-5 measured before the softmax left out the never-sampled tokens"

FIGURES = [
    Figure("CPU demo: reward, first 5 steps", "demo", first5("reward/overall"), "0.025 -> 0.480", 0.020, 0.030,
           "seeds 1-5: 0.024-0.030 (docs/tests.md)"),
    Figure("CPU demo: reward's rise, first 5 -> last 5", "demo", rise("reward/overall"), "0.025 -> 0.480", 0.42, 0.47,
           f"seeds 1-5: +0.42 to +0.47 (docs/tests.md, {AFTER}); seed 1 after: +0.455"),
    Figure("vision demo: accuracy, last 5 steps", "vision", last5("reward/accuracy"), "0.044 -> 0.680", 0.66, 0.95,
           f"seeds 1-5: 0.71-0.95 ({AFTER}); seed 1 after: 0.680"),
    Figure("vision demo: greedy validation", "vision", last("val/accuracy"), "0.680; 0.75", 0.75, 1.0,
           "seeds 1-5, both arithmetics: 0.75-1.00 (docs/tests.md)"),
    Figure("video demo: accuracy, last 5 steps", "video", last5("reward/accuracy"), "0.037 -> 0.949", 0.75, 0.98),
    Figure("video demo: greedy validation", "video", last("val/accuracy"), "0.949; 1.00", 0.75, 1.0,
           "seeds 1-5, both arithmetics: 0.75-1.00 (docs/tests.md)"),
    Figure("tool demo: accuracy, last 5 steps", "tools", last5("reward/accuracy"), "0.019 -> 0.941", 0.63, 0.95,
           f"seeds 1-5: 0.63-0.94 ({AFTER}); seed 1 after: 0.941"),
    Figure("tool demo: greedy validation", "tools", last("val/accuracy"), "0.941; 1.00", 0.75, 1.0,
           "seeds 1-5, both arithmetics: 0.75-1.00 (docs/tests.md)"),
    Figure("LoRA demo: reward, first 5 steps", "lora", first5("reward/overall"), "0.020 -> 0.999", 0.015, 0.030,
           "declared: the plain demo's seeds' spread"),
    Figure("LoRA demo: reward, last 5 steps", "lora", last5("reward/overall"), "0.020 -> 0.999", 0.998, 1.0),
    Figure("distillation demo: share of digits, first 5", "distill", first5("reward/digits"), "0.031 -> 0.654", 0.02,
           0.04, "declared: the untaught model's share, as the plain demo's seeds spread"),
    Figure("distillation demo: reverse KL, first 5 steps", "distill", first5("distill/reverse_kl"), "1.32 -> 0.02",
           1.2, 1.45, "declared: docs/distill.md's seed 1 gave 1.35"),
    Figure("distillation demo: share of digits, rise", "distill", rise("reward/digits"), "0.031 -> 0.654", 0.62, 0.65,
           f"seeds 1-5: +0.63 to +0.65 ({AFTER}); seed 1 after: +0.623"),
    Figure("distillation demo: reverse KL, last 5 steps", "distill", last5("distill/reverse_kl"), "1.32 -> 0.02",
           -0.3, 0.1, "declared: must fall to about 0 (docs/distill.md: seed 1 1.35 -> about 0)"),
    Figure("rollout engines: vLLM tokens/s", "engines", match(r"\| vllm \| \S+ \| \S+ \| ([\d,]+) \|"), "vLLM 9,593",
           6000, 13000, "declared: one run on a shared 2-core machine, +-35 %"),
    Figure("rollout engines: HF tokens/s", "engines", match(r"\| hf \| \S+ \| \S+ \| ([\d,]+) \|"), "HF 3,887", 2500,
           5300, "declared: one run on a shared 2-core machine, +-35 %"),
    Figure("training step: packed vs padded speed-up", "train", json_field("packed_vs_padded_speedup"), "(1.81x)", 1.5,
           2.2, "low: the bound docs/performance.md states (>= 1.5); high declared"),
    Figure("training step: padded, s", "train", json_field("padded_seconds"), "39.9 s vs 22.0 s", 26, 54,
           "declared: one run on a shared 2-core machine, +-35 %"),
    Figure("packed vs shared prefixes speed-up", "shared", json_field("shared_vs_unshared_speedup"), "(1.68x)", 1.45,
           1.9, "declared: +-0.2 on a shared 2-core machine"),
    Figure("sequence parallelism: peak per rank, size 2 / 1", "sp", match(r"size 2 / size 1: ([\d.]+)x"), "0.51x",
           0.48, 0.54, "declared: a memory figure, +-0.03"),
    Figure("sequence parallelism: size 1, MiB per rank", "sp", match(r"size=1: peak memory per rank ([\d,]+) MiB"),
           "485 vs 944 MiB", 900, 995, "declared: a memory figure, +-5 %"),
    Figure("sequence parallelism: size 2, MiB per rank", "sp", match(r"size=2: peak memory per rank ([\d,]+) MiB"),
           "485 vs 944 MiB", 460, 510, "declared: a memory figure, +-5 %"),
    Figure("log-prob memory: full logits, MiB", "train", json_field("naive_peak_mib"), "5,966 vs 1,283 MiB", 5670,
           6260, "declared: a memory figure, +-5 %"),
    Figure("log-prob memory: chunked, MiB", "train", json_field("chunked_peak_mib"), "5,966 vs 1,283 MiB", 1220,
           1350, "declared: a memory figure, +-5 %"),
    Figure("grading a step, guarded: s", "grading", json_field("guarded", "seconds"), "8.7 s, 0 timeouts", 4.0, 33.0,
           "docs/performance.md: 8.7-33 s over runs on this shared machine"),
    Figure("grading a step, guarded: timeouts", "grading", json_field("guarded", "timeouts"), "8.7 s, 0 timeouts", 0,
           0),
    Figure("grading a step, unguarded: timeouts", "grading_unguarded", json_field("unguarded", "timeouts"),
           "27 without guards", 15, 40, "declared: the degenerate answers' timeouts vary with the machine's load"),
    Figure("partial rollouts: throughput on / off", "partial", match(r"partial on / off: ([\d.]+)x\s*$"),
           "1.24x (median of nine)", 1.08, 1.77, "the runs' range in docs/performance.md: 1.08-1.77x"),
    Figure("partial rollouts, 3 prompts x 5: on / off", "partial_small", match(r"partial on / off: ([\d.]+)x\s*$"),
           "1.52x at 3 prompts x 5", 1.2, 1.8, "declared: one run on a shared 2-core machine"),
    Figure("loading: host memory per rank, x the model", "load", json_field("new_load_peak_x"), "0.69 model sizes",
           0.66, 0.72, "declared: a memory figure, one run repeats it to 0.003 (docs/memory.md)"),
    Figure("loading, bf16 masters and offloading", "load", json_field("bf16_offload_load_peak_x"),
           "0.63 with bf16 masters", 0.60, 0.66, "declared: a memory figure, one run repeats it to 0.003"),
    Figure("loading with from_pretrained, x the model", "load", json_field("old_load_peak_x"),
           "(`from_pretrained`: 1.75)", 1.70, 1.80, "declared: a memory figure"),
]  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="only the runs that fit in 20 minutes")
    p.add_argument("--only", help=f"comma-separated runs, of: {', '.join(RUNS)}")
    args = p.parse_args()
    runs = args.only.split(",") if args.only else [r for r, (_, _, quick) in RUNS.items() if quick or not args.quick]
    unknown = [r for r in runs if r not in RUNS]
    if unknown:
        p.error(f"no such run: {', '.join(unknown)}")
    # the README's headline table and its every figure in full (docs/performance.md), where the long forms live
    readme = (REPO / "README.md").read_text().split("## Headline figures", 1)[1].split("\n## ", 1)[0]
    readme += (REPO / "docs" / "performance.md").read_text().split("## The headline figures in full", 1)[1]
    print(f"runs: {', '.join(runs)} (about {sum(RUNS[r][1] for r in runs)} minutes)", flush=True)
    moved, failed = [], []
    for run in runs:
        t0 = time.perf_counter()
        try:
            out = RUNS[run][0]()
        except (RuntimeError, OSError) as e:
            print(f"{run}: FAILED\n{e}", flush=True)
            failed.append(run)
            continue
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / f"{run}.log").write_text(out)
        print(f"{run} ({time.perf_counter() - t0:.0f} s, output in {(OUT / run).relative_to(REPO)}.log):", flush=True)
        for f in (f for f in FIGURES if f.run == run):
            value = f.read(run, out)
            state = "ok" if f.low <= value <= f.high else "MOVED"
            if f.readme not in readme:
                state = "README TEXT GONE"
            if state != "ok":
                moved.append(f.name)
            band = f"band {f.low:g} - {f.high:g}" + (f" ({f.why})" if f.why else "")
            print(f"  {f.name:<48} {value:10.4g}   README: {f.readme:<28} {band}   {state}", flush=True)
    if moved or failed:
        print(f"\nmoved: {', '.join(moved) or 'none'}; failed: {', '.join(failed) or 'none'}")
    sys.exit(2 if failed else 1 if moved else 0)


if __name__ == "__main__":
    main()
