"""Video prompts: frame lists and video files through the data path, the processor, packing, shared prefixes and the
vision tower's one pass per forward, in every model family (tiny random models, tiny videos built here)."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import rollout
from data import PromptDataset
from grpo import attention, batching, loading, logprobs, video

FAMILIES = ["qwen2_5_vl", "qwen3_vl", "qwen3_5"]
BUDGET = dict(video_fps=2.0, max_frames=8, video_min_pixels=3136, video_max_pixels=12544)


def _frames(n, size=(90, 70), seed=0):
    """n frames of noise: every frame differs, so a frame lost, repeated or misplaced changes the log-probs."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    return [Image.fromarray(torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8).numpy())
            for _ in range(n)]  # fmt: skip


def _write_video(path, frames, fps):
    """A lossless video file (PNG frames in AVI), so decoding gives back exactly the frames written."""
    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream("png", rate=fps)
        stream.width, stream.height = frames[0].size
        stream.pix_fmt = "rgb24"
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_image(frame)):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return str(path)


def _video(processor, frames):
    side = processor.video_processor.patch_size * processor.video_processor.merge_size
    b = BUDGET
    return video.load_video(frames, b["video_fps"], b["max_frames"], b["video_min_pixels"], b["video_max_pixels"], side)


def _prompt(processor, text, images=(), videos=()):
    """A Prompt as the trainer encodes it: images and videos before the text, as the data path prepends marks."""
    from types import SimpleNamespace

    content = (
        [{"type": "image"} for _ in images] + [{"type": "video"} for _ in videos] + [{"type": "text", "text": text}]
    )
    prompt = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    return rollout.encode_prompt(processor, SimpleNamespace(prompt=prompt, images=list(images), videos=list(videos)))


def _video_batch(processor):
    """Five prompts -- video only (two frame counts, one odd), image and video, image only, text only -- and responses
    of uneven lengths."""
    from PIL import Image

    video.set_video_range(processor, BUDGET["video_min_pixels"], BUDGET["video_max_pixels"], BUDGET["max_frames"])
    image = Image.new("RGB", (84, 56), "white")
    prompts = [
        _prompt(processor, "How many frames? " * 2, videos=[_video(processor, _frames(4, seed=1))]),
        _prompt(processor, "Which colour?", images=[image], videos=[_video(processor, _frames(5, (70, 110), seed=2))]),
        _prompt(processor, "Find x. " * 3, images=[image]),
        _prompt(processor, "Text only."),
        _prompt(processor, "Again", videos=[_video(processor, _frames(3, seed=3))]),
    ]
    g = torch.Generator().manual_seed(0)
    responses = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (9, 2, 14, 5, 6)]
    return prompts, responses


def _processor(tiny_family_dir, family):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(tiny_family_dir(family))


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", FAMILIES)
def test_video_token_count_equals_the_processors(tiny_family_dir, family):
    """Guards against a prompt length computed wrong for videos (the overlong filter and the token budgets rely on
    it): Qwen2.5-VL's pads alone, and Qwen3-VL's and Qwen3.5's per-frame-pair timestamps written as text, for frame
    counts even and odd (an odd count gets its last frame repeated)."""
    processor = _processor(tiny_family_dir, family)
    video.set_video_range(processor, BUDGET["video_min_pixels"], BUDGET["video_max_pixels"], BUDGET["max_frames"])
    for n, size in ((2, (90, 70)), (5, (70, 110)), (12, (300, 40))):
        clip = _video(processor, _frames(n, size))
        assert len(clip.frames) % 2 == 0 and len({f.size for f in clip.frames}) == 1
        w, h = clip.frames[0].size
        assert BUDGET["video_min_pixels"] <= w * h <= BUDGET["video_max_pixels"], (w, h)
        text = "<|vision_start|><|video_pad|><|vision_end|>"
        out = processor(text=[text], videos=[clip.frames], video_metadata=[clip.metadata()], return_tensors="pt")
        grid = video.video_grid(processor.video_processor, len(clip.frames), w, h)
        assert out["video_grid_thw"][0].tolist() == grid  # the processor resized nothing
        assert out["input_ids"].shape[1] == 2 + video.video_token_count(processor, clip), (family, n, size)
        if "second_per_grid_ts" in out:  # a pair of frames at 2 fps is a second, a repeated last frame included;
            # 12 frames (6 s) thinned to max_frames 8 are 8 over 6 s
            fps = min(n, BUDGET["max_frames"]) / n * BUDGET["video_fps"]
            torch.testing.assert_close(out["second_per_grid_ts"], torch.tensor([2 / fps]))


