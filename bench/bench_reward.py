"""Grading time of one geo3k step, with and without reward.py's cheap guards (settle_cheaply), side by side in one run.

A step is 512 prompts x 5 responses = 2,560 answers shaped like a policy's on Geometry3K: <think>...</think>, then
a \\boxed{} answer, right about half the time, in the styles the graders meet (plain numbers, fractions, radicals,
degrees, units, "x = ...", "\\angle A = ...") against truths written the Geometry3K way ("48", "\\frac { 40 } { 3 }",
"2 \\sqrt { 221 }", "12.5"). 2 % are degenerate outputs of the kinds RL policies produce: deep brackets, power towers,
huge powers and factorials, 20,000-character boxes, junk outside the box. Seeded; nothing is downloaded.

Each variant grades the same step with RewardScorer at the trainer's defaults: timeout 10 s, default_num_workers()
for one rank. Its workers start (and import sympy) before the clock starts, as in training, where they persist
across steps. "unguarded" is what reward.py graded before the guards: plain numbers by value, every other answer
straight to mathruler and math_verify.

Wall seconds are the figure that matters, and the one other jobs on a shared machine distort: the CPU seconds of
the workers and this process, and the load average before and after, say how much. On a busy machine the unguarded
variant also times out more, as an answer that needs 6 s of CPU gets less than 10 s of it.

    .venv/bin/python bench/bench_reward.py                      # guarded and unguarded, ~4 min on 2 cores
    .venv/bin/python bench/bench_reward.py --variants guarded   # ~15 s

The last line of output is one JSON object with the results. tests/test_reward_guards.py reuses the generators.
"""

import argparse
import json
import math
import os
import random
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import reward  # noqa: E402
from grpo import grading  # noqa: E402

# -----------------------------------------------------------------------------
# legitimate answers
#
# A value is a small tuple: ("int", n), ("dec", "12.5"), ("frac", a, b), ("rad", k, m) for k sqrt(m),
# ("fracrad", k, m, n) for k sqrt(m) / n, ("pi", k) for k pi.

SQUAREFREE = [2, 3, 5, 6, 7, 10, 11, 13, 14, 15, 17, 19, 21, 22, 23, 221]
PREFIXES = ["", "", "", "x = ", "x=", "y = ", "AB = ", "m \\angle ABC = ", "\\angle A = ", "the answer is "]
UNITS = [" cm", " \\text{ cm}", "\\text{cm}", " cm^2", " cm^{2}", "\\text{cm}^2", " units", " \\text{ units}", " m"]
DEGREES = ["^\\circ", "^{\\circ}", "°", " degrees", "^\\circ"]


