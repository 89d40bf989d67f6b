"""A stand-in for wandb where it is not installed (the CPU test environment): `init` has the exact signature of wandb
0.31's `wandb.init` (wandb/sdk/wandb_init.py), so a call with an argument wandb does not take fails here as it would
there. Each call and each logged step is appended to <dir>/wandb-standin.jsonl, which a test reads back; like wandb
with resume="allow", a run whose id was seen before continues, and steps at or below its last are dropped.

Put on PYTHONPATH (tests/wandb_standin) for a torchrun's ranks, or imported into sys.modules in-process."""

from __future__ import annotations

import json
import os

UNSET = object()


def _append(path, record):
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


class Run:
    def __init__(self, path, run_id, last_step):
        self.path, self.id, self.last_step = path, run_id, last_step

    def log(self, data, step=None, commit=None):
        if step is not None and step <= self.last_step:
            return  # wandb's own rule: a resumed run's history only moves forward
        self.last_step = step if step is not None else self.last_step + 1
        _append(self.path, {"call": "log", "id": self.id, "step": self.last_step, "data": data})

    def finish(self, exit_code=None, quiet=None):
        _append(self.path, {"call": "finish", "id": self.id})


def init(
    entity=None, project=None, dir=None, id=None, name=None, notes=None, tags=None, config=None,
    config_exclude_keys=None, config_include_keys=None, allow_val_change=None, group=None, job_type=None, mode=None,
    force=None, reinit=None, resume=None, resume_from=None, fork_from=None, save_code=None, tensorboard=None,
    sync_tensorboard=None, monitor_gym=None, settings=None, anonymous=UNSET,
) -> Run:  # fmt: skip
    if sum(x is not None for x in (resume, resume_from, fork_from)) > 1:
        raise ValueError("`fork_from`, `resume`, or `resume_from` are mutually exclusive")
    path = os.path.join(dir or ".", "wandb-standin.jsonl")
    records = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
    seen = [r["step"] for r in records if r["call"] == "log" and r["id"] == id]
    if seen and resume not in ("allow", "must", "auto", True):
        raise ValueError(f"run {id} exists and resume={resume!r}")
    _append(path, {"call": "init", "id": id, "resume": resume, "project": project, "name": name})
    return Run(path, id, max(seen) if seen and id is not None else 0)
