"""engine/rl/transfer.py without an engine: a group's pull of what a transfer server
offered (here a second server of this process stands for the trainer's; the trainer in
another process is tests/server/clients/test_jax_transfer.py), a pull that gets nothing
failing with a message and leaving the group usable, and the checks of a transfer's
description against the model made before any pull."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from multiserve.engine.rl.checks import ParamLayout, WeightUpdateError
from multiserve.engine.rl.transfer import TransferGroups
from multiserve.reliability.tiny_model import TINY_RELIABILITY_MODEL


def test_pull_what_was_offered_and_survive_a_pull_of_nothing() -> None:
    from jax.experimental import transfer

    trainer = transfer.start_transfer_server(jax.devices()[0].client, "127.0.0.1:0",
                                             ["127.0.0.1:0"])
    host, port = trainer.address().rsplit(":", 1)
    groups = TransferGroups(jax.devices()[:1], timeout_s=0.5)
    joined = groups.join("g", host, int(port))
    assert joined["backend"] == "jax" and joined["trainer_address"] == trainer.address()
    a = jnp.arange(12, dtype=jnp.float32).reshape(3, 4)
    b = jnp.full((5,), 2.5, jnp.bfloat16)
    trainer.await_pull(5, [a, b])
    got = groups.pull("g", 5, ("a", "b"), ("float32", "bfloat16"), ((3, 4), (5,)))
    assert np.array_equal(np.asarray(got["a"]), np.asarray(a))
    assert got["b"].dtype == jnp.bfloat16 and np.array_equal(np.asarray(got["b"]),
                                                             np.asarray(b))
    with pytest.raises(WeightUpdateError, match="nothing arrived"):
        groups.pull("g", 6, ("a",), ("float32",), ((3, 4),))  # never offered
    trainer.await_pull(7, [a])  # the group works again (a fresh connection)
    again = groups.pull("g", 7, ("a",), ("float32",), ((3, 4),))
    assert np.array_equal(np.asarray(again["a"]), np.asarray(a))
    with pytest.raises(WeightUpdateError, match="no weights update group 'h'"):
        groups.pull("h", 7, ("a",), ("float32",), ((3, 4),))
    assert groups.leave("g") and not groups.leave("g") and groups.names() == []


def test_a_description_is_checked_against_the_model_before_any_pull() -> None:
    layout = ParamLayout(TINY_RELIABILITY_MODEL)
    name = "model.layers.0.self_attn.q_proj.weight"
    shape = layout.specs[name].hf_shape
    layout.check_specs([name, "model.norm.weight"], ["bfloat16", "float32"],
                       [shape, layout.specs["model.norm.weight"].hf_shape])
    with pytest.raises(WeightUpdateError, match="shape"):
        layout.check_specs([name], ["float32"], [(3, 5)])
    with pytest.raises(WeightUpdateError, match="not a parameter"):
        layout.check_specs(["model.no_such.weight"], ["float32"], [(4,)])
    with pytest.raises(WeightUpdateError, match="floating"):
        layout.check_specs([name], ["int32"], [shape])
