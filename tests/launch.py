"""Run a script's ranks on this machine's CPU, the way the end-to-end tests need it: under torchrun, or forked from
one process that imported the heavy libraries once (tests/rank_server.py), which saves each launch ~9 s of imports."""

import atexit
import json
import os
import pathlib
import select
import socket
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_server = {}


def seeded(args) -> list:
    """`args` with trainer.seed=$TEST_SEED added when that is set and the launch names a config without a seed of
    its own: how scripts/seeds.py --pytest runs the learning tests at other seeds than the default."""
    seed = os.environ.get("TEST_SEED")
    args = list(args)
    named = any(str(a).endswith(".yaml") for a in args) and not any(str(a).startswith("trainer.seed=") for a in args)
    if seed and named:
        args.append(f"trainer.seed={seed}")
    return args


def torchrun(nproc, *args, timeout=600, real=False):
    """The ranks of `torchrun --standalone --nproc_per_node=nproc *args` from the repo root, forked by the rank
    server, or under torchrun itself with real=True; fails the test with the output's tail; returns the ranks'
    stdout."""
    args = seeded(args)
    if real:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        return proc.stdout
    codes, timed_out, stdout, stderr = forked(nproc, *args, timeout=timeout)
    assert not timed_out, f"ranks still running after {timeout} s\n" + stdout[-3000:] + stderr[-5000:]
    assert codes == [0] * nproc, f"exit codes {codes}\n" + stdout[-3000:] + stderr[-5000:]
    return stdout


def forked(nproc, *args, timeout=600, merged=False):
    """The ranks forked by the rank server with torchrun's environment for them, from the repo root: (their exit
    codes, whether the timeout ended them, stdout, stderr); with merged=True stderr goes into stdout, in order."""
    with tempfile.TemporaryDirectory() as tmp:  # (each rank gets OMP_NUM_THREADS=1 from the server, as from torchrun)
        stderr = None if merged else f"{tmp}/stderr"
        job = {"nproc": nproc, "args": seeded(args), "env": dict(os.environ), "cwd": REPO, "port": free_port(),
               "timeout": timeout, "stdout": f"{tmp}/stdout", "stderr": stderr}  # fmt: skip
        result = _ask_server(job, timeout + 60)
        stdout, stderr = (pathlib.Path(path).read_text() if path else "" for path in (job["stdout"], job["stderr"]))
    return result["codes"], result["timed_out"], stdout, stderr


def _ask_server(job, timeout):
    """Send a launch to the rank server (started at the first one, ~9 s) and wait for its exit codes."""
    if not _server or _server["proc"].poll() is not None:
        read_fd, write_fd = os.pipe()
        log = tempfile.NamedTemporaryFile("w+", prefix="rank_server", suffix=".log", delete=False)
        proc = subprocess.Popen(
            [sys.executable, "-u", os.path.join(REPO, "tests", "rank_server.py"), str(write_fd)],
            cwd=REPO, stdin=subprocess.PIPE, stdout=log, stderr=log,  # (it sets OMP_NUM_THREADS=1 before torch)
            pass_fds=(write_fd,), text=True,
        )  # fmt: skip
        os.close(write_fd)
        _server.update(proc=proc, results=os.fdopen(read_fd), log=log.name)
        atexit.register(proc.stdin.close)  # end of input: the server ends
        atexit.register(os.unlink, log.name)
        _read(timeout=300)  # the imports
    _server["proc"].stdin.write(json.dumps(job) + "\n")
    _server["proc"].stdin.flush()
    return _read(timeout)


def _read(timeout):
    ready, _, _ = select.select([_server["results"]], [], [], timeout)
    line = _server["results"].readline() if ready else ""
    if not line:
        _server["proc"].kill()
        with open(_server["log"]) as f:
            raise AssertionError(f"the rank server gave no answer in {timeout} s; its log:\n{f.read()[-5000:]}")
    return json.loads(line)


def free_port() -> int:
    """A TCP port free on this machine right now, for a rendezvous or a 1-rank process group."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(fn, *args, nprocs: int = 2) -> None:
    """fn(rank, *args) in `nprocs` spawned processes that share one gloo process group (fn: a module's top-level
    function, so that the spawned interpreters can import it). Spawned, not forked: a fork after the test process
    has started torch's thread pools can hang in them. A rank that fails prints its traceback and ends at once, and
    the call raises."""
    import torch.multiprocessing as mp

    mp.start_processes(_spawned_rank, args=(nprocs, free_port(), fn, args), nprocs=nprocs, start_method="spawn")


def _spawned_rank(rank, nprocs, port, fn, args):
    import traceback

    import torch.distributed as dist

    from grpo.distributed import exit_rank

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=nprocs)
    try:
        fn(rank, *args)
    except BaseException:
        # said here and ended at once: tearing the group down while another rank waits in a collective aborts the
        # process (SIGABRT, "terminate called"), which hides which check failed
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    dist.barrier()  # no rank leaves while another still exchanges
    dist.destroy_process_group()
    # out as the trainer's ranks leave, without the interpreter's teardown, in which a gloo worker still dropping the
    # last collective's tensors aborts the process (SIGABRT, "terminate called without an active exception": one
    # launch in about twelve, after every rank had destroyed the group)
    exit_rank(0)
