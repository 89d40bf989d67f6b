"""The tests' launcher (tests/launch.py): ranks forked by the rank server must see what torchrun's workers see, and a
failed rank must fail the launch, as under torchrun."""

import json
import time

import pytest

from tests.launch import torchrun

# (each line one write: the ranks share the stream, and print() writes the text and its newline apart)
SHOW = """import json, os, sys
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "OMP_NUM_THREADS", "GROUP_RANK")
seen = {"env": {k: os.environ.get(k) for k in keys}, "argv": sys.argv[1:], "cwd": os.getcwd(), "main": __name__,
        "path0": sys.path[0], "port": bool(os.environ.get("MASTER_PORT"))}
sys.stdout.write(json.dumps(seen) + "\\n")
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
sys.stdout.write(json.dumps({"sum": t.item(), "rank": dist.get_rank()}) + "\\n")
dist.destroy_process_group()
"""


def test_forked_ranks_see_what_torchrun_workers_see(tmp_path):
    """Guards against a forked rank that differs from a torchrun worker where the trainer looks: its rank variables,
    arguments, working directory, `__main__`, the script's folder first on sys.path, and a process group that forms."""
    script = tmp_path / "show.py"
    script.write_text(SHOW)
    seen = {}
    for real in (True, False):
        out = torchrun(2, str(script), "a", "b=c", real=real)
        rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        seen[real] = sorted(rows, key=lambda r: json.dumps(r, sort_keys=True))
    assert seen[True] == seen[False]
    assert sorted(r["env"]["RANK"] for r in seen[False] if "env" in r) == ["0", "1"]
    assert [r["sum"] for r in seen[False] if "sum" in r] == [2.0, 2.0]


@pytest.mark.parametrize("real", [True, False], ids=["torchrun", "forked"])
def test_a_failed_rank_fails_the_launch_and_stops_the_others(tmp_path, real):
    """Guards against a launcher that hides a failure or waits for a rank that cannot finish: rank 1 exits with 3 while
    rank 0 sleeps; the launch must fail with rank 1's output, long before rank 0's sleep ends."""
    script = tmp_path / "fail.py"
    script.write_text("import os, sys, time\nif os.environ['RANK'] == '1':\n    print('rank 1 gives up')\n"
                      "    sys.exit(3)\ntime.sleep(300)\n")  # fmt: skip
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match="rank 1 gives up"):
        torchrun(2, str(script), real=real, timeout=120)
    assert time.monotonic() - t0 < 60
