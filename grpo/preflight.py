"""What a run checks before it spends its GPUs, and the data arguments the run and its checks share.

`python train_grpo.py CONFIG --dry-run` reads the config, checks it and its paths and prints the memory plan for the
world it is told (train_grpo.main), then runs dry_run here: every check that needs no GPU, one line each, "ok" with
what it saw, "FAIL" with the key to change, or "skip" when a check it needs failed:

    model     actor.model_path: the checkpoint's config and processor load (a hub id needs the hub, or its cache
              under HF_HUB_OFFLINE=1; an unreachable hub is one line, not five retries)
    data      data.train_files, data.val_files: the configured keys are columns of the files (a missing one named
              with the column that holds it); a sample of rows parses, its images and videos decode, its prompts
              fit data.max_prompt_length and do not already hold the format prompt's instruction; the train files
              fill one rollout batch
    reward    reward.reward_fn: it imports, is not in verl's, EasyR1's or TRL's form (the wrapper is named), and a
              call on a sample answer (the sample row's own ground truth, boxed) returns a number or a dict with
              "overall", with the keyword columns it asks for; an answer column of lists or structs is named
    tools     rollout.tools: they load and have schemas (train_grpo.check_config loaded them already)

Exit 0 only when every check passed. Nothing here needs torch.distributed, a GPU or the weights.
"""

from __future__ import annotations

import inspect
import os
import re
import socket
from urllib.parse import urlparse

from data import MissingColumn, PromptDataset, RepeatedInstruction, batches_per_epoch, local_files
from grpo import families, turns
from grpo.config import ConfigError
from grpo.distill import teacher_problem
from grpo.grading import call_reward, keyword_columns, load_reward_fn, peer_contract, resolve_spec, reward_kwargs
from grpo.loading import unsupported_model
from grpo.startup import resolve_path
from rollout import check_prompt_limits, data_media

SAMPLE_ROWS = 64  # rows of each data file a dry run parses (images decoded, prompts counted)
HUB_TIMEOUT_S = 3.0  # a dry run's wait for the hub before it says it cannot reach it


class Failed(Exception):
    """A check's one-line failure: the key to change and what is wrong."""


def check_paths(cfg) -> None:
    """Missing model or data files fail here in one line, not minutes later in a stack trace from the loaders.
    Separate from check_config so that configs naming files not yet built (tiny.yaml) still pass that check."""
    path = cfg.actor.model_path
    looks_like_hub_id = re.fullmatch(r"[\w][\w.-]*/[\w.-]+", path) is not None
    if not os.path.exists(path) and not looks_like_hub_id:
        raise ConfigError(f"actor.model_path={path!r} does not exist (a hub model is written org/name)")
    if not os.path.exists(path) and os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", ""):
        from huggingface_hub import try_to_load_from_cache

        if not isinstance(try_to_load_from_cache(path, "config.json"), str):
            raise ConfigError(f"actor.model_path={path!r}: no such local directory, and not in the hub cache (offline)")
    needs_experts = {"actor.router_aux_loss_coef balances": cfg.actor.router_aux_loss_coef > 0,
                     "algorithm.routing_replay=r3 replays": cfg.algorithm.routing_replay == "r3"}  # fmt: skip
    unsupported = unsupported_model(path, needs_experts=next((k for k, on in needs_experts.items() if on), None))
    if unsupported:
        raise ConfigError(f"actor.model_path={path!r}: {unsupported}")
    refused = family_refusal(cfg)
    if refused:
        raise ConfigError(refused)
    sp = cfg.actor.sequence_parallel_size
    for key, model in (("actor.model_path", path), ("distill.model_path", cfg.distill.model_path)):  # (both are cut)
        heads = attention_heads(model) if model else None
        if heads and heads % sp:  # else the first training forward stops, after the load and a rollout
            raise ConfigError(f"actor.sequence_parallel_size={sp} must divide the attention heads (Ulysses gives each "
                              f"rank of a group whole heads): {key}={model!r} has {heads} query heads")  # fmt: skip
    tp = cfg.rollout.tensor_parallel_size
    split = tensor_parallel_problem(path, tp) if tp > 1 and cfg.rollout.engine == "vllm" else None
    if split:  # else vLLM fails on every rank in its load or first prefill, after the trainer's load
        raise ConfigError(f"rollout.tensor_parallel_size={tp} must split the heads vLLM shards over an engine's ranks: "
                          f"actor.model_path={path!r} has {split}")  # fmt: skip
    teacher = cfg.distill.model_path
    if teacher:  # a teacher that is not there, or cannot score the policy's tokens (a hub id: once it is readable)
        if not os.path.exists(teacher) and not re.fullmatch(r"[\w][\w.-]*/[\w.-]+", teacher):
            raise ConfigError(f"distill.model_path={teacher!r} does not exist (a hub model is written org/name)")
        problem = unsupported_model(teacher)
        if not problem and _readable(path) and _readable(teacher):
            problem = teacher_problem(path, teacher)
        if problem:
            raise ConfigError(f"distill.model_path={teacher!r}: {problem}")
    for key in ("train_files", "val_files"):
        spec = getattr(cfg.data, key)
        try:
            if spec:  # val_files="" means no validation
                local_files(spec)  # raises for a missing local path, or a directory without data files
        except (FileNotFoundError, ValueError) as e:
            raise ConfigError(f"data.{key}: {e}") from None


