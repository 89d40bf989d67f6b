"""Host memory of loading the policy and the reference on 8 CPU ranks, the old way against the new, in one run.

- old: every rank calls from_pretrained in fp32 (the whole model), then FSDP2 keeps its shard; twice (the policy,
  then the reference), as the loader did before it read shards.
- new: loading.load_policy_and_reference: built on the meta device, sharded, each rank reading only its rows of
  each weight from the safetensors; the reference in the compute dtype.
- bf16_offload: the same with actor.master_dtype=bf16 and actor.offload_params / offload_optimizer, then the
  optimizer and the offload's hold as the trainer makes them at load (the host arenas come at the first rollout).

Each includes the first root forward of each model (root_forward), as the trainer does. Then each exports the policy
with its own save_hf (old: the full state dict gathered on rank 0, then save_pretrained; new: checkpoint.save_hf).

The ranks run with glibc's mmap threshold fixed at 1 MiB (MALLOC_MMAP_THRESHOLD_), so that a freed block goes back
to the system and the resident set follows the memory in use. With glibc's default the threshold rises to 32 MiB
as blocks are freed, freed blocks below it stay in the process for reuse, and the root forward alone (FSDP2's gloo
all-gathers of every layer, on the host here, in GPU memory on a GPU) then leaves about 1-1.5x the model resident
on some ranks each time, whichever loader ran before it: --default-malloc shows it.

The model is a random Qwen2.5-VL of ~105 M parameters (400 MiB in fp32) built from a config written here, saved in
bf16 as released checkpoints are. Its embedding + LM head are 12 % of it, as in the 7B (13 %): under FSDP2 the root
forward all-gathers them whole. Each variant runs under its own torchrun; each rank's peak resident set (VmHWM,
reset just before loading) minus its resident set then is reported as a multiple of the fp32 model size.

    .venv/bin/python bench/bench_load.py            # CPU, 8 ranks: about 3 minutes and 10 GB on 2 cores
    .venv/bin/python bench/bench_load.py --ranks 2 --layers 2 --variants new,bf16_offload   # tests/test_loading.py

The last line of output is one JSON object with the results.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from grpo import attention, checkpoint, loading  # noqa: E402
from grpo.distributed import exit_rank  # noqa: E402

VARIANTS = ("old", "new", "bf16_offload")
# what each variant of the new loader sets in the actor section
ACTOR = {"new": {}, "bf16_offload": {"master_dtype": "bf16", "offload_params": True, "offload_optimizer": True}}


def build_checkpoint(out_dir, layers):
    """A random Qwen2.5-VL saved in bf16: text 768 wide, `layers` layers, vocabulary 8,192; vision tower 4 blocks."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 0}
    text = dict(
        vocab_size=8192,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=layers,
        num_attention_heads=12,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [8, 12, 12]},
        **ids,
    )
    vision = dict(depth=4, hidden_size=512, intermediate_size=1376, num_heads=8, out_hidden_size=768,
                  fullatt_block_indexes=[3], window_size=112)  # fmt: skip
    config = Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=8190,
        video_token_id=8191,
        vision_start_token_id=8188,
        vision_end_token_id=8189,
        tie_word_embeddings=False,
        **ids,
    )
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(config).to(torch.bfloat16)
    model.save_pretrained(out_dir)
    return sum(p.numel() for p in model.parameters())


