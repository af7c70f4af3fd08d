"""update_weights_from_arrays: an in-process trainer's jax.Arrays, resharded device to device.

On the shared tiny engine. The trainer's arrays live on another device than the engine's;
the update runs with host transfers disallowed in both directions (jax.transfer_guard
"disallow_explicit", explicit transfers included), so a host round trip of the weights
fails the test by its host-to-device half (on CPU the guard cannot see reads to the host,
CPU buffers being host memory; on an accelerator it sees both). The engine's weights read
back afterwards equal the trainer's bit for bit, in HF names and in the params pytree
form; refusals (host array, another dtype, a wrong shape, an unknown name) change nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

Q0 = "model.layers.0.self_attn.q_proj.weight"
DOWN1 = "model.layers.1.mlp.down_proj.weight"


@pytest.fixture
def engine(tiny_engine: Any, tiny_model_dir: Path) -> Iterator[Any]:
    yield tiny_engine
    tiny_engine.continue_generation()
    if tiny_engine.get_internal_state()["weight_version"] != "default":
        res = tiny_engine.update_weights_from_disk(str(tiny_model_dir), "default")
        assert res.ok, res


@pytest.fixture(scope="module")
def trainer_named(tiny_model_dir: Path) -> dict[str, np.ndarray]:
    """Every HF-named tensor of the model, perturbed: what the trainer computed (host)."""
    from multiserve.model.loading import safetensors_io

    rng = np.random.default_rng(7)
    named = safetensors_io.load_file(next(tiny_model_dir.glob("*.safetensors")))
    return {k: (v * (1 + 0.3 * rng.standard_normal(v.shape))).astype(np.float32)
            for k, v in named.items()}


def _trainer_device() -> Any:
    """A device other than the tiny engine's (device 0) when there is one."""
    devices = jax.devices()
    return devices[-1]


def _read(engine: Any, name: str, rows: int) -> np.ndarray:
    res = engine.get_weights_by_name(name, truncate_size=rows)
    assert res.ok, res
    return np.asarray(res.details["values"], np.float32)


def test_device_arrays_are_published_bit_for_bit_without_host_transfers(
        engine: Any, trainer_named: dict[str, np.ndarray]) -> None:
    dev = _trainer_device()
    on_trainer = {k: jax.device_put(v, dev) for k, v in trainer_named.items()}
    jax.block_until_ready(on_trainer)
    with jax.transfer_guard_device_to_host("disallow_explicit"), \
            jax.transfer_guard_host_to_device("disallow_explicit"):
        res = engine.update_weights_from_arrays(on_trainer, "v-arrays")
    assert res.ok, res
    assert res.details["tensors"] == len(trainer_named)
    assert engine.get_internal_state()["weight_version"] == "v-arrays"
    for name in (Q0, DOWN1, "model.embed_tokens.weight", "model.norm.weight"):
        want = trainer_named[name]
        got = _read(engine, name, want.shape[0])
        assert got.shape == want.shape and got.tobytes() == want.tobytes(), name
    # the engine holds a copy: the trainer's buffers may be donated or deleted
    for a in on_trainer.values():
        a.delete()
    assert _read(engine, Q0, 4).tobytes() == trainer_named[Q0][:4].tobytes()
    out = engine.generate(input_ids=[5, 6, 7], sampling_params={
        "temperature": 0.0, "max_new_tokens": 3, "ignore_eos": True})
    assert len(out.output_ids) == 3


def test_params_pytree_form(engine: Any, tiny_model_dir: Path) -> None:
    """The engine's own params pytree (stacked layers), as device arrays: same path."""
    from multiserve.model.loading.loader import load_model

    params = load_model(str(tiny_model_dir), np.float32).params
    dev = _trainer_device()
    new = {k: ({kk: jax.device_put(vv[::-1].copy(), dev) for kk, vv in v.items()}
               if isinstance(v, dict) else jax.device_put(v, dev)) for k, v in params.items()}
    with jax.transfer_guard_device_to_host("disallow_explicit"), \
            jax.transfer_guard_host_to_device("disallow_explicit"):
        res = engine.update_weights_from_arrays(new, "v-tree")
    assert res.ok, res
    for leaf in ("wq", "w_down"):
        want = params["layers"][leaf][::-1]  # the layers swapped
        got = _read(engine, f"layers/{leaf}", want.shape[0])
        assert got.tobytes() == np.ascontiguousarray(want).tobytes(), leaf


@pytest.mark.parametrize("case", ["host", "dtype", "shape", "name"])
def test_refusals_name_the_tensor_and_change_nothing(
        engine: Any, trainer_named: dict[str, np.ndarray], case: str) -> None:
    before = _read(engine, Q0, 64)
    x = trainer_named[Q0]
    bad: Any = {"host": x, "dtype": jnp.asarray(x, jnp.bfloat16),
                "shape": jnp.asarray(x[:8]), "name": jnp.asarray(x)}[case]
    name = "model.layers.0.self_attn.q_projX.weight" if case == "name" else Q0
    res = engine.update_weights_from_arrays({name: bad, DOWN1: jnp.asarray(
        trainer_named[DOWN1])}, "v-bad")
    assert not res.ok
    assert name in res.message, res.message
    assert engine.get_internal_state()["weight_version"] == "default"
    assert _read(engine, Q0, 64).tobytes() == before.tobytes()
    assert not engine.get_internal_state()["engine_paused"]  # the staging hold ended