def test_dataset_reads_frame_lists_and_files_and_skips_bad_videos(tiny_family_dir, tmp_path):
    """Guards against video rows read wrong: marks prepended when missing (one per video, after the images' marks),
    a video file decoded into exactly the frames a frame list of the same frames gives (lossless file), sampled at
    data.video_fps from a faster file, and bad videos (undecodable, no frames, more videos than marks) skipped and
    counted instead of crashing a run."""
    processor = _processor(tiny_family_dir, "qwen2_5_vl")
    frames = _frames(8, (64, 48))
    io_frames = []
    for f in frames:
        import io

        buf = io.BytesIO()
        f.save(buf, format="PNG")
        io_frames.append({"bytes": buf.getvalue(), "path": None})
    at_2fps = _write_video(tmp_path / "a.avi", frames, 2)
    at_6fps = _write_video(tmp_path / "b.avi", [f for f in frames for _ in range(3)], 6)  # each frame 3 times
    (tmp_path / "broken.mp4").write_bytes(b"not a video")
    # frame lists in parquet (frames as image structs), file paths in JSON lines: one column holds one kind
    pq.write_table(pa.Table.from_pylist([{"problem": "How many?", "answer": "1", "videos": [io_frames]}]),
                   tmp_path / "frames.parquet")  # fmt: skip
    rows = [
        {"problem": "How many?", "answer": "2", "videos": ["a.avi"]},
        {"problem": "How many?", "answer": "3", "videos": ["b.avi"]},
        {"problem": "<video> and <video>?", "answer": "4", "videos": ["a.avi"]},  # mark/video mismatch
        {"problem": "How many?", "answer": "5", "videos": ["broken.mp4"]},  # undecodable
        {"problem": "How many?", "answer": "6", "videos": [[]]},  # no frames
        {"problem": "Text only", "answer": "7"},
    ]
    (tmp_path / "files.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    assert at_2fps and at_6fps
    with pytest.warns(UserWarning):
        ds = PromptDataset([str(tmp_path / "frames.parquet"), str(tmp_path / "files.jsonl")], processor,
                           format_prompt=None, **BUDGET)  # fmt: skip
    assert ds.n_skipped == 3
    assert [ds[i].answer for i in range(len(ds))] == ["1", "2", "3", "7"]
    listed, filed, faster, text = (ds[i] for i in range(4))
    assert listed.problem == "<video>How many?" and text.videos == []
    assert listed.prompt.count("<|video_pad|>") == 1
    for ex in (filed, faster):
        assert len(ex.videos[0].frames) == len(listed.videos[0].frames) == 8
        for a, b in zip(ex.videos[0].frames, listed.videos[0].frames):
            assert a.tobytes() == b.tobytes()
    assert faster.videos[0].fps == 6.0 and faster.videos[0].indices[-1] >= 21  # 8 of 24 frames, spread over all
    picked, indices, total, rate = video.decode_file(at_6fps, 2.0, 8)  # only the sampled frames are converted
    assert (total, rate, len(indices)) == (24, 6.0, 8) and sorted(picked) == indices
    encoded = [rollout.encode_prompt(processor, ds[i]) for i in range(3)]
    torch.testing.assert_close(encoded[1].pixel_values_videos, encoded[0].pixel_values_videos, rtol=0, atol=0)
    for ex, p in zip((listed, filed, faster), encoded):
        assert len(p.input_ids) == ex.num_prompt_tokens
        assert int((p.token_types == 2).sum()) == p.video_grid_thw.prod() // 4


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_and_shared_equal_padded_with_videos(tiny_family_dir, family):
    """Guards against video inputs lost or misplaced in the trainer's layouts: pixel_values_videos and grids
    stacked in another order than their tokens, video tokens typed as text or image (wrong mRoPE positions, and
    Qwen2.5-VL's time spacing by second_per_grid_ts), a packed row or a shared prefix that differs from the padded
    batch, in log-probs and gradients. Also checks that the frames matter: other frames, other log-probs."""
    path = tiny_family_dir(family)
    processor = _processor(tiny_family_dir, family)
    torch.manual_seed(0)
    model = loading.load_model(path, torch.device("cpu"), "sdpa")
    pad_id, image_token_id = processor.tokenizer.pad_token_id, model.config.image_token_id
    prompts, responses = _video_batch(processor)
    order = [0, 0, 1, 2, 1, 3, 4, 4]  # groups of answers that share a prompt, and one prompt in two parts
    g = torch.Generator().manual_seed(1)
    prompts = [prompts[i] for i in order]
    responses = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (9, 1, 14, 5, 2, 7, 3, 6)]
    layouts = {
        "padded": batching.collate(prompts, responses, pad_id, image_token_id),
        "packed": batching.pack(prompts, responses, image_token_id),
        "shared": batching.pack(prompts, responses, image_token_id, share_prompts=True),
    }
    results = {}
    for name, (inputs, response_ids, mask) in layouts.items():
        model.zero_grad(set_to_none=True)
        logp, ent = logprobs.forward_logprobs(model, inputs, response_ids, 0.9, True, True)
        ((logp * mask).sum() + 0.1 * (ent * mask).sum()).backward()
        results[name] = (logp.detach() * mask, _grads(model))
    logp_ref, grads_ref = results["padded"]
    assert any("visual" in n for n in grads_ref)
    for name in ("packed", "shared"):
        logp, grads = results[name]
        torch.testing.assert_close(logp, logp_ref, rtol=1e-5, atol=1e-5, msg=name)
        assert grads.keys() == grads_ref.keys()
        for n in grads_ref:
            torch.testing.assert_close(grads[n], grads_ref[n], rtol=1e-5, atol=1e-5, msg=f"{name} {n}")
        print(f"{family} {name} vs padded: max |dlogp| {(logp - logp_ref).abs().max():.1e}")
    # the frames reach the answer: shuffled video patches move the log-probs of the video prompts' answers
    inputs, response_ids, mask = layouts["packed"]
    inputs = {**inputs, "pixel_values_videos": inputs["pixel_values_videos"].flip(0)}
    with torch.no_grad():
        moved = logprobs.forward_logprobs(model, inputs, response_ids, 0.9)[0] * mask
    assert (moved - logp_ref)[:2].abs().max() > 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_one_tower_pass_per_forward_with_videos(tiny_family_dir, family):
    """Guards against a rank whose forward runs the vision tower a different number of times than another's (under
    FSDP2 each pass is an all-gather: a mismatch hangs the job): images and videos together must be encoded in one
    pass (the model's own forward makes two), videos alone in one pass and no dummy beside it, text alone in one
    dummy pass -- with the log-probs of the model without the hook."""
    path = tiny_family_dir(family)
    processor = _processor(tiny_family_dir, family)
    model = loading.load_model(path, torch.device("cpu"), "sdpa")
    pad_id, image_token_id = processor.tokenizer.pad_token_id, model.config.image_token_id
    prompts, responses = _video_batch(processor)
    batches = {"video": [0], "image+video": [0, 1, 2], "text": [3]}
    with torch.no_grad():
        plain = {}
        for name, rows in batches.items():
            batch = batching.pack([prompts[i] for i in rows], [responses[i] for i in rows], image_token_id)
            plain[name] = logprobs.forward_logprobs(model, *batch[:2], 1.0)[0]
    logprobs.add_vision_dummy(model)
    calls = []
    model.model.visual.register_forward_hook(lambda *_: calls.append(1))
    for name, rows in batches.items():
        calls.clear()
        for layout in ("packed", "padded"):
            p, r = [prompts[i] for i in rows], [responses[i] for i in rows]
            batch = (
                batching.pack(p, r, image_token_id)
                if layout == "packed"
                else batching.collate(p, r, pad_id, image_token_id)
            )
            with torch.no_grad():
                logp = logprobs.forward_logprobs(model, *batch[:2], 1.0)[0]
            if layout == "packed":
                torch.testing.assert_close(logp, plain[name], rtol=1e-5, atol=1e-5)
        assert len(calls) == 2, (name, len(calls))  # one per forward


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_hf_engine_samples_and_scores_video_prompts(tiny_family_dir, family):
    """Guards against the HF engine dropping or mis-timing videos: greedy answers to video prompts (alone, with an
    image -- encoded in one tower pass and handed to generate -- and beside text) must be generate's own greedy
    answers given the raw pixels, and their log-probs those of a padded forward over prompt and answer."""
    from tests.hf_engine_check import hf_engine, tiny_policy

    processor = _processor(tiny_family_dir, family)
    model = tiny_policy(tiny_family_dir(family), processor)
    engine = hf_engine(processor, max_num_seqs=256)
    engine.sync_weights(model)
    prompts = _video_batch(processor)[0]
    prompts = [prompts[i] for i in (0, 1, 3)]
    params = rollout.SamplingParams(0.0, 1.0, 8)
    samples = engine.generate(prompts, 1, params, seed=3)
    batch, response_ids, mask = batching.collate(prompts, [s.response_ids for s in samples], engine.pad_id,
                                                engine.image_token_id)  # fmt: skip
    with torch.no_grad():
        logp = logprobs.forward_logprobs(model, batch, response_ids, 1.0)[0] * mask
    from transformers import GenerationConfig

    for row, (p, s) in enumerate(zip(prompts, samples)):
        torch.testing.assert_close(torch.tensor(s.logprobs), logp[row, : len(s.logprobs)], rtol=0, atol=1e-5)
        inputs = batching.collate([p], [[]], engine.pad_id, engine.image_token_id)[0]
        gen_cfg = GenerationConfig(do_sample=False, max_new_tokens=8, eos_token_id=sorted(engine.eos_ids),
                                   pad_token_id=engine.pad_id, suppress_tokens=engine.forbidden)  # fmt: skip
        with torch.no_grad():
            plain = model.generate(**inputs, generation_config=gen_cfg)[0, inputs["input_ids"].shape[1] :].tolist()
        end = next((t + 1 for t, tok in enumerate(plain) if tok in engine.eos_ids), len(plain))
        assert s.response_ids == plain[:end], row
    # with the trainer's hook, a generate call with images and videos runs the tower once, as does its scoring
    logprobs.add_vision_dummy(model)
    calls = []
    model.model.visual.register_forward_hook(lambda *_: calls.append(1))
    again = engine.generate(prompts[1:2], 1, params, seed=3)
    assert len(calls) == 2 and again[0].response_ids == samples[1].response_ids


