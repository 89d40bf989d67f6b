"""Stress launches for the rare crash of the weight sync on CPU (gloo heap corruption; lora.full_tensor says why).

Two kinds, each on 2 ranks, each counting the launches that die and the signal that killed them:

    # the fault itself: the weight sync's all-gathers of dim-0 shards (uneven ones too), --inflight at once so
    # that the group's two gloo worker threads finish together; --op old is what DTensor.full_tensor() issues
    # (the functional all-gather), --op new what the sync issues now (lora.all_gather_rows)
    python scripts/stress_sync.py gather --op old --align --launches 3 --seconds 20
    python scripts/stress_sync.py gather --op new --align --launches 3 --seconds 20

    # the video demo (vLLM's CPU build, the tiny random Qwen2.5-VL) looped; without --align slow (the old code
    # died in about 1 of 20 launches of 60 steps); extra trainer overrides follow the kind
    python scripts/stress_sync.py demo trainer.val_freq=0 --align --launches 2 --steps 30

--align preloads scripts/gloo_align.cpp (built with g++ under --work), which makes two gloo worker threads run
the racy store together instead of once in a long while: the old code then dies within seconds. --cores keeps
core dumps (`gdb .venv/bin/python CORE`, `thread apply all bt`). The size knobs are --launches and --seconds
(gather) or --steps (demo). The exit status is the number of failed launches. A gather launch checks every
gathered tensor against the whole one and, with --parity, that lora.full_tensor equals DTensor.full_tensor()
and issues no functional all-gather (tests/test_stress_sync.py runs that)."""

import argparse
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHAPES = [(7, 3), (64, 16), (1, 5), (33,), (16, 8), (5, 2, 3)]  # dim 0 even, uneven, shorter than the ranks


