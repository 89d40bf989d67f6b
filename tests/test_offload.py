"""The trainer's state off the GPU during rollouts (offload.py) and bf16 master weights (optim.py), on CPU.

On CPU the compute device is the host, so an offload copies the state to fresh host tensors and back: the same code
path as on a GPU minus pinning, which is what these tests exercise (new storage on every move, FSDP2 re-registering
the moved shards, the optimizer's state replaced).
"""

import math
import re
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.tensor import DTensor

from grpo import loading, offload, optim, vllm_memory


def _train_step(model, optimizer, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.text_config.vocab_size, (2, 12), generator=g)
    model(input_ids=ids, use_cache=False).logits.float().logsumexp(-1).mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _locals(model):
    return {n: p.to_local() for n, p in model.named_parameters()}


def _moments(optimizer):
    return [(k, v.to_local()) for s in optimizer.state.values() for k, v in s.items() if k != "step"]


@pytest.mark.parametrize("master_dtype", ["fp32", "bf16"])
def test_offload_round_trip_is_bitwise_and_training_goes_on_as_without(tiny_model_dir, one_rank_group, master_dtype):
    """Guards against an offload that loses or changes state: every parameter shard and AdamW moment must come back
    bitwise, in new storage each way (a no-op move would hide a GPU path that never frees anything), and a step
    after the round trip (the moments brought in for it by the step hooks, and sent out again) must give exactly the
    weights of a twin that never moved. That catches FSDP2 still
    all-gathering from the old shard storage, gradients landing on a stale parameter, or the optimizer updating a
    moment that is no longer the one it reads."""
    cpu = torch.device("cpu")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[master_dtype]
    actor = SimpleNamespace(master_dtype=master_dtype, lr=1e-3, betas=[0.9, 0.999], weight_decay=0.01,
                            lr_warmup_steps=0, offload_params=True, offload_optimizer=True,
                            ref_offload=False)  # fmt: skip
    pair = []
    for _ in range(2):
        torch.manual_seed(0)
        model = loading.load_sharded(tiny_model_dir, cpu, "sdpa", dtype=dtype)
        optimizer, _ = optim.make_optimizer(model, actor)
        _train_step(model, optimizer, seed=1)  # AdamW's moments exist from the first step on
        pair.append((model, optimizer))
    (model, optimizer), (twin, twin_optimizer) = pair
    ref = loading.load_sharded(tiny_model_dir, cpu, "sdpa", dtype=dtype)
    ref.requires_grad_(False)
    before = {**_locals(model), **{f"ref.{n}": t for n, t in _locals(ref).items()}}
    moments = _moments(optimizer)
    assert moments and all(p.dtype == dtype for p in model.parameters())

    mover = offload.TrainerOffload()
    mover.hold(model, ref, optimizer, actor)
    timings = {}
    mover.offload(timings)
    mover.offload(timings)  # a second generate call of the same rollout: nothing more moves
    away = {**_locals(model), **{f"ref.{n}": t for n, t in _locals(ref).items()}}
    for name, t in away.items():
        assert (
            torch.equal(t, before[name]) and t.untyped_storage().data_ptr() != before[name].untyped_storage().data_ptr()
        ), name
    assert all(v.untyped_storage().data_ptr() != old.untyped_storage().data_ptr()
               for (_, old), (_, v) in zip(moments, _moments(optimizer)))  # fmt: skip
    # what the host takes, against the plan's figure (the shards' and moments' exact bytes): the arenas within 10 %;
    # a pinned block per tensor, as torch's allocator rounds it (vllm_memory.pinned_block), far over
    exact = sum(t.nbytes for t in away.values()) + sum(v.nbytes for _, v in moments)
    arenas = sum(arena.block.numel() for arena in [*mover.arenas, mover.moments])
    per_tensor = sum(vllm_memory.pinned_block(t.nbytes) for t in [*away.values(), *(v for _, v in moments)])
    assert exact <= arenas <= 1.1 * exact and per_tensor > 1.1 * exact, (exact, arenas, per_tensor)
    mover.onload(timings)
    assert set(timings) == {"time/offload", "time/onload"}
    back = {**_locals(model), **{f"ref.{n}": t for n, t in _locals(ref).items()}}
    for name, t in back.items():
        assert t.dtype == before[name].dtype and torch.equal(t, before[name]), name
        assert t.untyped_storage().data_ptr() != away[name].untyped_storage().data_ptr(), name
    for (key, old), (_, new) in zip(moments, _moments(optimizer)):
        assert torch.equal(new, old), key  # still in host memory: they come to the device for the step alone

    stored = [(k, v.clone()) for k, v in _moments(optimizer)]
    torch.manual_seed(5)  # the same stochastic rounding draws for both (bf16)
    _train_step(model, optimizer, seed=2)
    # the step hooks brought them in and sent the new ones out again, into the same host arena
    arena = mover.moments.block.untyped_storage().data_ptr()
    assert all(v.untyped_storage().data_ptr() == arena for _, v in _moments(optimizer))
    assert any(not torch.equal(v, old) for (_, old), (_, v) in zip(stored, _moments(optimizer)))
    torch.manual_seed(5)
    _train_step(twin, twin_optimizer, seed=2)
    for (name, p), (_, q) in zip(model.named_parameters(), twin.named_parameters()):
        assert torch.equal(p.to_local(), q.to_local()), name
    assert any(not torch.equal(p.to_local(), before[n]) for n, p in model.named_parameters())  # it did train


