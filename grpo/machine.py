"""The machine a rank runs on: whether this process can use the NVIDIA GPUs it has (the driver against the torch
build), and its host memory kept flat over a long run (oneDNN's kernel caches capped, the freed heap given back).

Imports none of the project's modules: distributed.setup_distributed runs these checks before the process group forms.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re

import torch

# ----------------------------------------------------------------------------------------------------------------------
# NVIDIA GPUs that torch cannot use.

# The oldest NVIDIA driver that runs each CUDA major version a torch build may target (CUDA's minor version
# compatibility: any 13.x build on a 580 driver, any 12.x on 525). PyPI's torch 2.14.0 is built for CUDA 13.0.
MIN_DRIVER = {"13": 580, "12": 525}


def visible_nvidia_gpus() -> int:
    """NVIDIA GPUs this process could use by the device files the driver makes (no CUDA or NVML needed), or 0 when
    CUDA_VISIBLE_DEVICES hides them all on purpose."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") in ("", "-1"):
        return 0
    return sum(1 for name in os.listdir("/dev") if re.fullmatch(r"nvidia\d+", name)) if os.path.isdir("/dev") else 0


def nvidia_driver_version() -> str | None:
    """The loaded NVIDIA kernel driver's version ("NVRM version: ... Kernel Module ... 550.54.15 ..."), or None."""
    try:
        with open("/proc/driver/nvidia/version") as f:
            match = re.search(r"Kernel Module.*?\s(\d+\.\d+(?:\.\d+)?)\s", f.read())
    except OSError:
        return None
    return match.group(1) if match else None


def cuda_problem(cuda_available: bool, n_gpus: int, driver: str | None, torch_cuda: str | None) -> str | None:
    """Why this process cannot use the NVIDIA GPUs it has, in words a user can act on; None when it can, or has
    none. Without this check a trainer on a node whose driver is older than its torch build needs sees
    torch.cuda.is_available() False and takes the CPU path (gloo, fp32) on an 8-GPU node."""
    if cuda_available or n_gpus == 0:
        return None
    found = f"{n_gpus} NVIDIA GPU{'s' * (n_gpus > 1)}"
    if torch_cuda is None:
        return f"{found} here, but torch {torch.__version__} is a CPU-only build: pip install -r requirements.txt"
    need = MIN_DRIVER.get(torch_cuda.split(".")[0])
    have = f"driver {driver}" if driver else "no NVIDIA driver loaded (/proc/driver/nvidia/version)"
    if driver and need and int(driver.split(".")[0]) >= need:
        cause = "although the driver is new enough: check `nvidia-smi` and CUDA_VISIBLE_DEVICES"
    else:
        cause = f"CUDA {torch_cuda} needs an NVIDIA driver >= {need or '?'}: update the driver (README, On GPUs)"
    return (
        f"{found} here, but torch {torch.__version__} (built for CUDA {torch_cuda}) cannot use them with {have}; "
        f"{cause}. To run on the CPU on purpose, set CUDA_VISIBLE_DEVICES=''"
    )


# ----------------------------------------------------------------------------------------------------------------------
# Host memory over a long run (docs/memory.md#host-memory-over-a-long-run).

# oneDNN, through torch's ideep layer, keeps a compiled kernel for each input shape of a CPU convolution, in two caches
# of 1,024 entries (ideep's LRU_CACHE_CAPACITY, oneDNN's ONEDNN_PRIMITIVE_CACHE_CAPACITY), tens of KB an entry. The
# vision tower's patch embedding is such a convolution over all patches of a micro-batch, a count that is new almost
# every time: the CPU demo's heap in use grew by 0.5 MB a step for hundreds of steps. The shapes rarely repeat, so a
# few entries lose nothing. The libraries read the variables at their first convolution: set before any.
KERNEL_CACHE_ENTRIES = 16


def bound_kernel_caches(entries: int = KERNEL_CACHE_ENTRIES):
    """Cap oneDNN's per-shape kernel caches at `entries` each (a value already in the environment wins)."""
    for key in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY"):
        os.environ.setdefault(key, str(entries))


def release_host_memory() -> float:
    """Give the heap's free pages back to the system (glibc's malloc_trim) and return this process's resident memory
    then, in GB. A step frees hundreds of MB of tensors of ever-changing sizes; glibc keeps the pages between the
    blocks still in use, and the CPU demo's heap grew by about 0.5 MB a step of pages nothing used. Tens of
    milliseconds, once a step; without glibc (musl) the memory is only measured."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9