def rss_bytes(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak resident set (VmHWM) starts again from the current one
    return rss_bytes("VmRSS")


def old_load(path, device):
    """What loading.load_policy_and_reference did before: from_pretrained (fp32, whole) on every rank, then shard."""
    model = loading.apply_fsdp(loading.load_model(path, device, "sdpa"), device)
    loading.root_forward(model, 0)
    ref = loading.load_model(path, device, "sdpa").requires_grad_(False).eval()
    loading.apply_fsdp(ref, device)
    loading.root_forward(ref, 0)
    return model, ref


def old_save_hf(model, out_dir):
    """What checkpoint.save_hf did before: the full state dict gathered on rank 0, then save_pretrained."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        model.save_pretrained(out_dir, state_dict=state)
    dist.barrier()


class _NoProcessor:  # save_hf writes the processor too; this model has none
    def save_pretrained(self, out_dir):
        pass


def run_rank(args):
    """One rank of one variant, under torchrun; rank 0 prints one JSON line with every rank's figures."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    device = torch.device("cpu")
    attention._register_attention()  # imports of transformers' attention code: not part of the loading
    marks, real_root_forward = [], loading.root_forward

    def root_forward(model, pad_id):  # note the peak so far: before it, the policy alone is loaded
        marks.append(rss_bytes("VmHWM") - before)
        real_root_forward(model, pad_id)

    loading.root_forward = root_forward
    dist.barrier()
    before = reset_peak()
    t0 = time.perf_counter()
    if args.variant == "old":
        model, _ = old_load(args.model, device)
    else:
        from grpo.config import ActorConfig
        from grpo.offload import TrainerOffload
        from grpo.optim import make_optimizer

        actor = ActorConfig(model_path=args.model, attn_implementation="sdpa", gradient_checkpointing=False,
                            **ACTOR[args.variant])  # fmt: skip
        model, ref = loading.load_policy_and_reference(actor, device, True, 0)
        optimizer, _ = make_optimizer(model, actor)  # (AdamW's moments: at its first step)
        TrainerOffload().hold(model, ref, optimizer, actor)
    load = [rss_bytes("VmHWM") - before, time.perf_counter() - t0, marks[0]]
    dist.barrier()
    before = reset_peak()
    out_dir = os.path.join(args.export, args.variant)
    if args.variant == "old":
        old_save_hf(model, out_dir)
    else:
        checkpoint.save_hf(model, _NoProcessor(), out_dir)
    export = [rss_bytes("VmHWM") - before]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, load + export)
    if dist.get_rank() == 0:
        keys = ["load_peak", "load_seconds", "policy_peak", "export_peak"]
        print(json.dumps({k: [g[i] for g in gathered] for i, k in enumerate(keys)}))
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--default-malloc", action="store_true", help="leave glibc's dynamic mmap threshold on")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"which to run, of {','.join(VARIANTS)}")
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--export", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.variant:
        run_rank(args)
        exit_rank(0)

    with tempfile.TemporaryDirectory() as tmp:
        n_params = build_checkpoint(os.path.join(tmp, "model"), args.layers)
        fp32 = 4 * n_params
        print(f"Qwen2.5-VL, {n_params / 1e6:.1f} M parameters ({fp32 / 2**20:.0f} MiB fp32, checkpoint in bf16) | "
              f"{args.ranks} ranks, gloo | torch {torch.__version__} | {os.cpu_count()} CPUs | "
              f"malloc {'default' if args.default_malloc else 'mmap threshold 1 MiB'}")  # fmt: skip
        results = {}
        for variant in args.variants.split(","):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.ranks}",
                   __file__, "--variant", variant, "--model", os.path.join(tmp, "model"), "--export", tmp]  # fmt: skip
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            if not args.default_malloc:
                env["MALLOC_MMAP_THRESHOLD_"] = str(2**20)
            out = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if out.returncode:
                sys.exit(f"{variant} failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
            r = json.loads(out.stdout.strip().splitlines()[-1])
            results[variant] = r
            x = {k: (min(v) / fp32, max(v) / fp32) for k, v in r.items() if k.endswith("_peak")}
            print(f"  {variant}: peak growth per rank, x the fp32 model: policy loaded {x['policy_peak'][1]:.2f}, "
                  f"policy + reference with root forwards {x['load_peak'][0]:.2f} - {x['load_peak'][1]:.2f} "
                  f"({max(r['load_seconds']):.1f} s), export {x['export_peak'][1]:.2f}")  # fmt: skip
    summary = {"params": n_params, "fp32_mib": round(fp32 / 2**20, 1), "ranks": args.ranks,
               "default_malloc": args.default_malloc}  # fmt: skip
    for variant, r in results.items():  # the worst rank's
        summary.update({f"{variant}_{k[:-5]}_peak_x": round(max(r[k]) / fp32, 3) for k in r if k.endswith("_peak")})
        summary[f"{variant}_load_seconds"] = round(max(r["load_seconds"]), 1)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