def _adamw_fp64(w, g, m, v, step, lr, betas, eps, wd):
    """One AdamW step (torch.optim.AdamW's update) in fp64 from the given state: the exact results to compare with,
    each with the sum of the magnitudes of the terms it adds up (where fp32 rounds them)."""
    b1, b2 = betas
    new_m, new_v = m * b1 + (1 - b1) * g, v * b2 + (1 - b2) * g * g
    denom = (new_v.sqrt() / math.sqrt(1 - b2**step)) + eps
    update = lr / (1 - b1**step) * new_m / denom
    return [
        (w * (1 - lr * wd) - update, w.abs() + update.abs()),
        (new_m, (m * b1).abs() + ((1 - b1) * g).abs()),
        (new_v, new_v),
    ]


def _ulp_bf16(x):
    """One bf16 step at |x|: 2^(floor(log2 |x|) - 7) (the smallest normal's for x = 0)."""
    e = torch.floor(torch.log2(x.abs().clamp_min(torch.finfo(torch.bfloat16).tiny)))
    return torch.exp2(e - 7)


def test_bf16_adamw_step_within_one_bf16_ulp_of_fp64_adamw():
    """Guards against a bf16 AdamW whose arithmetic differs from AdamW's (bias correction, decoupled weight decay,
    eps placement) or that rounds more than once: over 5 steps with changing gradients, each step's weights and
    moments must be within the bound optim.py states of an fp64 AdamW run from the same bf16 state on the same
    gradients: one bf16 ulp of the exact value, plus fp32's rounding of the terms summed (2^-22 of their magnitudes;
    it matters only where they cancel to near 0)."""
    torch.manual_seed(0)
    p = torch.nn.Parameter((torch.randn(4096) * 0.05).to(torch.bfloat16))
    lr, betas, eps, wd = 1e-3, (0.9, 0.999), 1e-8, 0.01
    opt = optim.AdamWBF16([p], lr=lr, betas=betas, weight_decay=wd)
    for step in range(1, 6):
        g = torch.randn(4096).to(torch.bfloat16) * 0.1
        state = opt.state.get(p, {})
        m0 = state["exp_avg"].double() if state else torch.zeros(4096, dtype=torch.float64)
        v0 = state["exp_avg_sq"].double() if state else torch.zeros(4096, dtype=torch.float64)
        wanted = _adamw_fp64(p.detach().double(), g.double(), m0, v0, step, lr, betas, eps, wd)
        p.grad = g
        opt.step()
        got = (p.detach(), opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"])
        for name, x, (want, terms) in zip(("weights", "exp_avg", "exp_avg_sq"), got, wanted):
            assert x.dtype == torch.bfloat16
            assert ((x.double() - want).abs() <= _ulp_bf16(want) + 2**-22 * terms).all(), (step, name)
    assert opt.state[p]["step"].item() == 5


def test_bf16_stochastic_rounding_keeps_updates_far_below_one_ulp():
    """Guards against the failure bf16 masters are known for: an lr 1e-6-sized update is 1/256 of a bf16 step at
    weights near 1, so round-to-nearest drops it every time and training silently stops. With stochastic rounding the
    mean change over many weights must be the exact fp32 change (here 10 steps of lr 1e-5 with constant gradients,
    m_hat / sqrt(v_hat) = 1: -1e-4 in all), within 5 standard errors of the rounding noise."""
    torch.manual_seed(0)
    n, lr, steps = 1 << 20, 1e-5, 10
    p = torch.nn.Parameter(torch.ones(n, dtype=torch.bfloat16))
    opt = optim.AdamWBF16([p], lr=lr, betas=(0.9, 0.999), weight_decay=0.0)
    for _ in range(steps):
        p.grad = torch.ones(n, dtype=torch.bfloat16)
        opt.step()
    change = p.detach().double().mean().item() - 1.0
    nearest = (torch.ones(n) - lr * steps).to(torch.bfloat16).double().mean().item() - 1.0
    assert nearest == 0.0  # what plain bf16 rounding keeps of it
    # each weight ends on the bf16 grid below 1 (step 2^-8); the mean's standard error is at most 2^-8 / sqrt(n) x
    # sqrt(steps) (each step's rounding independent and within one step)
    stderr = 2**-8 * math.sqrt(steps / n)
    assert abs(change - (-lr * steps)) <= 5 * stderr, change


def test_stochastic_rounding_is_exact_on_bf16_values_and_brackets_others():
    """Guards against a rounding that moves values bf16 holds exactly, or lands outside the two neighbours."""
    torch.manual_seed(0)
    exact = torch.randn(1000).to(torch.bfloat16).float()
    assert torch.equal(optim.stochastic_round_bf16(exact).float(), exact)
    x = torch.randn(100_000)
    r = optim.stochastic_round_bf16(x).double()
    down = x.to(torch.bfloat16).double()  # nearest; the other neighbour is one ulp away on the other side
    assert ((r - x.double()).abs() < _ulp_bf16(x.double()) * 1.0001).all()
    assert (r != down).any() and (r == down).any()


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["actor.master_dtype=fp16"], "actor.master_dtype='fp16'; valid: fp32, bf16"),
        (["actor.master_dtype=bf16", "actor.lora_rank=8"], "actor.master_dtype=bf16 is for full fine-tuning"),
        (["rollout.engine=hf", "actor.offload_params=true"], "actor.offload_params needs rollout.engine=vllm"),
    ],
)
def test_precision_and_offload_config_errors_stop_before_loading(overrides, message):
    """Guards against a master dtype the optimizer cannot hold, bf16 adapters, or the HF engine generating from
    parameters that were moved to host memory, reaching the loaders instead of failing at start naming the key."""
    import train_grpo

    cfg = train_grpo.load_config("configs/tiny.yaml", overrides)
    with pytest.raises(train_grpo.ConfigError, match=re.escape(message)):
        train_grpo.check_config(cfg, 2)


