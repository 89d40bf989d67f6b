"""train_grpo.py with one fault injected into one rank's checkpoint save, for the drills in tests/test_checkpoint.py.

FAULT_DRILL=KIND:STEP:RANK, run under torchrun with train_grpo.py's arguments:
- kill_in_save: the rank SIGKILLs itself in the save of STEP, after DCP wrote its shards, when it opens its rank file
  (no handler, no cleanup runs: the directory keeps what was on disk at that moment);
- disk_full: the rank's first write in DCP's writer at STEP raises OSError(ENOSPC), as on a full disk.
Without FAULT_DRILL this is train_grpo.py. The trainer has no hook for either: both are patched in here.
"""

import contextlib
import errno
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch.distributed.checkpoint.filesystem import FileSystem  # noqa: E402

import train_grpo  # noqa: E402
from grpo.distributed import exit_rank  # noqa: E402


class FullDisk:
    def __init__(self, path):
        self.path = str(path)

    def write(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.path)

    def __getattr__(self, name):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.path)


def inject(kind, step, rank):
    if os.environ["RANK"] != rank:
        return
    saving = f".tmp-step_{step}"
    if kind == "kill_in_save":
        save = torch.save

        def killing_save(obj, f, *args, **kwargs):
            if saving in str(f) and os.path.basename(str(f)).startswith("rank_"):
                os.kill(os.getpid(), signal.SIGKILL)
            return save(obj, f, *args, **kwargs)

        torch.save = killing_save
    elif kind == "disk_full":
        create_stream = FileSystem.create_stream

        @contextlib.contextmanager
        def full_disk_stream(self, path, mode):
            if saving in str(path) and "w" in mode:
                yield FullDisk(path)
                return
            with create_stream(self, path, mode) as stream:
                yield stream

        FileSystem.create_stream = full_disk_stream
    else:
        raise SystemExit(f"FAULT_DRILL: unknown kind {kind!r}")


if __name__ == "__main__":
    if os.environ.get("FAULT_DRILL"):
        inject(*os.environ["FAULT_DRILL"].split(":"))
    exit_rank(train_grpo.main())
