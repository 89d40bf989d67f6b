"""The metrics of a run: rank 0 writes each step's metrics to metrics.jsonl and to the chosen backends (a console
line with the ETA, TensorBoard, wandb), and a few validation generations to val_samples.jsonl."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import uuid

LOGGERS = {"console": None, "jsonl": None, "tensorboard": "tensorboard", "wandb": "wandb"}  # name -> package needed


def format_duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def save_config(output_dir: str, config: dict, rank: int) -> None:
    """The resolved config, first thing in a run's log and in <output_dir>/config.json (rank 0): the log alone, or the
    directory alone, says how to rerun it."""
    os.makedirs(output_dir, exist_ok=True)
    if rank == 0:
        with open(os.path.join(output_dir, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        print(f"config: {json.dumps(config)}", flush=True)


class MetricsLogger:
    """Rank 0 writes each step's metrics to <output_dir>/metrics.jsonl (always) and to the backends in
    trainer.logger: a console line (with a progress bar under it on a terminal), TensorBoard events in
    <output_dir>/tensorboard, wandb. Validation samples go to <output_dir>/val_samples.jsonl. Other ranks no-op."""

    console_keys = [
        ("reward/overall", "reward", ".3f"),
        ("reward/accuracy", "acc", ".3f"),
        ("actor/kl", "kl", ".1e"),
        ("distill/reverse_kl", "rkl", ".3f"),  # with a distillation teacher: the reverse KL to it
        ("actor/grad_norm", "gnorm", ".2f"),
        ("response_length/mean", "len", ".0f"),
        ("val/accuracy", "val", ".3f"),
        ("time/rollout", "gen", ".1f"),
        ("time/train", "train", ".1f"),
    ]

    def __init__(self, output_dir, total_steps, loggers, enabled, cfg=None):
        self.enabled, self.total_steps, self.console = enabled, total_steps, "console" in loggers
        self.file = open(os.path.join(output_dir, "metrics.jsonl"), "a") if enabled else None
        self.samples_path = os.path.join(output_dir, "val_samples.jsonl")
        self.pending_samples, self.step_seconds, self.t_last = [], [], None
        self.tb = self.wandb = self.bar = None
        if enabled and "tensorboard" in loggers:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(os.path.join(output_dir, "tensorboard"))
        # wandb starts once the run knows whether it continues an earlier one (drop_steps_after), or at the first log
        self.wandb_pending, self.output_dir, self.cfg = enabled and "wandb" in loggers, output_dir, cfg
        # a bar with the run's ETA only on a terminal: in a log file its redraws would be noise
        self.use_bar = enabled and self.console and sys.stdout.isatty()

    def start_wandb(self, resumed: bool):
        """One wandb run for a run and all its resumes: its id is kept in <output_dir>/wandb_id, and a resumed run (a
        requeued Slurm job, a rerun after a crash) continues it, so the curves are not split at every preemption. A
        fresh start in the same output_dir (no checkpoint, or trainer.resume=none) begins a new wandb run, as it
        begins a new metrics.jsonl. wandb drops what a resume logs at steps its run already has (those a crash made
        the run repeat): they keep the values first logged."""
        import wandb  # WANDB_MODE=offline writes the run under <output_dir>/wandb, for a later `wandb sync`

        self.wandb_pending = False
        id_file = os.path.join(self.output_dir, "wandb_id")
        run_id = open(id_file).read().strip() if resumed and os.path.exists(id_file) else None
        if not run_id:
            run_id = uuid.uuid4().hex[:16]
            with open(id_file, "w") as f:
                f.write(run_id + "\n")
        self.wandb = wandb.init(
            project=self.cfg.trainer.wandb_project if self.cfg else "grpo-vl",
            name=os.path.basename(os.path.abspath(self.output_dir)),
            dir=self.output_dir,
            config=dataclasses.asdict(self.cfg) if self.cfg else None,
            id=run_id,
            resume="allow",  # continue the run of that id if wandb has it, else create it
        )

    def drop_steps_after(self, step):
        """A resumed run reruns the steps after its checkpoint: drop their old lines, so the files read like one
        uninterrupted run. Truncating in place is safe: the files are appended to, and appends go to their end.
        step -1: a fresh start, not a resume."""
        if not self.enabled:
            return
        if self.wandb_pending:
            self.start_wandb(resumed=step >= 0)
        for path in (self.file.name, self.samples_path):
            if not os.path.exists(path):
                continue
            with open(path, "r+") as f:
                keep = 0
                for line in iter(f.readline, ""):
                    try:
                        if json.loads(line)["step"] > step:
                            break
                    except ValueError:  # a line cut short when the run was killed
                        break
                    keep = f.tell()
                f.truncate(keep)
        if self.tb is not None:  # TensorBoard hides the old events of the rerun steps itself, given purge_step
            self.tb.close()
            self.tb = type(self.tb)(self.tb.log_dir, purge_step=step + 1)

    def add_val_samples(self, rows):
        """Keep a few validation generations until the step's log() writes them, with its step number."""
        if self.enabled:
            self.pending_samples += rows

    def eta(self, step, metrics):
        """Seconds left: remaining steps x the mean wall time between step logs (validation and saving included)."""
        now = time.perf_counter()
        spent = now - self.t_last if self.t_last is not None else metrics.get("time/step")
        self.t_last = now
        if step > 0 and spent is not None:
            self.step_seconds.append(spent)
        if step == 0 or not self.step_seconds:
            return None
        return sum(self.step_seconds) / len(self.step_seconds) * (self.total_steps - step)

    def log(self, step, metrics):
        if not self.enabled:
            return
        if self.wandb_pending:
            self.start_wandb(resumed=False)
        self.file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.file.flush()
        if self.pending_samples:
            with open(self.samples_path, "a") as f:
                f.writelines(json.dumps({"step": step, **row}) + "\n" for row in self.pending_samples)
            self.pending_samples = []
        if self.tb is not None:
            for key, value in metrics.items():
                self.tb.add_scalar(key, value, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)
        eta = self.eta(step, metrics)
        if self.console:
            parts = [f"step {step}/{self.total_steps}"]
            for key, name, fmt in self.console_keys:
                if key in metrics:
                    unit = "s" if key.startswith("time/") else ""
                    parts.append(f"{name} {metrics[key]:{fmt}}{unit}")
            if eta is not None:
                parts.append(f"eta {format_duration(eta)}")
            if self.use_bar and step > 0:
                if self.bar is None:  # made at the first step logged (a resumed run starts late), rate from the next
                    from tqdm import tqdm

                    self.bar = tqdm(total=self.total_steps, initial=step, unit="step", dynamic_ncols=True)
                self.bar.update(step - self.bar.n)
                self.bar.write(" | ".join(parts))
            else:
                print(" | ".join(parts), flush=True)

    def close(self):
        for handle in (self.bar, self.tb, self.file):
            if handle is not None:
                handle.close()
        if self.wandb is not None:
            self.wandb.finish()
