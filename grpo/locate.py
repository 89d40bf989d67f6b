"""Where engine and trainer part: the same sequence through both models, compared module by module.

The mismatch metrics (mismatch.py) say that the engine's log-probs and the trainer's differ, not where. The engine
lives in the trainer's process, so both models can be run on the same prompt + answer with forward hooks on modules
that compute the same thing, and the first module whose outputs differ beyond the dtype's rounding is where they
part. What is compared, per module (trainer name -> vLLM 0.26 to 0.33 name: vLLM's Qwen VL models, and 0.32's
glm4_1v, hold the vision tower as `visual` and the text model as `language_model.model`; 0.32's gemma4_mm holds
Gemma 4's tower as `vision_tower`, transformers' own module, and its text model as `language_model.model` too):

- `model.visual.blocks.{i}` -> `visual.blocks.{i}`: each vision block's output, patch by patch. Both sides order the
  patches alike (Qwen2.5-VL's window order, which transformers and vLLM compute the same way, or none); vLLM keeps a
  batch dim of 1 in the middle, (patches, 1, dim), flattened here. GLM-4.1V's blocks alike.
- Gemma 4's `model.vision_tower.encoder.layers.{i}` -> `vision_tower.encoder.layers.{i}`: each encoder layer's output
  per patch, the padding patches of the processor's fixed-size input included (the same input on both sides).
- `model.visual.merger` and Qwen3-VL's `model.visual.deepstack_merger_list.{i}` -> `visual.merger`,
  `visual.deepstack_merger_list.{i}`: their merged tokens (before Qwen2.5-VL's reverse window order, on both sides).
  GLM-4.1V's merger alike (after its downsample). Gemma 4 has no merger: `model.embed_vision` -> `embed_vision`, the
  projection of the pooled soft tokens into the text model, is compared in its place.
- `model.language_model.layers.{i}` -> `language_model.model.layers.{i}`: the residual stream after the layer at every
  position of the sequence. vLLM's layers fuse the residual add into the next layer's norm and return
  (hidden, residual), the stream being their sum (Gemma 4's return (stream, None)); they run the tokens flattened,
  (tokens, dim), without a batch dim.
  (Qwen3-VL's deepstack features are added after the layer on both sides, so neither output holds them.)
- `model.language_model.layers.{i}.mlp.gate`, Gemma 4's `.router` (the mixtures of experts): the share of tokens
  whose top-k SET of experts differs (routing.py), not a relative difference.
- `model.language_model.norm` -> `language_model.model.norm`: the final norm's output at every position (vLLM's
  returns (normed, residual)).
- `lm_head` -> `language_model.logits_processor`: the logits at the sequence's last position, the only one whose
  logits vLLM computes for a one-token request; the trainer's are its head's weight (LoRA merged) times its final
  norm's output there, as its log-prob forward computes them (logprobs.chunked_logprobs), soft-capped where the
  model caps them (Gemma 4: vLLM's logits processor caps them too), before the forbidden tokens are taken out on
  either side.

Each tensor comparison is per row (a patch, a token): |t - e| / |t| in the L2 norm, its max and mean over the rows.
A module departs when its max passes NOISE for the coarser of the two dtypes (a router: when more tokens than
ROUTE_NOISE choose other experts). The first module that departs, in the order the trainer ran them, is named. A
trainer module without a known vLLM name, or whose vLLM module the engine's model does not have, is left out of the
report rather than stopping the run that asked for it.

The engine runs the sequence as a one-token request with its prefix and encoder caches emptied first, so every token
and image goes through every module. Modules vLLM runs inside CUDA graphs or torch.compile record nothing: the
report needs an eager engine (rollout.enforce_eager=true; the CPU engine always is)."""

from __future__ import annotations

import re

import torch

from grpo import batching, logprobs, moe
from grpo.routing import engine_logits, with_answer
from grpo.samples import SamplingParams

# Above the largest per-row relative difference that rounding alone gives, by the coarser dtype of the two sides.
# Measured on the tiny models (docs/algorithm.md, "Where engine and trainer part"): an fp32 engine against the fp32
# trainer stays below 1.1e-6 in every module (Gemma 4's decoder layers: 1.2e-5); Qwen3.5's bf16 engine on CPU
# against the fp32 trainer below 9e-3.
NOISE = {torch.float32: 1e-4, torch.bfloat16: 0.05, torch.float16: 0.05}
# the share of tokens routed to other experts that rounding alone gives: where two experts' logits nearly tie
ROUTE_NOISE = {torch.float32: 0.02, torch.bfloat16: 0.1, torch.float16: 0.1}

