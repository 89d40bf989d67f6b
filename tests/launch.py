"""Run a script under torchrun on this machine's CPU, the way the end-to-end tests need it."""

import os
import socket
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def torchrun(nproc, *args, timeout=600):
    """`torchrun --standalone --nproc_per_node=nproc *args` from the repo root; fails the test with the output tail."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout


def free_port() -> int:
    """A TCP port free on this machine right now, for a rendezvous or a 1-rank process group."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
