"""The pass conditions of bench/gpu_run.sh's steps, read from what each step left: its run's metrics.jsonl, its log,
gpu_check's JSON. One line per step, PASS or FAIL with the figures it read, and the figures as JSON beside the log.

    python bench/gpu_run_verdict.py --describe STEP        # the step's pass condition, in words
    python bench/gpu_run_verdict.py STEP RUN_DIR LOG OUT.json   # the verdict; exit 0 on PASS, 1 on FAIL

Kept apart from the shell script so that the conditions are tested on CPU (tests/test_gpu_run.py) with the rows a run
would write, before a GPU spends minutes on them.
"""

import json
import math
import os
import re
import sys

CONDITIONS = {
    "replay": "moe/replayed_tokens > 0 at every step, and rollout/mismatch_kl at steps 2 and 3 within 3x of step 1's "
    "(routes captured by vLLM itself, CUDA graphs on, full fine-tuning: the experts resent after each level-2 sleep)",
    "qwen3_5": "both steps end, and the log names fla's kernel (fla.ops) tuned before step 1, its seconds said apart "
    "from step 1's time (vLLM's GDN prefill on Triton: the first rollout itself is the check)",
    "distill": "distill/reverse_kl at step 1 the same, within 1 %, with the bf16 teacher's shards in host memory "
    "(distill.offload=true) and on the GPU (the same samples: same seeds, same engine)",
    "linear_attention": "bench_linear_attention.py --width 1 prints both rows (no sharing, shared prefixes) with the "
    "packed path's first call (Triton's compile and fla's tuning) timed apart",
    "gpu_check_qwen3_5": "gpu_check --family qwen3_5 --lora writes its JSON, with the allocator's peak within 10 % "
    "above the memory plan's",
    "gpu_check_moe": "gpu_check --lora of the reduced MoE shapes (Qwen3-VL-30B-A3B's first 12 layers, "
    "Qwen3.5-35B-A3B's first 8) write their JSON, with the allocator's peak within 10 % above the memory plan's",
}


def metrics(run_dir) -> list[dict]:
    """The training steps' rows of a run's metrics.jsonl (step > 0), in order; [] when there is none."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if r.get("step", 0) > 0]


def replay(run_dir, log) -> tuple[bool, dict]:
    rows = metrics(os.path.join(run_dir, "replay"))
    replayed = [r.get("moe/replayed_tokens", 0) for r in rows]
    kl = [r.get("rollout/mismatch_kl", math.nan) for r in rows]
    figures = {"steps": len(rows), "moe/replayed_tokens": replayed, "rollout/mismatch_kl": kl,
               "moe/routing_disagreement": [r.get("moe/routing_disagreement") for r in rows]}  # fmt: skip
    ok = len(rows) >= 3 and all(x > 0 for x in replayed) and all(0 <= x <= 3 * kl[0] for x in kl[1:3])
    return ok, figures


TUNED = re.compile(r"linear attention: (\S+) tuned for this model's shapes in ([\d.]+)s before step 1")


def qwen3_5(run_dir, log) -> tuple[bool, dict]:
    rows = metrics(os.path.join(run_dir, "qwen3_5"))
    tuned = TUNED.search(log)
    figures = {"steps": len(rows), "kernel": tuned and tuned.group(1), "tuning_s": tuned and float(tuned.group(2)),
               "step_s": [r.get("time/step") for r in rows]}  # fmt: skip
    return len(rows) >= 2 and tuned is not None and tuned.group(1).startswith("fla.ops"), figures


def distill(run_dir, log) -> tuple[bool, dict]:
    first = {}
    for offload in ("on", "off"):
        rows = metrics(os.path.join(run_dir, f"distill_offload_{offload}"))
        first[offload] = rows[0].get("distill/reverse_kl") if rows else None
    figures = {"distill/reverse_kl step 1, offload on": first["on"], "offload off": first["off"]}
    if first["on"] is None or first["off"] is None:
        return False, figures
    figures["relative_difference"] = abs(first["on"] - first["off"]) / max(abs(first["off"]), 1e-12)
    return figures["relative_difference"] <= 0.01, figures


ROW = re.compile(r"(no sharing|shared prefixes): .*\| segments ([\d.]+) ms \| packed ([\d.]+) ms .*packed ([\d.]+) s")


def linear_attention(run_dir, log) -> tuple[bool, dict]:
    rows = {m.group(1): {"segments_ms": float(m.group(2)), "packed_ms": float(m.group(3)),
                         "packed_first_call_s": float(m.group(4))} for m in ROW.finditer(log)}  # fmt: skip
    return set(rows) == {"no sharing", "shared prefixes"}, rows


def gpu_checks(out_dir, names) -> tuple[bool, dict]:
    """gpu_check's JSONs of these tags: each must be there with the peak within 10 % above the plan's."""
    figures, ok = {}, True
    for name in names:
        path = os.path.join(out_dir, f"gpu_check_{name}.json")
        if not os.path.exists(path):
            figures[name], ok = "missing", False
            continue
        with open(path) as f:
            result = json.load(f)
        keys = ("tokens_per_s_per_gpu", "step_s", "peak_gpu_memory_gib", "planned_peak_gib", "peak_vs_plan")
        figures[name] = {k: result.get(k) for k in keys}
        ok = ok and result.get("peak_vs_plan", math.inf) <= 0.10
    return ok, figures


VERDICTS = {
    "replay": replay,
    "qwen3_5": qwen3_5,
    "distill": distill,
    "linear_attention": linear_attention,
    "gpu_check_qwen3_5": lambda run_dir, log: gpu_checks(os.environ.get("OUT", run_dir), ["lora_qwen3_5"]),
    "gpu_check_moe": lambda run_dir, log: gpu_checks(
        os.environ.get("OUT", run_dir), ["lora_qwen3_vl_moe_12layers", "lora_qwen3_5_moe_8layers"]
    ),
}


def main(argv) -> int:
    if argv[:1] == ["--describe"]:
        print(CONDITIONS[argv[1]])
        return 0
    step, run_dir, log_path, out_path = argv
    log = open(log_path).read() if os.path.exists(log_path) else ""
    ok, figures = VERDICTS[step](run_dir, log)
    with open(out_path, "w") as f:
        json.dump({"step": step, "pass": ok, "condition": CONDITIONS[step], "figures": figures}, f, indent=2)
    print(f"[gpu_run] {step}: {'PASS' if ok else 'FAIL'} {json.dumps(figures)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
