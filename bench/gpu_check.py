"""The trainer on one GPU with a model of the real Qwen2.5-VL-3B shape, nothing downloaded: is the GPU path sound,
and how fast is it?

    python bench/gpu_check.py --dry-run         # the memory plan of exactly the run below; exit 0 when it fits
    python bench/gpu_check.py                   # one GPU, about 5 minutes; vLLM if importable, else the HF engine
    python bench/gpu_check.py --lora            # the same with rank-8 LoRA adapters
    python bench/gpu_check.py --enforce-eager   # vLLM without CUDA graphs (rollout.enforce_eager=true)
    python bench/gpu_check.py --set actor.ref_offload=true --set data.max_response_length=1024
    python bench/gpu_check.py --config configs/geo3k_3b_1x40gb.yaml --gpu-memory-utilization 0.43  # the 40 GB recipe
    python bench/gpu_check.py --family qwen3_5 --lora  # Qwen3.5-9B's shape: linear attention through fla's kernel
    python bench/gpu_check.py --family qwen3_vl_moe --lora  # Qwen3-VL-30B-A3B's shape: one H200 (141 GiB)
    python bench/gpu_check.py --family qwen3_5_moe --lora --layers 8  # Qwen3.5-35B-A3B's layers, 8 of its 40

1. Builds a random Qwen2.5-VL with the 3B shape (36 layers of width 2048, the 32-block vision tower, the 151,936-row
   vocabulary) from a config written here, with the tiny test tokenizer padded to the real token count, and saves
   it in bf16 as real checkpoints are; writes Geometry3K-shaped data (scripts/make_synthetic_data.py).
2. Runs train_grpo.main on it, one rank: the geo3k recipe's phases (rollout, reward, reference log-probs, clipped
   update with KL, weight sync) with FSDP2 in bf16, packed token-budget micro-batches through native varlen
   attention, chunked LM-head log-probs and gradient checkpointing. Full fine-tuning of 3.75 B parameters with fp32
   masters and AdamW does not fit one 80 GiB GPU beside the rollout (the plan says so), so the vision tower is
   frozen (0.67 B fewer trainable parameters); the toy digit reward: a random model never writes \\boxed{}, and the
   check is about the machinery, not learning. No final export (trainer.export_hf=false).
3. With the run's memory freed: log-probs of one packed micro-batch, plain and with shared prefixes, against the
   same batch padded (sdpa), all in bf16; and the vision tower's varlen path against sdpa on the same images (on
   torch 2.14 and sm90 the tower's calls can go to cuDNN, a kernel the CPU tests never reach).
4. With vLLM (the default where it imports): the rollout phase as the loop runs it, vLLM asleep while the trainer
   works (rollout.sleep_level's default: level 2, 1 with --lora), its generation tokens/s, the wake, weight-sync and
   sleep seconds, and the GPU memory free (torch.cuda.mem_get_info) right before and after every sleep: the device's
   use while vLLM is awake set beside the memory plan's rollout phase (within 10 % is the bar). CUDA graphs are on,
   as in a real run; --enforce-eager runs the same without them. Then, in a fresh process, vLLM's log-probs of its
   own samples against the trainer's (bf16, after a weight sync), separately for text prompts and for image prompts,
   and the engine's generation speed with a seed for each request (as the trainer samples) and without.

Prints and writes (to $OUT, else outputs/gpu_check/) tokens/s per GPU (prompt incl. image tokens + response tokens
of a step / step seconds, as EasyR1 counts it: docs/performance.md), model FLOPs utilisation of the training phases,
peak GPU memory against the plan's, and the agreements. Needs torch >= 2.11, transformers 5.17-5.19, torchvision,
safetensors, pillow, pyyaml, jinja2, pyarrow (and peft + accelerate for --lora); vLLM and the geo3k graders are
optional, and nothing is downloaded. With --family qwen3_5 the model has Qwen3.5-9B's shape instead (LoRA only: its
full fine-tuning does not fit one GPU), and its linear-attention layers take fla's kernels where flash-linear-attention
is installed (linear_attention.py; without it they run a sequence at a time, with a warning). With --family
qwen3_vl_moe it is Qwen3-VL-30B-A3B's shape (31.1 B parameters, 3.9 B active, against the dense 3B/8B figures), LoRA
only; its bf16 weights, 57.9 GiB, are there twice while vLLM generates (trainer and engine), which one 80 GiB GPU
cannot hold (the dry run says so; `--set trainer.gpu_memory_gib=141` plans an H200). Its engine-vs-trainer
comparison also prints the share of (token, layer) pairs that vLLM routes to other experts than the trainer
(routing.py), with vLLM eager: module hooks read the routers, and CUDA graphs would not run them. --family
qwen3_5_moe is Qwen3.5-35B-A3B's shape (35.11 B parameters, 3.9 B active), LoRA only.

--layers N keeps the first N decoder layers of the shape (every layer's own shape, the vocabulary and the tower
unchanged): an MoE shape whole is a 58 to 65 GiB bf16 checkpoint, which a machine with a 64 GiB disk cannot write, and
LoRA's level-1 sleep pins as much host memory again. The dry run prints the checkpoint's size beside the disk free
where it is built and the host's memory; a check that would take more than half of either stops before it builds.
"""

import argparse
import functools
import gc
import json
import os
import statistics
import sys
import tempfile
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import rollout  # noqa: E402
import train_grpo  # noqa: E402
from grpo import attention, batching, distributed, families, loading, logprobs, routing, startup  # noqa: E402
from scripts.make_synthetic_data import make_geo3k_like  # noqa: E402
from scripts.make_tiny_model import FAMILIES, QWEN_SPECIAL_TOKENS, _token_ids, build_generation_config, build_tokenizer  # noqa: E402

# The environment this process started with: the comparison's fresh process gets it, not what the trainer's run set
# since (vLLM's and the trainer's variables, the process group's)
START_ENV = dict(os.environ)
REAL_TOKENS, REAL_VOCAB = 151_665, 151_936  # Qwen2.5-VL's tokenizer size and embedding rows
QWEN3_5_VOCAB = 248_320  # Qwen3.5's embedding rows (its tokenizer is padded to them here)
# Qwen3.5's layers: three gated DeltaNet layers, then one of full attention (so --layers takes a multiple of 4)
QWEN3_5_LAYER_TYPES = ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 10
# Dense bf16 peak of the GPUs this is likely to meet, TFLOP/s (vendor data sheets, without sparsity)
PEAK_TFLOPS = {"H200": 989.0, "H100 80GB HBM3": 989.0, "H100 NVL": 835.0, "H100 PCIe": 756.0, "A100": 312.0}


