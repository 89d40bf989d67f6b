"""What differs between the vLLM releases the engine code runs on (0.26 to 0.33), each decided here once.

vllm_engine.VLLMEngine is written against 0.32/0.33; these few helpers make it mean the same on 0.26 (the last release
built for torch 2.11). Every choice comes from what the installed vLLM has (a field, an attribute, a parameter, an
importable package), not from its version string, so a patched or back-ported build still gets the right branch.
"""

import contextlib
import dataclasses
import gc
import importlib.util
import inspect
import math
import os


def engine_args() -> set[str]:
    """The names `LLM(...)` accepts as engine arguments (EngineArgs' fields): it raises TypeError on any other."""
    from vllm.engine.arg_utils import EngineArgs

    return {f.name for f in dataclasses.fields(EngineArgs)}


def processor_normalization() -> dict:
    """`LLM(...)` arguments that leave the pixels' normalization to the HF processors (each modality with its own
    processor's mean and std). vLLM 0.32/0.33 normalize on the device, videos with the IMAGE processor's mean and std,
    unless mm_device_do_normalize=False; vLLM 0.26 has no such argument (LLM raises TypeError on it) and always
    normalizes in the HF processor, so there is nothing to switch off."""
    return {"mm_device_do_normalize": False} if "mm_device_do_normalize" in engine_args() else {}


def gdn_prefill(linear_attention: bool) -> dict:
    """`LLM(...)` arguments for a model with gated-delta-net layers (Qwen3.5) on CUDA: vLLM's Triton prefill kernel.
    Left at "auto", vLLM 0.26 to 0.33 pick FlashInfer's GDN prefill on SM90 (H100, H200) without checking that
    flashinfer is there (model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py _resolve_gdn_prefill_backend), and
    import flashinfer.gdn_prefill only at the first prefill: an install without flashinfer (an offline vLLM 0.26)
    passes the engine's start, whose warm-up logs the error and goes on, and fails at the first rollout; with
    flashinfer (0.32/0.33) the kernel is JIT-compiled at that first prefill. Triton's needs nothing beyond vLLM. The
    argument (EngineArgs.gdn_prefill_backend, into additional_config) is passed only where EngineArgs has it."""
    return {"gdn_prefill_backend": "triton"} if linear_attention and "gdn_prefill_backend" in engine_args() else {}


def skip_engine_teardown(llm) -> None:
    """At exit vLLM 0.32/0.33's in-process client runs a weakref finalizer that shuts the engine core down and tears
    torch.distributed down a second time, after main() did (an ignored traceback); the process is exiting anyway, so
    it is detached. vLLM 0.26's in-process client registers none: nothing to skip."""
    finalizer = getattr(llm.llm_engine.engine_core, "_finalizer", None)
    if finalizer is not None:
        finalizer.detach()


def shut_down(llm, collect: bool = True) -> None:
    """Tear the in-process engine down as vLLM tears down its own engine processes, the same in 0.26 and 0.33:
    EngineCore.shutdown() shuts the worker down (its model and KV cache dropped, its CuMemAllocator pools released,
    so the allocator's exit hook finds nothing left), then the scheduler, then cleanup_dist_env_and_memory: vLLM's
    groups and their communicators (destroy_model_parallel), its world group, and last
    torch.distributed.destroy_process_group() of the default group, the one external_launcher shares with the
    trainer. It is called on the EngineCore itself: the 0.32/0.33 client's shutdown() runs it only while the finalizer
    that skip_engine_teardown detached is still attached.

    collect=False (a CPU run, which ends right after): the shutdown's two full garbage collections (its model
    runner's KV-cache cleanup, and cleanup_dist_env_and_memory's after it unfreezes the heap; 0.26 to 0.33) are
    skipped. They only give memory back to a process about to exit, and each walks the whole heap: 1.3 s at the end
    of every CPU run. On CUDA they run: the device memory they free is what the allocator's exit hook must find gone."""
    if collect:
        llm.llm_engine.engine_core.engine_core.shutdown()
        return
    collect_garbage = gc.collect
    gc.collect = lambda generation=2: 0
    try:
        llm.llm_engine.engine_core.engine_core.shutdown()
    finally:
        gc.collect = collect_garbage


