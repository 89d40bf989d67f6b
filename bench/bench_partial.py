"""Partial rollouts against whole ones, side by side: the trainer with rollout.partial off, then on, on the same
model, data and seeds, and the rollout throughput of each (tokens generated per second of generation).

    python bench/bench_partial.py                      # the workload below; its last line is the ratio, on / off
    python bench/bench_partial.py --workload other     # another length distribution, to check the gain holds
    python bench/bench_partial.py --workload loop      # a heavier tail: a few answers loop on to the limit
    python bench/bench_partial.py --workload loop --max-response-length 1024   # the same under a longer limit
    python bench/bench_partial.py --n 5                # 5 answers a prompt, as the geo3k recipes draw
    python bench/bench_partial.py --prompts 3 --n 5    # small batches: a full decode step costs ~1.5 times a tail
                                                       # step here (a GPU's under the recipe: 2-2.5 times)
    python bench/bench_partial.py --engine-steps       # also where each rollout's time goes, engine step by step

The workload has the long tail of reasoning answers on CPU: a tiny random Qwen2.5-VL whose end-of-answer logit is
raised (scripts/make_tiny_model.py `eos_logit`), so most answers end within a few dozen tokens and a few run to the
limit. Each run is `configs/tiny.yaml` on one rank with vLLM for `--steps` steps of 8 prompts (`--prompts`) x 8
answers (`--n`) at the recipe's learning rate (1e-6: the lengths stay as the model has them, the same workload in both
runs); the first step (the engine's warm-up) is left out. The two runs go at the same time, so that on a shared
machine both see the same load, and they trade cores every half second (`--swap-s`): on a virtual machine the cores do
not run at the same speed, nor each at one speed for long (two identical runs side by side, each left on a core of its
own, came out up to 30 % apart; trading cores, within 4 %). The throughput is the steps' tokens over their rollout
seconds. Partial on runs with rollout.partial_reserve=1.0 (twice the step's prompts in flight: with 8 answers a group,
a reserve of half the step's leaves most quotas waiting for a group with one long answer; `--reserve`, and 2.0 for the
loop workload, whose slow groups are more) and algorithm.rollout_is=token. The loop workload's model also has a
repetition loop (`loop_logit`): a few answers in a hundred fall into it and run on for hundreds of tokens, some to the
limit, as RL policies' answers that repeat themselves do.
Generated tokens: every token the engine sampled in the step (with partial, also those of answers it will finish
later); rollout time: the trainer's time/generate.
"""

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

# each workload's tiny model (its seed, end-of-answer logit, repetition loop), answer limit and partial_reserve. The
# lengths of 256 answers (4 steps, partial off): default median 42, mean 55, 10 % over 114, longest 365; loop median
# 32, mean 71, 10 % over 186, 1.6 % at the limit
WORKLOADS = {
    "default": {"eos_logit": 4.0, "max_response_length": 384, "seed": 0, "loop_logit": 0.0, "reserve": 1.0},
    "other": {"eos_logit": 5.0, "max_response_length": 384, "seed": 0, "loop_logit": 0.0, "reserve": 1.0},
    "loop": {"eos_logit": 10.0, "max_response_length": 384, "seed": 0, "loop_logit": 10.5, "reserve": 2.0},
}


def start(model, data, out, steps, max_len, prompts, n, engine_steps, *overrides):
    """One trainer run on one rank, started; metrics(out) reads its rows once it is done. With engine_steps through
    bench/engine_steps.py, which writes the engine's steps to {out}.steps."""
    script = ["bench/engine_steps.py", "train_grpo.py"] if engine_steps else ["train_grpo.py"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", *script,
           "configs/tiny.yaml", "rollout.engine=vllm", f"actor.model_path={model}", f"data.train_files={data}",
           "data.val_files=", f"data.rollout_batch_size={prompts}", f"actor.global_batch_size={prompts}",
           f"rollout.n={n}", f"data.max_response_length={max_len}", "actor.max_tokens_per_micro_batch=8192",
           "actor.max_tokens_per_micro_batch_no_grad=16384", f"trainer.max_steps={steps}", "trainer.save_freq=0",
           "trainer.export_hf=false", f"trainer.output_dir={out}", "trainer.resume=none",
           "actor.lr=1e-6", *overrides]  # fmt: skip
    log = open(f"{out}.log", "w")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ENGINE_STEPS_OUT": f"{out}.steps"}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=log)


def children():
    """Each process's children, as /proc lists them now (a run's workers start after it)."""
    found = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:  # pid (comm) state ppid ...; comm may hold spaces and parentheses
                parent = int(f.read().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):  # it ended meanwhile
            continue
        found.setdefault(parent, []).append(int(entry))
    return found


def pin(pid, cpus, kids):
    """Every thread of the process and its descendants (`kids`: children()) onto `cpus` (affinity is a thread's own)."""
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += kids.get(tree[-1], [])
    for p in tree:
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                os.sched_setaffinity(int(task), cpus)
        except OSError:
            pass


def trade_cores(procs, period, stop):
    """Two runs on two equal halves of this process's cores (an odd one left out), swapped every `period` seconds
    until `stop` is set: each run gets as much of each core as the other, whatever speed each core runs at meanwhile."""
    cpus = sorted(os.sched_getaffinity(0))
    half = len(cpus) // 2
    halves = [set(cpus[:half]), set(cpus[half : 2 * half])]
    for turn in itertools.count():
        kids = children()  # (one look at /proc for both runs)
        for k, proc in enumerate(procs):
            pin(proc.pid, halves[(k + turn) % 2], kids)
        if stop.wait(period):
            break