def family_refusal(cfg) -> str | None:
    """What the config asks that the checkpoint's family cannot do here yet (families.refusal), naming the key, or
    None; a checkpoint whose config.json is not readable without a download is left to the model checks."""
    path = cfg.actor.model_path
    if not _readable(path):
        return None
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    r, a = cfg.rollout, cfg.actor
    text_config = config.get_text_config()
    refused = families.refusal(config.model_type, a.sequence_parallel_size, r.tools, r.max_videos_per_prompt,
                               r.engine, text_config, a.lora_target_modules if a.lora_rank else ())  # fmt: skip
    if refused or r.engine != "vllm" or not getattr(text_config, "is_heterogeneous", False):
        return refused
    try:
        import vllm

        from grpo.vllm_compat import reads_per_layer_configs
    except ImportError:  # no vLLM here: the engine's own start says so
        return None
    if not reads_per_layer_configs():
        return (f"rollout.engine=vllm: vLLM {vllm.__version__} cannot read a {config.model_type} config, whose layers "
                "differ (transformers keeps head_dim per layer), and its engine would not start: vLLM 0.32 or 0.33 "
                "reads it, or rollout.engine=hf")  # fmt: skip
    return None


def attention_heads(path) -> int | None:
    """The language model's query heads of the checkpoint at `path` (its config.json, or the known numbers of a hub
    id), or None when it cannot be read without a download."""
    s = _shape(path)
    return s.heads if s else None


def _shape(path):
    """The checkpoint's ModelShape (its config.json, or a hub id's known numbers), or None when it cannot be read
    without a download or is not a config.json of a supported family (the model checks say so)."""
    from grpo.model_shape import KNOWN_SHAPES, PlanError, read_model_shape

    if path not in KNOWN_SHAPES and not _readable(path):
        return None
    try:
        return read_model_shape(path)
    except PlanError:
        return None


def tensor_parallel_problem(path, tp: int) -> str | None:
    """Which of the checkpoint's head counts vLLM cannot split over `tp` ranks (as "N query heads"), or None (also
    when its config.json cannot be read without a download). vLLM gives each rank whole query heads and whole
    linear-attention key and value heads (Qwen3.5's gated DeltaNet), and KV heads whole or replicated: a count that
    does not divide fails inside its load or first prefill, not at its own config check (which knows the query
    heads only)."""
    s = _shape(path)
    if s is None:
        return None
    counts = [(s.heads, "query heads")]
    if s.linear_layers:
        counts += [(s.linear_key_heads, "linear-attention key heads"), (s.linear_value_heads, "value heads")]
    for n, what in counts:
        if n % tp:
            return f"{n} {what}"
    for kv in (s.kv_heads, s.global_kv_heads or s.kv_heads):  # (Gemma 4's full layers have their own)
        if kv % tp and tp % kv:  # fewer KV heads than ranks are replicated, tp a multiple of them
            return f"{kv} KV heads"
    return None


def _readable(path) -> bool:
    """A local directory, or a hub id whose files are in the cache (a dry run does not download them)."""
    if os.path.isdir(path):
        return True
    from huggingface_hub import try_to_load_from_cache

    return all(isinstance(try_to_load_from_cache(path, f), str) for f in ("config.json", "tokenizer_config.json"))


