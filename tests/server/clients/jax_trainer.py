"""A JAX trainer in its own process, for test_jax_transfer.py: reads a checkpoint's tensors
(HF names), offers them over its own jax.experimental.transfer server and asks a server
to pull them with SGLang's two calls (multiserve/rl/jax_weight_sender.py). Prints each
answer as one JSON line.

    python jax_trainer.py URL CHECKPOINT_DIR WEIGHT_VERSION
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main(url: str, checkpoint: str, version: str) -> None:
    from multiserve.model.loading.safetensors_io import load_file
    from multiserve.rl.jax_weight_sender import JaxWeightSender

    tensors: dict = {}
    for f in sorted(Path(checkpoint).glob("*.safetensors")):
        tensors.update(load_file(f))
    with JaxWeightSender(url) as sender:
        print(json.dumps({"init": sender.init_group()}), flush=True)
        print(json.dumps({"update": sender.update(tensors, version)}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
