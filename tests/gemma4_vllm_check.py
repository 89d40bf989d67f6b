"""vLLM 0.32's gemma4_mm against the trainer's padded forward, for tests/test_families.py, in a process of its own: an
engine built in the test process would leave vLLM's CPU worker's changes to that process behind for the tests after it
(VLLM_DIST_IDENT in os.environ, which the next vLLM a test starts warns of; torch.set_num_threads replaced by a no-op).
Prints one line of JSON: the max |vLLM - trainer| log-prob of the text and the image prompt before and after the sync.
The sync sends what vllm_engine.sync_weights sends: transformers' in-memory names, a mixture of experts' experts one
at a time (moe.stream_experts), after forgetting vLLM's CPU expert kernels (vllm_compat.forget_cpu_moe_kernels).

    python tests/gemma4_vllm_check.py MODEL_DIR
"""

import json
import sys

sys.path.insert(0, __file__.rsplit("/tests/", 1)[0])

import torch  # noqa: E402

from grpo import batching, families, loading, logprobs, moe  # noqa: E402


def main(path):
    from PIL import Image, ImageDraw
    from transformers import AutoProcessor
    from vllm import LLM
    from vllm import SamplingParams as VLLMSampling

    from grpo import vllm_compat
    from grpo.samples import Prompt, vision_token_ids

    processor = AutoProcessor.from_pretrained(path)
    with vllm_compat.torch_cpu_linear(True):
        limits = {"image": 1, "video": 0, "audio": 0}
        llm = LLM(model=path, dtype=torch.float32, enforce_eager=True, max_model_len=512, seed=0, block_size=32,
                  kv_cache_memory_bytes=64 << 20, enable_chunked_prefill=False, limit_mm_per_prompt=limits,
                  logprobs_mode="processed_logprobs")  # fmt: skip
    model = loading.load_model(path, torch.device("cpu"), "sdpa")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05 * p.std())
    img = Image.new("RGB", (150, 90), "white")
    ImageDraw.Draw(img).line((0, 0, 80, 60), fill="black", width=5)
    bias = {t: -100.0 for t in vision_token_ids(processor.tokenizer, families.GEMMA_VISION_TOKENS)}

    def gaps():
        """max |vLLM - trainer| log-prob over 12 sampled tokens, text prompt and image prompt."""
        out = []
        for images in ([], [img]):
            content = [{"type": "image"}] * len(images) + [{"type": "text", "text": "Find x. Find x. "}]
            text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
            req = {"prompt": text, **({"multi_modal_data": {"image": images[0]}} if images else {})}
            params = VLLMSampling(max_tokens=12, temperature=0.9, logprobs=0, seed=1, logit_bias=bias)
            with vllm_compat.torch_cpu_linear(True):
                answer = llm.generate([req], params, use_tqdm=False)[0].outputs[0]
            ids = list(answer.token_ids)
            engine = torch.tensor([d[t].logprob for d, t in zip(answer.logprobs, ids)])
            hf = processor(text=[text], images=images or None, return_tensors="pt")
            prompt = Prompt(hf["input_ids"][0], hf.get("pixel_values"), None, images, hf["mm_token_type_ids"][0],
                            image_position_ids=hf.get("image_position_ids"))  # fmt: skip
            inputs, response_ids, _ = batching.collate([prompt], [ids], processor.tokenizer.pad_token_id,
                                                       model.config.image_token_id)  # fmt: skip
            with torch.no_grad():
                trainer = logprobs.forward_logprobs(model, inputs, response_ids, 0.9)[0][0]
            out.append((engine - trainer).abs().max().item())
        return out

    before = gaps()

    def weights():
        for name, p in model.named_parameters():
            if moe.EXPERT_PARAM.match(name):
                yield from moe.stream_experts(name, p.detach(), torch.float32)
            else:
                yield name, p.detach().clone()

    if families.family(model).moe:
        llm.apply_model(vllm_compat.forget_cpu_moe_kernels)
    with vllm_compat.torch_cpu_linear(True):
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights()})
    llm.reset_prefix_cache()
    llm.llm_engine.reset_encoder_cache()
    llm.reset_mm_cache()
    text, image = gaps()
    print(json.dumps({"before": before, "text": text, "image": image}))


if __name__ == "__main__":
    main(sys.argv[1])
