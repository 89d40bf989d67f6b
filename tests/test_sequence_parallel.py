"""The pieces of sequence parallelism (grpo/sequence_parallel.py) against one-rank references: the cut of a packed
row's positions and layout, the head's rows, the items' owners, and, on 2 gloo ranks, the all-to-all, the gathers
and Ulysses attention with their gradients. The whole step's parity is in test_train.py."""

import pytest
import torch
import torch.distributed as dist

from grpo import sequence_parallel as sp_mod
from grpo.attention import PackedLayout, sdpa_packed
from tests.launch import spawn_ranks


def test_cut_positions_and_layout_pad_to_the_group():
    """Guards against a cut that loses or shifts tokens: the slices of the (4, 1, L) positions, padded to a multiple
    of the group, put back together are the positions then zeros; the padding is a segment of its own, so the
    packing bounds (cu_seqlens) of the real sequences stay as they were."""
    positions = torch.arange(4 * 7).view(4, 1, 7)  # (4, 1, L), L = 7
    slices = [sp_mod.cut_positions(positions, 2, r) for r in range(2)]
    assert [s.shape[-1] for s in slices] == [4, 4]
    whole = torch.cat(slices, -1)
    assert torch.equal(whole[..., :7], positions) and not whole[..., 7:].any()
    layout = PackedLayout([(0, 3, 0, 0), (3, 5, 0, 3), (5, 7, 0, 3)], 7, "cpu")  # a prompt and two answers
    split = sp_mod.split_layout(layout, 2)
    assert split.length == 8 and split.segments == [*layout.segments, (7, 8, 0, 0)]
    _, cu_q, cu_k, _, _ = split.varlen_args()
    assert cu_q.tolist() == [*layout.varlen_args()[1].tolist(), 8]
    assert cu_k.tolist() == [*layout.varlen_args()[2].tolist(), layout.varlen_args()[2][-1].item() + 1]
    assert sp_mod.split_layout(PackedLayout.sequences([4, 4], "cpu"), 2).segments == [(0, 4, 0, 0), (4, 8, 0, 0)]


def test_head_rows_put_the_group_rows_back_in_order():
    """Guards against log-probs landing on the wrong tokens: each rank's rows of `keep` (not sorted: a group's second
    answer is predicted from its prompt's last position again), gathered in rank order and permuted back, are keep's
    rows in keep's order."""
    keep = torch.tensor([2, 5, 6, 2, 7, 3, 9])  # row positions of a length-10 row
    values = keep * 10  # what the head gives at each position
    gathered, local = [], []
    for rank in range(2):
        group = type("SP", (), {"size": 2, "rank": rank})()
        positions, mine, back, counts = sp_mod.head_rows(keep, 10, group)
        assert (positions + rank * 5).tolist() == keep[mine].tolist() and all(0 <= p < 5 for p in positions)
        gathered.append(values[mine])
        local.append(counts)
    assert local[0] == local[1] == [3, 4]
    assert torch.equal(torch.cat(gathered)[back], values)