COMPARED = re.compile(
    r"model\.visual\.(blocks\.\d+|merger|deepstack_merger_list\.\d+)|model\.language_model\.(layers\.\d+|norm)"
    r"|model\.vision_tower\.encoder\.layers\.\d+|model\.embed_vision"  # Gemma 4's tower and soft-token projection
)
# trainer prefix -> vLLM prefix
ENGINE_PREFIXES = (
    ("model.visual.", "visual."),
    ("model.vision_tower.", "vision_tower."),
    ("model.embed_vision", "embed_vision"),
    ("model.language_model.", "language_model.model."),
)
# the vision modules: compared only where the prompt has an image or a video (no tower runs on text)
TOWER = ("model.visual.", "model.vision_tower.", "model.embed_vision")


def engine_name(name: str) -> str:
    """The vLLM module that computes what the trainer's module `name` does (see the module docstring)."""
    if name == "lm_head":
        return "language_model.logits_processor"
    for trainer, engine in ENGINE_PREFIXES:
        if name.startswith(trainer):
            return engine + name[len(trainer) :]
    raise ValueError(f"no engine module known for {name}")


def _mapped(name: str) -> bool:
    try:
        engine_name(name)
    except ValueError:
        return False
    return True


def compared_modules(model) -> dict[str, torch.nn.Module]:
    """The trainer's modules the report compares, by their names (wrapper prefixes left out), routers included; one
    without a known engine module is left out (the report must not stop the run that asked for it)."""
    out = {}
    for name, module in model.named_modules():
        name = name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
        if (COMPARED.fullmatch(name) or moe.ROUTER.search(name)) and _mapped(name):
            out[name] = module
    return out


def _rows(x: torch.Tensor) -> torch.Tensor:
    # a copy: vLLM's sampler adds its logit bias to the logits in place, after the hook has seen them
    return x.detach().reshape(-1, x.shape[-1]).float().cpu().clone()  # (rows, dim)


def _is_router(name: str) -> bool:
    return bool(moe.ROUTER.search(name))


def trainer_outputs(model, prompt, answer, pad_id: int) -> tuple[dict, list[str]]:
    """The trainer's outputs of compared_modules over prompt + answer, as forward_logprobs computes them (one no-grad
    forward, collective under FSDP2), and the modules' names in the order they ran. Rows as in the module docstring;
    `lm_head`: the last position's logits."""
    found, order, handles = {}, [], []
    modules = compared_modules(model)
    softcap = logprobs.logit_softcap(model)  # read here: the log-prob forward sets the config's aside while it runs

    def hook(name):
        def record(_module, _args, out):
            if name not in found:
                order.append(name)
            if _is_router(name):
                x = out[2]  # transformers' routers: (logits or probabilities, weights, chosen experts)
            else:
                x = out[0] if isinstance(out, tuple) else out
                if name == "model.language_model.norm":  # the head inside the root's forward, its weight gathered
                    head = logprobs._head_weight(model.lm_head)  # (V, H)
                    logits = _rows(x)[-1:] @ head.detach().float().cpu().T  # (1, V)
                    found["lm_head"] = [logprobs.soft_capped(logits, softcap)]
            found.setdefault(name, []).append(_rows(x) if not _is_router(name) else x.detach().cpu())

        return record

    if prompt.pixel_values is None and prompt.pixel_values_videos is None:  # its tower runs a blank image only
        modules = {name: m for name, m in modules.items() if not name.startswith(TOWER)}
    handles = [m.register_forward_hook(hook(name)) for name, m in modules.items()]
    batch, answer_ids, _ = batching.collate([prompt], [list(answer)], pad_id, model.config.image_token_id)
    try:
        with torch.no_grad():
            # whole on every rank (each has the same sequence), not cut over a sequence-parallel group
            logprobs.forward_logprobs(model, batch, answer_ids, 1.0, split_over_group=False)
    finally:
        for h in handles:
            h.remove()
    if hasattr(model, "reshard"):  # FSDP2 keeps the root's parameters gathered after a no-grad forward
        model.reshard()
    if "model.language_model.norm" in order:
        order.append("lm_head")
    return {name: torch.cat(xs) for name, xs in found.items()}, order


