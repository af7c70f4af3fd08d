"""A JAX trainer in its own process, for test_jax_transfer.py: reads a checkpoint's tensors
(HF names), offers them over its own jax.experimental.transfer server and asks a server
to pull them with SGLang's two calls (multiserve/rl/jax_weight_sender.py). Prints each
answer as one JSON line.

    python jax_trainer.py URL CHECKPOINT_DIR WEIGHT_VERSION [URL2 CHECKPOINT_DIR2 VERSION2 GROUP2]

The second triple (another server, e.g. one engine's port, with its own sender and group)
runs after the first; answers are keyed "init", "update" (then "init2", "update2").
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def read(checkpoint: str) -> dict:
    from multiserve.model.loading.safetensors_io import load_file

    tensors: dict = {}
    for f in sorted(Path(checkpoint).glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def main(url: str, checkpoint: str, version: str, *second: str) -> None:
    from multiserve.rl.jax_weight_sender import JaxWeightSender

    runs = [(url, checkpoint, version, "weight_update_group", "")]
    if second:
        runs.append((*second[:4], "2"))
    for u, ckpt, v, group, key in runs:
        with JaxWeightSender(u, group_name=group) as sender:
            print(json.dumps({f"init{key}": sender.init_group()}), flush=True)
            print(json.dumps({f"update{key}": sender.update(read(ckpt), v)}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
