"""Checkpoints and export.

<output_dir>/checkpoints/step_N/ holds the model and optimizer shards (torch.distributed.checkpoint, each rank writes
its own; with LoRA the adapters and their optimizer state only, the frozen base being actor.model_path's),
rank_R.pt (that rank's RNG states and reward counters, as tensors and numbers) and trainer_state.json (step, data
position, LR schedule, resolved config). A save is written to .tmp-step_N and renamed once every file is on disk: a
directory named step_N is complete, anything else is a save that was killed midway (or ran out of disk).

Loading a checkpoint never runs code from it: checkpoints are copied between clusters and shared, and a pickle can
call anything. rank_R.pt is read with torch.load(weights_only=True); DCP's .metadata (a pickle that torch reads with
plain pickle.load) through an unpickler that admits only DCP's own metadata classes; DCP's non-tensor entries (the
optimizer's hyper-parameters, which torch reads with weights_only=False) through weights_only=True as well.

save_hf writes a Hugging Face model directory (the end of training, and export_checkpoint for any saved step); with
LoRA its weights are merged (base + scale B A, plain names), and save_adapter writes the adapter alone in PEFT's format.
"""

from __future__ import annotations

import dataclasses
import enum
import errno
import io
import json
import math
import os
import pickle
import time

import torch
import torch.distributed as dist

from grpo import moe
from grpo.distributed import Stop, phase, print0
from grpo.loading import load_model, reshard
from grpo.lora import LORA_ADAPTER, add_lora, base_name, full_tensor, is_lora_factor, lora_delta, merged_parameters
from grpo.startup import resolve_path


def save_checkpoint(output_dir, step, epoch, position, model, optimizer, scheduler, scorer, cfg, engine=None):
    """Collective: every rank writes its shards; rank 0 marks the checkpoint complete and prunes old ones. A save that
    fails on any rank (a full disk) fails on all of them together with one message, leaving the checkpoints that were
    complete as they were."""
    import shutil

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    t0 = phase("checkpoint save")
    rank, root = dist.get_rank(), os.path.join(output_dir, "checkpoints")
    tmp, final = os.path.join(root, f".tmp-step_{step}"), os.path.join(root, f"step_{step}")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # the remains of an earlier save of this step that was killed
        os.makedirs(tmp)
    dist.barrier()
    reshard(model)  # save the DTensor shards, never FSDP2's temporary unsharded root params
    model_state, optim_state = get_state_dict(model, optimizer, options=_state_options(cfg))
    error = None
    try:
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=tmp)
        state = rank_state(scorer, getattr(engine, "carry", None), (epoch, position))
        torch.save(state, os.path.join(tmp, f"rank_{rank}.pt"))
    except (Exception, dcp.CheckpointException) as e:  # (DCP's own is a BaseException)
        error = e
    _raise_if_save_failed(error, step, output_dir, tmp)  # every rank's files are written, or every rank stops here
    error = None
    if rank == 0:
        try:
            # The sampler's order is a pure function of (trainer.seed, epoch): epoch and position restore it exactly.
            trainer_state = {"step": step, "epoch": epoch, "position": position, "world_size": dist.get_world_size()}
            trainer_state.update(scheduler=scheduler.state_dict(), config=dataclasses.asdict(cfg))
            with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
                json.dump(trainer_state, f, indent=2)
            shutil.rmtree(final, ignore_errors=True)  # a step_N of an earlier run in this directory (resume=none)
            os.rename(tmp, final)  # atomic: from here on the checkpoint exists, complete
            prune_checkpoints(root, cfg.trainer.save_limit, keep=final)
            size = sum(e.stat().st_size for e in os.scandir(final))
            print(f"saved {final} ({size / 2**20:.1f} MiB in {time.perf_counter() - t0:.1f}s)", flush=True)
        except Exception as e:
            error = e
    _raise_if_save_failed(error, step, output_dir, tmp)  # no rank runs ahead (or exits) before the save is complete


