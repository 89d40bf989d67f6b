"""What the rollout passes around: the sampling parameters, a prompt as the trainer's model sees it, a sampled answer,
an answer to continue (partial rollouts, tool turns), and the prompt's ids as an engine that expands image pads
itself takes them. The engines (hf_engine.py, vllm_engine.py), partial.py, turns.py and routing.py all speak these;
rollout.py names them for the loop (`rollout.Prompt`, `rollout.Sample`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from grpo import families


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    max_tokens: int = 2048
    stop_token_ids: tuple = ()  # besides end-of-sequence: a tool rollout's turn ends at </tool_call> (turns.py)


@dataclass
class Prompt:
    """A prompt as the trainer's model sees it (image and video pads expanded by the processor) plus the raw images
    and videos, which engines with their own image processing need."""

    input_ids: torch.Tensor  # (P,)
    pixel_values: torch.Tensor | None  # (patches, dim) for all images of the prompt
    image_grid_thw: torch.Tensor | None  # (images, 3)
    images: list
    # (P,) the processor's mm_token_type_ids: 0 text, 1 image, 2 video token; None: image tokens found by their id
    token_types: torch.Tensor | None = None
    pixel_values_videos: torch.Tensor | None = None  # (patches, dim) for all videos of the prompt
    video_grid_thw: torch.Tensor | None = None  # (videos, 3)
    second_per_grid_ts: torch.Tensor | None = None  # (videos,) Qwen2.5-VL: seconds per temporal patch, for mRoPE
    videos: list = field(default_factory=list)  # video.Video: the frames and their timing
    # the chat template's tokens, one pad per image and video: what engines that expand the pads themselves get
    template_ids: list[int] | None = None
    max_tokens: int | None = None  # fewer new tokens than SamplingParams.max_tokens (what a tool rollout has left)
    # Gemma 4: (images, patches, 2) each patch's place in its image, (-1, -1) for padding (pixel_values is then
    # (images, patches, dim))
    image_position_ids: torch.Tensor | None = None


@dataclass
class Sample:
    prompt_index: int  # index into the prompts passed to generate()
    response_ids: list[int]  # sampled tokens, including the end-of-sequence token when there is one
    logprobs: list[float]  # log-prob of each sampled token under the engine's model (temperature applied)
    text: str
    truncated: bool  # hit max_tokens before end-of-sequence
    # the tool turns inside response_ids (turns.ToolTurn, in order): context the model did not write, whose tokens
    # carry no log-prob (0 in `logprobs`) and no loss; empty for a plain answer
    turns: list = field(default_factory=list)
    # leading tokens of response_ids sampled at earlier steps, under older weights (an answer cut short by a partial
    # rollout and continued now); their `logprobs` are the older policy's, so only the rest measures the engine
    carried: int = 0
    staleness: int = 0  # steps since its first token was sampled (partial.py); 0 for an answer of this step
    # algorithm.routing_replay=r3: the experts the engine routed each token of prompt + response to, (P + R, MoE
    # layers, top_k) int8/int16, replay.NO_ROUTE where none was recorded (replay.py); None otherwise
    routes: torch.Tensor | None = None

    @property
    def model_len(self) -> int:
        """The tokens the model wrote (those that carry loss)."""
        return len(self.response_ids) - sum(len(t.input_ids) for t in self.turns)


@dataclass
class Continuation:
    """An answer to sample or to continue (partial.py): its prompt, the tokens it has (sampled at earlier steps), its
    group among the requests, whether the step must wait for it to finish (the staleness bound), and the tokens at
    which it pauses rather than ends (a tool call, turns.py). A prompt with its own max_tokens is the answer's
    conversation so far, tool turns in it (turns.continuation): that answer has begun, and is a request of its own."""

    prompt: Prompt
    prefix: list[int]
    group: int
    pinned: bool = False
    pause_ids: tuple = ()


def encode_prompt(processor, example) -> Prompt:
    videos = getattr(example, "videos", [])
    # the frames come sampled and sized (video.py); the metadata places them in time
    kwargs = {"videos": [v.frames for v in videos], "video_metadata": [v.metadata() for v in videos]} if videos else {}
    out = processor(text=[example.prompt], images=example.images or None, return_tensors="pt", **kwargs)
    types = out.get("mm_token_type_ids")
    return Prompt(
        out["input_ids"][0], out.get("pixel_values"), out.get("image_grid_thw"), list(example.images),
        token_types=None if types is None else types[0], pixel_values_videos=out.get("pixel_values_videos"),
        video_grid_thw=out.get("video_grid_thw"), second_per_grid_ts=out.get("second_per_grid_ts"), videos=videos,
        template_ids=processor.tokenizer(example.prompt)["input_ids"],
        image_position_ids=out.get("image_position_ids"),
    )  # fmt: skip


def vision_token_ids(tokenizer, tokens=families.VISION_TOKENS) -> list[int]:
    """Ids of the family's vision special tokens (families.Family.vision_tokens): sampling one would put an image
    placeholder into a response, and the next training forward fails with "Image features and image tokens do not
    match". They are forbidden at every sampling step."""
    vocab = tokenizer.get_vocab()
    return sorted(vocab[t] for t in tokens if t in vocab)


def collapse_image_pads(input_ids: list[int], image_token_id: int) -> list[int]:
    """The processor expands each image's single <|image_pad|> into one per image token; vLLM wants the single
    one back (it expands it again itself, and expanding an expanded prompt corrupts it)."""
    return [t for i, t in enumerate(input_ids) if t != image_token_id or i == 0 or input_ids[i - 1] != image_token_id]


def engine_prompt_ids(prompt: Prompt, image_token_id: int) -> list[int]:
    """The prompt as vLLM takes it: one pad per image and video, which it expands itself. Qwen3-VL's videos expand
    into more than pads (a timestamp and vision start/end tokens per frame pair), so the template's own tokens are
    used where the prompt has them."""
    if prompt.template_ids is not None:
        return list(prompt.template_ids)
    return collapse_image_pads(prompt.input_ids.tolist(), image_token_id)