def test_cut_items_balances_patches_and_cuts_clips_between_temporal_patches():
    """Guards against one rank encoding most of the pixels (one long clip whole on one rank, as when the tower was
    split by item), a rank's pieces not being one contiguous run in the forward's order, and a cut inside a temporal
    patch (an image is one: it stays whole)."""
    images = [[1, 4, 4], [1, 4, 4], [1, 8, 8], [1, 4, 4], [1, 4, 4], [1, 4, 4], [1, 4, 4]]  # (t, h, w)
    pieces = sp_mod.cut_items(images, 2)
    assert pieces == [[(0, 0, 1), (1, 0, 1), (2, 0, 1)], [(i, 0, 1) for i in range(3, 7)]]  # 96 and 64 patches
    assert sp_mod.cut_items([[8, 4, 4]], 2) == [[(0, 0, 4)], [(0, 4, 4)]]  # one clip: half its temporal patches each
    assert sp_mod.cut_items([[8, 4, 4]], 4) == [[(0, 2 * r, 2)] for r in range(4)]
    # an image of 64 patches, then a clip of 6 x 16: the clip's first temporal patch on rank 0 with the image
    assert sp_mod.cut_items([[1, 8, 8], [6, 4, 4]], 2) == [[(0, 0, 1), (1, 0, 1)], [(1, 1, 5)]]
    assert sp_mod.cut_items([[1, 4, 4]], 2) == [[], [(0, 0, 1)]]  # one image: one rank encodes it, one the blank
    assert sp_mod.cut_items([[3, 4, 4]], 4) == [[(0, 0, 1)], [], [(0, 1, 1)], [(0, 2, 1)]]  # fewer than the ranks


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "qwen3_5"])
def test_a_clip_cut_between_temporal_patches_encodes_as_whole(tiny_family_dir, family):
    """Guards against the cut of a clip over a group changing its embeddings: each family's tower (Qwen2.5-VL's
    windowed and full-attention blocks, with windows that do not tile the frame; Qwen3-VL's interpolated position
    embeddings and deepstack mergers; Qwen3.5's) bounds attention, rotary and learned positions within a temporal
    patch, so an image and a clip encoded in pieces under their own grid rows (t', h, w), as cut_items cuts them over
    3 ranks, concatenate to the whole forward's encoding."""
    from grpo import loading

    model = loading.load_model(tiny_family_dir(family), torch.device("cpu"), "sdpa")
    inner, vision = model.model, model.config.vision_config
    grids = [[1, 6, 4], [5, 12, 20]]  # an image, then a clip of 5 temporal patches of 12 x 20 patches
    patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), patch_dim, generator=torch.Generator().manual_seed(0))

    def encode(rows, grid):  # (tokens, H x (1 + deepstack layers)): what encode_split gathers
        out = type(inner).get_image_features(inner, pixels[rows], torch.tensor(grid), return_dict=True)
        deep = getattr(out, "deepstack_features", None) or []
        return torch.cat([torch.cat(out.pooler_output), *(torch.cat(f) for f in deep)], -1)

    with torch.no_grad():
        whole = encode(slice(None), grids)
        pieces = sp_mod.cut_items(grids, 3)
        assert len({(i, t0) for part in pieces for i, t0, _ in part}) == 4  # the clip in 3 pieces
        parts, at = [], 0
        for part in pieces:
            n = sum(t * grids[i][1] * grids[i][2] for i, _, t in part)
            parts.append(encode(slice(at, at + n), [[t, *grids[i][1:]] for i, _, t in part]))
            at += n
    assert whole.shape[-1] == 128 * (3 if family == "qwen3_vl" else 1)  # (the deepstack layers' features too)
    torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-5, atol=1e-5)


def test_kv_repeats_only_as_far_as_the_group_needs():
    """Guards against key/value heads repeated beyond what gives each rank whole heads for its query heads (all the
    way up to the query heads: Qwen3-VL-30B-A3B's 4 at 8 ranks sent as 32), or not far enough (a rank without a
    whole head)."""
    assert [sp_mod.kv_repeats(4, k) for k in (1, 2, 4, 8)] == [1, 1, 1, 2]
    assert [sp_mod.kv_repeats(1, k) for k in (2, 4)] == [2, 4]
    assert sp_mod.kv_repeats(2, 4) == 2 and sp_mod.kv_repeats(4, 6) == 3 and sp_mod.kv_repeats(6, 4) == 2


