"""Export a training checkpoint as a Hugging Face model directory that from_pretrained and vLLM load as is.

    python scripts/export_hf.py outputs/geo3k/checkpoints/step_50 outputs/geo3k/hf_step_50

The model is built from the checkpoint's own config (actor.model_path, or --model-path if it moved), its weights are
replaced by the checkpoint's, and train_grpo.save_hf writes it: the function that writes <output_dir>/hf at the end of
training, so both give the same files (safetensors in the original naming, the processor with the run's image pixel
range, the chat template). One CPU process; it reads the sharded checkpoint whatever the number of ranks that wrote it.
"""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import train_grpo  # noqa: E402


def export_checkpoint(checkpoint: str, out_dir: str, model_path: str | None = None) -> str:
    import torch.distributed.checkpoint as dcp
    from transformers import AutoProcessor

    from data import set_pixel_range

    if not train_grpo.is_complete_checkpoint(checkpoint):
        raise SystemExit(f"{checkpoint}: not a complete checkpoint (no .metadata or trainer_state.json)")
    with open(os.path.join(checkpoint, "trainer_state.json")) as f:
        cfg = json.load(f)["config"]
    model_path = model_path or train_grpo.resolve_path(cfg["actor"]["model_path"])
    model = train_grpo.load_model(model_path, torch.device("cpu"), "sdpa")
    processor = AutoProcessor.from_pretrained(model_path)
    set_pixel_range(processor, cfg["data"]["min_pixels"], cfg["data"]["max_pixels"])  # as PromptDataset did in training

    # DCP and save_hf work through torch.distributed: a one-process group runs them here unchanged
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        # Only the model's entries are read (the optimizer's stay on disk); DCP loads in place into these tensors and
        # fails on any key the checkpoint lacks, so a model that does not match the checkpoint cannot be half-loaded.
        state = {"model": model.state_dict()}
        dcp.load(state, checkpoint_id=checkpoint)
        model.load_state_dict(state["model"])
        train_grpo.save_hf(model, processor, out_dir)
    finally:
        dist.destroy_process_group()
    return out_dir


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a complete <output_dir>/checkpoints/step_N directory")
    parser.add_argument("out_dir", help="where to write the Hugging Face model directory")
    parser.add_argument("--model-path", help="the base model, if the checkpoint's actor.model_path moved")
    args = parser.parse_args(argv)
    export_checkpoint(args.checkpoint, args.out_dir, args.model_path)
    print(f"exported {args.checkpoint} to {args.out_dir}")


if __name__ == "__main__":
    main()
