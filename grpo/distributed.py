"""The ranks: distributed setup (torchrun or Slurm, the GPU a rank uses, the collectives' timeout), the phase a rank
is in when it fails, a rank's exit (an error that stops the run said once, by rank 0; a fault named with its phase;
no hang in the interpreter's teardown), rank-0 printing and cross-rank means, and stopping cleanly on a signal.

Small and shared: train_grpo.py, the package's modules and the benches import it; it imports only machine.py.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import datetime
import faulthandler
import os
import signal
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist

from grpo.machine import bound_kernel_caches, cuda_problem, nvidia_driver_version, visible_nvidia_gpus

# ----------------------------------------------------------------------------------------------------------------------
# Distributed: one process per device, started by torchrun or Slurm.


def setup_distributed(collective_timeout_s: float = 3600.0, verbose: bool = False):
    """torchrun sets RANK/WORLD_SIZE/LOCAL_RANK; a bare `srun python train_grpo.py` gets them from Slurm.

    A collective that waits longer than collective_timeout_s (trainer.collective_timeout_s) for a rank fails instead of
    hanging: gloo raises it in the waiting rank, which then exits naming its phase (report_failure); NCCL's watchdog
    ends the process, and faulthandler prints where each thread was. verbose (trainer.verbose): whole tracebacks of
    Stop and of collectives that lost a rank too."""
    global _verbose
    _verbose = verbose
    env = os.environ
    if "RANK" not in env and "SLURM_PROCID" in env:
        env["RANK"], env["WORLD_SIZE"] = env["SLURM_PROCID"], env["SLURM_NTASKS"]
        env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
    env.setdefault("RANK", "0")
    env.setdefault("WORLD_SIZE", "1")
    env.setdefault("LOCAL_RANK", "0")
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env.setdefault("MASTER_PORT", "29500")
    bound_kernel_caches()
    local_rank = int(env["LOCAL_RANK"])
    gpus, driver = visible_nvidia_gpus(), nvidia_driver_version()
    problem = cuda_problem(torch.cuda.is_available(), gpus, driver, torch.version.cuda)
    if problem:  # an 8-GPU node must never quietly train on its CPUs
        raise Stop(f"error: {problem}")
    timeout = datetime.timedelta(seconds=collective_timeout_s)
    sys.excepthook = report_failure(sys.excepthook, collective_timeout_s)
    with contextlib.suppress(AttributeError, OSError):  # (a stderr without a file descriptor: captured in a test)
        faulthandler.enable()  # a fatal signal (NCCL's watchdog aborts on a timeout) prints each thread's Python stack
    if torch.cuda.is_available():
        device = torch.device("cuda", cuda_index(local_rank, torch.cuda.device_count()))
        # vLLM's external_launcher takes its device from LOCAL_RANK (cuda:LOCAL_RANK, 0.26 to 0.33), which under srun
        # is the task's place on the node: one GPU bound per task would make every task but the first fail there
        env["LOCAL_RANK"] = str(device.index)
        torch.cuda.set_device(device)
        dist.init_process_group("cpu:gloo,cuda:nccl", device_id=device, timeout=timeout)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    return dist.get_rank(), dist.get_world_size(), device


_phase = "start-up"  # what this rank is doing, for the message of a collective that fails
_verbose = False  # trainer.verbose: the tracebacks that are left out otherwise


def phase(name: str) -> float:
    """Record the phase of the run this rank enters (the step's phases, validation, checkpoint save or load). Returns
    time.perf_counter(), so that the phase's timer starts on the same line."""
    global _phase
    _phase = name
    return time.perf_counter()


def report_failure(excepthook, timeout_s):
    """sys.excepthook that also says which phase the rank was in, and, for a collective that timed out or lost a
    peer, that another rank stopped taking part: the rank that reports first is rarely the one at fault."""

    def report(kind, error, trace):
        text = str(error)
        if "Timed out" in text or "timed out" in text:
            why = (f": a collective waited longer than trainer.collective_timeout_s={timeout_s:g}s for another rank, "
                   "which stopped taking part (it hangs or died: see its output)")  # fmt: skip
        elif "closed by peer" in text or "reset by peer" in text:
            why = ": another rank left a collective (it died: see its output)"
        else:
            why = ""
        # a rank that lost a peer says so in one line: the cause, with its traceback, is in the output of the peer
        if not why or _verbose:
            excepthook(kind, error, trace)
        last = f" ({kind.__name__}: {text.splitlines()[0][:200]})" if why and text else ""
        print(f"rank {os.environ.get('RANK', '?')}: failed in phase '{_phase}'{why}{last}", file=sys.stderr, flush=True)
        mark_failed()

    return report


def cuda_index(local_rank: int, device_count: int) -> int:
    """The GPU this rank uses: the one at its LOCAL_RANK, or the only one it sees. Slurm with one GPU bound per task
    (`srun --ntasks-per-node=8 --gpus-per-task=1`) shows each task its own GPU as device 0 whatever its local rank."""
    if device_count == 1:
        return 0
    if local_rank >= device_count:
        raise Stop(
            f"error: this is local rank {local_rank} but it sees {device_count} GPUs "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): start at most {device_count} "
            "ranks per node, or give each rank exactly one GPU",
            every_rank=False,
        )
    return local_rank