@pytest.fixture
def rank_1_of_2():
    """This process as rank 1 of 2 on torch's fake backend (collectives do nothing): FSDP2 gives it the short last
    chunk of a parameter whose rows do not split evenly, as a real rank would get, without a second process."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=1, world_size=2, store=FakeStore())
    yield
    dist.destroy_process_group()


def _uneven_model():
    """Units whose parameters split unevenly over 2 ranks: 7 rows (rank 1 holds 3 of a padded 4), 3 rows (1 of 2),
    1 row (none of 1), besides an even one."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 7), torch.nn.Linear(7, 3), torch.nn.Linear(3, 1),
                                torch.nn.Linear(1, 4))  # fmt: skip
    for layer in model:
        fully_shard(layer)
    return fully_shard(model)


class InFlightCopies:
    """A stand-in for a CUDA stream's device-to-host copies: `moved` returns its copy with the rows not yet
    written (NaN), as a non_blocking copy's destination is until the stream gets there, and `wait_for_copies` lands
    them, as the stream's synchronize does. FSDP2's reset_sharded_param is watched for what it reads on the host."""

    def __init__(self, monkeypatch):
        from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

        self.pending, self.in_flight_at_reset = [], []
        real_moved, real_reset = offload.moved, FSDPParam.reset_sharded_param

        def moved(t, device, out=None):
            copy = real_moved(t, device, out)
            if not isinstance(copy, DTensor):  # (a DTensor's shard comes through here as a plain tensor)
                self.pending.append((copy, copy.clone()))
                copy.fill_(float("nan"))
            return copy

        def reset(param):
            self.in_flight_at_reset.append(len(self.pending))
            return real_reset(param)

        monkeypatch.setattr(offload, "moved", moved)
        monkeypatch.setattr(offload, "wait_for_copies", self.land)
        monkeypatch.setattr(FSDPParam, "reset_sharded_param", reset)

    def land(self):
        for dst, value in self.pending:
            dst.copy_(value)
        self.pending.clear()


