"""Corrupt the vLLM engine's weights in one module at a time and write what grpo/locate.py reports, for
tests/test_mismatch.py.

One process: the engine and the trainer's model (FSDP2, world size 1) as a run builds them, then for each case a weight
sync whose tensors of that module are scaled on their way to the engine (the trainer keeps its own), and the report
on an image, a video (where the family takes videos: not GLM-4.1V's nor Gemma 4's) and a text prompt
(locate.report_prompts' synthetic ones). Cases: clean; `layer`: decoder layer 1's MLP output weight x 3 (a mixture of
experts': every expert's); `vision`: the first vision block's MLP x 30 (its output linear's weight and bias; Gemma
4's first encoder layer's); `norm`: the final norm's gain x 3; and for a mixture of experts, `router`: decoder
layer 1's router with its experts' rows rolled by one, so that every token's top-k set of experts changes (no set of
2 of 4 experts maps onto itself when each expert e becomes e + 1 mod 4). Each case's sync sends every weight, so the
next case starts from the trainer's.

    torchrun --nproc_per_node=1 tests/locate_check.py MODEL_DIR OUT_JSON
"""

import json
import re
import sys

sys.path.insert(0, __file__.rsplit("/tests/", 1)[0])

import rollout  # noqa: E402
import train_grpo  # noqa: E402
from grpo import distributed, families, locate, moe  # noqa: E402
from grpo.loading import load_policy_and_reference  # noqa: E402
from grpo.media import set_pixel_range  # noqa: E402
from grpo.video import set_video_range  # noqa: E402


def scaled_sync(engine, model, scales):
    """engine.sync_weights with each tensor named in `scales` transformed by its function on the way."""
    rpc = engine.llm.collective_rpc

    def scaling(method, *args, kwargs=None, **rest):
        if method == "reload_weights":
            weights = kwargs["weights_iterator"]
            kwargs = {**kwargs, "weights_iterator": ((n, scales[n](t) if n in scales else t) for n, t in weights)}
        return rpc(method, *args, kwargs=kwargs, **rest)

    engine.llm.collective_rpc = scaling
    try:
        engine.sync_weights(model)
    finally:
        del engine.llm.collective_rpc


# (Gemma 4's experts sit beside its MLP: layers.1.experts.{e})
LAYER_1_MLP_OUT = re.compile(
    r"model\.language_model\.layers\.1\.(mlp\.|mlp\.experts\.\d+\.|experts\.\d+\.)down_proj\.weight"
)
VISION_MLP_OUT = re.compile(
    r"model\.visual\.blocks\.0\.mlp\.(down_proj|linear_fc2)\.(weight|bias)"
    r"|model\.vision_tower\.encoder\.layers\.0\.mlp\.down_proj\.linear\.weight"  # Gemma 4's (clippable linear)
)


def cases(model) -> dict:
    names = [name for name, _ in model.named_parameters()]
    # Qwen3.5's norms multiply by 1 + weight (its tiny model's weights are 0): scale that gain, not the weight; the
    # others' (GLM-4.1V's and Gemma 4's too, on both sides) by the weight itself
    one_plus = model.config.model_type.startswith("qwen3_5")
    experts = getattr(model.config.get_text_config(), "num_experts", 0) or 0
    # (a mixture's experts reach the engine one expert at a time, under their checkpoint names: moe.stream_experts)
    layer_1 = {m["prefix"] for n in names if (m := moe.EXPERT_PARAM.match(n)) and ".layers.1." in n}
    down = [f"{prefix}.{e}.down_proj.weight" for prefix in layer_1 for e in range(experts)]
    out = {
        "clean": {},
        "layer": {n: lambda t: t * 3 for n in [*names, *down] if LAYER_1_MLP_OUT.fullmatch(n)},
        "vision": {n: lambda t: t * 30 for n in names if VISION_MLP_OUT.fullmatch(n)},
        "norm": {"model.language_model.norm.weight": (lambda t: (1 + t) * 3 - 1) if one_plus else (lambda t: t * 3)},
    }
    if experts:
        gate = "router.proj" if model.config.model_type == "gemma4" else "mlp.gate"  # moe.ROUTER's, (experts, H)
        out["router"] = {f"model.language_model.layers.1.{gate}.weight": lambda t: t.roll(1, 0)}
    return out


def main():
    model_dir, out_path = sys.argv[1], sys.argv[2]
    _, _, device = distributed.setup_distributed()
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    videos = int(families.family_of(model_dir).videos)  # no video prompt for a family that refuses them
    cfg = train_grpo.load_config("configs/tiny.yaml", [
        f"actor.model_path={model_dir}", "data.train_files=", "data.val_files=", "rollout.max_images_per_prompt=1",
        f"rollout.max_videos_per_prompt={videos}", "data.video_min_pixels=3136", "data.video_max_pixels=12544",
        "data.max_frames=4", f"rollout.cpu_kv_cache_bytes={64 << 20}",
    ])  # fmt: skip
    d = cfg.data
    set_pixel_range(processor, d.min_pixels, d.max_pixels)
    set_video_range(processor, d.video_min_pixels, d.video_max_pixels, d.max_frames)
    engine = rollout.make_engine(cfg, processor)
    pad_id = processor.tokenizer.pad_token_id
    model, _ = load_policy_and_reference(cfg.actor, device, False, pad_id)
    model.eval()
    engine.wake()
    engine.sync_weights(model)
    prompts = locate.report_prompts(cfg, processor)
    params = rollout.SamplingParams(temperature=0.0, max_tokens=4)
    answers = {kind: engine.generate([p], 1, params, seed=0)[0].response_ids for kind, p in prompts.items()}
    result = {}
    for case, scales in cases(model).items():
        scaled_sync(engine, model, scales)
        result[case] = {"scaled": sorted(scales)}
        for kind, prompt in prompts.items():
            rows = locate.locate(engine, model, prompt, answers[kind], pad_id)
            print(locate.format_report(rows, f"{case}, {kind} prompt"), flush=True)
            result[case][kind] = {"first": locate.first_divergence(rows), "rows": rows}
    with open(out_path, "w") as f:
        json.dump(result, f)
    distributed.shut_down(engine)


if __name__ == "__main__":
    main()
    distributed.exit_rank(0)
