"""Export a training checkpoint as a Hugging Face model directory that from_pretrained and vLLM load as is.

    python scripts/export_hf.py outputs/geo3k/checkpoints/step_50 outputs/geo3k/hf_step_50

A thin wrapper of checkpoint.export_checkpoint: the model is built from the checkpoint's own config
(actor.model_path, or --model-path if it moved) and checkpoint.save_hf writes it, the function that writes
<output_dir>/hf at the end of training, so both give the same files. One CPU process, any number of ranks saved it.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from grpo.checkpoint import export_checkpoint  # noqa: E402


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