def test_uneven_shards_survive_offload_round_trips_with_copies_in_flight(rank_1_of_2, monkeypatch):
    """Guards against handing FSDP2 a shard whose copy is still in flight: FSDPModule._apply re-pads a shard shorter
    than its padded size by reading it on the host (torch 2.11-2.14 reset_sharded_param), so a move that lets it do
    so before the copies land re-pads rows not yet written, silently (Qwen2.5-VL's vision MLP, 3,420 rows over 8
    ranks). With copies that land only when the host waits for them, no reset may run while one is in flight, and
    three round trips must give every shard back bit for bit, in the padded layout FSDP2 all-gathers from."""
    model = _uneven_model()
    before = {n: p.to_local().clone() for n, p in model.named_parameters()}
    assert {n: t.shape[0] for n, t in before.items() if n.endswith("weight")} == {
        "0.weight": 3, "1.weight": 1, "2.weight": 0, "3.weight": 2}  # fmt: skip
    copies = InFlightCopies(monkeypatch)
    arena = offload.HostArena(pin=False)
    for _ in range(3):
        offload.move_parameters(model, torch.device("cpu"), arena)
        offload.move_parameters(model, torch.device("cpu"))
        copies.land()  # (whatever the stream still held by now)
    assert copies.in_flight_at_reset and not any(copies.in_flight_at_reset)
    for name, p in model.named_parameters():
        assert torch.equal(p.to_local(), before[name]), name
    for unit in model:  # the padded storage FSDP2 all-gathers from holds the same rows, then the padding's zeros
        for fsdp_param in unit._get_fsdp_state()._fsdp_param_groups[0].fsdp_params:
            rows = fsdp_param.sharded_param.to_local().shape[0]
            padded = fsdp_param._sharded_param_data.view(fsdp_param.padded_sharded_param_size)
            assert torch.equal(padded[:rows], fsdp_param.sharded_param.to_local())
            assert not padded[rows:].any()


def test_host_arena_takes_its_exact_size_and_reuses_it():
    """Guards against host memory per tensor (torch's pinned allocator rounds each block to a power of two: 1.5x on
    average, 2x at worst): an arena is one block of the tensors' bytes, each slice aligned, reused when the same
    shapes come again and replaced when they change."""
    arena = offload.HostArena(pin=False)
    tensors = [torch.randn(3, 5), torch.zeros(0), torch.randn(7, dtype=torch.float64).to(torch.bfloat16)]
    views = arena.views(tensors)
    assert [(v.shape, v.dtype) for v in views] == [(t.shape, t.dtype) for t in tensors]
    assert arena.block.numel() == offload.HostArena.bytes_for([60, 0, 14]) == 2 * offload.ALIGN
    assert all(v.data_ptr() % offload.ALIGN == 0 for v in views if v.numel())
    block = arena.block.data_ptr()
    assert arena.views(tensors)[0].data_ptr() == block  # the same shapes: the same block
    assert arena.views(tensors[:1])[0].numel() == 15 and arena.block.numel() == offload.ALIGN


class RuntimeStandIn:
    """torch.cuda.cudart()'s two calls an arena makes, with the binding's signature (torch 2.11-2.14:
    cudaHostRegister(ptr, size, flags) and cudaHostUnregister(ptr), each returning a cudaError, 0 for success), and
    the driver's rule that a range is registered once and unregistered by the pointer it was registered at."""

    def __init__(self):
        self.registered, self.calls = {}, []

    def cudaHostRegister(self, ptr, size, flags):  # noqa: N802 (the CUDA runtime's name)
        self.calls.append(("register", ptr, size, flags))
        overlaps = any(p < ptr + size and ptr < p + n for p, n in self.registered.items())
        if overlaps or ptr % 4096:
            return 712  # cudaErrorHostMemoryAlreadyRegistered (a misaligned range: also refused here)
        self.registered[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr):  # noqa: N802
        self.calls.append(("unregister", ptr))
        return 0 if self.registered.pop(ptr, None) is not None else 713  # cudaErrorHostMemoryNotRegistered


def test_a_pinned_arena_registers_its_block_once_and_unregisters_it_before_it_goes(monkeypatch):
    """Guards against the CUDA-only branch of HostArena: the block pinned at its exact size from a page boundary (the
    driver locks whole pages), registered once while the same shapes come again, unregistered by the same pointer
    before a new layout's block is pinned or when released (a block freed while registered, or registered twice,
    is a CUDA error), and an empty arena not registered at all."""
    cudart = RuntimeStandIn()

    def check_error(res):
        if res != 0:
            raise RuntimeError(f"CUDA error {res}")

    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(torch.cuda, "check_error", check_error)
    arena = offload.HostArena(pin=True)
    tensors = [torch.randn(3, 5), torch.randn(40, dtype=torch.float64)]
    arena.views(tensors)
    arena.views(tensors)  # the same shapes: nothing registered again
    first = arena.block.data_ptr()
    total = offload.HostArena.bytes_for([60, 320])
    assert cudart.calls == [("register", first, total, 0)] and first % offload.PAGE == 0
    arena.views(tensors[:1])  # a new layout: the old block unregistered first
    assert cudart.calls[1] == ("unregister", first) and cudart.calls[2][0] == "register"
    arena.release()
    assert cudart.registered == {} and arena.block is None
    arena.views([torch.zeros(0)])  # nothing to pin
    assert cudart.calls[-1][0] == "unregister" and arena.block.numel() == 0
    arena.release()
    assert cudart.registered == {}