def test_text_after_a_video_continues_after_its_last_position(tiny_family_dir):
    """Guards against the trainer placing the text after a Qwen2.5-VL video inside the video's temporal positions
    (transformers 5.17-5.19 continue at the block's start + its spatial side; Qwen's reference code and vLLM at the
    largest position + 1): the log-probs would differ from vLLM's by 0.06 here. A video of 3 frame pairs at 1 s per
    pair spans temporal positions start .. start + 4, past its 2 x 4 spatial ones."""
    processor = _processor(tiny_family_dir, "qwen2_5_vl")
    model = loading.load_model(tiny_family_dir("qwen2_5_vl"), torch.device("cpu"), "sdpa")
    video.set_video_range(processor, BUDGET["video_min_pixels"], BUDGET["video_max_pixels"], BUDGET["max_frames"])
    p = _prompt(processor, "Count.", videos=[_video(processor, _frames(6, (112, 56)))])
    assert p.video_grid_thw[0].tolist() == [3, 4, 8] and p.second_per_grid_ts.tolist() == [1.0]
    args = (p.input_ids[None], p.token_types[None], None, p.video_grid_thw)
    ours, _ = model.model.get_rope_index(*args, second_per_grid_ts=p.second_per_grid_ts)  # (3, 1, L)
    library, _ = type(model.model).get_rope_index(model.model, *args, second_per_grid_ts=p.second_per_grid_ts)
    vid = (p.token_types == 2).nonzero().flatten()
    after = vid[-1] + 1
    assert ours[:, 0, after].tolist() == [ours[:, 0, vid].max() + 1] * 3
    assert library[:, 0, after].max() <= library[:, 0, vid].max()  # the overlap this fixes
    assert torch.equal(ours[:, 0, :after], library[:, 0, :after])  # nothing before it moves


