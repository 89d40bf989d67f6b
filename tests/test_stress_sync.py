"""The weight sync's all-gather on CPU, under the stress that crashed it (scripts/stress_sync.py gather)."""

import re
import shutil
import sys

from scripts.stress_sync import build_align
from tests.launch import torchrun


def test_sync_gather_survives_the_gloo_race_and_matches_dtensor(tmp_path, monkeypatch):
    """Guards against the heap corruption of the weight sync on gloo: DTensor.full_tensor() all-gathers as gloo's
    ALLGATHER_COALESCED, and two of those finishing together on the group's two worker threads free one buffer
    twice (lora.full_tensor). The stress keeps 4 of lora.all_gather_rows' gathers in flight for 8 s, with
    scripts/gloo_align.cpp preloaded so that the two worker threads store their op's name at the same instant (the
    old op died within seconds in every launch so, 3 of 3), and checks every gathered tensor; it first checks that
    lora.full_tensor equals DTensor.full_tensor() on Shard(0) layouts (even, uneven, shorter than the ranks) without
    a functional all-gather. Without a C++ compiler the stress runs unaligned (the race then rarely fires)."""
    if shutil.which("g++"):
        monkeypatch.setenv("LD_PRELOAD", str(build_align(tmp_path)))
    out = torchrun(2, "scripts/stress_sync.py", "gather", "--worker", "--op=new", "--seconds=8", "--inflight=4",
                   "--parity", timeout=300)  # fmt: skip
    assert out.count("parity: lora.full_tensor == DTensor.full_tensor for 12 tensors") == 2, out[-2000:]
    rounds = int(re.search(r"gather new: (\d+) rounds", out).group(1))
    assert rounds >= 100, out[-2000:]  # the stress really ran (rounds of 12 all-gathers)
    print(f"{rounds} rounds of 12 all-gathers, 4 in flight", file=sys.stderr)