@contextlib.contextmanager
def torch_cpu_linear(on: bool):
    """While it is open, vLLM's CPU build sets up the unquantized linear layers it processes (at the engine's load
    and at each reload_weights) with torch's own matmul, its fallback, instead of a oneDNN handler (0.26 to 0.33:
    model_executor/layers/utils.py dispatch_cpu_unquantized_gemm, taken while vllm._custom_ops._supports_onednn).
    A handler prepacks the weights and builds a matmul primitive for each batch size it meets (at most 32 kept), and
    a reload builds every handler again: this trainer reloads at every step, so every rollout paid the primitives
    anew at each batch size its decode steps went through, 0.1-0.4 ms a layer each, and more in a rollout whose
    batches are large and change size often (the partial rollout's), and every sync repacked each weight. torch's
    matmul keeps the weights as loaded and builds nothing. Only with `on` (an fp32 engine on CPU: the matmul the
    trainer itself computes with); otherwise, and on CUDA, nothing is touched."""
    if not on:
        yield
        return
    import vllm._custom_ops as ops

    before = getattr(ops, "_supports_onednn", None)
    if before is None:  # (no such switch in this build: its layers are as vLLM sets them up)
        yield
        return
    ops._supports_onednn = False
    try:
        yield
    finally:
        ops._supports_onednn = before


def forget_cpu_moe_kernels(model) -> int:
    """Make the next weight reload set up every MoE layer's kernel as the first load did; returns how many there are.
    Run on the engine's model (LLM.apply_model) before each sync, on CPU only. vLLM 0.32 re-runs an MoE layer's weight
    processing on reload but, once the layer has a kernel, skips the experts' own step, which on CPU prepacks the
    weights into its grouped-GEMM layout: the new weights would be read as if packed (measured: a sync of unchanged
    weights moved the tiny Qwen3-VL-MoE's log-probs by 0.18). With no kernel the reload builds one and prepacks, and
    vLLM copies the result into the tensors it had. On CUDA the kernel is kept: CUDA graphs hold those tensors, and
    the step is a no-op for the bf16 experts there (Triton's, FlashInfer CUTLASS's act on quantized weights only).
    A model without experts is left as it is."""
    n = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if getattr(method, "moe_kernel", None) is not None:
            method.moe_kernel = None
            n += 1
    return n


def sampler_environment(on_cuda: bool) -> None:
    """vLLM 0.26 and 0.33 both sample with flashinfer on CUDA by default (VLLM_USE_FLASHINFER_SAMPLER) and the
    sampler's probe raises at engine start when flashinfer is not importable, which can be the case in an offline
    install of vLLM 0.26 (PyPI's vllm 0.33 depends on flashinfer). vLLM's own PyTorch sampler is taken then. A
    value the user set wins. Off CUDA the variable is never read."""
    if on_cuda and importlib.util.find_spec("flashinfer") is None:
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")


def model_runner_environment() -> None:
    """Run vLLM's V1 model runner, on every platform, unless the user set VLLM_USE_V2_MODEL_RUNNER (theirs wins).

    Left to itself vLLM picks per engine: 0.33 takes Model Runner V2 wherever Triton imports, so on every CUDA node
    (config/vllm.py use_v2_model_runner); 0.26 takes it for dense models only (Qwen2.5-VL, Qwen3-VL) and V1 for the
    hybrid Qwen3.5 and the MoE families; the CPU builds have no Triton and run V1. V2 is a second implementation
    (vllm/v1/worker/gpu/: its own Gumbel-max sampler with hashed per-request seeds, its own logit-bias, log-prob and
    encoder-cache code) that no CPU test can run (it needs Triton). V1 is the runner vLLM's CPU build subclasses, so
    its sampler (vllm/v1/sample), logit_bias, seeded generators, raw log-probs (logprobs_mode) and encoder-cache reset
    are what every engine test checks, token for token against the trainer. V1 takes everything the engine uses on CUDA
    in 0.26 and 0.33 (no pipeline parallelism, no speculative decoding); sleep/wake (the worker's CuMemAllocator)
    and reload_weights(weights_iterator=...) (model_loader/reload, then the encoder caches reset) are the same code
    under either runner. One runner then for every family and version, the one the tests ran."""
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")


