"""A 2-rank gloo run whose rank 1 leaves while a gloo worker thread still holds a collective's tensor, the last owner of
its Python object. Used by test_startup.py.

    torchrun --nproc_per_node=2 tests/exit_check.py exit_rank|return

Rank 1 starts an all-reduce and drops its own references; rank 0 joins the all-reduce only once rank 1 is in its exit
handlers, so the worker finishes the collective, and drops the tensor, while rank 1 is ending. Ended by returning, the
interpreter is mostly finalizing by then (7 of 10 launches on a 2-core machine): the worker's GIL acquire ends that
thread inside a C++ destructor and the process aborts ("terminate called without an active exception"). Ended by
distributed.exit_rank it must exit with code 0, after its exit handlers ran and its output was written.
"""

import atexit
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, __file__.rsplit("/tests/", 1)[0])

from grpo import distributed  # noqa: E402


class SlowTeardown:
    """Gives rank 0's reply the time to reach the worker while the interpreter finalizes."""

    def __del__(self, sleep=time.sleep):  # (module globals such as `time` may be gone by then)
        sleep(1.0)


def main():
    rank, _, _ = distributed.setup_distributed()
    store = dist.distributed_c10d._get_default_store()
    if rank == 1:
        tensor = torch.ones(1 << 16)
        dist.all_reduce(tensor, async_op=True)
        del tensor  # the gloo worker's reference is now the only one
        atexit.register(store.set, "rank1_exiting", "1")  # the last exit handler to run (last in, first out)
        atexit.register(lambda: print("rank 1: exit handlers ran"))
        global slow_teardown  # cleared (and so waited on) by a finalizing interpreter; never by exit_rank
        slow_teardown = SlowTeardown()
        print("rank 1: main returned")  # (torchrun runs ranks with -u: test_startup checks buffered output apart)
    else:
        store.wait(["rank1_exiting"])
        try:
            dist.all_reduce(torch.ones(1 << 16))
        except RuntimeError:  # rank 1 may be gone before it sent its half: only rank 1's exit is under test
            pass


if __name__ == "__main__":
    main()
    if sys.argv[1] == "exit_rank":
        distributed.exit_rank(0)