def _all_to_all_and_gathers(rank):
    group = dist.group.WORLD
    g = torch.Generator().manual_seed(0)
    x_all = torch.randn(1, 4, 6, 3, generator=g)  # (1, heads, L, D): the whole sequence
    w = torch.randn(1, 4, 6, 3, generator=g)
    x = x_all[:, :, rank * 3 : (rank + 1) * 3].clone().requires_grad_()  # this rank's tokens, every head
    heads = sp_mod.all_to_all(x, 1, 2, group)  # (1, 2, 6, 3): this rank's heads, every token
    assert torch.equal(heads, x_all[:, rank * 2 : (rank + 1) * 2])
    assert torch.equal(sp_mod.all_to_all(heads, 2, 1, group), x)  # and back
    (heads * w[:, rank * 2 : (rank + 1) * 2]).sum().backward()
    # the one-rank loss is (x_all * w).sum(): its gradient at this rank's tokens is w there
    assert torch.equal(x.grad, w[:, :, rank * 3 : (rank + 1) * 3])

    # gathers of uneven rows: the vision embeddings (gradients summed, each rank keeps its own) and the head's rows
    counts = [2, 3]
    rows = torch.arange(5.0)[:, None].repeat(1, 2)  # (5, 2)
    mine = rows[sum(counts[:rank]) : sum(counts[: rank + 1])].clone().requires_grad_()
    for sum_grads in (True, False):
        mine.grad = None
        out = sp_mod.gather_rows(mine, counts, group, sum_grads)
        assert torch.equal(out, rows)
        scale = torch.tensor([1.0, 2.0])[rank]  # each rank's loss weighs the rows differently
        (out * scale).sum().backward()
        want = 3.0 if sum_grads else scale.item()  # summed over the group, or this rank's own
        assert torch.equal(mine.grad, torch.full_like(mine, want))
    empty = torch.zeros(0, 2, requires_grad=True) if rank == 1 else rows[:5].clone().requires_grad_()
    out = sp_mod.gather_rows(empty, [5, 0], group, True)  # a rank with no rows still joins, and gets its (empty) grad
    out.sum().backward()
    assert out.shape == (5, 2) and empty.grad.shape == empty.shape


class _Attention(torch.nn.Module):
    is_causal = True

    def __init__(self, groups):
        super().__init__()
        self.num_key_value_groups = groups


