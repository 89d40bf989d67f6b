"""Host memory over a long run: the 2-rank CPU demo (configs/tiny.yaml) for 600 steps, each rank's resident memory
(RSS) recorded after every step, and the growth per rank between step 100 and the last step, the last line printed.

    python bench/bench_soak.py                          # the demo, 600 steps (assets built when missing)
    python bench/bench_soak.py --demo video --steps 300 # the video or the tool demo (make demo-video / demo-tools)
    python bench/bench_soak.py --report outputs/soak_tiny 100   # the figures of a run again (one cut short too)

The ranks run train_grpo.main() under a hook that, after each step's log, appends the step, RSS and glibc's heap
figures (bytes in use vs. free inside its arenas) to <out>/rss_rank<r>.jsonl. The growth printed is of RSS's anonymous
part (RssAnon: the heap, tensors, caches), as medians of 11 steps (see report): its file-backed part is the
libraries' code and mapped files, which the system drops and rereads as other processes need memory (400 MB of a
rank's RSS once went that way here).
Switches for finding where memory goes, by environment variable:
    SOAK_TRACEMALLOC=N  tracemalloc snapshots every N steps: the top growth by traceback, <out>/tracemalloc_rank<r>.txt
    SOAK_MALLOC_TRIM=1  glibc's malloc_trim(0) after every step (the trainer does it too: for runs of older code)
"""

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time
import tracemalloc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]  # fmt: skip


def heap_figures() -> dict:
    """RSS and glibc's own count of the heap: bytes handed out (in use) and bytes free inside its arenas."""
    with open("/proc/self/status") as f:
        status = dict(line.split(":", 1) for line in f)
    out = {key: int(status[name].split()[0]) / 1024 for key, name in
           (("rss_mb", "VmRSS"), ("anon_mb", "RssAnon"), ("file_mb", "RssFile"))}  # fmt: skip
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = MallInfo2
        info = libc.mallinfo2()
        out["heap_used_mb"] = (info.uordblks + info.hblkhd) / 2**20
        out["heap_free_mb"] = info.fordblks / 2**20
    except (OSError, AttributeError):
        pass
    return out


def install_hooks(out_dir):
    """Wrap the logger's per-step call (every rank makes it) to record this rank's memory after each step."""
    import gc

    import train_grpo

    rank = int(os.environ["RANK"])
    every = int(os.environ.get("SOAK_TRACEMALLOC", "0"))
    trim = os.environ.get("SOAK_MALLOC_TRIM") == "1"
    state = {"snapshot": None, "first": None}
    log = train_grpo.MetricsLogger.log
    path = os.path.join(out_dir, f"rss_rank{rank}.jsonl")

    def logged(self, step, metrics):
        log(self, step, metrics)
        if trim:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        row = {"step": step, "t": time.time(), **heap_figures()}
        if every:
            row["traced_mb"] = tracemalloc.get_traced_memory()[0] / 2**20
        if step % 50 == 0:
            row["gc_objects"] = len(gc.get_objects())
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if every and not tracemalloc.is_tracing():  # from the first step on: start-up is not what grows
            tracemalloc.start(10)
        elif every and step % every == 0:
            snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
            for name, base in (("previous", state["snapshot"]), ("first", state["first"])):
                if base is None:
                    continue
                stats = snap.compare_to(base, "traceback")[:12]
                with open(os.path.join(out_dir, f"tracemalloc_rank{rank}.txt"), "a") as f:
                    f.write(f"==== step {step} vs {name} snapshot\n")
                    for s in stats:
                        f.write(f"{s.size_diff / 1024:+.1f} KiB, {s.count_diff:+d} blocks\n")
                        f.write("".join(f"    {line}\n" for line in s.traceback.format()[-12:]))
            state["snapshot"] = snap
            state["first"] = state["first"] or snap

    train_grpo.MetricsLogger.log = logged


def rank_main(argv):
    out_dir = os.environ["SOAK_OUT"]
    install_hooks(out_dir)
    import train_grpo
    from grpo.distributed import run_rank

    run_rank(lambda: train_grpo.main(argv))