def test_memory_plan_bounds_the_tokens_of_a_clip():
    """Guards against a plan that undercounts videos: its tokens per clip at the video budget must bound what
    load_video's frames become for any frame shape, and not by much (Qwen2.5-VL's 28 px and Qwen3-VL's 32 px grid)."""
    from grpo import memory_plan, model_shape

    for patch, frames in ((14, 32), (16, 7)):
        shape = model_shape.ModelShape(1, 1, 1, 1, 1, 1, False, patch=patch)
        clip, pair = memory_plan.video_clip_tokens(shape, frames, 65536)
        side = 2 * patch
        counts = []
        for w in range(64, 2000, 37):
            for h in (w // 3, w // 2, w, 2 * w):
                fw, fh = video.frame_size(w, h, 16384, 65536, side)
                counts.append((fw // side) * (fh // side))
        assert max(counts) <= pair and max(counts) >= 0.9 * pair, (max(counts), pair)
        assert clip == (frames + 1) // 2 * pair


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_varlen_path_covers_video_patches(tiny_family_dir, family, monkeypatch):
    """Guards against the CUDA attention path mishandling videos (run on CPU with the kernel swapped for its
    reference, as tests/test_varlen.py does): the vision tower's varlen call must bound each frame pair's (and
    window's) patches as the tower's own sdpa loop does, in one kernel call per block for all images and videos,
    and the packed decoder must give the padded sdpa model's log-probs and tower gradients."""
    from tests.test_varlen import reference_varlen

    calls = []

    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window=None):
        calls.append((causal, len(cu_q) - 1))
        return reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window)

    monkeypatch.setattr(attention, "varlen_kernel", kernel)
    processor = _processor(tiny_family_dir, family)
    torch.manual_seed(0)
    ref = loading.load_model(tiny_family_dir(family), torch.device("cpu"), "sdpa")
    model = loading.load_model(tiny_family_dir(family), torch.device("cpu"), "varlen_packed")
    logprobs.add_vision_dummy(model)  # as apply_fsdp does: one tower pass for the images and videos
    pad_id, image_token_id = processor.tokenizer.pad_token_id, model.config.image_token_id
    prompts, responses = _video_batch(processor)
    padded, response_ids, mask = batching.collate(prompts, responses, pad_id, image_token_id)
    packed = batching.pack(prompts, responses, image_token_id)[0]
    results = []
    for m, inputs in ((ref, padded), (model, packed)):
        logp = logprobs.forward_logprobs(m, inputs, response_ids, 1.0)[0]
        (logp * mask).sum().backward()
        results.append((logp.detach() * mask, m.model.visual.blocks[0].attn.qkv.weight.grad))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-4, atol=1e-6)
    vision = [n for causal, n in calls if not causal]
    assert len(vision) == model.config.vision_config.depth  # one call per block for all images and videos
    pairs = sum(int(p.video_grid_thw[:, 0].sum()) for p in prompts if p.video_grid_thw is not None)
    images = sum(len(p.image_grid_thw) for p in prompts if p.image_grid_thw is not None)
    assert min(vision) >= pairs + images  # every frame pair and image bounded on its own (windows may split more)