def captures_routes(on_cuda: bool, tensor_parallel_size: int = 1) -> bool:
    """Whether this vLLM returns each request's routed experts (LLM(enable_return_routed_experts=True),
    CompletionOutput.routed_experts [tokens, layers, top_k]) under the model runner the trainer runs. 0.26 captures
    them in the V1 runner (gpu_worker: init_routed_experts_capturer after the KV cache; its slot buffer is written
    inside the model, CUDA graphs included); 0.32 and 0.33 only in Model Runner V2 (AuxOutputConfig; the config
    check refuses it under V1, and asks for prefix caching), so there only where the user set
    VLLM_USE_V2_MODEL_RUNNER=1 (model_runner_environment), and only without tensor parallelism: there the first TP
    rank's worker alone produces the routes (distributed/aux_output_connector/worker.py, 0.32 and 0.33 line 112:
    `if not get_tp_group().is_first_rank: return`), while under the external launcher every rank runs a scheduler
    of its own, which asserts that its requests' routes are there (connector.py take_output, 0.32 line 112, 0.33
    line 193): the other ranks would stop at the first step. Off CUDA never: the CPU builds run the V1 runner, and
    the 0.26 capturer's buffers are the GPU worker's."""
    if not on_cuda or "enable_return_routed_experts" not in engine_args():
        return False
    if not v2_only_capture():
        return True
    return os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "1" and tensor_parallel_size == 1


def v2_only_capture() -> bool:
    """Whether this vLLM captures routed experts in Model Runner V2 only (0.32, 0.33: vllm.config.AuxOutputConfig)."""
    import vllm.config

    return hasattr(vllm.config, "AuxOutputConfig")


def reads_per_layer_configs() -> bool:
    """Whether the installed vLLM reads a config whose layers differ (transformers' heterogeneous configs: Gemma 4's
    head_dim is its sliding layers', global_head_dim its full layers', kept per layer). vLLM 0.32/0.33 ask for the
    per-layer configs (ModelArchConfigConvertorBase.get_per_layer_hf_configs); vLLM 0.26 reads text_config.head_dim,
    which such a config refuses (AmbiguousGlobalPerLayerAttributeError), and its engine does not start."""
    import vllm.config  # noqa: F401  (first: the convertor's module imports it back, a cycle when imported alone)
    from vllm.transformers_utils.model_arch_config_convertor import ModelArchConfigConvertorBase

    return hasattr(ModelArchConfigConvertorBase, "get_per_layer_hf_configs")


def budget_reads_modality_kwargs() -> bool:
    """Whether the installed vLLM's Qwen-VL token-budget estimate (the largest image or video it profiles memory for
    and sizes the encoder cache by) reads per-modality `images_kwargs`/`videos_kwargs` in mm_processor_kwargs: vLLM
    0.32/0.33 do (`_get_vision_info` takes the modality); vLLM 0.26 reads only a flat size/min_pixels/max_pixels and
    otherwise estimates from the checkpoint's processor defaults."""
    from vllm.model_executor.models.qwen2_vl import Qwen2VLProcessingInfo

    return "modality" in inspect.signature(Qwen2VLProcessingInfo._get_vision_info).parameters


def modality_kwargs(image: dict, video: dict) -> dict:
    """mm_processor_kwargs with the images' and the videos' own processor arguments. vLLM 0.32/0.33 take them scoped
    (images_kwargs / videos_kwargs) all the way. vLLM 0.26's Qwen3-VL and Qwen3.5 processors set do_sample_frames
    themselves as a flat argument (from the clip's metadata) unless a flat one is there, and transformers refuses it
    twice ("passed two times"): there do_sample_frames goes flat (the image processor ignores it). Decided by the
    same feature as budget_reads_modality_kwargs: the release whose Qwen-VL code reads per-modality kwargs."""
    if budget_reads_modality_kwargs():
        return {"images_kwargs": image, "videos_kwargs": video}
    flat = {k: v for k, v in video.items() if k == "do_sample_frames"}
    return {"images_kwargs": image, "videos_kwargs": {k: v for k, v in video.items() if k not in flat}, **flat}


def capped_profile(limits: dict, image_pixels: int, frame_pixels: int, frames: int, side: int) -> dict:
    """limit_mm_per_prompt with the largest image and video vLLM profiles memory with capped at the run's bounds.
    Where the budget estimate misses per-modality kwargs (vLLM 0.26, budget_reads_modality_kwargs) a video run would
    profile the checkpoint's default largest image (Qwen2.5-VL's: 12.8 M pixels, 16,384 tokens), leaving the KV cache
    less memory than on 0.32/0.33; the per-modality dummy options (vLLM 0.26 to 0.33) cap those profiling inputs."""
    return {"image": {"count": limits["image"], **most_tokens(image_pixels, side)},
            "video": {"count": limits["video"], "num_frames": frames, **most_tokens(frame_pixels, side)}}  # fmt: skip