# each demo's config and the commands that build its assets (the Makefile's demo-video and demo-tools)
TASK = "from scripts.make_synthetic_data import {0} as m; m('outputs/tiny_{1}_data/train.parquet', 128, 0); " \
       "m('outputs/tiny_{1}_data/val.parquet', 32, 1)"  # fmt: skip
DEMOS = {
    "tiny": ("configs/tiny.yaml", []),
    "video": ("configs/tiny_video.yaml", [["-c", TASK.format("make_video_count_task", "video")]]),
    "tools": ("configs/tiny_tools.yaml", [["scripts/make_tiny_model.py", "outputs/tiny_tools_model", "--tools"],
                                          ["-c", TASK.format("make_tool_task", "tools")]]),
}  # fmt: skip


def build_assets(demo):
    """The tiny model and data of `demo`, where they are missing (the Makefile's tiny-assets and the demo's own)."""
    commands = [["scripts/make_tiny_model.py", "outputs/tiny_model"]] * (not os.path.exists("outputs/tiny_model"))
    for split, rows, seed in (("train", "256", "0"), ("val", "32", "1")):
        path = f"outputs/tiny_data/{split}.parquet"
        if not os.path.exists(path):
            commands.append(["scripts/make_synthetic_data.py", path, "--rows", rows, "--seed", seed])
    if demo != "tiny" and not os.path.exists(f"outputs/tiny_{demo}_data/train.parquet"):
        commands += DEMOS[demo][1]
    for command in commands:
        subprocess.run([sys.executable, *command], check=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--demo", choices=sorted(DEMOS), default="tiny")
    parser.add_argument("--out", default=None, help="default: outputs/soak_<demo>")
    parser.add_argument("--from-step", type=int, default=100, help="growth from this step to the last")
    parser.add_argument("overrides", nargs="*", help="config overrides, key.sub=value")
    args = parser.parse_args()
    os.chdir(ROOT)
    build_assets(args.demo)
    args.out = args.out or f"outputs/soak_{args.demo}"
    os.makedirs(args.out, exist_ok=True)
    for r in range(2):
        for name in (f"rss_rank{r}.jsonl", f"tracemalloc_rank{r}.txt"):
            if os.path.exists(os.path.join(args.out, name)):
                os.remove(os.path.join(args.out, name))
    env = {**os.environ, "SOAK_OUT": os.path.abspath(args.out), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__, "--rank",
           DEMOS[args.demo][0], f"trainer.max_steps={args.steps}", f"trainer.output_dir={args.out}/run",
           "trainer.save_freq=0", "trainer.export_hf=false", *args.overrides]  # fmt: skip
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, env=env, check=True)
    report(args.out, args.from_step)


def report(out_dir, from_step):
    """Each rank's growth: the median of the last 11 steps' anonymous RSS minus that of the 11 steps around
    `from_step`. Medians, because a step that validates ends with its validation's freed heap not yet given back
    (the trainer trims at each step's metrics, before validating): tens of MB for one step, not growth."""
    growth = []
    for r in range(2):
        with open(os.path.join(out_dir, f"rss_rank{r}.jsonl")) as f:
            rows = sorted((row["step"], row) for row in map(json.loads, f))
        last = rows[-1][0]
        start = [row["anon_mb"] for step, row in rows if abs(step - min(from_step, last)) <= 5]
        end = [row["anon_mb"] for _, row in rows[-11:]]
        growth.append(statistics.median(end) - statistics.median(start))
        print(
            f"rank {r}: anonymous RSS around step {from_step} {statistics.median(start):.0f} MB, over the last 11 "
            f"steps to {last} {statistics.median(end):.0f} MB (RSS at the last {rows[-1][1]['rss_mb']:.0f} MB)"
        )
    print(f"RSS growth per rank, step {from_step} to {last}, MB: " + " ".join(f"{g:.1f}" for g in growth))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        rank_main(sys.argv[2:])
    elif len(sys.argv) > 1 and sys.argv[1] == "--report":  # --report OUT_DIR [FROM_STEP]: a run's figures again
        report(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 100)
    else:
        main()