def metrics(out):
    """The rows of steps 2 .. the last (step 1 warms the engine up)."""
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    return [r for r in rows if r["step"] > 1]


def summary(rows, partial, answers):
    """Generated tokens per second of rollout (the steps' tokens over their rollout seconds), the median step
    seconds, and the trained answers."""
    gen = [r["rollout/partial_generated"] if partial else r["response_length/mean"] * answers for r in rows]
    return {
        "tokens_per_s": sum(gen) / sum(r["time/generate"] for r in rows),
        "tokens": sum(gen) / len(rows),
        "rollout_s": statistics.median(r["time/generate"] for r in rows),
        "step_s": statistics.median(r["time/step"] for r in rows),
        "len_mean": sum(r["response_length/mean"] for r in rows) / len(rows),
        "len_max": max(r["response_length/max"] for r in rows),
        "carried": sum(r.get("rollout/partial_carried", 0.0) for r in rows) / len(rows),
        "off_policy": sum(r.get("rollout/off_policy_share", 0.0) for r in rows) / len(rows),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="default")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--reserve", type=float, help="rollout.partial_reserve of the partial run (the workload's)")
    parser.add_argument("--max-response-length", type=int, help="the answers' limit (the workload's)")
    parser.add_argument("--prompts", type=int, default=8, help="a step's prompts (rollout_batch_size, one rank)")
    parser.add_argument("--n", type=int, default=8, help="answers a prompt (rollout.n; the geo3k recipes' is 5)")
    steps_help = "also where each rollout's time goes, vLLM's engine steps recorded one by one (bench/engine_steps.py)"
    parser.add_argument("--engine-steps", action="store_true", help=steps_help)
    parser.add_argument("--swap-s", type=float, default=0.5, help="seconds between the runs' core trades (0: none)")
    args = parser.parse_args()
    from bench import engine_steps
    from scripts.make_synthetic_data import make_geo3k_like
    from scripts.make_tiny_model import build_tiny_model

    w = WORKLOADS[args.workload]
    tmp = tempfile.mkdtemp(prefix="bench_partial_")
    reserve = w["reserve"] if args.reserve is None else args.reserve
    if args.max_response_length is not None:
        w = {**w, "max_response_length": args.max_response_length}
    model = build_tiny_model(os.path.join(tmp, "model"), seed=w["seed"], eos_logit=w["eos_logit"],
                             loop_logit=w["loop_logit"])  # fmt: skip
    data = make_geo3k_like(os.path.join(tmp, "train.parquet"), n_rows=256, seed=w["seed"])
    print(f"workload {args.workload}: eos_logit {w['eos_logit']}, loop_logit {w['loop_logit']}, answers up to "
          f"{w['max_response_length']} tokens, {args.steps} steps of {args.prompts} prompts x {args.n} answers, "
          f"1 rank, vLLM (CPU), partial_reserve {reserve}", flush=True)  # fmt: skip
    # Both runs at once, each with its own rendezvous port: on a shared machine they see the same load, which
    # one after the other they would not
    runs = {
        "off": [],
        "on": ["rollout.partial=true", "algorithm.rollout_is=token", f"rollout.partial_reserve={reserve}"],
    }
    t0 = time.perf_counter()
    shape = (args.steps, w["max_response_length"], args.prompts, args.n, args.engine_steps)
    procs = {k: start(model, data, os.path.join(tmp, k), *shape, *v) for k, v in runs.items()}
    stop = threading.Event()
    if args.swap_s > 0 and hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) >= 2:
        threading.Thread(target=trade_cores, args=(list(procs.values()), args.swap_s, stop), daemon=True).start()
    for name, proc in procs.items():
        if proc.wait():
            stop.set()
            raise SystemExit(f"partial {name} failed: see {os.path.join(tmp, name)}.log")
    stop.set()
    results = {}
    for name in runs:
        results[name] = s = summary(metrics(os.path.join(tmp, name)), name == "on", args.prompts * args.n)
        print(f"partial {name:3}: {s['tokens_per_s']:7.0f} tokens/s generated ({s['tokens']:.0f} tokens a step, "
              f"rollout {s['rollout_s']:.1f}s) | step {s['step_s']:.2f}s | trained answers: mean length "
              f"{s['len_mean']:.0f}, longest {s['len_max']:.0f}, carried {s['carried']:.2f}, off-policy tokens "
              f"{s['off_policy']:.2f}", flush=True)  # fmt: skip
        if args.engine_steps:
            e = engine_steps.summarise(os.path.join(tmp, f"{name}.steps"))
            print(f"  a rollout's engine steps: {e['steps']:.0f}; prefill {e['prefill_tokens']:.0f} tokens, "
                  f"{e['prefill_s']:.2f}s; decode {e['decode_steps']:.0f} steps of {e['decode_answers']:.0f} answers "
                  f"on average, {e['decode_s']:.2f}s, of them {e['tail_steps']:.0f} at fewer than 8 answers, "
                  f"{e['tail_s']:.2f}s", flush=True)  # fmt: skip
    print(f"both runs together: {time.perf_counter() - t0:.0f}s")
    on, off = (results[k]["tokens_per_s"] for k in ("on", "off"))
    print(f"step time, partial on / off: {results['on']['step_s'] / results['off']['step_s']:.2f}x")
    print(f"rollout throughput (generated tokens per second of rollout), partial on / off: {on / off:.2f}x")


if __name__ == "__main__":
    main()