def qwen2_5_vl_3b_config(tokenizer, layers=None):
    """Qwen2.5-VL-3B-Instruct's architecture (its published config.json), with token ids from our tokenizer; its
    first `layers` decoder layers only where given (all 36 by default)."""
    from transformers import Qwen2_5_VLConfig

    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in QWEN_SPECIAL_TOKENS}
    text = dict(
        vocab_size=REAL_VOCAB, hidden_size=2048, intermediate_size=11008, num_hidden_layers=layers or 36,
        num_attention_heads=16, num_key_value_heads=2, hidden_act="silu", max_position_embeddings=128000,
        rms_norm_eps=1e-6, use_sliding_window=False, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
    )  # fmt: skip
    vision = dict(
        depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, in_channels=3, patch_size=14,
        spatial_merge_size=2, temporal_patch_size=2, window_size=112, fullatt_block_indexes=[7, 15, 23, 31],
        out_hidden_size=2048, tokens_per_second=2, hidden_act="silu",
    )  # fmt: skip
    return Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"], tie_word_embeddings=True, dtype="bfloat16",
    )  # fmt: skip


# the 27-block tower Qwen3-VL and Qwen3.5 share (their published configs), and Qwen3.5's rotary positions
QWEN3_VL_TOWER = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, in_channels=3, patch_size=16,
                      spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304)  # fmt: skip
QWEN3_5_ROPE = {
    "rope_type": "default",
    "rope_theta": 10000000.0,
    "partial_rotary_factor": 0.25,
    "mrope_section": [11, 11, 10],
    "mrope_interleaved": True,
}


def qwen3_5_9b_config(tokenizer, layers=None):
    """Qwen3.5-9B's architecture (the numbers model_shape.KNOWN_SHAPES keeps: 32 layers of width 4096, three gated
    DeltaNet layers to one full-attention layer, 248,320 embedding rows untied, Qwen3-VL's 27-block tower without
    deepstack), with token ids from our tokenizer; its first `layers` decoder layers only where given."""
    from transformers import Qwen3_5Config

    vision_ids, special = _token_ids(tokenizer)
    text = dict(
        vocab_size=QWEN3_5_VOCAB, hidden_size=4096, intermediate_size=12288, num_hidden_layers=layers or 32,
        layer_types=QWEN3_5_LAYER_TYPES[: layers or 32],
        num_attention_heads=16, num_key_value_heads=4, head_dim=256, linear_conv_kernel_dim=4,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32,
        hidden_act="silu", max_position_embeddings=262144, rms_norm_eps=1e-6,
        rope_parameters=dict(QWEN3_5_ROPE),
        **special,
    )  # fmt: skip
    vision = dict(QWEN3_VL_TOWER, out_hidden_size=4096)
    return Qwen3_5Config(text_config=text, vision_config=vision, **vision_ids, tie_word_embeddings=False,
                         dtype="bfloat16")  # fmt: skip


def qwen3_vl_30b_a3b_config(tokenizer, layers=None):
    """Qwen3-VL-30B-A3B's architecture (its published config.json; model_shape.KNOWN_SHAPES' numbers): 48 layers of
    width 2048, each a mixture of 128 experts with 8 routed a token (3 B of its 31 B parameters active), Qwen3-VL's
    27-block tower with deepstack, 151,936 embedding rows untied, with token ids from our tokenizer; its first
    `layers` decoder layers only where given."""
    from transformers import Qwen3VLMoeConfig

    vision_ids, special = _token_ids(tokenizer)
    text = dict(
        vocab_size=REAL_VOCAB, hidden_size=2048, intermediate_size=6144, num_hidden_layers=layers or 48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, hidden_act="silu", max_position_embeddings=262144,
        rms_norm_eps=1e-6, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, decoder_sparse_step=1,
        norm_topk_prob=True, rope_parameters={"rope_type": "default", "rope_theta": 5000000.0,
                                              "mrope_section": [24, 20, 20], "mrope_interleaved": True},
        **special,
    )  # fmt: skip
    vision = dict(QWEN3_VL_TOWER, out_hidden_size=2048, deepstack_visual_indexes=[8, 16, 24])
    return Qwen3VLMoeConfig(text_config=text, vision_config=vision, **vision_ids, tie_word_embeddings=False,
                            dtype="bfloat16")  # fmt: skip


def qwen3_5_35b_a3b_config(tokenizer, layers=None):
    """Qwen3.5-35B-A3B's architecture (model_shape.KNOWN_SHAPES' numbers, its model card's config.json; transformers'
    Qwen3.5-MoE defaults are the same): 40 layers of width 2048, three gated DeltaNet layers to one full-attention
    layer, each a mixture of 256 experts (8 routed a token) beside a shared expert, 248,320 embedding rows untied,
    Qwen3-VL's 27-block tower without deepstack, with token ids from our tokenizer; its first `layers` decoder layers
    only where given."""
    from transformers import Qwen3_5MoeConfig

    vision_ids, special = _token_ids(tokenizer)
    text = dict(
        vocab_size=QWEN3_5_VOCAB, hidden_size=2048, num_hidden_layers=layers or 40,
        layer_types=QWEN3_5_LAYER_TYPES[: layers or 40], num_attention_heads=16, num_key_value_heads=2, head_dim=256,
        linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
        linear_num_value_heads=32, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, hidden_act="silu", max_position_embeddings=262144, rms_norm_eps=1e-6,
        rope_parameters=dict(QWEN3_5_ROPE),
        **special,
    )  # fmt: skip
    vision = dict(QWEN3_VL_TOWER, out_hidden_size=2048)
    return Qwen3_5MoeConfig(text_config=text, vision_config=vision, **vision_ids, tie_word_embeddings=False,
                            dtype="bfloat16")  # fmt: skip


# --family -> (the architecture, its name, the recipe the check scales down to one GPU)
SHAPES = {
    "qwen2_5_vl": (qwen2_5_vl_3b_config, "Qwen2.5-VL-3B", "configs/geo3k_3b.yaml"),
    "qwen3_5": (qwen3_5_9b_config, "Qwen3.5-9B", "configs/qwen3_5_9b_geo3k.yaml"),
    "qwen3_vl_moe": (qwen3_vl_30b_a3b_config, "Qwen3-VL-30B-A3B", "configs/qwen3_vl_8b_geo3k.yaml"),
    "qwen3_5_moe": (qwen3_5_35b_a3b_config, "Qwen3.5-35B-A3B", "configs/qwen3_5_9b_geo3k.yaml"),
}
LORA_ONLY = ("qwen3_5", "qwen3_vl_moe", "qwen3_5_moe")  # whole, their fp32 state alone outgrows one GPU


