"""Run one optimizer step of train_grpo.update_policy under torchrun and save the updated full weights.

Used by test_train.py: the same rollout batch split over 1 or 2 ranks and into any number of micro-batches must give
the same update. The batch is synthetic but realistic: 4 prompts with images, 2 responses each of uneven lengths.

    torchrun --nproc_per_node=W tests/dist_update_check.py MODEL_DIR OUT.pt MICRO_BATCH LOSS_AGG_MODE [KEY=VALUE ...]
        [--then KEY=VALUE ... [--then ...]]

Each `--then` starts another step from the checkpoint's weights under the overrides that follow it (those alone):
several settings in one launch, one file each (OUT.pt, then OUT.1.pt, OUT.2.pt, ...).

The last two prompts (rank 1's half on 2 ranks) get longer responses, so with a token budget the two ranks need
different numbers of micro-batches unless the trainer makes them agree. Rank 0 saves the weights, the stats and
each rank's micro-batch count. EXTRA_EMPTY_MICRO_BATCH=1 appends an empty bin to every token-budget plan.
TEXT_ONLY=2,3 makes those prompts text-only (no image); NO_VISION_DUMMY=1 leaves out logprobs.add_vision_dummy.
VIDEO=0,1,2,3 takes those prompts from the video demo's (a clip each) instead; among a step's overrides, for that step
only. With distill.model_path the samples get the teacher's log-probs first, from the trainer's no-grad phase
(train_grpo.compute_old_and_ref_logprobs). Rank 0 also saves the step's metrics reduced over ranks and each rank's
vision tower patches.
"""

import os
import sys

import torch
import torch.distributed as dist
from PIL import Image, ImageDraw

REPO = __file__.rsplit("/tests/", 1)[0]
sys.path.insert(0, REPO)

import rollout  # noqa: E402
import train_grpo  # noqa: E402
from grpo import distill, distributed, loading, mismatch, sequence_parallel  # noqa: E402
from grpo.stats import StepStats  # noqa: E402

PROMPTS, N = 4, 2


def synthetic_prompts(processor, text_only=()):
    prompts = []
    for i in range(PROMPTS):
        if i in text_only:
            messages = [{"role": "user", "content": [{"type": "text", "text": f"Find x {i}."}]}]
            text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            prompts.append(rollout.Prompt(processor(text=[text], return_tensors="pt")["input_ids"][0], None, None, []))
            continue
        img = Image.new("RGB", (56 + 28 * i, 84), "white")
        ImageDraw.Draw(img).line((0, 0, 40, 60 - 10 * i), fill="black", width=3)
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"Find x {i}."}]}]
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        out = processor(text=[text], images=[img], return_tensors="pt")
        prompts.append(rollout.Prompt(out["input_ids"][0], out["pixel_values"], out["image_grid_thw"], [img]))
    return prompts


def video_prompts(processor, tmp_dir):
    """PROMPTS prompts of the video demo's task through the data path, as configs/tiny_video.yaml reads them."""
    from data import PromptDataset
    from grpo import preflight
    from grpo.samples import encode_prompt
    from scripts.make_synthetic_data import make_video_count_task

    path = make_video_count_task(os.path.join(tmp_dir, f"videos{dist.get_rank()}.parquet"), n_rows=PROMPTS)
    demo = train_grpo.load_config(os.path.join(REPO, "configs", "tiny_video.yaml"))
    ds = PromptDataset(path, processor, **preflight.dataset_kwargs(demo, processor))
    return [encode_prompt(processor, ds[i]) for i in range(PROMPTS)]


def count_vision_patches(model):
    """Record in model.vision_patches the patches of this rank's forwards' images and videos ("inputs"), and of
    every vision tower pass ("real"; blank dummies apart), the forwards and the tower's passes."""
    model.vision_patches = {"inputs": 0, "real": 0, "dummy": 0, "forwards": 0, "passes": 0}
    tower = model.model.visual

    def inputs(module, args, kwargs):
        for key in ("pixel_values", "pixel_values_videos"):
            model.vision_patches["inputs"] += len(kwargs[key]) if kwargs.get(key) is not None else 0
        model.vision_patches["forwards"] += 1

    model.model.register_forward_pre_hook(inputs, with_kwargs=True)

    def count(module, args, kwargs):
        grid = kwargs.get("grid_thw", args[1] if len(args) > 1 else None)
        side = tower.config.spatial_merge_size
        dummy = grid.tolist() == [[1, side, side]]
        model.vision_patches["dummy" if dummy else "real"] += int(grid.prod(-1).sum())
        model.vision_patches["passes"] += 1

    tower.register_forward_pre_hook(count, with_kwargs=True)


def main():
    if os.environ.get("EXTRA_EMPTY_MICRO_BATCH"):  # as a rank with fewer sequences than the agreed count gets it
        plan = train_grpo.plan_micro_batches
        train_grpo.plan_micro_batches = lambda lengths, budget: plan(lengths, budget) + [[]]
    if os.environ.get("NO_VISION_DUMMY"):
        loading.add_vision_dummy = lambda model: None  # where apply_fsdp looks it up

    model_dir, out_path, micro, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    sets, rest = [], sys.argv[5:]
    while "--then" in rest:
        sets.append(rest[: rest.index("--then")])
        rest = rest[rest.index("--then") + 1 :]
    _, _, device = distributed.setup_distributed()
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    stem, ext = os.path.splitext(out_path)
    for i, overrides in enumerate([*sets, rest]):
        one_step(model_dir, out_path if i == 0 else f"{stem}.{i}{ext}", micro, mode, overrides, processor, device)
    dist.destroy_process_group()


