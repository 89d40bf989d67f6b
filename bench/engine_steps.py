"""Runs a script (the trainer) with vLLM's engine steps recorded one by one, to see where a rollout's time goes: each
step's scheduled requests and tokens, whether requests came since the step before (a call starts) and its seconds,
a line a step in the file ENGINE_STEPS_OUT names. `bench/bench_partial.py --engine-steps` starts its runs through
it and prints summarise()'s figures.

    ENGINE_STEPS_OUT=steps.txt python bench/engine_steps.py train_grpo.py configs/tiny.yaml rollout.engine=vllm

Written against vLLM 0.26 and 0.32's v1 engine (`EngineCore.step`, `Scheduler.schedule` and its SchedulerOutput's
`num_scheduled_tokens` and `total_num_scheduled_tokens`, `EngineCore.add_request`).
"""

import os
import runpy
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def install(path: str):
    """Wrap the engine's step, its scheduler's schedule and its add_request so that every step that ran a batch
    writes its line."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore

    out = open(path, "w", buffering=1)
    schedule, step, add = Scheduler.schedule, EngineCore.step, EngineCore.add_request
    last, added = [], [0]

    def recorded_schedule(self, *args, **kwargs):
        s = schedule(self, *args, **kwargs)
        last.append((len(s.num_scheduled_tokens), s.total_num_scheduled_tokens))
        return s

    def marked_add(self, *args, **kwargs):
        added[0] = 1
        return add(self, *args, **kwargs)

    def timed_step(self, *args, **kwargs):
        last.clear()
        t0 = time.perf_counter()
        result = step(self, *args, **kwargs)
        seconds = time.perf_counter() - t0
        if last and last[0][0]:  # (a step with nothing scheduled ran no batch)
            reqs, tokens = last[0]
            out.write(f"{reqs} {tokens} {added[0]} {seconds:.6f}\n")
            added[0] = 0
        return result

    Scheduler.schedule, EngineCore.step, EngineCore.add_request = recorded_schedule, timed_step, marked_add


def summarise(path: str, skip_calls: int = 1, small: int = 8) -> dict:
    """Per generate call (the first step after requests came starts one), the first `skip_calls` left out
    (the engine's warm-up): its engine steps, those that prefilled (more tokens than requests: prompts, or answers
    continued under new weights) with their tokens and seconds, and the decode steps, all and those at fewer than
    `small` answers, with their seconds."""
    rows = [tuple(float(x) for x in line.split()) for line in open(path)]
    calls = []
    for reqs, tokens, new, seconds in rows:
        if new:
            calls.append([])
        if calls:
            calls[-1].append((reqs, tokens, seconds))
    calls = calls[skip_calls:]
    prefill = [r for call in calls for r in call if r[1] > r[0]]
    decode = [r for call in calls for r in call if r[1] <= r[0]]
    tail = [r for r in decode if r[0] < small]
    per = 1 / max(len(calls), 1)
    return {
        "calls": len(calls),
        "steps": per * (len(prefill) + len(decode)),
        "prefill_tokens": per * sum(r[1] for r in prefill),
        "prefill_s": per * sum(r[2] for r in prefill),
        "decode_steps": per * len(decode),
        "decode_answers": sum(r[0] for r in decode) / max(len(decode), 1),
        "decode_s": per * sum(r[2] for r in decode),
        "tail_steps": per * len(tail),
        "tail_s": per * sum(r[2] for r in tail),
    }


if __name__ == "__main__":
    install(os.environ["ENGINE_STEPS_OUT"])
    sys.argv = sys.argv[1:]
    sys.path.insert(0, REPO)
    runpy.run_path(sys.argv[0], run_name="__main__")