def build_model(out_dir, family="qwen2_5_vl", layers=None):
    """A random checkpoint of the family's real shape (bf16 safetensors, tokenizer, processor) in out_dir (kept if it
    is there already, so that several checks share one); returns its parameter count, that of the language model
    alone (with its LM head) and that of the vision tower. The tokenizer is the tests' tiny BPE plus placeholder
    tokens up to the real count, so the vocabulary, and with it the LM head and the sampling cost, are the real
    ones. `layers`: the shape's first that many decoder layers only."""
    _, make_processor, _, model_class = FAMILIES[family]
    make_config = SHAPES[family][0]
    if not os.path.exists(os.path.join(out_dir, "model.safetensors.index.json")):
        tokenizer = real_size_tokenizer(family)
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = model_class._from_config(make_config(tokenizer, layers), dtype=torch.bfloat16)
        model.generation_config = build_generation_config(tokenizer)
        model.save_pretrained(out_dir)
        make_processor(tokenizer).save_pretrained(out_dir)
        del model
        torch.cuda.empty_cache()
    with torch.device("meta"):
        model = model_class._from_config(make_config(real_size_tokenizer(family), layers))
    total = sum(p.numel() for p in model.parameters())  # a tied embedding / LM head counted once
    vision = sum(p.numel() for p in model.model.visual.parameters())
    return total, total - vision, vision


@functools.cache  # (some seconds to build; read, never changed)
def real_size_tokenizer(family="qwen2_5_vl"):
    tokenizer = build_tokenizer(seed=0, vocab_size=400, tokenizer_class=FAMILIES[family][0])
    real = QWEN3_5_VOCAB if family.startswith("qwen3_5") else REAL_TOKENS
    tokenizer.add_tokens([f"<|filler_{i}|>" for i in range(real - len(tokenizer))])
    return tokenizer


def write_config_only(out_dir, family="qwen2_5_vl", layers=None):
    """The checkpoint's config.json alone: all that the memory plan reads (a dry run builds no weights)."""
    SHAPES[family][0](real_size_tokenizer(family), layers).save_pretrained(out_dir)


def checkpoint_gib(family="qwen2_5_vl", layers=None) -> float:
    """The bf16 checkpoint's size, GiB: 2 bytes a parameter (counted on the meta device; the files' headers and the
    tokenizer add a few MiB)."""
    model_class = FAMILIES[family][3]
    with torch.device("meta"):
        model = model_class._from_config(SHAPES[family][0](real_size_tokenizer(family), layers))
    return 2 * sum(p.numel() for p in model.parameters()) / 2**30


def machine_problem(gib: float, disk_free_gib: float, host_gib: float, lora: bool) -> str | None:
    """Why a checkpoint of `gib` would not fit this machine with room, or None: more than half the disk free where it
    is built (the run's data, outputs and the engine's own files need the rest), or, with LoRA (vLLM sleeps at level
    1: its weights, as large, pinned in host memory), more than half the host's memory (the trainer's processes and
    the loader's buffers need the rest)."""
    if gib > disk_free_gib / 2:
        return f"its checkpoint, {gib:.1f} GiB, is more than half of the {disk_free_gib:.1f} GiB free on its disk"
    if lora and gib > host_gib / 2:
        return (f"with LoRA vLLM's level-1 sleep pins its weights, {gib:.1f} GiB, in host memory: more than half of "
                f"the host's {host_gib:.1f} GiB")  # fmt: skip
    return None


def machine_room(path) -> tuple[float, float]:
    """GiB free on the disk that holds `path` (or its nearest existing parent), and the host's memory in GiB."""
    import shutil

    while not os.path.exists(path):
        path = os.path.dirname(path) or "."
    return shutil.disk_usage(path).free / 2**30, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def trainer_argv(model_dir, data_dir, out_dir, args):
    """train_grpo's command line: the family's geo3k recipe, scaled to one GPU and a few steps; --lora and --set
    last."""
    overrides = [
        f"actor.model_path={model_dir}", f"data.train_files={data_dir}/train.parquet", "data.val_files=",
        f"data.rollout_batch_size={args.prompts}", f"actor.global_batch_size={args.prompts}", f"rollout.n={args.n}",
        f"data.max_response_length={args.response_tokens}", "data.max_prompt_length=2048",
        f"rollout.engine={args.engine}", "rollout.tensor_parallel_size=1",
        f"rollout.enforce_eager={str(args.enforce_eager).lower()}",
        f"rollout.max_num_seqs={args.prompts * args.n}",
        "reward.reward_fn=reward.py:digit_fraction", "reward.num_workers=2",
        f"actor.ref_offload={str(args.ref_offload).lower()}", f"trainer.max_steps={args.steps}",
        "trainer.val_before_train=false", "trainer.val_freq=0", "trainer.save_freq=0", "trainer.resume=none",
        "trainer.export_hf=false", "trainer.n_gpus_per_node=1",
        f"trainer.output_dir={out_dir}", "trainer.logger=[console,jsonl]",
        # fp32 masters and AdamW for all 3.75 B parameters (60 GiB) leave too little of 80 GiB for the rollout
    ]  # fmt: skip
    # LoRA's default targets are the decoder's projections: the tower is frozen with the rest of the base. Full
    # fine-tuning of all 3.75 B parameters (fp32 masters and AdamW: 56 GiB) leaves too little of 80 GiB for the
    # rest, so the tower is frozen there too. A --config recipe keeps its own precision, offloading, tower and vLLM
    # share (unless --gpu-memory-utilization is given)
    lora = ["actor.lora_rank=8", "actor.lora_alpha=16"] if args.lora else []
    if args.config:
        given = args.gpu_memory_utilization_given
        return [args.config, *overrides, *([f"rollout.gpu_memory_utilization={given}"] if given else []), *lora,
                *args.set]  # fmt: skip
    overrides.append(f"rollout.gpu_memory_utilization={args.gpu_memory_utilization}")
    overrides += lora or ["actor.freeze_vision_tower=true"]
    return [os.path.join(REPO, SHAPES[args.family][2]), *overrides, *args.set]


def memory_plan(argv):
    """The trainer's own memory plan of the run (memory_plan.py, as train_grpo prints it at start) and the problem
    that would stop it, or None."""
    from grpo.memory_plan import plan_memory
    from grpo.plan_advice import format_plan, plan_problem

    cfg = train_grpo.load_config(argv[0], argv[1:])
    train_grpo.check_config(cfg, world_size=1)
    plan = plan_memory(cfg, 1)
    return cfg, plan, format_plan(plan), plan_problem(plan)


