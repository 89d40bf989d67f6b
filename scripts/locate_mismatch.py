"""Where the rollout engine and the trainer part: build both as a run does, sync the weights, and run the same prompts
(an image, a video and a text prompt: the config's data's first of each, synthetic ones for what it lacks) through
both, module by module (grpo/locate.py says what is compared). Prints a table per prompt (module, max and mean
relative difference, whether it departs from the dtype's rounding) and, last, `first divergence: <module>` named as
the trainer names it, or `first divergence: none`.

    python scripts/locate_mismatch.py CONFIG [key=value ...]

One process, the vLLM engine (rollout.engine is taken as vllm), eager (hooks see nothing of a CUDA graph), tensor
and sequence parallel 1; full fine-tuning or LoRA as the config says (a fresh adapter changes nothing).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv) -> int:
    if not argv or argv[0].startswith("-"):
        print(__doc__)
        return 2
    import rollout
    import train_grpo
    from grpo import distributed, locate, preflight
    from grpo.loading import load_policy_and_reference

    cfg_path, overrides = (argv[0], argv[1:]) if "=" not in argv[0] else (None, argv)
    cfg = train_grpo.load_config(cfg_path, overrides)
    cfg.rollout.engine, cfg.rollout.enforce_eager = "vllm", True
    cfg.rollout.tensor_parallel_size = cfg.actor.sequence_parallel_size = 1
    train_grpo.check_config(cfg, 1)
    _, _, device = distributed.setup_distributed(cfg.trainer.collective_timeout_s, cfg.trainer.verbose)

    from transformers import AutoProcessor

    from data import PromptDataset
    from grpo.media import set_pixel_range
    from grpo.video import set_video_range

    d, r = cfg.data, cfg.rollout
    processor = AutoProcessor.from_pretrained(cfg.actor.model_path)
    dataset = None
    if d.train_files:  # its first prompts, and the engine's limits from it, as a run sets them
        dataset = PromptDataset(d.train_files, processor, **preflight.dataset_kwargs(cfg, processor))
        rollout.check_prompt_limits(r, [dataset])
    else:
        set_pixel_range(processor, d.min_pixels, d.max_pixels)
        set_video_range(processor, d.video_min_pixels, d.video_max_pixels, d.max_frames)
        r.max_images_per_prompt, r.max_videos_per_prompt = (
            max(r.max_images_per_prompt, 1),
            max(r.max_videos_per_prompt, 1),
        )
    engine = rollout.make_engine(cfg, processor)
    inner = getattr(engine, "engine", engine)  # (the tool loop's engine: plain requests)
    tokenizer = processor.tokenizer
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    model, _ = load_policy_and_reference(cfg.actor, device, False, pad_id)
    model.eval()
    engine.wake()
    engine.sync_weights(model)
    reports = []
    for kind, prompt in locate.report_prompts(cfg, processor, dataset).items():
        # the engine's own greedy answer, so that the answer's positions are compared too
        params = rollout.SamplingParams(temperature=0.0, max_tokens=8)
        answer = inner.generate([prompt], 1, params, seed=0)[0].response_ids
        rows = locate.locate(inner, model, prompt, answer, pad_id)
        reports.append(rows)
        title = f"{kind} prompt: {len(prompt.input_ids)} tokens and an answer of {len(answer)}"
        print(locate.format_report(rows, title, f"first divergence on the {kind} prompt") + "\n", flush=True)
    print(f"first divergence: {locate.merged_first_divergence(reports)}", flush=True)
    distributed.shut_down(engine)
    return 0


if __name__ == "__main__":
    from grpo import distributed

    distributed.run_rank(lambda: main(sys.argv[1:]))