def dataset_kwargs(cfg, processor, columns: bool | frozenset[str] = frozenset(), sample_rows: int = 0) -> dict:
    """PromptDataset's arguments from the config: the same prompts in the run and in its dry run. `columns`: what
    the reward function asks for of each row (grading.keyword_columns)."""
    d = cfg.data
    return dict(
        prompt_key=d.prompt_key, answer_key=d.answer_key, image_key=d.image_key, video_key=d.video_key,
        video_fps=d.video_fps, max_frames=d.max_frames, video_min_pixels=d.video_min_pixels,
        video_max_pixels=d.video_max_pixels, format_prompt=resolve_path(d.format_prompt) or None,
        **turns.offer_tools(cfg.rollout, processor, d.system_prompt or None),  # the tools' offer, when there are any
        min_pixels=d.min_pixels, max_pixels=d.max_pixels, max_soft_tokens=d.max_soft_tokens,
        max_prompt_length=d.max_prompt_length,
        filter_overlong_prompts=d.filter_overlong_prompts, columns=columns, sample_rows=sample_rows,
    )  # fmt: skip


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "")


def hub_reachable() -> bool:
    """Whether a TCP connection to the hub opens within HUB_TIMEOUT_S (the libraries retry for minutes)."""
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=HUB_TIMEOUT_S).close()
        return True
    except OSError:
        return False


def need_hub(key: str, value: str) -> None:
    if not hub_offline() and not hub_reachable():
        raise Failed(f"{key}={value!r}: cannot reach the hub: use a local path or HF_HUB_OFFLINE=1")


def check_model(cfg):
    """The checkpoint's config and processor; returns (line, processor)."""
    from transformers import AutoConfig, AutoProcessor

    path = cfg.actor.model_path
    if not os.path.isdir(path):
        need_hub("actor.model_path", path)
    try:
        config = AutoConfig.from_pretrained(path)
        processor = AutoProcessor.from_pretrained(path)
    except Exception as e:
        raise Failed(f"actor.model_path={path!r}: {type(e).__name__}: {str(e).splitlines()[0]}") from None
    return f"{config.model_type} config and {type(processor).__name__} from {path}", processor


def check_data(cfg, processor, columns, world):
    """A sample of each data spec's rows, as the run reads them; returns (line, the train sample's datasets). The train
    files must fill one rollout batch over `world` ranks, as the run's start checks: exactly when every row was
    parsed, else by the files' rows (usable ones are at most that many)."""
    kwargs = dataset_kwargs(cfg, processor, columns, sample_rows=SAMPLE_ROWS)
    sets, lines = [], []
    for key in ("train_files", "val_files"):
        spec = getattr(cfg.data, key)
        if not spec:
            continue
        if local_files(spec) is None:  # a hub dataset
            need_hub(f"data.{key}", spec)
        try:
            dataset = PromptDataset(spec, processor, **kwargs)
        except (MissingColumn, RepeatedInstruction, ValueError, OSError) as e:  # (no usable row, an unreadable file)
            raise Failed(f"data.{key}: {str(e).removeprefix('error: ').splitlines()[0]}") from None
        sets.append(dataset)
        sampled = dataset.n_read < dataset.n_rows
        usable = dataset.n_rows if sampled else len(dataset)
        if key == "train_files" and batches_per_epoch(usable, world, cfg.data.rollout_batch_size) == 0:
            what = f"the {usable} rows of the files" if sampled else f"{usable} usable train prompts"
            raise Failed(f"data.train_files: {what} are fewer than one rollout batch (data.rollout_batch_size="
                         f"{cfg.data.rollout_batch_size} over {world} ranks): lower it or add data")  # fmt: skip
        longest = max(ex.num_prompt_tokens for ex in dataset.examples)
        lines.append(f"{key}: {len(dataset)} sampled prompts parse ({dataset.n_skipped} bad rows, "
                     f"{dataset.n_overlong} over max_prompt_length={cfg.data.max_prompt_length}; longest kept "
                     f"{longest} tokens)")  # fmt: skip
    try:
        check_prompt_limits(cfg.rollout, sets)
    except SystemExit as e:
        raise Failed(str(e)) from None
    refused = family_refusal(cfg)  # rollout.max_videos_per_prompt at -1 is now the data's most
    if refused:
        raise Failed(refused)
    return f"{'; '.join(lines)}; {data_media(sets)}", sets


def load_reward(cfg):
    """The reward function, loaded as the run's workers load it; Failed names the spec when it does not."""
    try:
        return load_reward_fn("{}:{}".format(*resolve_spec(cfg.reward.reward_fn)))
    except ValueError as e:
        raise Failed(f"reward.reward_fn: {e}") from None


