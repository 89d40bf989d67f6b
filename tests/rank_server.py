"""The ranks of a test launch, forked from one process that imported the heavy libraries once (tests/launch.py).

A CPU rank spends ~9 s of its ~20 s start importing torch, transformers, vLLM and pyarrow, every launch again; the
suite makes dozens of launches. This process imports them once, then for each launch read from stdin (one JSON line:
script, arguments, environment, ranks, timeout) forks one child a rank. A child takes the environment torchrun gives
a worker (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, OMP_NUM_THREADS=1), sends its
stdout and stderr into the launch's two files (the ranks' lines interleaved, as under torchrun) and runs the script as
`__main__`. When a rank fails the others are stopped (SIGTERM, then SIGKILL), as torchrun's agent does. The exit
codes go back as one JSON line on the file descriptor given as the argument.

Nothing here is started before the imports end, so no thread of ours is alive at a fork. Started with -u: a logging
handler made at import (vLLM's) keeps the interpreter's stdout object, which then writes through to the child's file.
"""

import json
import os
import runpy
import signal
import sys
import time
import traceback

GRACE_S = 10  # from a failed rank's exit to SIGKILL of the others still running
RESULTS_FD = int(sys.argv[1]) if __name__ == "__main__" else -1


def preload():
    os.environ["OMP_NUM_THREADS"] = "1"  # what torchrun gives each worker, before torch reads it
    # the level quiet.quiet_logs sets before the trainer first imports vLLM, which reads it at import
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import pyarrow.parquet  # noqa: F401
    import torch  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import transformers  # noqa: F401
    from PIL import Image  # noqa: F401
    from transformers import AutoModelForImageTextToText, AutoProcessor  # noqa: F401

    try:
        import vllm  # noqa: F401
        from vllm import LLM, SamplingParams  # noqa: F401
    except ImportError:
        pass


def rank(job, index, out_fd, err_fd):
    """In the forked child: become rank `index` of the launch and run its script; never returns."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    os.close(RESULTS_FD)  # the result channel is the server's alone
    code = 1
    try:
        os.environ.clear()
        os.environ.update(job["env"])
        os.environ.update(RANK=str(index), LOCAL_RANK=str(index), GROUP_RANK="0", ROLE_RANK=str(index),
                          WORLD_SIZE=str(job["nproc"]), LOCAL_WORLD_SIZE=str(job["nproc"]),
                          ROLE_WORLD_SIZE=str(job["nproc"]), MASTER_ADDR="localhost",
                          MASTER_PORT=str(job["port"]), OMP_NUM_THREADS="1")  # fmt: skip
        os.chdir(job["cwd"])
        script = os.path.abspath(job["args"][0])  # a script's __file__ is absolute since Python 3.9
        sys.argv = list(job["args"])
        sys.path[0] = os.path.dirname(script)
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def launch(job):
    """Fork the job's ranks, wait for them (stopping the rest when one fails, killing all at the timeout); the exit
    code of each rank, negative for a signal."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
    out_fd = os.open(job["stdout"], flags)
    err_fd = os.open(job["stderr"], flags) if job["stderr"] else os.dup(out_fd)  # None: one stream, in order
    pids = []
    for index in range(job["nproc"]):
        pid = os.fork()
        if pid == 0:
            rank(job, index, out_fd, err_fd)
        pids.append(pid)
    os.close(out_fd)
    os.close(err_fd)
    codes, deadline, failed_at, timed_out = {}, time.monotonic() + job["timeout"], None, False
    while len(codes) < len(pids):
        for pid in pids:
            if pid in codes:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[pid] = os.waitstatus_to_exitcode(status)
                if codes[pid] != 0 and failed_at is None:
                    failed_at = time.monotonic()
                    signal_all(pids, codes, signal.SIGTERM)
        now = time.monotonic()
        timed_out = timed_out or (now > deadline and len(codes) < len(pids))
        if timed_out or (failed_at is not None and now > failed_at + GRACE_S):
            signal_all(pids, codes, signal.SIGKILL)
        time.sleep(0.05)
    return [codes[pid] for pid in pids], timed_out


def signal_all(pids, codes, sig):
    for pid in pids:
        if pid not in codes:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass


def main():
    preload()
    results = os.fdopen(RESULTS_FD, "w", buffering=1)
    results.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        codes, timed_out = launch(json.loads(line))
        results.write(json.dumps({"codes": codes, "timed_out": timed_out}) + "\n")


if __name__ == "__main__":
    main()