def engine_outputs(engine, prompt, answer, names: list[str], top_k: int, absent: list | None = None) -> dict:
    """The engine's outputs of the modules that match the trainer's `names`, over prompt + answer: one request of
    one new token, the prefix and encoder caches emptied first. Every member of a TP group must call it with the same
    sequence (vLLM's rule); each then records the whole outputs (the compared ones are reduced or replicated).
    `absent`, a list: the names whose module the engine's model does not have are appended to it."""
    found, handles = {}, []
    sequence = with_answer(prompt, list(answer), engine.image_token_id)

    def wrap(name, forward):
        def recording(*args, **kwargs):
            return record(name, forward(*args, **kwargs))

        return recording

    def record(name, out):
        if _is_router(name):
            x = engine_logits(out).topk(top_k, dim=-1).indices.cpu()
        elif isinstance(out, tuple) and name.startswith("model.language_model.layers."):
            x = _rows(out[0] + out[1]) if out[1] is not None else _rows(out[0])  # (hidden, residual): the stream
        else:
            x = _rows(out[0] if isinstance(out, tuple) else out)
        found.setdefault(name, []).append(x)
        return out

    def install(model):
        # The module's forward wrapped, not a forward hook: vLLM calls a module compiled with its
        # support_torch_compile (Qwen2.5-VL's vision blocks and merger) through self.forward even when eager,
        # which runs no hooks
        modules = dict(model.named_modules())
        for name in names:
            module = modules.get(engine_name(name)) if _mapped(name) else None
            if module is not None:
                module.forward = wrap(name, module.forward)
                handles.append(module)
            elif absent is not None:
                absent.append(name)

    engine.llm.apply_model(install)  # in this process: the engine's model is this rank's worker's
    try:
        engine.llm.reset_prefix_cache()  # every token through every layer, none from cached KV
        engine.llm.llm_engine.reset_encoder_cache()  # every image through the tower
        engine.generate([sequence], 1, SamplingParams(temperature=0.0, max_tokens=1), seed=0)
    finally:
        for module in handles:
            del module.forward  # back to the class's
    out = {name: torch.cat(xs) for name, xs in found.items()}
    if "lm_head" in out:
        out["lm_head"] = out["lm_head"][-1:]  # the last position: what the request sampled from
    return out


def relative_difference(t: torch.Tensor, e: torch.Tensor) -> tuple[float, float]:
    """Per row |t - e| / |t| (L2), its max and mean over the rows: (rows, dim) each."""
    rel = (t - e).norm(dim=-1) / t.norm(dim=-1).clamp_min(1e-30)  # (rows,)
    return rel.max().item(), rel.mean().item()


def compare(trainer: dict, engine: dict, order: list[str], dtype) -> list[dict]:
    """One row per module, in the trainer's order: module, max, mean, departs, and a note when the two are not
    comparable (other shapes: a departure; a module the engine did not run: departs None, unknown)."""
    rows = []
    for name in order:
        t, e, note = trainer[name], engine.get(name), ""
        if e is None:
            mx = mean = float("nan")
            note = "the engine ran it in a CUDA graph or compiled, or not at all"
        elif _is_router(name):
            e = e[: len(t)]
            differ = (e.sort(-1).values != t.sort(-1).values).any(-1).float() if e.shape == t.shape else None
            mx = mean = differ.mean().item() if differ is not None else float("nan")
            note = "share of tokens whose top-k experts differ" if differ is not None else "other token counts"
        elif name.startswith("model.language_model.") and len(e) > len(t):  # vLLM may pad the batch's tokens
            e = e[: len(t)]
        if e is not None and not _is_router(name):
            if e.shape != t.shape:
                mx = mean = float("nan")
                note = f"shapes differ: trainer {tuple(t.shape)}, engine {tuple(e.shape)}"
            else:
                mx, mean = relative_difference(t, e)
        bound = (ROUTE_NOISE if _is_router(name) else NOISE)[dtype]
        departs = None if e is None else not mx <= bound  # None: unknown
        rows.append({"module": name, "max": mx, "mean": mean, "departs": departs, "note": note})
    return rows


def first_divergence(rows: list[dict]) -> str:
    """The first module that departs; `unknown` when the engine did not run one before it (nothing to compare)."""
    for r in rows:
        if r["departs"] is None:
            return f"unknown (the engine's {engine_name(r['module'])} recorded nothing: rollout.enforce_eager=true)"
        if r["departs"]:
            return r["module"]
    return "none"


def locate(engine, model, prompt, answer, pad_id: int) -> list[dict]:
    """compare() of the trainer's and the engine's modules on prompt + answer. Collective: every rank calls it with
    the same sequence (a forward of the FSDP2 model; the engine's TP group submits it together)."""
    text = model.config.get_text_config()
    top_k = moe.top_k(text) or 1
    trainer, order = trainer_outputs(model, prompt, answer, pad_id)
    absent = []
    engine_out = engine_outputs(engine, prompt, answer, order, top_k, absent)
    # a module the engine's model does not have (another vLLM's layout) is left out, not reported as unknown: the
    # report must not stop, nor blame eager mode, for a module it cannot map
    order = [name for name in order if name not in absent]
    dtype = torch.bfloat16 if torch.bfloat16 in (engine.dtype, next(model.parameters()).dtype) else engine.dtype
    if logprobs.compute_device(model).type == "cuda":  # FSDP2 computes in bf16 there (loading.mixed_precision)
        dtype = torch.bfloat16
    return compare(trainer, engine_out, order, dtype)