def test_prompt_limits_follow_the_data_or_are_checked_before_the_models_load(tiny_family_dir, tmp_path):
    """Guards against a video dataset needing a key before it trains (the limits at -1 must become the data's most
    images and videos per prompt, counted over the rows the run sees) and against an explicit limit below the data's
    loading the models and then failing at the first rollout that draws a video: it stops as soon as the data is
    read, naming the key to set; an explicit limit is kept as it is; the HF engine has no such limits. Data with
    neither images nor videos keeps one image, so vLLM still builds the vision tower the weight sync fills."""
    from types import SimpleNamespace

    from scripts.make_synthetic_data import make_mixed_media

    processor = _processor(tiny_family_dir, "qwen2_5_vl")
    ds = PromptDataset(make_mixed_media(str(tmp_path / "mixed.parquet"), n_rows=8), processor, format_prompt=None,
                       **BUDGET)  # fmt: skip
    limits = lambda engine, images, videos, tools=(), turns=4: SimpleNamespace(  # noqa: E731
        engine=engine, max_images_per_prompt=images, max_videos_per_prompt=videos, tools=list(tools), max_turns=turns
    )
    rollout.check_prompt_limits(limits("vllm", 1, 1), [ds, None])
    rollout.check_prompt_limits(limits("hf", 0, 0), [ds])
    with pytest.raises(SystemExit, match=r"1 videos: set rollout.max_videos_per_prompt=1 or -1, .* \(now 0"):
        rollout.check_prompt_limits(limits("vllm", 1, 0), [ds])
    with pytest.raises(SystemExit, match=r"1 images: set rollout.max_images_per_prompt=1 or -1, .* \(now 0"):
        rollout.check_prompt_limits(limits("vllm", 0, 1), [torch.utils.data.Subset(ds, range(2))])
    rollout.check_prompt_limits(limits("vllm", 0, 1), [torch.utils.data.Subset(ds, [1, 5])])  # a subset: its rows
    rollout.check_prompt_limits(limits("vllm", 0, 0), [torch.utils.data.Subset(ds, [3, 7])])  # text only: 0 is fine
    # rows in turn: an image, a video, both, text only
    for rows, expected in ((range(8), (1, 1)), ([1, 5], (0, 1)), ([0, 4], (1, 0)), ([3, 7], (1, 0)), ([3, 5], (0, 1))):
        cfg = limits("vllm", -1, -1)
        subset = torch.utils.data.Subset(ds, rows)
        assert rollout.check_prompt_limits(cfg, [subset, None]) == expected, rows
        assert (cfg.max_images_per_prompt, cfg.max_videos_per_prompt) == expected  # what the engine is built with
    cfg = limits("vllm", 3, -1)  # an explicit limit above the data's is kept
    assert rollout.check_prompt_limits(cfg, [ds]) == (3, 1) and cfg.max_images_per_prompt == 3
    # with tools each turn after the first may bring one image (a crop): the data's most plus max_turns - 1, and
    # never 0 (text-only data and a single turn must still build the vision tower)
    for rows, turns, expected in ((range(8), 4, (4, 1)), ([1, 5], 3, (2, 1)), ([3, 7], 1, (1, 0))):
        cfg = limits("vllm", -1, -1, tools=["tools.py:crop"], turns=turns)
        assert rollout.check_prompt_limits(cfg, [torch.utils.data.Subset(ds, rows)]) == expected, (rows, turns)