def most_tokens(pixels: int, side: int) -> dict:
    """The size of an image of at most `pixels` with the most merged vision tokens (sides multiples of `side`, one
    token): the token count factored into the two sides closest to square, with a lower count where that would be
    more than 200:1 (the processors refuse such images), as vLLM picks its own largest profiling input."""
    for tokens in range(pixels // side**2, 0, -1):
        height = next(d for d in range(math.isqrt(tokens), 0, -1) if tokens % d == 0)
        if tokens // height <= 200 * height:
            return {"width": side * (tokens // height), "height": side * height}
    return {"width": side, "height": side}


def clip_metadata_per_request(model_path: str) -> bool:
    """Whether each video's metadata (its frame rate, the indices sampled) must travel as a per-request processor
    argument. The engine hands vLLM a video as (frames, metadata); Qwen2.5-VL's processor spaces the temporal
    positions by the sampled frame rate the metadata gives (second_per_grid_ts). vLLM 0.32/0.33 pass that metadata to
    the HF processor (Qwen2.5-VL's multimodal processor splits it off in `_get_hf_mm_inputs`); vLLM 0.26 drops it for
    Qwen2.5-VL, so the processor assumes 24 frames/s and the video's positions differ from the trainer's. Qwen3-VL and
    Qwen3.5 keep it in every version claimed (their data parser needs the metadata)."""
    from transformers import AutoConfig

    if AutoConfig.from_pretrained(model_path).model_type != "qwen2_5_vl":
        return False
    from vllm.model_executor.models.qwen2_5_vl import Qwen2_5_VLMultiModalProcessor

    return not hasattr(Qwen2_5_VLMultiModalProcessor, "_get_hf_mm_inputs")


def external_ids(llm, request_ids) -> list[str]:
    """The ids that outputs and `abort_request` name the requests `LLM.enqueue` returned: enqueue returns the
    engine's internal ids (the caller's id plus a random suffix), outputs carry the caller's (`external_req_id` of the
    output processor's request state, or of its ParentRequest for a request of n > 1 answers, whose states are its
    children's), in 0.26, 0.32 and 0.33 alike."""
    processor = llm.llm_engine.output_processor
    states, parents = processor.request_states, processor.parent_requests
    return [(states[r] if r in states else parents[r]).external_req_id for r in request_ids]


def stop_requests(llm, request_ids) -> list:
    """Stop the unfinished requests among `request_ids` (internal ids, as enqueue returned them) and return what each
    has sampled so far: a RequestOutput with its answers' tokens and their log-probs, one completion per answer
    (`index`: which of the request's n). `LLM.enqueue` marks requests final-only (LLM._add_request, 0.26 to 0.33),
    so `llm_engine.step()` reports a request only when it finishes, all its answers, and `abort_request` keeps
    their tokens to itself (the abort's own output goes only to an async client's queue). So each answer's output is
    made from the output processor's request state first, switched to cumulative
    (`make_request_output(new_token_ids, pooling_output, finish_reason, stop_reason)`, the same four leading
    parameters in 0.26, 0.32 and 0.33), then the requests are aborted. A request of n > 1 answers is a ParentRequest
    (`output_processor.parent_requests`, by its internal id) whose answers are child requests of their own states
    (`parent_req` set: detached here, or their output would wait for the others); the answers that did finish wait
    in its `output_aggregator` (final-only), with their finish reason; aborting the parent aborts the children
    (`abort_requests`), all alike in 0.26, 0.32 and 0.33. Reading them only at the stop keeps the engine's steps as
    cheap as offline generate's: a per-step stream of every running request's tokens cost the tiny CPU model more than
    its decode steps."""
    from vllm.sampling_params import RequestOutputKind

    def so_far(state):
        state.output_kind, state.parent_req = RequestOutputKind.CUMULATIVE, None
        return state.make_request_output([], None, None, None)

    processor = llm.llm_engine.output_processor
    states, parents = processor.request_states, processor.parent_requests
    outputs, open_ids = [], []
    for request_id in request_ids:
        if request_id in states:
            outputs.append(so_far(states[request_id]))
        elif request_id in parents:
            parent = parents[request_id]
            children = [so_far(states[child]) for child in sorted(parent.child_requests)]
            out = children[0]  # (each child's output names the parent's external id and prompt)
            out.outputs = [c for c in parent.output_aggregator if c is not None] + [c.outputs[0] for c in children]
            outputs.append(out)
        else:
            continue
        open_ids.append(request_id)
    if open_ids:
        llm.llm_engine.abort_request(open_ids, internal=True)
    return outputs