def format_report(rows: list[dict], title: str = "", label: str = "first divergence") -> str:
    """The table, then `<label>: <module>`."""
    width = max([len(r["module"]) for r in rows] + [6])
    lines = [title] if title else []
    lines.append(f"{'module':<{width}}  {'max rel':>9}  {'mean rel':>9}  departs")
    for r in rows:
        departs = {True: "YES", False: "no", None: "?"}[r["departs"]] + (f"  ({r['note']})" if r["note"] else "")
        lines.append(f"{r['module']:<{width}}  {r['max']:>9.2e}  {r['mean']:>9.2e}  {departs}")
    lines.append(f"{label}: {first_divergence(rows)}")
    return "\n".join(lines)


def report_prompts(cfg, processor, dataset=None) -> dict:
    """modality -> a Prompt for the report: the first text-only, image and video prompt of `dataset`
    (data.PromptDataset, or None), and a synthetic one for each modality it lacks (a drawn line, random frames; a
    video only where the engine takes videos), under the config's pixel and frame bounds, which the processor must
    already have (PromptDataset sets them; media.set_pixel_range, video.set_video_range)."""
    from types import SimpleNamespace

    from PIL import Image, ImageDraw

    from grpo import video
    from grpo.media import fit_image, image_side
    from grpo.samples import encode_prompt

    found = {}
    for i in range(len(dataset) if dataset is not None else 0):
        kind = "video" if dataset.video_sources[i] else "image" if dataset.image_sources[i] else "text"
        if kind not in found:
            found[kind] = encode_prompt(processor, dataset[i])
        if len(found) == 3:
            break
    d, side = cfg.data, image_side(processor.image_processor)
    g = torch.Generator().manual_seed(0)
    for kind in ("text", "image", "video"):
        if kind in found or (kind == "video" and not cfg.rollout.max_videos_per_prompt):
            continue
        images, videos = [], []
        if kind == "image":
            image = Image.new("RGB", (300, 200), "white")
            ImageDraw.Draw(image).line((0, 0, 250, 150), fill="black", width=5)
            images = [fit_image(image, d.min_pixels, d.max_pixels, side)]
        if kind == "video":
            frames = [Image.fromarray(torch.randint(0, 256, (96, 128, 3), generator=g, dtype=torch.uint8).numpy())
                      for _ in range(4)]  # fmt: skip
            videos = [video.load_video(frames, d.video_fps, d.max_frames, d.video_min_pixels, d.video_max_pixels, side)]
        content = [{"type": "image"}] * len(images) + [{"type": "video"}] * len(videos)
        content.append({"type": "text", "text": "What is in the figure? Answer with one number."})
        text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
        found[kind] = encode_prompt(processor, SimpleNamespace(prompt=text, images=images, videos=videos))
    return {kind: found[kind] for kind in ("image", "video", "text") if kind in found}


def merged_first_divergence(reports: list[list[dict]]) -> str:
    """The earliest, in the order the trainer runs its modules, of the reports' first divergences."""
    firsts = [first_divergence(rows) for rows in reports]
    order = max(([r["module"] for r in rows] for rows in reports), key=len, default=[])
    named = [f for f in firsts if f in order]
    return min(named, key=order.index) if named else next((f for f in firsts if f != "none"), "none")


def in_run(engine, model, pad_id: int):
    """The report as the loop's start guard runs it (mismatch.check_start's `locate`): (prompt, answer) -> locate()'s
    rows, with the engine woken for it and put back to sleep; None for an engine that is not vLLM (the HF engine
    samples with the trainer's own model). An engine whose level-2 sleep discarded its weights gets them again by a
    sync first, which reproduces what the sync gave it (not what went bad after one)."""
    inner = getattr(engine, "engine", engine)  # (the tool loop's engine: plain requests)
    if getattr(inner, "llm", None) is None:
        return None

    def run(prompt, answer):
        inner.wake()
        if inner.sleep_level == 2:
            inner.sync_weights(model)
        try:
            return locate(inner, model, prompt, answer, pad_id)  # (the trainer's forward first: the engine's
        finally:  # request may move the trainer's state to host memory, which its sleep brings back)
            inner.sleep()

    return run