def one_step(model_dir, out_path, micro, mode, overrides, processor, device):
    """One update_policy step from the checkpoint's weights with these overrides; rank 0 saves what it gives."""
    rank, world = dist.get_rank(), dist.get_world_size()
    video = next((o.split("=", 1)[1] for o in overrides if o.startswith("VIDEO=")), os.environ.get("VIDEO", ""))
    overrides = [o for o in overrides if not o.startswith("VIDEO=")]
    # (the samples' engine log-probs are placeholder 0s, far from any model's: no mismatch guard)
    cfg = train_grpo.load_config(None, [f"actor.global_batch_size={PROMPTS}", f"data.rollout_batch_size={PROMPTS}",
                                        f"rollout.n={N}", f"actor.micro_batch_size={micro}",
                                        f"actor.loss_agg_mode={mode}", "actor.max_grad_norm=1e9",
                                        "algorithm.kl_coef=0.1", "data.max_prompt_length=128",
                                        "data.max_response_length=32", "algorithm.mismatch_guard=0",
                                        f"actor.model_path={model_dir}",  # (a teacher is checked against it)
                                        *overrides])  # fmt: skip
    train_grpo.check_config(cfg, world)

    g = torch.Generator().manual_seed(0)  # identical on every rank: each rank then keeps its own slice
    text_only = [int(i) for i in os.environ.get("TEXT_ONLY", "").split(",") if i]
    prompts = synthetic_prompts(processor, text_only)
    video = [int(i) for i in video.split(",") if i]
    if video:
        clips = video_prompts(processor, os.path.dirname(os.path.abspath(out_path)))
        prompts = [clips[i] if i in video else p for i, p in enumerate(prompts)]
    samples, ref_logps = [], []
    for p in range(PROMPTS):
        for _ in range(N):
            length = int(torch.randint(1, 9, (1,), generator=g)) + (20 if p >= PROMPTS // 2 else 0)
            ids = torch.randint(0, 300, (length,), generator=g).tolist()  # plain text tokens, no specials
            samples.append(rollout.Sample(p, ids, [0.0] * length, "", False))
            ref_logps.append(-torch.rand(length, generator=g) * 3)
    advantages = torch.randn(PROMPTS * N, generator=g)

    per_rank = PROMPTS // world
    mine = slice(rank * per_rank * N, (rank + 1) * per_rank * N)
    local_samples = [
        rollout.Sample(s.prompt_index - rank * per_rank, s.response_ids, s.logprobs, s.text, s.truncated)
        for s in samples[mine]
    ]
    local_prompts = prompts[rank * per_rank : (rank + 1) * per_rank]

    model = loading.load_model(model_dir, device, "sdpa", gradient_checkpointing=True)
    loading.apply_fsdp(model, device)
    loading.root_forward(model, processor.tokenizer.pad_token_id)
    sequence_parallel.attach(model, cfg.actor.sequence_parallel_size)
    count_vision_patches(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)  # the update IS the gradient: compare gradients
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    stats = StepStats()
    ids = (processor.tokenizer.pad_token_id, model.config.image_token_id)
    taught = None
    if cfg.distill.model_path:  # a teacher's log-probs of the samples, as the trainer's no-grad phase gives them
        teacher = distill.load_teacher(cfg.distill, cfg.actor, device, processor.tokenizer.pad_token_id)
        count_vision_patches(teacher)
        model.eval()
        _, _, taught = train_grpo.compute_old_and_ref_logprobs(
            model, None, local_prompts, local_samples, cfg, ids, False, teacher
        )
    model.train()
    train_grpo.update_policy(model, optimizer, scheduler, local_samples, local_prompts, advantages[mine], None,
                             ref_logps[mine], cfg, ids, stats, 1, taught)  # fmt: skip

    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    counts, patches = [None] * world, [None] * world
    dist.all_gather_object(counts, stats["actor/micro_batches"])
    dist.all_gather_object(patches, model.vision_patches)
    if cfg.distill.model_path:  # (then each entry: the policy's patches, and under "teacher" the teacher's)
        every = [None] * world
        dist.all_gather_object(every, teacher.vision_patches)
        patches = [{**p, "teacher": t} for p, t in zip(patches, every)]
    metrics = stats.metrics(stats["actor/optimizer_steps"])  # reduced over ranks, as the trainer logs them
    metrics.update(mismatch.step_metrics(stats, cfg.algorithm))  # the trainer/engine gap (placeholder engine logps)
    if rank == 0:
        torch.save({"state": state, "stats": dict(stats), "metrics": metrics, "micro_batches": counts,
                    "vision_patches": patches}, out_path)  # fmt: skip
    dist.barrier()


if __name__ == "__main__":
    main()
    distributed.exit_rank(0)
