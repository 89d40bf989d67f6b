"""docs/memory.md's table of which models fit which GPUs: the `--dry-run` plan for each model, node, setting.

    .venv/bin/python scripts/memory_table.py      # a markdown table, one row per model and setting (a few seconds)
    .venv/bin/python scripts/memory_table.py --sequence-parallel   # docs/sequence_parallel.md's longest sequences

Every cell is the geo3k recipe's batch shape (512 prompts x 5 answers per step, 128 prompts per optimizer step,
2,048 + 2,048 tokens), vLLM with tensor parallel 2 (1 on one GPU, 4 for 32B), micro-batch token budgets 16,384 /
32,768 on 80 GB GPUs and 8,192 / 16,384 on smaller ones. vLLM's share of the GPU is geo3k's 0.6 when that fits, else
the largest share that does (the plan's own "vllm share up to" line): the cell gives the peak GiB per GPU and that
share, or "no" and the peak at 0.6 when no share fits.
"""

import contextlib
import io
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "0")  # check_paths would want the hub cache; the plan does not

import train_grpo  # noqa: E402
from grpo.memory_plan import planned_world  # noqa: E402

MODELS = {
    "Qwen2.5-VL-3B": ("configs/geo3k_3b.yaml", []),
    "Qwen2.5-VL-7B": ("configs/geo3k.yaml", []),
    "Qwen2.5-VL-32B": ("configs/geo3k.yaml", ["actor.model_path=Qwen/Qwen2.5-VL-32B-Instruct"]),
    "Qwen3-VL-8B": ("configs/qwen3_vl_8b_geo3k.yaml", []),
}
NODES = [(1, 24), (1, 40), (1, 80), (4, 40), (8, 80)]
SETTINGS = {
    "full (fp32 masters)": [],
    "bf16 masters": ["actor.master_dtype=bf16"],
    "bf16 + offload": ["actor.master_dtype=bf16", "actor.offload_params=true", "actor.offload_optimizer=true"],
    "LoRA rank 8": ["actor.lora_rank=8"],
}


def dry_run(config, overrides):
    """The dry run's plan alone (0: it fits, 2: it does not): its other checks (the model's files, the data, the
    reward) say nothing of memory, and would each want the hub."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cfg = train_grpo.load_config(config, overrides)
        world = planned_world(cfg.trainer, dry_run=True)
        try:
            train_grpo.check_config(cfg, world)
            train_grpo.check_memory(cfg, world, dry_run=True)
            code = 0
        except train_grpo.ConfigError:
            code = 2
    return code, out.getvalue()


def cell(config, overrides):
    code, out = dry_run(config, [*overrides, "rollout.gpu_memory_utilization=0.6"])
    share = re.search(r"vllm share up to ([0-9.]+) of the GPU fits", out)
    if code != 0 and share:
        code, out = dry_run(config, [*overrides, f"rollout.gpu_memory_utilization={share.group(1)}"])
    peak = re.search(r"peak\s+([0-9.]+) \(([^)]+)\)", out)
    util = re.findall(r"gpu_memory_utilization, now ([0-9.]+)", out)
    if code == 0:
        return f"{peak.group(1)} ({util[0] if util else '0.6'})"
    return f"no: {peak.group(1)}" if peak else "no"


def longest_sequences():
    """docs/sequence_parallel.md's table: Qwen2.5-VL-7B on 8 x 80 GB, configs/geo3k.yaml, the longest micro-batch
    (every token a vision token) whose update and log-prob phases fit, at each actor.sequence_parallel_size."""
    import dataclasses

    from grpo import memory_plan, plan_advice

    node = ["trainer.n_gpus_per_node=8", "trainer.gpu_memory_gib=80"]
    plan = memory_plan.plan_memory(train_grpo.load_config("configs/geo3k.yaml", node), 8)
    print("| actor.sequence_parallel_size | longest sequence (tokens) |\n|---|---|")
    for size in (1, 2, 4, 8):

        def fits(tokens, size=size):
            x = dataclasses.replace(plan.settings, sp=size, train_tokens=tokens, nograd_tokens=tokens)
            phases = memory_plan.compute_plan(plan.shape, x)["phases"]
            return all(sum(phases[p].values()) <= plan_advice.FIT_SHARE * x.gpu_bytes for p in ("update", "log-probs"))

        heads = "" if plan.shape.heads % size == 0 else f" ({plan.shape.heads} attention heads: not {size} ways)"
        print(f"| {size} | {plan_advice._largest(1, 10**7, fits):,}{heads} |")


def main():
    if "--sequence-parallel" in sys.argv:
        return longest_sequences()
    header = ["model", "setting"] + [f"{n} x {g} GB" for n, g in NODES]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for model, (config, base) in MODELS.items():
        for setting, overrides in SETTINGS.items():
            row = [model, setting]
            for gpus, gib in NODES:
                tp = 1 if gpus == 1 else (4 if "32B" in model else 2)
                budget = [] if gib >= 80 else [
                    "actor.max_tokens_per_micro_batch=8192", "actor.max_tokens_per_micro_batch_no_grad=16384"
                ]  # fmt: skip
                node = [f"trainer.n_gpus_per_node={gpus}", f"trainer.gpu_memory_gib={gib}",
                        f"rollout.tensor_parallel_size={tp}"]  # fmt: skip
                row.append(cell(config, [*base, *node, *budget, *overrides]))
            print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
