"""The library messages a run does not show, each with the reason it is harmless, and the switch that shows them.

A run's log is its config, versions, hosts, memory plan and one line per step. The libraries add, at start and at
every weight sync, messages that nobody running this trainer can act on; they are named here, one row each, and
nowhere else. Everything else they say still shows: vLLM at WARNING and above, every other warning as it comes.
`trainer.verbose=true`, or a VLLM_LOGGING_LEVEL of your own (INFO, DEBUG, even WARNING), shows it all: no row is
filtered, vLLM logs at that level (INFO by default) and draws its progress bars.

    quiet = quiet_logs(verbose, sleep_level)  # before vLLM is first imported: it reads its level at setup
    with filtered_stderr(quiet):              # around the engine's start, for what C++ writes past Python
        llm = LLM(...)

One row is harmless only while the engine keeps its weights: the reload's "Following weights were not loaded", which
names the engine's parameters a sync did not send. At sleep level 0 or 1 they keep what they hold; after a level-2
sleep they hold uninitialised memory, so at level 2 the line is shown and the run stops on it (unsent_weights).
"""

import contextlib
import logging
import os
import sys
import threading
import warnings
from multiprocessing import resource_tracker

# vLLM's reload names the engine's parameters a sync did not send in a line that starts so (model_loader/reload/
# inplace.py in 0.32/0.33, v1/worker/gpu_model_runner.py in 0.26: the set of names as its one argument).
NOT_LOADED = "Following weights were not loaded"

# Logged through Python's logging: (logger, text in the message, why it is harmless here). A logger's filter sees
# only the records logged to that very logger, not its children's, so each row names the module that logs.
LOGGED = [
    # at the engine's start on CPU (vLLM's CPU build, the demo and the tests)
    ("vllm.triton_utils.importing", "doesn't include CPU backend",
     "PyPI's torch brings Triton without its CPU backend; vLLM's CPU build runs its own kernels instead"),
    ("vllm.triton_utils.importing", "`triton.backends` could not be imported",
     "vLLM 0.26's CPU build says the same where PyPI's Triton lacks its backends module: it runs without Triton"),
    ("vllm.platforms.cpu", "triton-cpu is expected",
     "the same: the CPU kernels vLLM ships need no Triton"),
    ("vllm.config.vllm", "Model Runner V2 requires Triton",
     "the same: the V1 runner it falls back to is the one this trainer is tested with"),
    ("vllm.platforms.cpu", "Reset SSM cache type to float32",
     "vLLM's CPU build keeps linear-attention state in fp32, as the trainer's fp32 CPU run does"),
    ("torch.utils.cpp_extension", "No CUDA runtime is found",
     "torch looks for a CUDA toolkit to build extensions with when vLLM imports it; nothing is built on CPU"),
    ("vllm.engine.arg_utils", "The global random seed is set to",
     "vLLM seeds the process's global generators with the engine's seed; the data order and each request's "
     "sampling have seeds of their own (data.ShardSampler, vllm_engine.request_seed) and checkpoints keep RNG states"),
    ("vllm.engine.arg_utils", "does not officially support disabling chunked prefill",
     "rollout.py turns chunked prefill off on CPU on purpose (seeded requests crash vLLM 0.32's CPU runner when "
     "it rewinds them); every prompt is then scheduled whole, which is what any model supports"),
    ("vllm.config.vllm", "Enforce eager set",
     "the trainer asks for eager mode on CPU (CUDA graphs and compilation exist on CUDA only)"),
    ("vllm.config.vllm", "Inductor compilation was disabled",
     "the same eager mode, seen from the compiler's side"),
    ("vllm.v1.worker.cpu_worker", "is not found in LD_PRELOAD",
     "vLLM's CPU performance tip (tcmalloc, Intel OpenMP): the CPU runs are the demo and the tests, not production"),
    # at the engine's start on any device, vLLM 0.26 with transformers 5.17 to 5.19
    ("transformers.models.auto.image_processing_auto", "The `use_fast` parameter is deprecated",
     "vLLM 0.26 asks for Qwen-VL's fast image processor with the old flag, which transformers maps to the torchvision "
     "backend: the one the trainer's processor resolves to without it, so both see the same pixels"),
    # at every weight sync
    ("vllm.model_executor.model_loader.reload.layerwise", "Failed to load weights",
     "the layer-wise reload names the class of each layer that received nothing: at every sync those that hold only "
     "buffers (rotary tables, the image normalizer's mean and std), which vLLM keeps at every sleep level; a "
     "parameter that received nothing is named in the next row's line"),
    ("vllm.model_executor.model_loader.reload.inplace", NOT_LOADED,
     "with LoRA the sync resends only what can change; the rest keeps its tensors (tests/test_vllm.py). Shown at "
     "sleep level 2, where the rest would be uninitialised, and the run stops on it (unsent_weights)"),
    ("vllm.v1.worker.gpu_model_runner", NOT_LOADED,
     "the same message as vLLM 0.26 logs it, from its model runner"),
    ("vllm.v1.worker.cpu_worker", "torch.set_num_threads",
     "on CPU, vLLM's thread binding skips later set_num_threads calls, as intended"),
]  # fmt: skip