def training_mode(cfg):
    """What the run trains, and how: as the summary and the dry run say it."""
    actor = cfg.actor
    if actor.lora_rank:
        return f"LoRA rank {actor.lora_rank}"
    offload = ", offloaded while vLLM generates" if actor.offload_params else ""
    tower = "frozen" if actor.freeze_vision_tower else "trained"
    return f"full fine-tuning with {actor.master_dtype} masters{offload}, the vision tower {tower}"


def dry_run(args):
    """Print the plan of exactly the run main() would make, on the GPU it would assume; 0 when it fits."""
    with tempfile.TemporaryDirectory() as tmp:
        write_config_only(tmp, args.family, args.layers)
        argv = trainer_argv(tmp, tmp, os.path.join(tmp, "run"), args)
        cfg, _, text, problem = memory_plan(argv)
    print("gpu check, dry run: " + " ".join(a for a in argv[1:] if not a.startswith(("actor.model_path", "data.tr"))))
    print(text)
    # the machine the dry run runs on may not be the one the check will: its room is said, the run itself stops on it
    gib = checkpoint_gib(args.family, args.layers)
    disk, host = machine_room(args.model_dir or tempfile.gettempdir())
    here = machine_problem(gib, disk, host, args.lora)
    print(f"checkpoint {gib:.1f} GiB (bf16); this machine: {disk:.1f} GiB free on its disk, {host:.1f} GiB of memory"
          f" ({f'a run here would stop: {here}' if here else 'room for it'})")  # fmt: skip
    if problem:
        print(f"does not fit: {problem}")
        return 1
    print(f"fits one GPU ({SHAPES[args.family][1]}, {training_mode(cfg)})")
    return 0


# the loop's phase functions, under the memory plan's names of the phases
PHASES = {"rollout": "collect_rollouts", "log-probs": "compute_old_and_ref_logprobs", "update": "update_policy"}
ENGINE_AWAKE = ("rollout",)  # the phases vLLM is awake through; it sleeps through the others


def engine_pool_gib():
    """GiB held by vLLM's sleep-mode pool (vllm.device_allocator.cumem.CuMemAllocator, 0.26 to 0.33: one
    AllocationData a mapping, its handle (device, size, pointer, memory handle)). torch's allocator counts the pool's
    blocks as allocated and reserved while vLLM sleeps, although sleep has handed their memory back to the device:
    a phase vLLM sleeps through is the trainer's alone only with the pool taken out. 0 without the pool."""
    cumem = sys.modules.get("vllm.device_allocator.cumem")
    pool = cumem.CuMemAllocator.instance if cumem is not None else None
    if pool is None:
        return 0.0
    return sum(data.handle[1] for data in pool.pointer_to_data.values()) / 2**30


def run_trainer(model_dir, data_dir, out_dir, args):
    """train_grpo.main, one rank in this process; returns the metrics of each step and the peak GPU memory (GiB,
    torch's allocator; vLLM's pool left out of the phases it sleeps through) of each phase, over the steps, to set
    beside the plan's phases."""
    peaks, pool = dict.fromkeys(PHASES, 0.0), [0.0]

    def measured(phase, fn):
        def wrapper(*a, **kw):
            torch.cuda.reset_peak_memory_stats()
            try:
                return fn(*a, **kw)
            finally:
                pool[0] = max(pool[0], engine_pool_gib())
                asleep = 0.0 if phase in ENGINE_AWAKE else pool[0]
                peaks[phase] = max(peaks[phase], torch.cuda.max_memory_allocated() / 2**30 - asleep)

        return wrapper

    originals = {name: getattr(train_grpo, name) for name in PHASES.values()}
    for phase, name in PHASES.items():
        setattr(train_grpo, name, measured(phase, originals[name]))
    from grpo.vllm_engine import VLLMEngine

    sleeps, sleep = [], VLLMEngine.sleep
    VLLMEngine.sleep = lambda engine: free_around(sleeps, sleep, engine)
    try:
        code = train_grpo.main(trainer_argv(model_dir, data_dir, out_dir, args))
    finally:
        for name, fn in originals.items():
            setattr(train_grpo, name, fn)
        VLLMEngine.sleep = sleep
    if code != 0:
        raise SystemExit(f"the trainer exited with {code}")
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f], peaks, sleeps, pool[0]


def phase_memory(measured, planned, pool_gib):
    """The per-phase line: measured / planned GiB of each phase the plan has ("-" where none was measured: the weight
    sync runs inside no phase of its own)."""
    pairs = (f"{k} {measured[k]:.1f} / {v:.1f}" if k in measured else f"{k} - / {v:.1f}" for k, v in planned.items())
    pool = f" (vLLM's sleep pool, {pool_gib:.1f} GiB, left out of the phases it sleeps through)" if pool_gib else ""
    return "per phase, measured / planned: " + ", ".join(pairs) + pool


def free_around(record, fn, *args):
    """fn(*args) between two readings of the device's free memory (GiB, torch.cuda.mem_get_info: every allocator on
    the device, vLLM's own CuMemAllocator included, which torch's counters do not see), appended to `record` as
    {"before": .., "after": .., "total": ..}."""

    def free():
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        return free / 2**30, total / 2**30

    before, total = free()
    try:
        return fn(*args)
    finally:
        record.append({"before": before, "after": free()[0], "total": total})


def rollout_memory(sleeps, planned_gib):
    """The device's use while vLLM is awake against the plan's rollout phase. The first sleep is the engine's own at
    start, before the trainer's model loads: the loop's are the others, each right after a rollout (vLLM awake with
    its weights and KV cache, the trainer's state resident). The plan's deviation is relative to the device."""
    loop = sleeps[1:]
    if not loop:
        return {}
    used = max(s["total"] - s["before"] for s in loop)
    freed = [s["after"] - s["before"] for s in loop]
    return {
        "free_gib_before_after_each_sleep": [(round(s["before"], 2), round(s["after"], 2)) for s in sleeps],
        "device_used_gib_awake": used,
        "planned_rollout_gib": planned_gib,
        "plan_vs_device": planned_gib / used - 1,
        "freed_by_sleep_gib": statistics.median(freed),
    }


