"""Export a checkpoint's model as one safetensors file, to share it or load it anywhere.

    python -m src.loop.export outputs/DATE/TIME/checkpoints/best model.safetensors
    python -m src.loop.export CHECKPOINT generator.safetensors --model generator --weights ema

CHECKPOINT is any checkpoint of this template (a sharded one is gathered here, in one process). OUT holds the model's
whole state_dict under the plain module's names, so `model.load_state_dict(load_file(OUT))` loads it into the module the
config builds, and `init_from=OUT` fine-tunes from it. No code in the checkpoint runs; OUT is written atomically."""

from __future__ import annotations

import argparse
from pathlib import Path

from src import checkpoint
from src.checkpoint.store import FORMAT
from src.common import files
from src.common.errors import UsageError, exit_on_usage_error


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m src.loop.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path, help="a checkpoint: step_<N>/, last, best, or a .pt file")
    parser.add_argument("out", type=Path, help="the .safetensors file to write")
    parser.add_argument("--model", default=None, help="which model of a run of several (default: its output model)")
    parser.add_argument("--weights", default="model", choices=["model", "ema"], help="its weights, or its EMA weights")
    args = parser.parse_args(argv)
    with exit_on_usage_error(is_main_process=True):
        if not args.out.parent.is_dir():
            raise UsageError(f"cannot write {args.out}: the folder {args.out.parent} does not exist")
        try:  # an optional package
            from safetensors.torch import save
        except ImportError:
            raise UsageError("exporting needs the safetensors package (pip install safetensors)") from None
        state = checkpoint.read(args.checkpoint).model_weights(args.model, args.weights)
        # safetensors stores each tensor's own bytes: views and shared storage are copied out.
        tensors = {name: tensor.detach().contiguous().clone() for name, tensor in state.items()}
        with files.atomic_file(args.out) as file:
            file.write(save(tensors, metadata={"source": str(args.checkpoint), "format": FORMAT}))
        count = sum(tensor.numel() for tensor in state.values())
        print(f"wrote {args.out}: {len(state)} tensors, {count:,} elements, from {args.checkpoint}")


if __name__ == "__main__":
    main()