# ----------------------------------------------------------------------------------------------------------------------
# A rank's way out: a stop said once, a fault named with its phase, an exit that cannot hang.


class Stop(SystemExit):
    """An error that ends the run with one line a user can act on: a config error, a check at start, the start
    guard, a failed save. Raised by every rank at the same point (every_rank, the default: the same check on the
    same data, or a decision the ranks agreed on in a collective), it is printed once, by rank 0, as is (begin the
    message with "error: "): 16 ranks that all print their own traceback and line bury it under 16 copies. A
    condition of one rank alone (its GPU is busy) is raised with every_rank=False and printed by that rank.

    A SystemExit, so that no `except Exception` on the way up takes it for a fault to survive; uncaught (a script
    that does not end through run_rank), Python prints the message and exits 1."""

    def __init__(self, message: str, code: int = 1, every_rank: bool = True):
        super().__init__(message)
        self.message, self.exit_code, self.every_rank = message, code, every_rank


def rank() -> int:
    """This process's rank: the process group's, or before it forms, the launcher's (RANK or SLURM_PROCID)."""
    if dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))


# How long the ranks but rank 0 wait for it to say a stop before a process group exists: their start-ups (imports,
# the config's checks) run side by side and differ by seconds at most.
PRE_GROUP_WAIT_S = 10.0


def report_stop(message: str, every_rank: bool = True):
    """Print a run-ending message once: by rank 0 when every rank stops alike, else by this rank, its rank named.

    The other ranks let rank 0 end first: torchrun ends all ranks as soon as one exits (SIGTERM), and a rank 0 still
    on its way to the same check would die without a word. With a process group they wait until rank 0 has printed
    (a key in the group's store); before one forms, for a few seconds (torchrun ends them once rank 0 has exited)."""
    if not every_rank:
        print(f"rank {rank()}: {message}", file=sys.stderr, flush=True)
        mark_failed()
    elif rank() == 0:
        print(message, file=sys.stderr, flush=True)
        if dist.is_initialized():
            dist.distributed_c10d._get_default_store().set("stop_reported", "1")
    elif dist.is_initialized():
        with contextlib.suppress(Exception):  # (rank 0 gone, or stopping otherwise: nothing left to wait for)
            dist.distributed_c10d._get_default_store().wait(["stop_reported"], datetime.timedelta(seconds=60))
    else:
        time.sleep(PRE_GROUP_WAIT_S)


# The store key a rank that ends the run alone (a fault, a Stop of its own) sets on its way out, for the ranks it
# leaves behind: they can never finish their step (StopSignal).
FAILED_KEY = "rank_failed"


def mark_failed():
    if dist.is_initialized():
        with contextlib.suppress(Exception):  # (the store went with the rank that held it: nothing to tell)
            store = dist.distributed_c10d._get_default_store()
            if not store.check([FAILED_KEY]):  # the first rank to end is the cause; the others followed it
                store.set(FAILED_KEY, str(rank()))


def failed_rank() -> str | None:
    """The rank that ended the run alone, if one did and the group's store still answers."""
    with contextlib.suppress(Exception):
        store = dist.distributed_c10d._get_default_store()
        if store.check([FAILED_KEY]):
            return store.get(FAILED_KEY).decode()
    return None


def run_rank(main):
    """A rank's whole life: `exit_rank(main())`, with a Stop said once (report_stop) and ended with its code, no
    traceback (trainer.verbose adds one). A SystemExit with a message counts as a Stop of every rank; sys.exit(n)
    ends with n. Any other exception is a fault of the code or a library: sys.excepthook (report_failure) prints its
    traceback and the phase the rank was in, and the rank ends with 1. Every way out goes through exit_rank, a fault
    too: the interpreter's own teardown waits for every thread that is not a daemon and for what vLLM and NCCL
    leave behind, and a rank that crashed must end, not hang until its peers' collectives time out (a GPU check
    that raised after its run waited there until it was killed)."""
    try:
        code = main()
    except SystemExit as stop:
        if isinstance(stop.code, str):
            every_rank = getattr(stop, "every_rank", True)
            if _verbose and (rank() == 0 or not every_rank):
                traceback.print_exc()
            report_stop(stop.code, every_rank)
            code = getattr(stop, "exit_code", 1)
        else:  # sys.exit(n) or sys.exit(): an exit code, not a message
            code = stop.code or 0
    except BaseException:  # a fault
        sys.excepthook(*sys.exc_info())
        code = 1
    exit_rank(code)


EXIT_HANDLERS_S = 5.0  # the most the exit handlers may take, all together, before the process ends without them