def optional_parameters(fn) -> set[str]:
    """The names of fn's parameters that have a default."""
    return {p.name for p in inspect.signature(fn).parameters.values() if p.default is not p.empty}


def check_reward(cfg, fn, sample, answer_value=None):
    """The reward function grades a sample answer (the sample row's ground truth, boxed) with a valid value; an
    answer column of lists or structs (`answer_value`, the file's first) reaches it only as their text, unless it
    takes that column by keyword."""
    spec, wanted = cfg.reward.reward_fn, keyword_columns(fn)
    key = cfg.data.answer_key
    if isinstance(answer_value, (list, dict)) and wanted is not True and key.split(".")[0] not in wanted:
        fix = (f"set data.answer_key={key}.ground_truth" if isinstance(answer_value, dict) and "ground_truth" in
               answer_value else f"name a column of text, or give the reward a parameter {key.split('.')[0]!r}, "
               "which gets the column as the file has it")  # fmt: skip
        raise Failed(f"reward.reward_fn={spec!r}: data.answer_key={key!r} holds a {type(answer_value).__name__} "
                     f"({answer_value!r:.80}), and the reward gets its text as ground_truth: {fix}")  # fmt: skip
    truth = sample.answer if sample else "1"
    answer = f"<think>a sample answer</think> The answer is \\boxed{{{truth}}}"
    given = reward_kwargs(sample, wanted) if sample else {}
    missing = wanted - given.keys() if sample and wanted is not True else set()
    unnamed = sorted(missing - optional_parameters(fn)) if missing else []
    peer = peer_contract(fn)  # its first parameter would get the answer's text; a lucky call could even grade
    if peer:
        raise Failed(f"reward.reward_fn={spec!r}: {peer}")
    if unnamed:  # (the call's TypeError would say only that an argument is missing)
        raise Failed(f"reward.reward_fn={spec!r}: its parameter {unnamed[0]!r} has no default, and the sample row "
                     f"has no column {unnamed[0]!r} (nor is it question or prompt): name a column of data.train_files, "
                     f"or give it a default")  # fmt: skip
    try:
        result = call_reward(fn, answer, truth, **given)
    except Exception as e:
        raise Failed(f"reward.reward_fn={spec!r}: {type(e).__name__}: {e} (on the answer {answer!r})") from None
    asks = "every column" if wanted is True else ", ".join(sorted(wanted)) or "no column"
    return f"{spec} returns {result} on a sample answer; it asks for {asks} by keyword", None


def dry_run(cfg, world: int) -> int:
    """Every check that needs no GPU, after main's config checks and memory plan; 0 when all pass, else 1."""
    t = cfg.trainer
    nodes = f"{t.nnodes} nodes x {world // t.nnodes}" if t.nnodes else f"{world}"
    report = [(True, "config and paths", "the keys, their types and values; the model and data paths exist"),
              (True, "memory plan", f"fits {nodes} GPUs (trainer.nnodes, trainer.n_gpus_per_node)")]  # fmt: skip

    def run(name, check, *args):
        try:
            line, out = check(*args)
        except Failed as e:
            report.append((False, name, str(e)))
            return None
        report.append((True, name, line))
        return out

    processor = run("model", check_model, cfg)
    try:
        fn, reward_problem = load_reward(cfg), None
    except Failed as e:
        fn, reward_problem = None, e
    datasets = None
    if processor is None:
        report.append((None, "data", "not checked: it needs the model's processor"))
    else:
        datasets = run("data", check_data, cfg, processor, keyword_columns(fn) if fn else frozenset(), world)
    if fn is None:
        report.append((False, "reward", str(reward_problem)))
    elif keyword_columns(fn) and not datasets:
        report.append((None, "reward", "not called: it asks for the row's columns, and no data sample was read"))
    else:
        sample = (datasets[0].examples[0], datasets[0].answer_value) if datasets else (None, None)
        run("reward", check_reward, cfg, fn, *sample)
    report.append((True, "tools", ", ".join(cfg.rollout.tools) or "none (rollout.tools)"))
    for ok, name, line in report:  # ok: True passed, False failed, None not checked (a check it needs failed)
        print(f"{ {True: 'ok  ', False: 'FAIL', None: 'skip'}[ok] }  {name}: {line}", flush=True)
    passed = sum(ok is True for ok, _, _ in report)
    print(f"dry run: {passed} of {len(report)} checks passed", flush=True)
    return 0 if passed == len(report) else 1