def engine_vs_trainer(model_dir, data_dir, response_tokens, enforce_eager=False, prompts=8, n=4):
    """vLLM's log-prob of each token it sampled against the trainer's (logprobs.forward_logprobs, FSDP2) after a weight
    sync, for text prompts (the data's, its image dropped) and image prompts apart: max and mean |diff| over the
    sampled tokens. bf16 on the GPU (what a run compares as rollout/logprob_diff_*), fp32 on CPU. For an MoE family
    also the share of (token, layer) pairs the two route to other experts (routing.agreement), and the image
    answers' log-prob gap with routing replay on (the trainer routed by the engine's record). One rank; vLLM's
    engine must be this process's first (its parallel state is per process), so main() runs it in a fresh one."""
    from types import SimpleNamespace

    from transformers import AutoProcessor

    from data import PromptDataset

    _, _, device = distributed.setup_distributed()
    processor = AutoProcessor.from_pretrained(model_dir)
    dataset = PromptDataset(f"{data_dir}/train.parquet", processor, min_pixels=262144, max_pixels=4194304,
                            format_prompt=os.path.join(REPO, "configs/format_prompt/geo3k.jinja"))  # fmt: skip
    at_once = 4 * n  # answers a prompt in the seeding timing (seeding_cost), all decoded together
    cfg = train_grpo.load_config(None, [
        "rollout.engine=vllm", f"actor.model_path={model_dir}", "data.min_pixels=262144", "data.max_pixels=4194304",
        "data.max_prompt_length=2048", f"data.max_response_length={response_tokens}",
        "rollout.gpu_memory_utilization=0.3", f"rollout.max_num_seqs={prompts * at_once}",
        f"rollout.enforce_eager={str(enforce_eager).lower()}", f"rollout.cpu_kv_cache_bytes={256 << 20}",
    ])  # fmt: skip
    rollout.check_prompt_limits(cfg.rollout, [dataset])  # the engine's images a prompt: the data's most, as in training
    engine = rollout.make_engine(cfg, processor)
    model = loading.load_model(model_dir, device, "auto")
    loading.apply_fsdp(model, device)
    pad_id, image_token_id = processor.tokenizer.pad_token_id, model.config.image_token_id
    loading.root_forward(model, pad_id)
    model.eval()
    engine.wake()
    engine.sync_weights(model)
    examples = [dataset[i] for i in range(prompts)]
    vision = "<|vision_start|><|image_pad|><|vision_end|>"
    text = [SimpleNamespace(prompt=e.prompt.replace(vision, ""), images=[], videos=[]) for e in examples]
    result = {"dtype": str(engine.dtype).removeprefix("torch.")}
    params = rollout.SamplingParams(temperature=1.0, top_p=1.0, max_tokens=response_tokens)
    for modality, rows in (("text", text), ("image", examples)):
        encoded = [rollout.encode_prompt(processor, e) for e in rows]
        samples = engine.generate(encoded, n, params, seed=0)
        answered = [encoded[s.prompt_index] for s in samples]
        responses = [s.response_ids for s in samples]
        batch, response_ids, mask = batching.collate(answered, responses, pad_id, image_token_id)
        with torch.no_grad():
            logp = logprobs.forward_logprobs(model, batch, response_ids, 1.0)[0].float().cpu()  # (B, T)
        engine_logp = torch.zeros_like(logp)
        for row, sample in enumerate(samples):
            engine_logp[row, : len(sample.logprobs)] = torch.tensor(sample.logprobs)
        diff = (engine_logp - logp).abs()[mask.bool()]
        result[modality] = {"max": diff.max().item(), "mean": diff.mean().item(), "tokens": diff.numel()}
    if families.family(model).moe:  # over the image prompts' sequences (text and vision tokens), an answer a prompt
        result["routing"] = routing.agreement(engine, model, encoded, samples[::n], pad_id)
        # replay on (algorithm.routing_replay=r3): the engine's routes of its samples, and the trainer's log-probs
        # routed by them; the disagreement of the replayed forward is the share above (the same routers' choices)
        routing.record_routes(engine, model, encoded, samples)
        batch, response_ids, mask = batching.collate(answered, responses, pad_id, image_token_id,
                                                     routes=[s.routes for s in samples])  # fmt: skip
        with torch.no_grad():
            logp = logprobs.forward_logprobs(model, batch, response_ids, 1.0)[0].float().cpu()  # (B, T)
        diff = (engine_logp - logp).abs()[mask.bool()]
        result["image_replayed"] = {"max": diff.max().item(), "mean": diff.mean().item(), "tokens": diff.numel()}
    result["seeding"] = seeding_cost(engine, encoded, at_once, response_tokens)
    distributed.shut_down(engine)  # the engine, then the process group, as the trainer ends
    return result


def packed_vs_padded(model_dir, data_dir, response_tokens, device=None):
    """Max and mean |log p packed - log p padded| of answers to image prompts, bf16 on the GPU: plain packing, and the
    shared-prefix layout (two answers per prompt, the prompt once; it relies on the kernel's bottom-right causal
    alignment, which this checks: the wrong alignment would hide most of the prompt from the answers)."""
    import torch.distributed as dist
    from transformers import AutoProcessor

    from data import PromptDataset

    device = device or torch.device("cuda", torch.cuda.current_device())
    backend, device_id = ("nccl", device) if device.type == "cuda" else ("gloo", None)  # CPU: its test
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, device_id=device_id)
    try:
        processor = AutoProcessor.from_pretrained(model_dir)
        dataset = PromptDataset(f"{data_dir}/train.parquet", processor, min_pixels=262144, max_pixels=4194304,
                                format_prompt=os.path.join(REPO, "configs/format_prompt/geo3k.jinja"))  # fmt: skip
        two = [rollout.encode_prompt(processor, dataset[i]) for i in range(2)]
        prompts = [two[0], two[0], two[1], two[1]]  # each prompt twice, the same object: a group of two answers
        model = loading.load_model(model_dir, device, "auto")
        loading.apply_fsdp(model, device)
        pad_id, image_token_id = processor.tokenizer.pad_token_id, model.config.image_token_id
        loading.root_forward(model, pad_id)
        g = torch.Generator().manual_seed(0)
        # ordinary text tokens (the low ids of the BPE), never a vision special token
        responses = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (response_tokens, 37, 300, 5)]
        diffs = {"attention": model.config._attn_implementation}
        with torch.no_grad():
            padded, response_ids, mask = batching.collate(prompts, responses, pad_id, image_token_id)
            want = logprobs.forward_logprobs(model, padded, response_ids, 1.0)[0]
            for name, shared in (("packed", False), ("shared_prefix", True)):
                packed = batching.pack(prompts, responses, image_token_id, share_prompts=shared)[0]
                got = logprobs.forward_logprobs(model, packed, response_ids, 1.0)[0]
                diff = (got - want).abs()[mask.to(device).bool()]
                diffs[name] = {"max": diff.max().item(), "mean": diff.mean().item()}
        return diffs
    finally:
        dist.destroy_process_group()


