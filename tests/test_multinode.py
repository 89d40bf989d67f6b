"""Multi-node launch: the Slurm script's torchrun rendezvous, with two local "nodes" on this machine."""

import json
import os
import stat
import subprocess
import sys

from tests.launch import REPO, free_port

# Stand-ins for Slurm's commands: srun starts its command once per "node" (all here, at the same time) and fails
# when one of them fails; scontrol names the nodes, the first being this machine's loopback address.
FAKE_SRUN = """#!/bin/bash
while [[ "$1" == -* ]]; do shift; done
pids=()
for i in $(seq 0 $((SLURM_NNODES - 1))); do
    SLURM_NODEID=$i "$@" > "$FAKE_LOG_DIR/node$i.log" 2>&1 &
    pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
exit $rc
"""
FAKE_SCONTROL = """#!/bin/bash
printf '127.0.0.1\\nlocalhost\\n'
"""


def test_sbatch_scripts_are_valid_bash():
    """Guards against a syntax error that would only show once a job has waited in the queue."""
    for name in ("train_1node.sbatch", "train_multinode.sbatch"):
        subprocess.run(["bash", "-n", os.path.join(REPO, "scripts", name)], check=True)


def test_two_node_rendezvous_run_finishes(tiny_model_dir, tmp_path):
    """Guards against a multi-node launch that hangs or fails at the rendezvous: the multi-node sbatch script,
    under a fake srun, starts two torchrun "nodes" of one rank each that meet at a c10d rendezvous and train."""
    from scripts.make_synthetic_data import make_geo3k_like

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
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
        f"trainer.output_dir={out_dir}", "trainer.max_steps=2", "data.rollout_batch_size=4",
        "actor.global_batch_size=4", "actor.micro_batch_size=8", "rollout.n=4",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    logs = {i: (tmp_path / f"node{i}.log").read_text() for i in range(2) if (tmp_path / f"node{i}.log").exists()}
    assert proc.returncode == 0, proc.stdout + proc.stderr + "".join(v[-3000:] for v in logs.values())
    assert "rendezvous on 127.0.0.1:" in proc.stdout
    info = json.loads((out_dir / "run_info.json").read_text())
    assert info["world_size"] == 2
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert sum("step 2/2" in log for log in logs.values()) == 1  # one rank 0 in the two "nodes"
