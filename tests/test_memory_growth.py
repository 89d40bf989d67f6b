"""Host memory that must not grow over a long run (docs/memory.md#host-memory-over-a-long-run). Each check runs in a
fresh interpreter: the caches and the heap it measures are per process."""

import os
import socket
import subprocess
import sys

from tests.launch import REPO


def run_python(code: str, **env) -> str:
    """The last line `code` prints, run in a fresh interpreter without a cache capacity of the caller's environment."""
    base = {k: v for k, v in os.environ.items() if k not in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**base, **env}, capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def test_kernel_caches_stay_bounded_over_new_convolution_shapes():
    """The growth behind a CPU run's ~1 MB a step: oneDNN's two per-shape kernel caches (1,024 entries each by default)
    filled by the vision tower's patch convolution, whose patch count is new at nearly every micro-batch. A rank set
    up by setup_distributed caps them; 400 new shapes then add a few MB, against ~35 MB uncapped."""
    code = """
import torch
from grpo import distributed, machine
distributed.setup_distributed()
conv = torch.nn.Conv3d(3, 32, kernel_size=(2, 14, 14), stride=(2, 14, 14), bias=False)
def step(n):
    conv(torch.randn(n, 3, 2, 14, 14)).sum().backward()
step(8)
start = machine.release_host_memory()
for n in range(16, 416):  # a new patch count each time, as packed micro-batches have
    step(n)
print((machine.release_host_memory() - start) * 1000)
"""
    growth_mb = float(run_python(code, RANK="0", WORLD_SIZE="1", MASTER_PORT=free_port(), OMP_NUM_THREADS="1"))
    assert growth_mb < 12, f"{growth_mb:.1f} MB for 400 new convolution shapes: a kernel cache grows unbounded"


def test_release_host_memory_gives_the_freed_heap_back():
    """A step frees hundreds of MB of tensors whose sizes change every step; glibc keeps the pages between blocks still
    in use. Freed 90 % of a 64 KB-block heap: the resident memory stays, until release_host_memory hands it back."""
    code = """
from grpo import machine
blocks = [bytearray(64 << 10) for _ in range(3200)]  # 200 MB in blocks under glibc's mmap threshold: its heap
full = machine.release_host_memory()
del blocks[:-1]  # all but the last, which pins the heap's top: free() alone cannot shrink it
with open("/proc/self/statm") as f:
    before = int(f.read().split()[1]) * 4096 / 1e9
print(full, before, machine.release_host_memory())
"""
    full, before, after = map(float, run_python(code).split())
    assert before > full - 0.05, "the setup did not leave the heap's pages resident: nothing to test"
    assert after < full - 0.15, f"resident {after:.3f} GB after release, {full:.3f} GB when full"