def gather_worker(args) -> None:
    """One rank of a gather launch: gather two tensors of each of SHAPES (two parameters of one shape, as a layer's
    q and k projections), --inflight of them at once, so that the group's two worker threads both always have an
    all-gather to finish, until --seconds are up."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    sys.path.insert(0, str(REPO))
    from grpo import lora

    dist.init_process_group("gloo")
    rank, world, group = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    wholes = [torch.arange(torch.Size(s).numel(), dtype=torch.float32).reshape(s) + k for s in SHAPES for k in (0, 1)]
    shares = [w[rank * -(-len(w) // world) : (rank + 1) * -(-len(w) // world)] for w in wholes]  # Shard(0)'s split
    if args.parity:
        check_parity(wholes, world, lora, funcol)

    def start(i):
        local, n = shares[i], len(wholes[i])
        if args.op == "new":
            return lora.all_gather_rows(local, n, group, async_op=True)
        rows = -(-n // world)
        padded = torch.cat([local, local.new_zeros(rows - len(local), *local.shape[1:])])
        return funcol.all_gather_tensor(padded, 0, group), None  # an AsyncCollectiveTensor, waited in finish

    def finish(i, started):
        out, work = started
        out = out.wait()[: len(wholes[i])] if work is None else (work.wait(), out)[1]
        assert torch.equal(out, wholes[i]), wholes[i].shape

    t0, rounds, go = time.perf_counter(), 0, torch.ones(1)
    while go.item():
        for i in range(0, len(wholes), args.inflight):
            batch = [(j, start(j)) for j in range(i, min(i + args.inflight, len(wholes)))]
            for j, started in batch:
                finish(j, started)
        rounds += 1
        if rounds % 100 == 0:  # every rank stops after the same round (rank 0's clock)
            go.fill_(float(time.perf_counter() - t0 < args.seconds))
            dist.broadcast(go, src=0)
    if rank == 0:
        print(f"gather {args.op}: {rounds} rounds of {len(wholes)} all-gathers in {time.perf_counter() - t0:.0f}s")
    dist.destroy_process_group()


def check_parity(wholes, world, lora, funcol) -> None:
    """lora.full_tensor of Shard(0) DTensors (FSDP2's layout) equals DTensor.full_tensor(), without going through
    the functional collectives; a replicated one comes back whole."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    calls, real = [], {n: getattr(funcol, n) for n in ("all_gather_single", "all_gather_tensor")}  # DTensor's
    for name, fn in real.items():
        setattr(funcol, name, lambda *a, _fn=fn, **k: calls.append(a) or _fn(*a, **k))
    try:
        for w in wholes:
            got = lora.full_tensor(distribute_tensor(w, mesh, [Shard(0)]))
            assert got.shape == w.shape and torch.equal(got, w), w.shape
            assert torch.equal(lora.full_tensor(distribute_tensor(w, mesh, [Replicate()])), w)
    finally:
        for name, fn in real.items():
            setattr(funcol, name, fn)
    assert not calls, f"{len(calls)} functional all-gathers"
    expected = [distribute_tensor(w, mesh, [Shard(0)]).full_tensor() for w in wholes]
    assert all(torch.equal(a, b) for a, b in zip(expected, wholes))
    print(f"parity: lora.full_tensor == DTensor.full_tensor for {len(wholes)} tensors, no functional all-gather")


def demo_assets(work: Path) -> tuple[Path, Path, Path]:
    """The tiny model and the video demo's data (Makefile demo-video), built once under work."""
    sys.path.insert(0, str(REPO))
    from scripts.make_synthetic_data import make_video_count_task
    from scripts.make_tiny_model import build_tiny_model

    model, train, val = work / "tiny_model", work / "train.parquet", work / "val.parquet"
    if not (model / "config.json").exists():
        build_tiny_model(str(model), seed=0)
    if not train.exists():
        make_video_count_task(str(train), 128, 0)
        make_video_count_task(str(val), 32, 1)
    return model, train, val


def build_align(work: Path) -> Path:
    """scripts/gloo_align.cpp built into a preloadable library under work (once)."""
    src, lib = REPO / "scripts" / "gloo_align.cpp", work / "libgloo_align.so"
    if not lib.exists() or lib.stat().st_mtime < src.stat().st_mtime:
        work.mkdir(parents=True, exist_ok=True)
        subprocess.run([os.environ.get("CXX", "g++"), "-O2", "-shared", "-fPIC", "-o", str(lib), str(src), "-ldl"],
                       check=True)  # fmt: skip
    return lib


def launch(cmd: list[str], run_dir: Path, args) -> dict:
    """One torchrun launch: rc, the signals torchrun names for its failed ranks, the output's tail, seconds."""
    run_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if args.align:
        env["LD_PRELOAD"] = str(build_align(args.work))

    def core_limit():
        if args.cores:
            resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))

    t0 = time.perf_counter()
    with open(run_dir / "log", "w") as log:
        try:
            rc = subprocess.run(cmd, cwd=run_dir, env=env, stdout=log, stderr=subprocess.STDOUT,
                                preexec_fn=core_limit, timeout=args.timeout).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            rc = "timeout"
    text = (run_dir / "log").read_text(errors="replace")
    signals = {int(a or b) for a, b in re.findall(r"Signal (\d+) \(SIG\w+\)|exitcode\s*:\s*-(\d+)", text)}
    return {"rc": rc, "signals": sorted(signals), "text": text, "seconds": time.perf_counter() - t0}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kind", choices=["gather", "demo"])
    p.add_argument("--launches", type=int, default=5, help="how many launches (a size knob)")
    p.add_argument("--seconds", type=float, default=30, help="gather: seconds of all-gathers per launch")
    p.add_argument("--op", choices=["old", "new"], default="new", help="gather: the functional all-gather or ours")
    p.add_argument("--inflight", type=int, default=4, help="gather: all-gathers in flight at once (>= 2)")
    p.add_argument("--parity", action="store_true", help="gather: check lora.full_tensor against DTensor first")
    p.add_argument("--steps", type=int, default=60, help="demo: training steps per launch (the demo runs 60)")
    p.add_argument("--work", type=Path, default=REPO / "outputs" / "stress_sync", help="assets and launch logs")
    p.add_argument("--timeout", type=float, default=1800, help="seconds before a launch counts as hung")
    p.add_argument("--align", action="store_true", help="preload scripts/gloo_align.cpp (g++): the race in seconds")
    p.add_argument("--cores", action="store_true", help="keep core dumps of crashed ranks (RLIMIT_CORE)")
    p.add_argument("--keep-going", action="store_true", help="run every launch even after a failure")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # a rank of a gather launch
    p.add_argument("overrides", nargs="*", help="demo: extra trainer overrides, key=value (after the kind)")
    args = p.parse_args()
    if args.worker:
        gather_worker(args)
        from grpo import distributed  # (gather_worker put the repository on the path)

        # gloo's worker threads can still be dropping the last gathers' tensors: an interpreter that finalizes under
        # them aborts ("terminate called without an active exception"), a launch counted as crashed
        distributed.exit_rank(0)
    args.work = args.work.resolve()
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    if args.kind == "demo":
        model, train, val = demo_assets(args.work)
    failed = 0
    for i in range(args.launches):
        run_dir = args.work / f"{args.kind}{i:03d}"
        if args.kind == "gather":
            cmd = [*run, __file__, "gather", "--worker", f"--op={args.op}", f"--seconds={args.seconds}",
                   f"--inflight={args.inflight}"]  # fmt: skip
            cmd += ["--parity"] if args.parity else []
        else:
            cmd = [*run, str(REPO / "train_grpo.py"), str(REPO / "configs/tiny_video.yaml"),
                   f"actor.model_path={model}", f"data.train_files={train}", f"data.val_files={val}",
                   f"trainer.output_dir={run_dir / 'out'}", f"trainer.max_steps={args.steps}", "trainer.save_freq=0",
                   *args.overrides]  # fmt: skip
        r = launch(cmd, run_dir, args)
        ok = r["rc"] == 0
        failed += not ok
        steps = re.findall(r"^step (\d+)/|^(gather \w+: .*|parity: .*)$", r["text"], re.M)
        last = " ".join(s[1] for s in steps if s[1]) or (f"last step {steps[-1][0]}" if steps else "")
        sig = ",".join(map(str, r["signals"])) or "-"
        print(f"{args.kind} launch {i + 1}/{args.launches}: rc {r['rc']} signal {sig} {r['seconds']:.0f}s {last}"
              f"{'' if ok else '  FAILED, log: ' + str(run_dir / 'log')}", flush=True)  # fmt: skip
        if not ok and not args.keep_going:
            break
    print(f"{failed} of {i + 1} {args.kind} launches failed", flush=True)
    return failed


if __name__ == "__main__":
    sys.exit(main())
