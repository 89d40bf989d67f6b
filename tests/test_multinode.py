"""Multi-node launch: the Slurm script's torchrun rendezvous, with two local "nodes" on this machine, and its stop
before the time limit."""

import json
import os
import signal
import stat
import subprocess
import sys
import time

from tests.launch import REPO, free_port

# Stand-ins for Slurm's commands: srun starts its command once per "node" (all here, at the same time) and fails
# when one of them fails; scontrol names the nodes, the first being this machine's loopback address, and records a
# requeue; scancel --signal signals the step's tasks (each node's torchrun), as slurmstepd does.
FAKE_SRUN = """#!/bin/bash
while [[ "$1" == -* ]]; do shift; done
pids=()
for i in $(seq 0 $((SLURM_NNODES - 1))); do
    SLURM_NODEID=$i "$@" > "$FAKE_LOG_DIR/node$i.log" 2>&1 &
    pids+=($!)
done
echo "${pids[@]}" > "$FAKE_LOG_DIR/tasks"
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
exit $rc
"""
FAKE_SCONTROL = """#!/bin/bash
if [ "$1" = requeue ]; then echo "$@" >> "$FAKE_LOG_DIR/requeued"; exit 0; fi
printf '127.0.0.1\\nlocalhost\\n'
"""
FAKE_SCANCEL = """#!/bin/bash
[ "$1" = --signal=TERM ] && kill -TERM $(cat "$FAKE_LOG_DIR/tasks")
"""


def test_sbatch_scripts_are_valid_bash():
    """Guards against a syntax error that would only show once a job has waited in the queue."""
    for name in ("train_1node.sbatch", "train_multinode.sbatch"):
        subprocess.run(["bash", "-n", os.path.join(REPO, "scripts", name)], check=True)


def test_two_node_rendezvous_run_trains_and_stops_before_the_time_limit(tiny_model_dir, tmp_path):
    """Guards against a multi-node launch that hangs or fails at the rendezvous: the multi-node sbatch script,
    under a fake srun, starts two torchrun "nodes" of one rank each that meet at a c10d rendezvous and train. And
    against a job that its time limit ends without a checkpoint, or that is not requeued: Slurm's USR1 to the script
    (its --signal=B:USR1@900) must reach the ranks as SIGTERM (through scancel, not srun), which save and stop, and
    the script then requeues the job."""
    from scripts.make_synthetic_data import make_geo3k_like

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL), ("scancel", FAKE_SCANCEL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    train = make_geo3k_like(str(tmp_path / "train.parquet"), n_rows=16, seed=0)
    out_dir = tmp_path / "run"
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.path.dirname(sys.executable)}:{os.environ['PATH']}",  # fakes, then the venv's torchrun
        "SLURM_NNODES": "2",
        "SLURM_JOB_NODELIST": "node[1-2]",
        "SLURM_JOB_ID": "4242",
        "GPUS_PER_NODE": "1",
        "MASTER_PORT": str(free_port()),
        "FAKE_LOG_DIR": str(tmp_path),
        "OMP_NUM_THREADS": "1",
    }
    cmd = [
        "bash", "scripts/train_multinode.sbatch", "configs/tiny.yaml", "rollout.engine=hf",
        f"actor.model_path={tiny_model_dir}", f"data.train_files={train}", "data.val_files=",
        f"trainer.output_dir={out_dir}", "trainer.max_steps=50", "trainer.save_freq=100", "data.rollout_batch_size=4",
        "actor.global_batch_size=4", "actor.micro_batch_size=8", "rollout.n=4",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def logs():
        return {i: (tmp_path / f"node{i}.log").read_text() for i in range(2) if (tmp_path / f"node{i}.log").exists()}

    deadline = time.monotonic() + 300
    while not any("step 1/50" in log for log in logs().values()) and proc.poll() is None:
        assert time.monotonic() < deadline, "".join(log[-3000:] for log in logs().values())
        time.sleep(0.5)
    proc.send_signal(signal.SIGUSR1)  # Slurm, 15 minutes before the time limit
    output = proc.communicate(timeout=300)[0]
    ended = "".join(log[-3000:] for log in logs().values())
    assert "rendezvous on 127.0.0.1:" in output
    info = json.loads((out_dir / "run_info.json").read_text())
    assert info["world_size"] == 2
    (stopped,) = [line for log in logs().values() for line in log.splitlines() if line.startswith("stopped by SIGTERM")]
    step = int(stopped.split()[5].rstrip(":"))  # "stopped by SIGTERM after step 2: saved its checkpoint; ..."
    assert "saved its checkpoint" in stopped and os.listdir(out_dir / "checkpoints") == [f"step_{step}"], ended
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, step + 1))
    assert sum("step 1/50" in log for log in logs().values()) == 1  # one rank 0 in the two "nodes"
    assert proc.returncode != 0 and (tmp_path / "requeued").read_text() == "requeue 4242\n", output + ended