def _raise_if_save_failed(error, step, output_dir, tmp):
    """Collective: every rank stops with SystemExit when any rank's part of a save failed (rank 0 with the message),
    so none waits for the failed one in a later collective. The partial directory is removed (on a full disk it holds
    the space a rerun needs); the complete checkpoints are untouched, and the newest is what a rerun resumes from."""
    import shutil

    failures = [None] * dist.get_world_size()
    dist.all_gather_object(failures, None if error is None else (_describe(error), _disk_full(error)))
    failed = [(rank, failure) for rank, failure in enumerate(failures) if failure is not None]
    if not failed:
        return
    if dist.get_rank() != 0:
        raise Stop("a rank's part of a save failed")  # (said by rank 0)
    shutil.rmtree(tmp, ignore_errors=True)
    complete, _ = list_checkpoints(output_dir)
    last = f"the last complete checkpoint, {complete[-1][1]}, is intact" if complete else "no checkpoint is complete"
    (rank, (what, _)), disk_full = failed[0], any(full for _, (_, full) in failed)
    cause = "no space left on device" if disk_full else f"rank {rank}: {what}"
    advice = "free space there (or lower trainer.save_limit), then " if disk_full else ""
    raise Stop(f"error: saving the checkpoint of step {step} to {tmp} failed ({cause}); {last}. {advice}"
                     "rerun the same command to resume from the last complete checkpoint")  # fmt: skip


def _inner_errors(error):
    return [failure[0] for failure in getattr(error, "failures", {}).values()]  # DCP's: (exception, trace) per rank


def _describe(error):
    return "; ".join(f"{type(e).__name__}: {e}" for e in _inner_errors(error) or [error])


def _disk_full(error):
    errors = [error, *_inner_errors(error)]
    return any(isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) for e in errors)