# Python warnings: (category, the message's start as a regular expression, why it is harmless here).
WARNED = [
    (FutureWarning, r"`torch.distributed.reduce_op` is deprecated",
     "vLLM's kernel dispatcher reads every attribute of the modules it scans, torch's deprecated alias among them; "
     "nothing uses it"),
]  # fmt: skip

# Written by C++ straight to the process's stderr, past Python's logging and warnings: (text in the line, why).
PRINTED = [
    ("NUMA binding: Using MEMBIND policy",
     "vLLM's CPU worker binds the rank's memory to the NUMA node of its cores, as it should"),
]  # fmt: skip

_level_set_here = False  # whether VLLM_LOGGING_LEVEL is ours (then a second engine in the process is quiet too)


class _Noise(logging.Filter):
    def __init__(self, texts):
        super().__init__()
        self.texts = texts

    def filter(self, record):
        return not any(text in record.getMessage() for text in self.texts)


def quiet_logs(verbose: bool, sleep_level: int = 0) -> bool:
    """Filter the rows above and set vLLM's level to WARNING, unless `verbose` or the user's own VLLM_LOGGING_LEVEL
    asks for everything. True when quiet. At `sleep_level` 2 the NOT_LOADED rows are not filtered. Call it before
    vLLM is first imported (it reads the level then); calling it again adds no second filter (its rows are the
    latest call's)."""
    global _level_set_here
    user_level = "VLLM_LOGGING_LEVEL" in os.environ and not _level_set_here
    if verbose or user_level:
        return False
    os.environ["VLLM_LOGGING_LEVEL"], _level_set_here = "WARNING", True
    texts = {name: [] for name, _, _ in LOGGED}
    for name, text, _ in LOGGED:
        if text != NOT_LOADED or sleep_level != 2:
            texts[name].append(text)
    for name, logger_texts in texts.items():
        logger = logging.getLogger(name)
        noise = [f for f in logger.filters if isinstance(f, _Noise)]
        if noise:
            noise[0].texts = logger_texts
        else:
            logger.addFilter(_Noise(logger_texts))
    for category, message, _ in WARNED:
        warnings.filterwarnings("ignore", message=message, category=category)
    return True


@contextlib.contextmanager
def unsent_weights():
    """The names of the engine's parameters that vLLM's reload reports as not loaded (NOT_LOADED) inside the block,
    as a set filled when the block ends. The record is read before any filter of this module could drop it, and the
    loggers log warnings inside the block even where the user's VLLM_LOGGING_LEVEL is above them."""
    names, loggers = set(), [logging.getLogger(name) for name, text, _ in LOGGED if text == NOT_LOADED]

    def read(record):
        if record.getMessage().startswith(NOT_LOADED):
            found = record.args[0] if isinstance(record.args, tuple) and record.args else None
            names.update(map(str, found) if isinstance(found, (set, frozenset, list, tuple)) else [record.getMessage()])
        return True

    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.filters.insert(0, read)
        logger.setLevel(min(logger.getEffectiveLevel(), logging.WARNING))
    try:
        yield names
    finally:
        for logger, level in zip(loggers, levels):
            logger.removeFilter(read)
            logger.setLevel(level)


@contextlib.contextmanager
def filtered_stderr(quiet: bool):
    """Drop PRINTED's lines from what is written to file descriptor 2 inside the block (C++ warnings reach no Python
    filter); every other line passes through as it comes, so a hang still shows what was said before it."""
    if not quiet:
        yield
        return
    # A process started inside the block inherits the pipe as its stderr and keeps it open for as long as it lives,
    # so the pipe never ends: vLLM's first shared-memory segment starts multiprocessing's resource tracker, which
    # lives as long as the rank. Started here, it keeps the real stderr (its notes at exit still reach the log).
    # For any other such child the block ends at a marker written after the last line of its own, not at the
    # pipe's end (waiting for that cost every engine start 10 s); the pump goes on passing the child's lines.
    resource_tracker.ensure_running()
    sys.stderr.flush()
    saved, (read_end, write_end) = os.dup(2), os.pipe()
    os.dup2(write_end, 2)
    marker, drained = f"quiet.filtered_stderr {os.urandom(8).hex()} end\n".encode(), threading.Event()

    def pump():
        with os.fdopen(read_end, "rb") as lines:
            for line in lines:
                if line.endswith(marker):  # (after a line a child left unfinished, if one did)
                    line = line[: -len(marker)]
                    drained.set()
                while line and not any(text.encode() in line for text, _ in PRINTED):
                    line = line[os.write(saved, line) :]  # (a pipe may take part of a long line)
        drained.set()
        os.close(saved)  # at the pipe's end: when the block ends, or later if a child started inside still holds it

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.write(write_end, marker)  # after every line written inside the block: the pipe keeps their order
        os.close(write_end)
        drained.wait(timeout=10)