def tower_varlen_vs_sdpa(model_dir, data_dir, device=None, attn_implementation="auto"):
    """Max and mean |varlen - sdpa| of the vision tower's merged image features on the same images (four of the
    data's figures), in the compute dtype: the tower under the name that makes transformers hand it the per-image
    and per-window bounds (attention.VISION_VARLEN, one kernel call per block), against the same weights under sdpa,
    which loops over the images and windows. Both halves of packed_vs_padded go through the same tower path, so
    only this compares the tower's kernel with another."""
    from transformers import AutoProcessor

    from data import PromptDataset

    device = device or torch.device("cuda", torch.cuda.current_device())
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    processor = AutoProcessor.from_pretrained(model_dir)
    dataset = PromptDataset(f"{data_dir}/train.parquet", processor, min_pixels=262144, max_pixels=4194304,
                            format_prompt=os.path.join(REPO, "configs/format_prompt/geo3k.jinja"))  # fmt: skip
    prompts = [rollout.encode_prompt(processor, dataset[i]) for i in range(4)]
    pixels = torch.cat([p.pixel_values for p in prompts]).to(device, dtype)  # (patches, dim)
    grid = torch.cat([p.image_grid_thw for p in prompts]).to(device)  # (4, 3)
    model = loading.load_model(model_dir, device, attn_implementation, dtype=dtype).to(device)
    tower = model.model.visual
    assert tower.config._attn_implementation == attention.VISION_VARLEN, tower.config._attn_implementation
    out = {}
    with torch.no_grad():
        for name in (attention.VISION_VARLEN, "sdpa"):
            tower.config._attn_implementation = name
            features = tower(pixels, grid_thw=grid)
            out[name] = getattr(features, "pooler_output", features).float()  # (image tokens, hidden)
    diff = (out[attention.VISION_VARLEN] - out["sdpa"]).abs()
    scale = out["sdpa"].abs().mean().item()
    del model
    return {"max": diff.max().item(), "mean": diff.mean().item(), "mean_abs_feature": scale, "tokens": diff.shape[0]}


def seeding_cost(engine, prompts, n, max_tokens):
    """Generation tokens/s of n answers to each prompt with a seed for each request, as the trainer samples (so that
    a resumed run samples what an uninterrupted one would), and with none. vLLM draws a seeded request's noise with
    the request's own generator, one request at a time (v1/sample/ops/topk_topp_sampler.py: `random_sample` loops
    over `generators`, 0.26 and 0.32; on CUDA any seeded request also sends the batch past FlashInfer's sampler to
    that path), an unseeded batch's in one call: with hundreds of answers a rank, hundreds of small kernels a decode
    step. Alternated, twice each, the faster of each."""
    from grpo.samples import engine_prompt_ids
    from grpo.vllm_engine import request_seed

    requests = [engine._request(engine_prompt_ids(p, engine.image_token_id), p.images, []) for p in prompts]
    params = rollout.SamplingParams(temperature=1.0, top_p=1.0, max_tokens=max_tokens)
    best = {"seeded": 0.0, "unseeded": 0.0}
    for _ in range(2):
        for name in best:
            seeds = [request_seed(7, i, n) if name == "seeded" else None for i in range(len(requests))]
            sampling = [engine._sampling(params, n, max_tokens, seed) for seed in seeds]
            t0 = time.perf_counter()
            outputs = engine.llm.generate(requests, sampling, use_tqdm=False)
            tokens = sum(len(c.token_ids) for out in outputs for c in out.outputs)
            best[name] = max(best[name], tokens / (time.perf_counter() - t0))
    return {**{f"{k}_tokens_per_s": v for k, v in best.items()}, "answers": len(requests) * n}