def _state_options(cfg):
    """With LoRA a checkpoint holds the trainable adapters only: the frozen base never changes (actor.model_path), so
    loading leaves it as it is (strict=False; dcp.load still fails on any adapter the checkpoint lacks)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    lora = cfg.actor.lora_rank > 0
    return StateDictOptions(ignore_frozen_params=lora, strict=not lora)


def list_checkpoints(output_dir):
    """Complete checkpoints as [(step, path)], oldest first, and the paths of incomplete ones."""
    root = os.path.join(output_dir, "checkpoints")
    complete, incomplete = [], []
    for entry in sorted(os.scandir(root), key=lambda e: e.name) if os.path.isdir(root) else []:
        name = entry.name
        if name.startswith("step_") and name[5:].isdigit() and is_complete_checkpoint(entry.path):
            complete.append((int(name[5:]), entry.path))
        elif name.startswith((".tmp-step_", "step_")):
            incomplete.append(entry.path)
    return sorted(complete), incomplete


def is_complete_checkpoint(path):
    return all(os.path.exists(os.path.join(path, f)) for f in (".metadata", "trainer_state.json"))


def prune_checkpoints(root, limit, keep):
    """Keep the newest `limit` complete checkpoints (0 keeps all), always including `keep`, the one just written;
    remove leftovers of saves that were killed midway."""
    import shutil

    complete, incomplete = list_checkpoints(os.path.dirname(root))
    others = [path for _, path in reversed(complete) if path != keep]
    doomed = others[max(limit - 1, 0) :] if limit > 0 else []
    for path in doomed + [p for p in incomplete if os.path.basename(p).startswith(".tmp-")]:
        shutil.rmtree(path, ignore_errors=True)


def find_resume_checkpoint(output_dir, resume):
    """trainer.resume: auto = the newest complete checkpoint in output_dir (None if there is none), none = None,
    or a checkpoint path, which must be complete. Rank 0 decides, checks that the checkpoint's pickles hold data only,
    and tells the others, so all load the same one (or all stop with rank 0's reason)."""
    choice = [None, None]  # the checkpoint, why it cannot be loaded
    if dist.get_rank() == 0:
        complete, incomplete = list_checkpoints(output_dir)
        if resume == "auto":
            for path in incomplete:
                print(f"warning: skipping incomplete checkpoint {path} (a save that did not finish)", flush=True)
            choice[0] = complete[-1][1] if complete else None
        elif resume != "none":
            if not is_complete_checkpoint(resume) or os.path.basename(os.path.normpath(resume)).startswith(".tmp-"):
                choice[1] = f"trainer.resume={resume}: not a complete checkpoint (a save that did not finish?)"
            choice[0] = resume
        elif complete:
            print(f"warning: trainer.resume=none: starting fresh; the checkpoints in {output_dir} will be replaced")
        try:
            if choice[0] and not choice[1]:
                check_checkpoint(choice[0])
        except UnsafeCheckpointError as e:
            choice[1] = str(e)
    dist.broadcast_object_list(choice, src=0)
    if choice[1]:
        raise Stop(f"error: {choice[1]}")
    return choice[0]


def load_checkpoint(path, model, optimizer, scheduler, scorer, cfg, engine=None):
    """Collective: restore everything save_checkpoint wrote. Returns (step, epoch, position) to continue from."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    t0 = phase("checkpoint load")
    reshard(model)  # load into the DTensor shards the optimizer owns
    options = _state_options(cfg)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    state = {"model": model_state, "optim": optim_state}
    load_shards(state, path)  # each rank reads only its own shards, resharded if the world size changed
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options)
    with open(os.path.join(path, "trainer_state.json")) as f:
        saved = json.load(f)
    step, epoch, position = saved["step"], saved["epoch"], saved["position"]
    scheduler.load_state_dict(saved["scheduler"])
    rank, world = dist.get_rank(), dist.get_world_size()
    if saved["world_size"] != world:
        # position counts prompts of this rank's shard: keep the number of steps done in the epoch instead
        old_per_rank = saved["config"]["data"]["rollout_batch_size"] // saved["world_size"]
        position = position // old_per_rank * (cfg.data.rollout_batch_size // world)
        lost = saved["world_size"] > world and getattr(engine, "carry", None) is not None  # (their rank files)
        print0(f"warning: checkpoint written by {saved['world_size']} ranks, resumed on {world}: "
               "the data order and random streams differ from an uninterrupted run"
               + (f"; the answers in flight of ranks {world} and up are dropped" if lost else ""))  # fmt: skip
    rank_file = os.path.join(path, f"rank_{rank}.pt")
    if os.path.exists(rank_file):
        rank_saved = read_rank_state(rank_file)
        restore_rank_state(rank_saved, scorer, getattr(engine, "carry", None))
        if saved["world_size"] == world and "data_position" in rank_saved:  # (files written before it: the shared one)
            epoch, position = rank_saved["data_position"]
    print0(
        f"resumed from {path} in {time.perf_counter() - t0:.1f}s: step {step}, epoch {epoch}, "
        f"index {position} of this epoch's shard on rank 0; next step {step + 1}"
    )
    changed = changed_settings(saved.get("config", {}), cfg)
    if changed:  # a run resumed in an old output_dir with a changed config continues the old run: say what it changed
        more = f" and {len(changed) - 8} more" if len(changed) > 8 else ""
        print0(f"note: {len(changed)} settings differ from the checkpoint's run: {', '.join(changed[:8])}{more} "
               "(trainer.resume=none or another trainer.output_dir starts afresh)")  # fmt: skip
    return step, epoch, position


def changed_settings(saved: dict, cfg) -> list[str]:
    """The settings of `cfg` that differ from a checkpoint's config (`saved`, as trainer_state.json holds it), as
    `section.key=now (was then)` in the config's order; keys the checkpoint does not have, and trainer.resume (how
    a resume is asked for), are not compared."""
    now = json.loads(json.dumps(dataclasses.asdict(cfg)))  # (as the checkpoint wrote it: tuples as lists)
    now["trainer"].pop("resume", None)
    return [f"{section}.{key}={value!r} (was {saved[section][key]!r})"
            for section, values in now.items() for key, value in values.items()
            if key in saved.get(section, {}) and saved[section][key] != value]  # fmt: skip


# ----------------------------------------------------------------------------------------------------------------------
# What a checkpoint may hold: data, never code.


class UnsafeCheckpointError(pickle.UnpicklingError):
    pass


def _refusal(path, what, entry=""):
    return (
        f"{path}: refused to load{entry}: its pickle would call {what}, and a checkpoint of this trainer holds only "
        "data, so the file was altered or written by something else (nothing in it was run). Resume from another "
        "checkpoint (trainer.resume=PATH) or start fresh (trainer.resume=none)"
    )


def _refused_globals(file):
    """The globals in a torch.save file (a path, or bytes read into a BytesIO) that torch.load(weights_only=True)
    refuses, read without unpickling it; numpy's array classes, which old rank files hold, are not named."""
    if hasattr(file, "seek"):
        file.seek(0)
    names = [n for n in torch.serialization.get_unsafe_globals_in_checkpoint(file) if not n.startswith("numpy.")]
    return ", ".join(names) or "something that is not data"