def random_truth_value(rng: random.Random) -> tuple:
    """A truth value, about as often of each kind as in Geometry3K: mostly whole numbers and decimals."""
    kind = rng.choices(["int", "dec", "frac", "rad", "fracrad", "pi"], weights=[50, 20, 10, 12, 4, 4])[0]
    if kind == "int":
        return ("int", rng.randint(1, 360))
    if kind == "dec":
        return ("dec", f"{rng.randint(1, 99)}.{rng.randint(1, 99)}".rstrip("0"))
    if kind == "frac":
        a, b = rng.randint(1, 99), rng.randint(2, 12)
        g = math.gcd(a, b)
        return ("frac", a // g, b // g) if b // g > 1 else ("int", a // g)
    if kind == "rad":
        return ("rad", rng.randint(1, 12), rng.choice(SQUAREFREE))
    if kind == "fracrad":
        return ("fracrad", rng.randint(1, 20), rng.choice(SQUAREFREE[:6]), rng.randint(2, 6))
    return ("pi", rng.randint(1, 40))


def truth_text(v: tuple) -> str:
    """The value as Geometry3K writes its answers: LaTeX with spaces inside the braces."""
    kind = v[0]
    if kind in ("int", "dec"):
        return str(v[1])
    if kind == "frac":
        return f"\\frac {{ {v[1]} }} {{ {v[2]} }}"
    if kind == "rad":
        return f"{v[1]} \\sqrt {{ {v[2]} }}" if v[1] > 1 else f"\\sqrt {{ {v[2]} }}"
    if kind == "fracrad":
        return f"\\frac {{ {v[1]} \\sqrt {{ {v[2]} }} }} {{ {v[3]} }}"
    return f"{v[1]} \\pi"


def numeric(v: tuple) -> float:
    kind = v[0]
    if kind in ("int", "dec"):
        return float(v[1])
    if kind == "frac":
        return v[1] / v[2]
    if kind == "rad":
        return v[1] * math.sqrt(v[2])
    if kind == "fracrad":
        return v[1] * math.sqrt(v[2]) / v[3]
    return v[1] * math.pi


def forms(v: tuple) -> list[str]:
    """Renderings of the value a policy writes, simplest first; all equal to it but the rounded decimals."""
    kind = v[0]
    if kind == "int":
        return [str(v[1]), f"{v[1]}.0", f"\\frac{{{2 * v[1]}}}{{2}}"]
    if kind == "dec":
        return [v[1], v[1] + "0", f"{float(v[1]):.2f}"]
    if kind == "frac":
        a, b = v[1], v[2]
        return [f"\\frac{{{a}}}{{{b}}}", f"\\dfrac{{{a}}}{{{b}}}", f"{a}/{b}", truth_text(v), f"{a / b:.2f}"]
    if kind == "rad":
        k, m = v[1], v[2]
        return [f"{k}\\sqrt{{{m}}}", truth_text(v), f"\\sqrt{{{k * k * m}}}", f"{k * math.sqrt(m):.2f}"]
    if kind == "fracrad":
        k, m, n = v[1], v[2], v[3]
        return [f"\\frac{{{k}\\sqrt{{{m}}}}}{{{n}}}", f"\\frac{{{k * m}}}{{{n}\\sqrt{{{m}}}}}", f"{numeric(v):.2f}"]
    return [f"{v[1]}\\pi", f"{v[1]} \\pi", f"{numeric(v):.2f}"]


def nearby_wrong_value(v: tuple, rng: random.Random) -> tuple:
    """A different value of the same kind, as a wrong answer usually is: off by a little, a factor, or swapped."""
    kind = v[0]
    if kind == "int":
        return ("int", rng.choice([v[1] + 1, v[1] - 1 or 2, 2 * v[1], 180 - v[1] or 90, v[1] + 10]))
    if kind == "dec":
        return ("dec", f"{float(v[1]) + rng.choice([0.1, 1, -0.5, 2.5]):.2f}".rstrip("0").rstrip("."))
    if kind == "frac":
        return ("frac", v[2], v[1]) if v[1] != v[2] and v[1] > 1 else ("frac", v[1] + 1, v[2])
    if kind == "rad":
        return rng.choice([("rad", v[1] + 1, v[2]), ("rad", v[1], v[2] + 1), ("int", v[1] * v[2])])
    if kind == "fracrad":
        return ("fracrad", v[1] + 1, v[2], v[3])
    return ("pi", v[1] + rng.choice([1, -1 if v[1] > 1 else 2]))


def decorate(core: str, v: tuple, rng: random.Random) -> str:
    """Dress an answer up as policies do: a variable or angle in front, degrees or a unit behind."""
    prefix = rng.choice(PREFIXES)
    suffix = ""
    if rng.random() < 0.3:
        plain = v[0] in ("int", "dec") and reward.PLAIN_NUMBER.fullmatch(core)
        suffix = rng.choice(DEGREES if plain and rng.random() < 0.6 else UNITS)
    return prefix + core + suffix


def legitimate_answer(v: tuple, correct: bool, rng: random.Random) -> str:
    value = v if correct else nearby_wrong_value(v, rng)
    written = forms(value)
    core = written[0] if rng.random() < 0.6 else rng.choice(written[1:])  # mostly the simplest form
    return decorate(core, value, rng) if rng.random() < 0.4 else core


def legitimate_pairs(count: int, seed: int) -> list[tuple[str, str]]:
    """(answer, truth) pairs in every legitimate style, about half of them equal."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(count):
        v = random_truth_value(rng)
        pairs.append((legitimate_answer(v, rng.random() < 0.5, rng), truth_text(v)))
    return pairs


# -----------------------------------------------------------------------------
# degenerate answers, one function per style, each a whole response


def _boxed(content: str) -> str:
    return f"<think>Let me compute this carefully.</think> The answer is \\boxed{{{content}}}"


HOSTILE = {
    "open_brackets": lambda rng: _boxed("(" * rng.randint(200, 5000)),
    "nested_brackets": lambda rng: _boxed("(" * (d := rng.randint(20, 300)) + "1" + ")" * d),
    "nested_braces": lambda rng: _boxed("{" * (d := rng.randint(20, 300)) + "2" + "}" * d),
    "power_tower": lambda rng: _boxed("^".join(["9"] * rng.randint(3, 40))),
    "braced_tower": lambda rng: _boxed("10^{" * (d := rng.randint(2, 8)) + "10" + "}" * d),
    "huge_power": lambda rng: _boxed(f"2^{{{rng.randint(10**7, 10**9)}}}"),
    "huge_factorial": lambda rng: _boxed(f"{rng.randint(10**5, 10**7)}!"),
    "long_sum": lambda rng: _boxed("1+" * 10_000 + "1"),
    "long_letters": lambda rng: _boxed("x" * 20_000),
    "long_latex": lambda rng: _boxed("\\sqrt{2}+" * 2_200 + "1"),
    "junk_outside_box": lambda rng: "<think>" + "(" * 20_000 + "</think>\\boxed{48} " + "9^" * 5_000,
}


# -----------------------------------------------------------------------------
# a step

FILLER = [
    "The diagram shows triangle ABC with the marked sides.",
    "By the Pythagorean theorem the hypotenuse squared equals the sum of the squares of the legs.",
    "The angles of a triangle add up to 180 degrees.",
    "Opposite angles of a parallelogram are equal, so the unknown angle follows.",
    "Using similar triangles, the ratio of corresponding sides is constant.",
    "The area of the circle is \\pi r^2 with r the radius.",
    "Substituting x into the expression for the side gives the length.",
    "Since the chords are equal, their arcs are equal too.",
]


def legitimate_response(answer: str, rng: random.Random) -> str:
    """A response around the answer: mostly well formatted, sometimes without <think> or without a box."""
    thinking = " ".join(rng.choices(FILLER, k=rng.randint(3, 12)))
    roll = rng.random()
    if roll < 0.04:
        return f"{thinking} So the answer is {answer}."
    if roll < 0.08:
        return f"{thinking} Therefore \\boxed{{{answer}}}."
    return f"<think>{thinking}</think>\nThe answer is \\boxed{{{answer}}}."


def make_step(prompts: int = 512, n: int = 5, hostile_fraction: float = 0.02, seed: int = 0):
    """(responses, truths, hostile styles or None) for one step, prompt-major as the rollout returns them."""
    rng = random.Random(seed)
    responses, truths, styles = [], [], []
    for _ in range(prompts):
        v = random_truth_value(rng)
        skill = rng.random()  # some prompts are easy for the policy, some hard
        for _ in range(n):
            responses.append(legitimate_response(legitimate_answer(v, rng.random() < skill, rng), rng))
            truths.append(truth_text(v))
            styles.append(None)
    for i in rng.sample(range(len(responses)), round(hostile_fraction * len(responses))):
        styles[i] = rng.choice(sorted(HOSTILE))
        responses[i] = HOSTILE[styles[i]](rng)
    return responses, truths, styles


# -----------------------------------------------------------------------------
# the grading before the guards


def compute_score_unguarded(response: str, ground_truth: str) -> dict[str, float]:
    """reward.compute_score as it was before settle_cheaply: only plain numbers skip the symbolic graders."""
    answer = reward.last_boxed(response)
    if answer is None:
        accuracy = 0.0
    elif reward.PLAIN_NUMBER.fullmatch(answer) and reward.PLAIN_NUMBER.fullmatch(ground_truth.strip()):
        accuracy = float(float(answer) == float(ground_truth))
    else:
        accuracy = float(reward.grade_symbolically(answer, ground_truth))
    format_score = float(reward.has_format(response))
    return {"overall": 0.9 * accuracy + 0.1 * format_score, "format": format_score, "accuracy": accuracy}


VARIANTS = {
    "guarded": grading.DEFAULT_SPEC,
    "unguarded": f"{os.path.abspath(__file__)}:compute_score_unguarded",
}


def reaped_children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def process_cpu(pid: int) -> float:
    """CPU seconds a live process has used so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def grade_step(spec: str, responses: list[str], truths: list[str], timeout: float, workers: int) -> dict:
    """Wall seconds of one step's score() call, and CPU seconds of the workers and this process during it.

    CPU seconds say what the step costs on a quiet machine: on a shared one, wall time also counts other jobs."""
    cpu_before = reaped_children_cpu()
    with grading.RewardScorer(spec, timeout=timeout, num_workers=workers) as scorer:
        t0 = time.perf_counter()
        scorer.score(["<think>r</think> \\boxed{\\frac{7}{2}}"] * workers, ["3.5"] * workers)  # start the workers
        start_s = time.perf_counter() - t0
        startup_cpu = sum(process_cpu(w.proc.pid) for w in scorer._workers)
        t0, own_cpu = time.perf_counter(), time.process_time()
        results = scorer.score(responses, truths)
        seconds, own_cpu = time.perf_counter() - t0, time.process_time() - own_cpu
    # close() has killed and reaped every worker, the timed-out ones' replacements included
    cpu = reaped_children_cpu() - cpu_before - startup_cpu + own_cpu
    return {
        "seconds": round(seconds, 2),
        "cpu_seconds": round(cpu, 2),
        "start_seconds": round(start_s, 2),
        "timeouts": scorer.n_timeouts,
        "errors": scorer.n_errors,
        "load_after": round(os.getloadavg()[0], 2),  # 1-minute load average: how busy the machine was meanwhile
        "accuracy": [r["accuracy"] for r in results],
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--n", type=int, default=5, help="responses per prompt")
    parser.add_argument("--hostile", type=float, default=0.02, help="fraction of degenerate responses")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=10.0, help="the trainer's reward.timeout")
    parser.add_argument("--workers", type=int, default=grading.default_num_workers(1), help="default: one rank's")
    parser.add_argument("--variants", default="guarded,unguarded", help="comma-separated, of: " + ", ".join(VARIANTS))
    args = parser.parse_args()

    responses, truths, styles = make_step(args.prompts, args.n, args.hostile, args.seed)
    hostile = [i for i, s in enumerate(styles) if s]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    out = {"responses": len(responses), "hostile": len(hostile), "cores": cores, "workers": args.workers}
    out["load_before"] = round(os.getloadavg()[0], 2)
    print(
        f"{len(responses)} responses, {len(hostile)} degenerate; {cores} cores, {args.workers} grading workers; "
        f"load average {out['load_before']}"
    )
    for name in args.variants.split(","):
        r = grade_step(VARIANTS[name], responses, truths, args.timeout, args.workers)
        print(
            f"{name:>10}: {r['seconds']:7.2f} s for the step, {r['cpu_seconds']:7.2f} CPU s "
            f"({r['start_seconds']:.1f} s to start the workers before), {r['timeouts']} timeouts, "
            f"{r['errors']} errors, accuracy {sum(r['accuracy']) / len(responses):.3f}, load after {r['load_after']}"
        )
        out[name] = r
    if "guarded" in out and "unguarded" in out:
        # the guards must only change what degenerate answers score; a timeout scores zero, a guard scores "wrong"
        changed = [
            i for i, (a, b) in enumerate(zip(out["guarded"]["accuracy"], out["unguarded"]["accuracy"])) if a != b
        ]
        out["labels_changed_on_legitimate"] = sum(styles[i] is None for i in changed)
        out["speedup"] = round(out["unguarded"]["seconds"] / out["guarded"]["seconds"], 1)
        out["cpu_speedup"] = round(out["unguarded"]["cpu_seconds"] / out["guarded"]["cpu_seconds"], 1)
        print(
            f"speed-up {out['speedup']}x wall, {out['cpu_speedup']}x CPU; accuracy labels changed on "
            f"{out['labels_changed_on_legitimate']} legitimate answers ({len(changed)} in all)"
        )
    for name in VARIANTS:
        if name in out:
            del out[name]["accuracy"]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