def _ulysses(kind, rank):
    from grpo import attention
    from tests.test_varlen import reference_varlen

    attention.varlen_kernel = reference_varlen  # the CUDA path's kernel, as a CPU reference (this process only)
    fn = getattr(attention, kind)
    g = torch.Generator().manual_seed(1)
    length, d = 7, 4
    layout = PackedLayout([(0, 3, 0, 0), (3, 5, 0, 3), (5, 7, 0, 3)], length, "cpu")  # a prompt, two answers
    exchange, sent = sp_mod.all_to_all, []  # the heads each all-to-all sends, recorded (this process only)
    sp_mod.all_to_all = lambda x, *args: sent.append(x.shape[1]) or exchange(x, *args)
    # key/value heads the group does not divide (repeated: up to the query heads, then only half as far), ones it does
    for hq, hkv, kv_sent in ((2, 1, 2), (4, 1, 2), (4, 2, 2)):
        module = _Attention(hq // hkv)
        sent.clear()
        q_all = torch.randn(1, hq, length, d, generator=g)
        k_all, v_all = torch.randn(2, 1, hkv, length, d, generator=g)
        w = torch.randn(1, length, hq, d, generator=g)
        leaves = [t.clone().requires_grad_() for t in (q_all, k_all, v_all)]
        ref, _ = sdpa_packed(module, *leaves, None, packed_layout=layout, scaling=d**-0.5)  # (1, L, Hq, D)
        (ref * w).sum().backward()

        split = sp_mod.split_layout(layout, 2)
        split.sequence_parallel = sp_mod.SequenceParallel.__new__(sp_mod.SequenceParallel)
        split.sequence_parallel.size, split.sequence_parallel.rank = 2, rank
        split.sequence_parallel.group = dist.group.WORLD
        start, end = rank * 4, (rank + 1) * 4
        pad = lambda t: torch.cat([t, t.new_zeros(1, t.shape[1], 1, d)], 2)  # noqa: E731  (L 7 -> 8)
        mine = [pad(t)[:, :, start:end].detach().requires_grad_() for t in (q_all, k_all, v_all)]
        out, _ = sp_mod.ulysses_attention(fn, module, *mine, None, packed_layout=split, scaling=d**-0.5)
        assert module.num_key_value_groups == hq // hkv  # restored
        assert sent[:3] == [hq, kv_sent, kv_sent] and kv_sent == hkv * sp_mod.kv_repeats(hkv, 2)
        real = min(end, length) - start
        torch.testing.assert_close(out[:, :real], ref[:, start : start + real])
        (out[:, :real] * w[:, start : start + real]).sum().backward()
        # the one-rank gradients at this rank's tokens (the padding's own gradient is its business)
        for leaf, part in zip(leaves, mine):
            total = [torch.empty_like(part.grad) for _ in range(2)]
            dist.all_gather(total, part.grad.contiguous())
            whole = torch.cat(total, 2)[:, :, :length]
            torch.testing.assert_close(whole, leaf.grad)
    sp_mod.all_to_all = exchange


def _collectives(rank):
    _all_to_all_and_gathers(rank)
    for kind in ("sdpa_packed", "varlen_packed"):
        _ulysses(kind, rank)


def test_collectives_and_ulysses_attention_match_one_rank():
    """Guards against the exchanges losing or misplacing values or gradients, on 2 gloo ranks (one launch: a rank's
    start costs more than its checks). The all-to-all's round trip is the identity and its backward gives each rank
    the one-rank gradient at its tokens; the vision gather's backward sums the group's gradients, the head gather's
    keeps each rank's own. Ulysses attention, each rank with half of a packed row of a prompt and its two answers
    (shared prefix, padded to even), gives the output and query, key and value gradients of one rank's sdpa_packed,
    for grouped key/value heads fewer than the group (repeated) and as many, around the CPU attention and around the
    CUDA one (its varlen kernel swapped for a CPU reference); key/value heads repeated only as far as each rank needs
    whole ones (one head for 4 query heads: 2 copies, not 4)."""
    spawn_ranks(_collectives)


@pytest.mark.parametrize("size,world", [(3, 4), (0, 2)])
def test_config_refuses_a_group_that_does_not_divide_the_ranks(size, world):
    """Guards against groups that would straddle ranks, or none at all."""
    from train_grpo import ConfigError, check_config, load_config

    cfg = load_config(None, [f"actor.sequence_parallel_size={size}", "rollout.engine=hf"])
    with pytest.raises(ConfigError, match="actor.sequence_parallel_size"):
        check_config(cfg, world)


def test_a_group_that_does_not_divide_the_heads_stops_before_anything_loads(tiny_model_dir, monkeypatch, capsys):
    """Guards against a group size that cannot cut the attention heads passing the checks and stopping at the first
    training forward, after the load and a rollout: the dry run and the run both stop at the config, naming the key
    and the model's heads (the tiny model's 2); a size that divides them goes on (here to the data's check)."""
    from train_grpo import main

    args = ["configs/tiny.yaml", f"actor.model_path={tiny_model_dir}", "trainer.n_gpus_per_node=4",
            "data.train_files=configs", "data.val_files="]  # fmt: skip
    said = "actor.sequence_parallel_size=4 must divide the attention heads (Ulysses gives each rank of a group whole "
    said += f"heads): actor.model_path={tiny_model_dir!r} has 2 query heads"
    assert main([*args, "actor.sequence_parallel_size=4", "--dry-run"]) == 2
    assert said in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "4")  # as torchrun sets it: the run stops before its process group
    assert main([*args, "actor.sequence_parallel_size=4"]) == 2
    assert said in capsys.readouterr().err
    assert main([*args, "actor.sequence_parallel_size=2"]) == 2
    assert "config error: data.train_files" in capsys.readouterr().err