def rank_state(scorer, carry=None, data_position=None):
    """This rank's random streams, reward counters, data position (epoch, index in its shard) and (partial rollouts)
    the answers in flight as tensors, numbers and lists, which torch.load(weights_only=True) reads back (numpy's and
    Python's states are tuples of objects; their numbers go into int64 tensors). The position is the rank's own:
    with partial rollouts and dynamic sampling a rank that filled its batch in fewer rounds draws fewer prompts."""
    import random

    import numpy as np

    version, mt, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    assert kind == "MT19937"
    return {
        "python_rng": torch.tensor(mt, dtype=torch.int64), "python_rng_version": version, "python_gauss": gauss,
        "numpy_rng": torch.from_numpy(keys.astype(np.int64)), "numpy_rng_pos": int(pos),
        "numpy_gauss": [int(has_gauss), float(cached_gaussian)],
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "reward_counters": {"n_timeouts": scorer.n_timeouts, "n_errors": scorer.n_errors},
        **({"data_position": [int(x) for x in data_position]} if data_position is not None else {}),
        **({"partial": carry.state_dict()} if carry is not None else {}),
    }  # fmt: skip


def restore_rank_state(state, scorer, carry=None):
    import random

    import numpy as np

    random.setstate((state["python_rng_version"], tuple(state["python_rng"].tolist()), state["python_gauss"]))
    has_gauss, cached_gaussian = state["numpy_gauss"]
    np.random.set_state(("MT19937", state["numpy_rng"].numpy().astype(np.uint32), state["numpy_rng_pos"], has_gauss,
                         cached_gaussian))  # fmt: skip
    torch.set_rng_state(state["torch_rng"])
    if state["cuda_rng"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda_rng"])
    scorer.n_timeouts = state["reward_counters"]["n_timeouts"]
    scorer.n_errors = state["reward_counters"]["n_errors"]
    if carry is not None:  # a checkpoint of a run without partial rollouts has none in flight
        carry.load_state_dict(state.get("partial", {"groups": []}))


def read_rank_state(path):
    """A rank_R.pt as rank_state wrote it, read with weights_only=True; UnsafeCheckpointError, naming the file, for one
    whose pickle would call anything but torch's tensor rebuilders. A file written before rank files held only tensors
    (numpy's RNG state as an array) is read with numpy's array classes admitted as well (its uint32 array: no object
    array, no code), and converted."""
    import numpy as np

    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError:
        pass
    core = getattr(np, "_core", None) or np.core  # numpy 2 moved it; numpy 1 pickles name numpy.core
    arrays = [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype("u4"))]
    try:
        with torch.serialization.safe_globals(arrays):
            old = torch.load(path, weights_only=True)
    except pickle.UnpicklingError:
        raise UnsafeCheckpointError(_refusal(path, _refused_globals(path))) from None
    version, mt, gauss = old["python_rng"]
    _, keys, pos, has_gauss, cached_gaussian = old["numpy_rng"]
    return {
        **old, "python_rng": torch.tensor(mt, dtype=torch.int64), "python_rng_version": version,
        "python_gauss": gauss, "numpy_rng": torch.from_numpy(keys.astype(np.int64)), "numpy_rng_pos": int(pos),
        "numpy_gauss": [int(has_gauss), float(cached_gaussian)],
    }  # fmt: skip