def engine_vs_trainer_process(model_dir, data_dir, args):
    """engine_vs_trainer in a fresh process (this one's vLLM engine ran the trainer's rollouts), with the environment
    this one started with; {} if it failed, with how it ended and the device's free memory at its start."""
    import signal
    import subprocess

    # an MoE's routing is read by module hooks, which CUDA graphs and torch.compile's graphs do not run: eager there
    eager = args.enforce_eager or families.family_of(model_dir).moe
    cmd = [sys.executable, os.path.abspath(__file__), "--engine-vs-trainer", model_dir, data_dir, "--response-tokens",
           str(args.response_tokens), *(["--enforce-eager"] if eager else [])]  # fmt: skip
    env = {**START_ENV, "MASTER_PORT": str(int(os.environ.get("MASTER_PORT", "29500")) + 7)}
    free, total = (x / 2**30 for x in torch.cuda.mem_get_info()) if torch.cuda.is_available() else (0.0, 0.0)
    code = subprocess.run(cmd, env=env).returncode
    if code != 0:
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        print(f"engine vs trainer comparison failed ({how}; its output is above; the device had {free:.1f} of "
              f"{total:.1f} GiB free when it started)")  # fmt: skip
        return {}
    with open(os.path.join(data_dir, "engine_vs_trainer.json")) as f:
        return json.load(f)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="print the run's memory plan; exit 0 when it fits")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step")
    parser.add_argument("--n", type=int, default=8, help="answers per prompt")
    parser.add_argument("--response-tokens", type=int, default=512)
    default_engine = "vllm" if __import__("importlib").util.find_spec("vllm") else "hf"
    parser.add_argument("--engine", default=default_engine, choices=["vllm", "hf"])
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.0,
        help="vLLM's share while awake (default 0.2; 0.4 for qwen3_5, 0.5 for qwen3_vl_moe: weights 17.6, 57.9 GiB)",
    )
    parser.add_argument("--ref-offload", action="store_true", help="keep the reference model in host memory")
    parser.add_argument("--enforce-eager", action="store_true", help="vLLM without CUDA graphs")
    parser.add_argument("--engine-vs-trainer", nargs=2, metavar=("MODEL_DIR", "DATA_DIR"), help=argparse.SUPPRESS)
    parser.add_argument("--lora", action="store_true", help="rank-8 LoRA adapters instead of full fine-tuning")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a trainer override (repeat)")
    parser.add_argument("--no-comparisons", action="store_true", help="the run only: no packed/tower checks")
    parser.add_argument(
        "--image-size",
        type=int,
        nargs=2,
        default=[400, 700],
        metavar=("MIN", "MAX"),
        help="the figures' sides in pixels; larger images stagger the answers' starts (prefill)",
    )
    parser.add_argument("--model-dir", default="", help="build the model here, or reuse the one built there")
    parser.add_argument("--peak-tflops", type=float, default=0.0, help="the GPU's dense bf16 peak (default: known)")
    recipe = "a recipe of the family's shape instead of its geo3k one (its precision, offload, tower, vLLM share)"
    parser.add_argument("--config", default="", help=recipe)
    parser.add_argument("--family", default="qwen2_5_vl", choices=sorted(SHAPES), help="the shape: " + ", ".join(
        f"{k} = {v[1]}" for k, v in SHAPES.items()))  # fmt: skip
    parser.add_argument("--layers", type=int, default=0, help="the shape's first N decoder layers only (default: all)")
    args = parser.parse_args(argv)
    args.layers = args.layers or None
    if args.family in LORA_ONLY and not args.lora and not args.layers:  # fp32 masters and AdamW: 16 B a parameter
        parser.error(f"{SHAPES[args.family][1]}'s full fine-tuning does not fit one GPU: add --lora (or --layers)")
    whole = {"qwen2_5_vl": 36, "qwen3_5": 32, "qwen3_vl_moe": 48, "qwen3_5_moe": 40}[args.family]  # (the configs')
    if args.layers is not None and not 1 <= args.layers <= whole:
        parser.error(f"--layers {args.layers}: {SHAPES[args.family][1]} has {whole}")
    if args.layers and args.family.startswith("qwen3_5") and args.layers % 4:  # keep 3 linear : 1 full attention
        parser.error(f"--layers {args.layers}: Qwen3.5's layers come in fours (three linear attention, one full)")
    # vLLM's share while awake: its bf16 weights and a KV cache (Qwen3-VL-30B-A3B's weights alone are 57.9 GiB)
    utilization = {"qwen3_5": 0.4, "qwen3_vl_moe": 0.5, "qwen3_5_moe": 0.5}.get(args.family, 0.2)
    args.gpu_memory_utilization_given = args.gpu_memory_utilization
    args.gpu_memory_utilization = args.gpu_memory_utilization or utilization
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.dry_run:
        return dry_run(args)
    if args.engine_vs_trainer:  # main()'s fresh process for the comparison: the result as JSON beside the data
        model_dir, data_dir = args.engine_vs_trainer
        result = engine_vs_trainer(model_dir, data_dir, args.response_tokens, args.enforce_eager)
        with open(os.path.join(data_dir, "engine_vs_trainer.json"), "w") as f:
            json.dump(result, f)
        distributed.exit_rank(0)  # as the trainer's ranks end (gloo's threads may outlive the group)
    if not torch.cuda.is_available():
        raise SystemExit("bench/gpu_check.py needs a CUDA GPU (--dry-run does not)")
    out = os.environ.get("OUT") or os.path.join(REPO, "outputs", "gpu_check")
    os.makedirs(out, exist_ok=True)
    name = torch.cuda.get_device_name()
    peak = args.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in name), 0.0)

    with tempfile.TemporaryDirectory() as tmp:
        model_dir, data_dir = args.model_dir or os.path.join(tmp, "model"), os.path.join(tmp, "data")
        argv = trainer_argv(model_dir, data_dir, os.path.join(tmp, "run"), args)
        write_config_only(tmp, args.family, args.layers)  # the plan first: a run that cannot fit stops before building
        cfg, plan, plan_text, problem = memory_plan([argv[0], *argv[1:], f"actor.model_path={tmp}"])
        if not os.path.exists(os.path.join(model_dir, "model.safetensors.index.json")):
            problem = problem or machine_problem(checkpoint_gib(args.family, args.layers), *machine_room(model_dir),
                                                 args.lora)  # fmt: skip
        if problem:
            raise SystemExit(f"{plan_text}\nthe run does not fit: {problem}")
        phases = {k: sum(v.values()) / 2**30 for k, v in plan.numbers["phases"].items()}
        t0 = time.perf_counter()
        n_params, n_text, n_vision = build_model(model_dir, args.family, args.layers)
        make_geo3k_like(f"{data_dir}/train.parquet", n_rows=max(64, args.prompts * (args.steps + 1)), seed=0,
                        image_size=tuple(args.image_size))  # fmt: skip
        shape = SHAPES[args.family][1]
        print(f"a random {n_params / 1e9:.2f} B-parameter {shape} ready in {time.perf_counter() - t0:.0f}s")
        torch.cuda.reset_peak_memory_stats()
        steps, measured, sleeps, pool_gib = run_trainer(model_dir, data_dir, os.path.join(tmp, "run"), args)
        peak_gib = max(measured.values())
        reserved_gib = torch.cuda.max_memory_reserved() / 2**30 - pool_gib  # (from the last update on)
        gc.collect()  # the run's model, optimizer and engine, before the comparisons load their own
        torch.cuda.empty_cache()
        left_gib = torch.cuda.memory_allocated() / 2**30
        agreement, tower = {"attention": "skipped"}, {}
        if not args.no_comparisons:
            agreement = packed_vs_padded(model_dir, data_dir, args.response_tokens)
            gc.collect()
            torch.cuda.empty_cache()
            tower = tower_varlen_vs_sdpa(model_dir, data_dir)
        engine_agreement = {}
        if args.engine == "vllm" and not args.no_comparisons:
            gc.collect()
            torch.cuda.empty_cache()
            engine_agreement = engine_vs_trainer_process(model_dir, data_dir, args)

    timed = steps[1:] or steps  # the first step pays for warm-up (allocator, kernels)
    keys = ("perf/tokens_per_s_per_device", "time/step", "time/rollout", "time/logprobs", "time/train",
            "perf/rollout_tokens_per_s", "time/wake", "time/weight_sync", "time/sleep")  # fmt: skip
    med = {k: statistics.median(s.get(k, 0.0) for s in timed) for k in keys}
    med["tokens"] = med["perf/tokens_per_s_per_device"] * med["time/step"]  # one rank: the step's tokens
    # Model FLOPs of the training side per step, N = the language model's parameters (its tied embedding counted
    # once, as the LM head's matmul): the update's forward and backward (6 N per token; with LoRA 4 N, the frozen
    # base computing no weight gradients) and the reference forward (2 N). Left out, so the figure errs low: the
    # vision tower (it sees image patches only), attention's own FLOPs, and the recompute of gradient checkpointing
    # (not model FLOPs by definition).
    flops = med["tokens"] * ((4 if args.lora else 6) + 2) * n_text
    train_seconds = med["time/logprobs"] + med["time/train"]
    planned = max(phases.values())
    result = {
        "device": name,
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "engine": args.engine,
        "model": SHAPES[args.family][1] + (f", its first {args.layers} layers" if args.layers else ""),
        "fla": startup.library_versions()["fla"],
        "mode": training_mode(cfg),
        "config": os.path.relpath(argv[0], REPO),
        "overrides": args.set,
        "params": n_params,
        "steps": len(steps),
        "tokens_per_step": med["tokens"],
        "tokens_per_s_per_gpu": med["perf/tokens_per_s_per_device"],
        "step_s": med["time/step"],
        "rollout_s": med["time/rollout"],
        "logprobs_s": med["time/logprobs"],
        "train_s": med["time/train"],
        "mfu_training_phases": flops / train_seconds / (peak * 1e12) if peak else None,
        "peak_gpu_memory_gib": peak_gib,
        "peak_gpu_memory_reserved_gib": reserved_gib,
        "engine_pool_gib": pool_gib,
        "planned_gib_per_phase": phases,
        "measured_gib_per_phase": measured,
        "planned_peak_gib": planned,
        "peak_vs_plan": peak_gib / planned - 1,
        "memory_left_after_run_gib": left_gib,
        "cuda_graphs": args.engine == "vllm" and not args.enforce_eager,
        "generation_tokens_per_s": med["perf/rollout_tokens_per_s"],
        "wake_s": med["time/wake"],
        "weight_sync_s": med["time/weight_sync"],
        "sleep_s": med["time/sleep"],
        "rollout_memory": rollout_memory(sleeps, phases["rollout"]) if args.engine == "vllm" else {},
        "engine_vs_trainer_logprob_diff": engine_agreement,
        "packed_vs_padded_logprob_diff": agreement,
        "tower_varlen_vs_sdpa": tower,
    }
    tag = ("lora" if args.lora else "full") + ("" if args.family == "qwen2_5_vl" else f"_{args.family}")
    tag += f"_{args.layers}layers" if args.layers else ""
    tag += f"_{os.path.splitext(os.path.basename(args.config))[0]}" if args.config else ""
    tag += "_eager" if args.enforce_eager and args.engine == "vllm" else ""
    with open(os.path.join(out, f"gpu_check_{tag}.json"), "w") as f:
        json.dump({**result, "metrics": steps, "plan": plan_text}, f, indent=2)
    mfu = f"{result['mfu_training_phases']:.1%}" if peak else "n/a (pass --peak-tflops)"
    print(
        f"gpu check on {name} ({result['model']}, {args.engine} engine, {result['mode']}, {len(steps)} steps of "
        f"{args.prompts} x "
        f"{args.n}; torch {result['torch']}, transformers {result['transformers']}):\n"
        f"  tokens/s per GPU {result['tokens_per_s_per_gpu']:.0f} | step {med['time/step']:.1f}s (rollout "
        f"{med['time/rollout']:.1f}s, ref log-probs {med['time/logprobs']:.1f}s, update {med['time/train']:.1f}s)\n"
        f"  MFU of the training phases {mfu}\n"
        f"  peak GPU memory (torch allocator) {peak_gib:.1f} GiB, plan {planned:.1f} GiB "
        f"({result['peak_vs_plan']:+.0%}); {phase_memory(measured, phases, pool_gib)}"
    )
    if args.engine == "vllm":
        graphs = "CUDA graphs " + ("on" if result["cuda_graphs"] else "off")
        print(f"  vLLM ({graphs}): generation {result['generation_tokens_per_s']:.0f} tokens/s | wake "
              f"{result['wake_s']:.2f}s, weight sync {result['weight_sync_s']:.2f}s, "
              f"sleep {result['sleep_s']:.2f}s")  # fmt: skip
        mem = result["rollout_memory"]
        if mem:
            print(f"  rollout phase on the device (total - free before each sleep, the most) "
                  f"{mem['device_used_gib_awake']:.1f} GiB, plan {mem['planned_rollout_gib']:.1f} GiB "
                  f"({mem['plan_vs_device']:+.1%}{'' if abs(mem['plan_vs_device']) <= 0.10 else ', more than 10 %'})"
                  f"; a sleep frees {mem['freed_by_sleep_gib']:.1f} GiB; free before/after each sleep "
                  f"{mem['free_gib_before_after_each_sleep']}")  # fmt: skip
        for modality, d in engine_agreement.items():
            if modality in ("text", "image", "image_replayed"):  # (image_replayed: routing replay on, an MoE)
                print(f"  vLLM vs trainer log-probs of vLLM's samples ({engine_agreement['dtype']}, {modality}, "
                      f"{d['tokens']} tokens): max |diff| {d['max']:.3f}, mean {d['mean']:.4f}")  # fmt: skip
        if "seeding" in engine_agreement:
            d = engine_agreement["seeding"]
            print(f"  vLLM generation, {d['answers']} answers at once: a seed a request (as the trainer samples) "
                  f"{d['seeded_tokens_per_s']:.0f} tokens/s, none {d['unseeded_tokens_per_s']:.0f} "
                  f"({d['seeded_tokens_per_s'] / d['unseeded_tokens_per_s']:.2f}x)")  # fmt: skip
        if "routing" in engine_agreement:
            r = engine_agreement["routing"]
            print(f"  vLLM vs trainer routing (eager engine): share of (token, layer) pairs whose top-k experts "
                  f"differ: text {r['text']:.4f} ({r['text_tokens']} tokens), vision {r['vision']:.4f} "
                  f"({r['vision_tokens']}), answers {r['answer']:.4f} ({r['answer_tokens']})")  # fmt: skip
    if tower:
        print(
            f"  log-probs vs padded ({agreement['attention']}, bf16): packed max |diff| "
            f"{agreement['packed']['max']:.3f} (mean {agreement['packed']['mean']:.4f}), shared prefix max |diff| "
            f"{agreement['shared_prefix']['max']:.3f} (mean {agreement['shared_prefix']['mean']:.4f})\n"
            f"  vision tower varlen vs sdpa ({tower['tokens']} image tokens, bf16): max |diff| {tower['max']:.3f}, "
            f"mean {tower['mean']:.4f} (mean |feature| {tower['mean_abs_feature']:.3f})"
        )
    return 0


if __name__ == "__main__":
    # Ended as the trainer's ranks end (distributed.run_rank), not through the interpreter's teardown, which can wait
    # for ever on what vLLM's engine and the process group leave behind: a check that failed must still end.
    distributed.run_rank(main)
