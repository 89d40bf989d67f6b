"""The tool loop (turns.py) on the vLLM engine: the later turns' log-probs against the trainer's. Used by
tests/test_tools.py.

    torchrun --nproc_per_node=1 tests/vllm_tools_check.py MODEL_DIR OUT.json

The first turn is scripted (the tiny random model never calls a tool itself): six calls, one of each outcome; the
continuation turn is vLLM's, from the engine ids of the prompt, the scripted call and the tool turn, with the
prompt's image and the tool's. The trainer then scores the whole interleaved answer (the tool turn as context) and
the continuation's tokens must get vLLM's log-probs."""

import json
import sys

import torch

sys.path.insert(0, __file__.rsplit("/tests/", 1)[0])

import rollout  # noqa: E402
import train_grpo  # noqa: E402
from grpo import batching, distributed, loading, logprobs, tools, turns  # noqa: E402
from grpo.media import set_pixel_range  # noqa: E402
from tests.hf_engine_check import image_prompts  # noqa: E402
from tests.test_tools import SPECS, Scripted, scripted_calls  # noqa: E402

BOUNDS = (56 * 56, 112 * 112)


def main():
    from transformers import AutoProcessor

    model_dir, out_path = sys.argv[1], sys.argv[2]
    _, world, device = distributed.setup_distributed()
    processor = AutoProcessor.from_pretrained(model_dir)
    set_pixel_range(processor, *BOUNDS)
    cfg = train_grpo.load_config(None, [
        "rollout.engine=vllm", f"actor.model_path={model_dir}", f"data.min_pixels={BOUNDS[0]}",
        f"data.max_pixels={BOUNDS[1]}", "data.max_prompt_length=256", "data.max_response_length=256",
        f"rollout.cpu_kv_cache_bytes={64 << 20}", "rollout.max_images_per_prompt=2", "rollout.max_videos_per_prompt=0",
    ])  # fmt: skip
    train_grpo.check_config(cfg, world)
    engine = rollout.make_engine(cfg, processor)
    model = loading.load_model(model_dir, device, "sdpa").eval()  # the checkpoint the engine loaded: nothing to sync
    engine.wake()
    result = {}
    # a stop token ends an answer and stays in it, as end-of-sequence does (the loop finds calls by it)
    stops = tuple(range(100, 400))
    params = rollout.SamplingParams(1.0, 1.0, 8, stop_token_ids=stops)
    prompts = image_prompts(processor, 2)
    stopped = engine.generate(prompts, 4, params, seed=3)
    result["stopped_at_stop"] = sum(s.response_ids[-1] in stops and not s.truncated for s in stopped)
    result["answers"] = len(stopped)

    first = scripted_calls(processor.tokenizer)
    params = rollout.SamplingParams(1.0, 1.0, 256)
    with tools.ToolPool(SPECS, timeout=2.0, num_workers=2) as pool:
        samples, stats = turns.generate_with_tools(Scripted(engine, first), processor, pool, prompts, 3, params, 11,
                                                   max_turns=2, budget=256, bounds=BOUNDS)  # fmt: skip
    result["stats"] = stats
    result["later_tokens"] = [len(s.response_ids) - s.turns[0].start - len(s.turns[0].input_ids) for s in samples]
    result["tool_images"] = [len(s.turns[0].images) for s in samples]
    batch, response_ids, mask = batching.pack([prompts[s.prompt_index] for s in samples],
                                              [s.response_ids for s in samples], model.config.image_token_id,
                                              turns=[s.turns for s in samples])  # fmt: skip
    with torch.no_grad():
        logp = logprobs.forward_logprobs(model, batch, response_ids, 1.0)[0]  # (B, T)
    diffs = []
    for row, s in enumerate(samples):
        end = s.turns[0].start + len(s.turns[0].input_ids)
        diffs.append((logp[row, end : len(s.response_ids)] - torch.tensor(s.logprobs[end:])).abs().max().item())
    result["diff"] = diffs
    engine.sleep()
    with open(out_path, "w") as f:
        json.dump(result, f)
    distributed.shut_down(engine)  # the engine, then the process group, as the trainer ends


if __name__ == "__main__":
    main()
    distributed.exit_rank(0)  # past gloo's worker threads still dropping the last tensors (see distributed.exit_rank)