def _is_metadata_global(module, name):
    """The globals DCP's .metadata is made of: the dataclasses and enums of torch.distributed.checkpoint.metadata,
    its _StorageInfo, torch.Size, dtypes and layouts (a layout pickles through torch.serialization._get_layout, a
    name lookup), and the path the checkpoint was written to."""
    import torch.distributed.checkpoint.metadata as dcp_metadata

    if module == dcp_metadata.__name__:
        cls = getattr(dcp_metadata, name, None)
        own = isinstance(cls, type) and cls.__module__ == module
        return own and (dataclasses.is_dataclass(cls) or issubclass(cls, enum.Enum))
    if module == "torch":
        obj = getattr(torch, name, None)
        return obj is torch.Size or isinstance(obj, (torch.dtype, torch.layout, torch.memory_format))
    paths = ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")
    return (module, name) in {("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                              ("torch.serialization", "_get_layout"), ("collections", "OrderedDict")} or (
        module in ("pathlib", "pathlib._local") and name in paths)  # fmt: skip


class MetadataUnpickler(pickle.Unpickler):
    """pickle.load for DCP's .metadata, admitting only its own classes (_is_metadata_global): every way a pickle
    calls code goes through a global, and any other global is refused before it is even imported."""

    def __init__(self, file, path):
        super().__init__(file)
        self.path = path

    def find_class(self, module, name):
        if not _is_metadata_global(module, name):
            raise UnsafeCheckpointError(_refusal(self.path, f"{module}.{name}"))
        return super().find_class(module, name)


def _data_only_reader(path):
    """torch's FileSystemReader (its tensors are read with weights_only=True), but with .metadata read by
    MetadataUnpickler where torch calls pickle.load (filesystem.py, 2.11 to 2.14)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class DataOnlyReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            rank = kwargs.get("rank")  # __R.metadata: a checkpoint saved without collectives (torch >= 2.9)
            path = self.fs.concat_path(self.path, ".metadata" if rank is None else f"__{rank}.metadata")
            with self.fs.create_stream(path, "rb") as f:
                metadata = MetadataUnpickler(f, str(path)).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return DataOnlyReader(path)


def _data_only_planner(path):
    """DCP's default load planner, but its non-tensor entries (the optimizer's hyper-parameters; torch reads them
    with torch.load(weights_only=False)) are read with weights_only=True first, and torch gets a fresh pickle of that
    data."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class DataOnlyPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            try:
                data = torch.load(value, weights_only=True)
            except pickle.UnpicklingError:
                file = os.path.join(path, self.metadata.storage_data[read_item.storage_index].relative_path)
                entry = f" (entry {read_item.dest_index.fqn})"
                raise UnsafeCheckpointError(_refusal(file, _refused_globals(value), entry)) from None
            value = io.BytesIO()
            torch.save(data, value)
            value.seek(0)
            super().load_bytes(read_item, value)

    return DataOnlyPlanner()


def load_shards(state, path):
    """Collective: dcp.load of a checkpoint's model and optimizer shards into `state`, without running its pickles."""
    import torch.distributed.checkpoint as dcp

    dcp.load(state, storage_reader=_data_only_reader(path), planner=_data_only_planner(path))


def check_checkpoint(path):
    """Read the pickles a checkpoint holds outside its tensors (.metadata, each rank_R.pt) the way loading does, so
    that a file that would run code is refused, by name, before any rank loads anything."""
    _data_only_reader(path).read_metadata()
    for name in sorted(os.listdir(path)):
        if name.startswith("rank_") and name.endswith(".pt"):
            read_rank_state(os.path.join(path, name))


SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def save_hf(model, processor, out_dir, max_shard_bytes=50 * 10**9):
    """Write a Hugging Face model directory (safetensors in the checkpoint's own naming, config, generation config,
    processor) that from_pretrained and vLLM load as is. Collective, and nothing gathers the whole model: weight by
    weight, every rank all-gathers one full tensor and rank 0 appends it to the file, so a rank holds its own shards
    plus one weight at a time. Files split at `max_shard_bytes` (save_pretrained's default, 50 GB) with the same
    index file; the tensors keep the model's dtype (fp32 master weights). A LoRA model is written merged: each adapted
    weight as base + scale B A, under the plain model's names, no adapter tensors (from_pretrained and vLLM load it as
    any model)."""
    from torch.distributed.fsdp import FSDPModule
    from transformers.core_model_loading import revert_weight_conversion

    phase("export")
    if isinstance(model, FSDPModule):  # (export_checkpoint's model is a plain one)
        reshard(model)  # the DTensor shards, never FSDP2's temporary unsharded root params
    tensors, seen = {}, set()
    for name, t in model.state_dict(keep_vars=True).items():  # keep_vars: the parameters themselves, not copies
        # a tied weight once, under its first name (3B: embed_tokens, not lm_head); LoRA factors: merged in below
        if id(t) not in seen and not is_lora_factor(name):
            seen.add(id(t))
            tensors[base_name(name)] = t
    merge = {name: layer for name, _, layer in merged_parameters(model) if layer is not None}  # LoRA-adapted weights
    # the names save_pretrained writes (`model.language_model.layers.*` back to `model.layers.*`): checkpoint -> ours
    names = revert_weight_conversion(model, {name: name for name in tensors})
    # what each of ours is written as: [(the checkpoint's name, shape, the cut of ours or None)]; an MoE's experts in
    # the layout its checkpoint had (moe.export_pieces: transposed, or a tensor per expert)
    pieces = {ours: [(key, tuple(tensors[ours].shape), None)] for key, ours in names.items()}
    for ours, kind in getattr(model, "_expert_layouts", {}).items():
        pieces[ours] = moe.export_pieces(ours, kind, tensors[ours].shape)
    files, size = [[]], 0
    for ours in sorted(pieces, key=lambda ours: pieces[ours][0][0]):
        nbytes = tensors[ours].numel() * tensors[ours].element_size()
        if files[-1] and size + nbytes > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(ours)
        size += nbytes
    filenames = ["model.safetensors"] if len(files) == 1 else [
        f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))
    ]  # fmt: skip

    rank = dist.get_rank()
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        for name in os.listdir(out_dir):  # the weights of an earlier export here would mix with these
            if name.startswith("model") and name.endswith((".safetensors", ".safetensors.index.json")):
                os.remove(os.path.join(out_dir, name))
        model.config.save_pretrained(out_dir)
        model.generation_config.save_pretrained(out_dir)
        processor.save_pretrained(out_dir)
    for filename, ours in zip(filenames, files):
        items = [(pieces[name], tensors[name], merge.get(name)) for name in ours]
        _write_safetensors(os.path.join(out_dir, filename), items, rank)
    if rank == 0 and len(files) > 1:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                 "weight_map": {key: fn for fn, ours in zip(filenames, files) for name in ours
                                for key, _, _ in pieces[name]}}  # fmt: skip
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
    dist.barrier()


def save_adapter(model, out_dir):
    """Write the LoRA adapter alone as PEFT writes one (adapter_config.json, and adapter_model.safetensors with PEFT's
    names, `base_model.model.<module>.lora_A.weight`), so peft.PeftModel.from_pretrained(base model, out_dir) loads
    it. Collective: every rank all-gathers the adapters, rank 0 writes."""
    import copy

    reshard(model)
    items = [([(f"base_model.model.{name.replace(f'.{LORA_ADAPTER}.', '.')}", tuple(p.shape), None)], p, None)
             for name, p in model.named_parameters() if is_lora_factor(name)]  # fmt: skip
    rank = dist.get_rank()
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        config = copy.copy(model.peft_config[LORA_ADAPTER])
        config.inference_mode = True  # as PEFT saves it: loaded for inference unless asked otherwise
        config.save_pretrained(out_dir)
    _write_safetensors(os.path.join(out_dir, "adapter_model.safetensors"), items, rank)
    dist.barrier()