def exit_rank(code: int):
    """End this process with `code`, skipping only the interpreter's own teardown: Python's exit handlers run, the
    standard streams are flushed, and C's exit() then runs the libraries' teardown (vLLM's CPU build unlinks its
    shared-memory segments there; os._exit would leave them to break the next run's start).

    gloo's worker threads outlive destroy_process_group, and a worker can still be dropping the tensors of the last
    collective it ran (a barrier keeps the work before it) after the main thread has moved on. If the interpreter is
    finalizing by then, the worker's GIL acquire (the tensor's Python object is released with it) ends the thread
    inside a C++ destructor, and the process aborts with "terminate called without an active exception": a finished
    run reported by torchrun and Slurm as failed (SIGABRT). Here the interpreter never finalizes, and exit() is called
    holding the GIL, so such a worker waits until the process ends instead.

    An exit handler can wait on something that never comes: torch inductor's compile-worker pool, which vLLM's CUDA
    graphs start, waits up to 300 s for its worker (SubprocPool.shutdown's process.wait(300) in torch 2.13),
    multiprocessing's joins a child that does not end. What releases device memory is done before (shut_down; the
    engine's pools), and the device's memory goes back with the process. So the handlers get EXIT_HANDLERS_S in all;
    past that a watchdog thread names the one still running and ends the process the same way, with the same code."""

    def end():
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        ctypes.PyDLL(None).exit(code)  # PyDLL: the call keeps the GIL, so no other Python thread runs past this

    def give_up(main_thread: int):
        at = handler = sys._current_frames().get(main_thread)  # where it waits, and the handler that called it
        while handler is not None and handler.f_back is not None and handler.f_back.f_code is not exit_rank.__code__:
            handler = handler.f_back
        name = f"{handler.f_code.co_name} ({handler.f_code.co_filename})" if handler else "?"
        where = f"{at.f_code.co_filename}:{at.f_lineno}" if at else "?"
        print(f"exit: the exit handler {name} still waits after {EXIT_HANDLERS_S:.0f} s (at {where}); ending "
              "without it", file=sys.stderr)  # fmt: skip
        end()

    watchdog = threading.Timer(EXIT_HANDLERS_S, give_up, args=(threading.get_ident(),))
    watchdog.daemon = True
    watchdog.start()
    atexit._run_exitfuncs()  # what a normal exit runs: the reward workers' close, logging's flush, child processes
    watchdog.cancel()
    end()


def shut_down(engine) -> None:
    """End the run's distributed part: every rank, at the same point, after the trainer's last collective. The rollout
    engine goes first, then the process group. vLLM's in-process engine shares the default group (external_launcher)
    and holds process groups, NCCL communicators and CuMemAllocator pools of its own; left alive past
    destroy_process_group, they are torn down at exit by exit hooks and static destructors after what they depend on
    is gone, which can abort a run that finished (torchrun then reports a failure). Every rank must call it."""
    dist.barrier()  # every rank is past the trainer's collectives: the engine's teardown may use the groups
    engine.close()
    if dist.is_initialized():  # (vLLM's teardown ends by destroying the default group itself)
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------------------------------
# Rank-0 printing and cross-rank means.


def print0(*args, **kwargs):
    if rank() == 0:  # (before the process group forms too: one config error printed, not one a rank)
        print(*args, **kwargs, flush=True)


def mean_over_ranks(sums: dict[str, float], counts: dict[str, float]) -> dict[str, float]:
    """Global means of per-rank (sum, count) pairs; every rank must call it (one all_reduce)."""
    keys = sorted(sums)
    t = torch.tensor([sums[k] for k in keys] + [counts[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(t)
    return {k: (t[i] / t[len(keys) + i]).item() if t[len(keys) + i] > 0 else 0.0 for i, k in enumerate(keys)}


def max_over_ranks(values: dict[str, float]) -> dict[str, float]:
    keys = sorted(values)
    t = torch.tensor([values[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return dict(zip(keys, t.tolist()))


# ----------------------------------------------------------------------------------------------------------------------
# Signals.


class StopSignal:
    """SIGTERM (Slurm preemption, scancel) and SIGINT (Ctrl-C) only set a flag: the loop finishes its step, saves and
    exits with 128 + the signal number (143, 130), which shells, Slurm and torchrun report as killed by that signal.
    A repeated signal changes nothing: torchrun forwards the one the terminal or Slurm already sent to every rank.

    Unless another rank has ended the run (failed_rank): then no step can finish, and the signal is the launcher
    ending the ranks left behind (torchrun sends it when one rank exits). Waiting for the step would only wait for
    the SIGKILL that follows 30 s later, which also skips the exit's teardown; the rank stops where it is instead."""

    def __init__(self):
        self.signum = 0
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        failed = failed_rank()
        if failed is not None and failed != str(rank()):
            name = signal.Signals(signum).name
            raise Stop(f"stopped by {name} in phase '{_phase}': rank {failed} ended the run", 128 + signum, False)
        self.signum = signum  # no print here: a handler that interrupts a print would raise a reentrant-call error

    def agreed(self):
        """Collective: the signal any rank got, else 0. All ranks must stop at the same step, or the ones that went on
        would hang in the next step's collectives."""
        phase("end of step (stop signal check)")
        flag = torch.tensor([self.signum])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())