@torch.no_grad()
def _write_safetensors(path, items, rank):
    """Collective: write [(pieces, tensor, LoRA layer or None)] as one safetensors file without holding more than one
    full tensor (a LoRA layer's weight is written merged, + lora_delta). Every rank all-gathers each tensor in turn
    (lora.full_tensor, in the same order everywhere) and rank 0 appends the bytes of its pieces: [(name, shape, cut)],
    cut(full) the piece written under that name, or None for the whole tensor (an MoE's experts are written as a
    tensor per expert, or transposed: moe.export_pieces).
    The layout: the header's length (8 bytes, little-endian), the JSON header (dtype, shape and byte range of each
    tensor, padded with spaces to a multiple of 8), then the tensors' bytes back to back."""
    import struct

    f = open(path, "wb") if rank == 0 else None  # noqa: SIM115
    try:
        if rank == 0:
            header, offset = {"__metadata__": {"format": "pt"}}, 0
            for pieces, t, _ in items:
                for key, shape, _ in pieces:
                    nbytes = math.prod(shape) * t.element_size()
                    header[key] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(shape),
                                   "data_offsets": [offset, offset + nbytes]}  # fmt: skip
                    offset += nbytes
            blob = json.dumps(header, separators=(",", ":")).encode()
            blob += b" " * (-len(blob) % 8)
            f.write(struct.pack("<Q", len(blob)) + blob)
        for pieces, t, lora in items:
            full = full_tensor(t)
            if lora is not None:  # merged in fp32, written in the header's dtype, the base's (bf16 on GPU)
                full = (full + lora_delta(lora)).to(full.dtype)
            if rank == 0:
                for _, _, cut in pieces:
                    piece = full if cut is None else cut(full)
                    f.write(piece.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
            del full
    finally:
        if f is not None:
            f.close()


def export_checkpoint(checkpoint: str, out_dir: str, model_path: str | None = None) -> str:
    """Write the HF model directory of a saved checkpoint (scripts/export_hf.py), in one CPU process, whatever the
    number of ranks that wrote it. The model is built from the checkpoint's own config (actor.model_path, or
    `model_path` if it moved) and filled with the checkpoint's weights; save_hf then writes the same files as at the
    end of training (safetensors in the original naming, the processor with the run's pixel ranges). The base
    model's weights are never read: one copy of the model in memory, the checkpoint's. (A LoRA checkpoint holds the
    adapters only: then the base model is read, and the export is it with the adapters merged.)"""
    from transformers import AutoProcessor

    from grpo.media import set_pixel_range
    from grpo.video import set_video_range

    if not is_complete_checkpoint(checkpoint):
        raise SystemExit(f"{checkpoint}: not a complete checkpoint (no .metadata or trainer_state.json)")
    try:
        _data_only_reader(checkpoint).read_metadata()
    except UnsafeCheckpointError as e:
        raise SystemExit(str(e)) from None
    with open(os.path.join(checkpoint, "trainer_state.json")) as f:
        cfg = json.load(f)["config"]
    model_path = model_path or resolve_path(cfg["actor"]["model_path"])
    lora = cfg["actor"].get("lora_rank", 0) > 0
    if lora:  # the checkpoint holds the adapters: the base model's weights, with them on top
        from types import SimpleNamespace

        from grpo.lora import lora_config

        model = load_model(model_path, torch.device("cpu"), "sdpa")
        add_lora(model, lora_config(SimpleNamespace(**{**cfg["actor"], "model_path": model_path})))
    else:  # the structure only, then one fp32 copy of the weights, uninitialised until the checkpoint fills it below
        model = load_model(model_path, torch.device("cpu"), "sdpa", meta=True).to_empty(device="cpu")
    processor = AutoProcessor.from_pretrained(model_path)
    d = cfg["data"]  # the processor as PromptDataset left it in training: the images' and the videos' budgets
    set_pixel_range(processor, d["min_pixels"], d["max_pixels"])
    if "video_max_pixels" in d:  # (a checkpoint from before videos: its run's export had no video budget either)
        set_video_range(processor, d["video_min_pixels"], d["video_max_pixels"], d["max_frames"])

    # DCP and save_hf work through torch.distributed: a one-process group runs them here unchanged
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        # Only the model's entries are read (the optimizer's stay on disk); DCP loads in place into these tensors and
        # fails on any key the checkpoint lacks, so a model that does not match the checkpoint cannot be half-loaded.
        state = {"model": {k: v for k, v in model.state_dict().items() if not lora or is_lora_factor(k)}}
        load_shards(state, checkpoint)
        model.load_state_dict(state["model"], strict=not lora)
        save_hf(model, processor, out_dir)
    finally:
        dist.destroy_process_group()
    return out_dir
