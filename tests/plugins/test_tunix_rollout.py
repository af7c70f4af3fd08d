"""Tunix's own GRPO learner with multiserve as its rollout engine (plugins/tunix_rollout).

Runs only where google-tunix is installed: a venv of its own with pyproject.toml's `tunix`
extra (plugins/tunix_rollout/__init__.py says why and how); elsewhere it is skipped.

A tiny random Llama (multiserve's reliability tiny model config: 2 layers, hidden 64,
SmolLM2's tokenizer) is built as Tunix's Llama3 nnx model on the trainer's device
(virtual CPU device 0); the engine runs on the rollout mesh (device 1) and serves that
model's config.json, taking the trainer's weights at construction and at every
`sync_weights`. Tunix trains for 3 steps (GRPO, 2 prompts x 2 generations, sampled at
temperature 1 with top_k and a seed). Checked:
(a) every rollout's logprobs equal multiserve's own scoring pass of the same tokens
    (prompt logprobs of prompt + completion) bit for bit, and Tunix's own scorer
    (`tunix.rl.common.compute_per_token_logps` on the trainer's model at the synced
    weights) to 3e-4 (float32, another program; 1.3e-4 seen: this checks the name mapping);
    the scoring pass is the plugin's `get_per_token_logps` (Tunix's padded arrays);
(b) after every sync, read back from the engine, each weight equals the trainer's bit for
    bit (the expected HF orientation is computed here with numpy, independently of
    plugins/tunix_rollout/param_names.py), the weights changed between syncs, and the sync
    ran under Tunix's own transfer guard (`sync_weights` on CPU disallows host transfers,
    explicit ones too: a host round trip of the weights fails by its host-to-device half;
    CPU buffers being host memory, reads to the host are not seen).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("tunix", reason="google-tunix runs in its own venv "
                    "(pyproject.toml's tunix extra; plugins/tunix_rollout/__init__.py)")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from tunix.models.llama3 import model as llama3  # noqa: E402
from tunix.rl import common as tunix_common  # noqa: E402
from tunix.rl import rl_cluster as rl_cluster_lib  # noqa: E402
from tunix.rl.grpo import grpo_learner  # noqa: E402
from tunix.rl.rollout import base_rollout  # noqa: E402

from multiserve.config import EngineConfig  # noqa: E402
from multiserve.reliability.tiny_model import (  # noqa: E402
    TINY_RELIABILITY_MODEL,
    tiny_engine_fields,
    write_tiny_model,
)
from plugins.tunix_rollout import MultiserveRollout  # noqa: E402

STEPS = 3
MAX_NEW = 8
PROMPTS = ["The capital of France is", "Two plus two equals", "Colours of the sea:",
           "A haiku about rain"]


def tunix_config() -> llama3.ModelConfig:
    c = TINY_RELIABILITY_MODEL
    return llama3.ModelConfig(
        num_layers=c.num_layers, vocab_size=c.vocab_size, embed_dim=c.hidden_size,
        hidden_dim=c.intermediate_size, num_heads=c.num_heads, head_dim=c.head_dim,
        num_kv_heads=c.num_kv_heads, rope_theta=int(c.rope_theta), norm_eps=c.rms_norm_eps,
        weight_tying=c.tie_word_embeddings)


def mesh_on(device: object) -> jax.sharding.Mesh:
    """A one-device ("fsdp", "tp") mesh with Auto axes, as Tunix's models expect (JAX
    0.10's make_mesh defaults to Explicit axes, under which Tunix's gathers fail)."""
    auto = (jax.sharding.AxisType.Auto,) * 2
    return jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=auto, devices=[device])


def expected_hf(state: Any) -> dict[str, np.ndarray]:
    """The trainer's params in HF names and orientation, by numpy (independent of the
    plugin's table)."""
    flat = {".".join(map(str, p)): np.asarray(v.get_value())
            for p, v in nnx.to_flat_state(state)}
    out = {"model.embed_tokens.weight": flat["embedder.input_embedding"],
           "model.norm.weight": flat["final_norm.w"], "lm_head.weight": flat["lm_head.w"].T}
    for i in range(TINY_RELIABILITY_MODEL.num_layers):
        pre, hf = f"layers.{i}.", f"model.layers.{i}."
        for x in "qkv":
            w = flat[pre + f"attn.{x}_proj.w"]
            out[hf + f"self_attn.{x}_proj.weight"] = w.reshape(w.shape[0], -1).T
        o = flat[pre + "attn.o_proj.w"]
        out[hf + "self_attn.o_proj.weight"] = o.reshape(-1, o.shape[-1]).T
        for m in ("gate", "up", "down"):
            out[hf + f"mlp.{m}_proj.weight"] = flat[pre + f"mlp.{m}_proj.kernel"].T
        out[hf + "input_layernorm.weight"] = flat[pre + "input_layernorm.w"]
        out[hf + "post_attention_layernorm.weight"] = flat[pre + "post_attention_layernorm.w"]
    return out


class Recording(MultiserveRollout):
    """MultiserveRollout that records each rollout and checks each sync (b)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # (weight version, the scoring pass's logprobs, the rollout)
        self.rollouts: list[tuple[str, np.ndarray, base_rollout.RolloutOutput]] = []
        self.synced: list[dict[str, np.ndarray]] = []
        self.guards: list[str] = []
        super().__init__(*args, **kwargs)

    def generate(self, prompts: list[str], rollout_config: base_rollout.RolloutConfig,
                 **kwargs: Any) -> base_rollout.RolloutOutput:
        out = super().generate(prompts, rollout_config, **kwargs)
        version = self.engine.get_internal_state()["weight_version"]
        # (a)'s scoring pass, on the weights that sampled (before the next sync), through
        # BaseRollout.get_per_token_logps (Tunix's padded [B, P] and [B, C] arrays)
        scored = np.asarray(self.get_per_token_logps(
            jnp.asarray(out.left_padded_prompt_tokens), jnp.asarray(_pad(out.tokens,
                                                                         self.pad_id()))))
        self.rollouts.append((version, scored, out))
        return out

    def update_params(self, params: Any, filter_types: Any = None) -> None:
        self.guards.append(str(jax.config.jax_transfer_guard_device_to_host))
        super().update_params(params, filter_types)
        with jax.transfer_guard("allow"):  # the test's own read-back, after the sync
            want = expected_hf(params)
            for name, w in want.items():
                res = self.engine.get_weights_by_name(name, truncate_size=w.shape[0])
                assert res.ok, res
                got = np.asarray(res.details["values"], np.float32)
                assert got.shape == w.shape and got.tobytes() == w.tobytes(), name
            self.synced.append(want)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tunix-tiny"))


def test_tunix_grpo_with_multiserve_rollout(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    devices = jax.devices()
    assert len(devices) >= 2, "needs 2 devices (tests/conftest.py makes 4 CPU devices)"
    actor_mesh, rollout_mesh = mesh_on(devices[0]), mesh_on(devices[1])
    with jax.set_mesh(actor_mesh):
        actor = llama3.Llama3(tunix_config(), rngs=nnx.Rngs(0))
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    rollout_config = base_rollout.RolloutConfig(
        max_tokens_to_generate=MAX_NEW, max_prompt_length=16, temperature=1.0, top_p=1.0,
        top_k=64, seed=jnp.asarray(11), return_logprobs=True)
    engine_config = EngineConfig(model_path=str(model_dir), dtype="float32",
                                 **tiny_engine_fields())
    cluster = rl_cluster_lib.RLCluster(
        actor=actor, tokenizer=tokenizer,
        cluster_config=rl_cluster_lib.ClusterConfig(
            role_to_mesh={rl_cluster_lib.Role.ACTOR: actor_mesh,
                          rl_cluster_lib.Role.REFERENCE: actor_mesh,
                          rl_cluster_lib.Role.ROLLOUT: rollout_mesh},
            rollout_engine=functools.partial(Recording, engine_config=engine_config),
            training_config=rl_cluster_lib.RLTrainingConfig(
                actor_optimizer=optax.sgd(0.5), eval_every_n_steps=1000, max_steps=STEPS),
            rollout_config=rollout_config))
    rollout = cluster.rollout
    assert isinstance(rollout, Recording)
    try:
        learner = grpo_learner.GRPOLearner(
            rl_cluster=cluster,
            algo_config=grpo_learner.GRPOConfig(num_generations=2, num_iterations=1, beta=0.0),
            reward_fns=lambda prompts, completions, **_: [float(len(c)) for c in completions])
        # batches as a grain loader gives them: arrays (Tunix repeats them per generation)
        data = [{"prompts": np.asarray(PROMPTS[2 * (s % 2):2 * (s % 2) + 2])}
                for s in range(STEPS)]
        learner.train(data)

        # (b) the construction's sync and one per step, each checked in update_params
        assert len(rollout.synced) == STEPS + 1
        assert rollout.guards[1:] == ["disallow_explicit"] * STEPS  # Tunix's sync guard
        for a, b in zip(rollout.synced, rollout.synced[1:]):
            assert any(a[n].tobytes() != b[n].tobytes() for n in a), "weights never changed"
        assert rollout.engine.get_internal_state()["weight_version"] == f"tunix-{STEPS}"

        # (a) logprobs: multiserve's scoring pass (bitwise), Tunix's scorer (2e-4)
        assert len(rollout.rollouts) == STEPS
        graphdef, _ = nnx.split(actor)
        for step, ((version, scored, out), synced) in enumerate(
                zip(rollout.rollouts, rollout.synced)):
            assert version == f"tunix-{step}"  # the rollout of step s ran on sync s
            assert out.logprobs is not None and len(out.tokens) == 2 * 2
            for lp, sc, t in zip(out.logprobs, scored, out.tokens):
                n = _before_pad(t, rollout.pad_id())
                assert len(lp) == len(t) >= n >= 1
                assert lp[:n].tobytes() == sc[:n].tobytes()
                assert not sc[n:].any()  # padding scores 0
            state = _state_of(actor, synced)
            tunix_lp = np.asarray(tunix_common.compute_per_token_logps(
                graphdef, state, prompt_tokens=jnp.asarray(out.left_padded_prompt_tokens),
                completion_tokens=jnp.asarray(_pad(out.tokens, rollout.pad_id())),
                pad_id=rollout.pad_id(), eos_id=rollout.eos_id()))
            for i, (lp, t) in enumerate(zip(out.logprobs, out.tokens)):
                n = _before_pad(t, rollout.pad_id())
                np.testing.assert_allclose(lp[:n], tunix_lp[i, :n], rtol=0, atol=3e-4)
    finally:
        rollout.shutdown()


def _pad(tokens: list[np.ndarray], pad: int) -> np.ndarray:
    out = np.full((len(tokens), MAX_NEW), pad, np.int32)
    for row, t in zip(out, tokens):
        row[:len(t)] = t
    return out


def _before_pad(t: np.ndarray, pad: int) -> int:
    hits = np.flatnonzero(t == pad)
    return int(hits[0]) if hits.size else len(t)


def _state_of(actor: Any, hf: dict[str, np.ndarray]) -> Any:
    """The actor's params state with the values of one synced snapshot (HF -> Tunix)."""
    state = nnx.state(actor)
    c = TINY_RELIABILITY_MODEL
    back = {("embedder", "input_embedding"): hf["model.embed_tokens.weight"],
            ("final_norm", "w"): hf["model.norm.weight"],
            ("lm_head", "w"): hf["lm_head.weight"].T}
    for i in range(c.num_layers):
        pre = f"model.layers.{i}."
        for x, heads in (("q", c.num_heads), ("k", c.num_kv_heads), ("v", c.num_kv_heads)):
            back[("layers", i, "attn", f"{x}_proj", "w")] = hf[
                pre + f"self_attn.{x}_proj.weight"].T.reshape(c.hidden_size, heads, c.head_dim)
        back[("layers", i, "attn", "o_proj", "w")] = hf[pre + "self_attn.o_proj.weight"].T \
            .reshape(c.num_heads, c.head_dim, c.hidden_size)
        for m in ("gate", "up", "down"):
            back[("layers", i, "mlp", f"{m}_proj", "kernel")] = hf[pre + f"mlp.{m}_proj.weight"].T
        back[("layers", i, "input_layernorm", "w")] = hf[pre + "input_layernorm.weight"]
        back[("layers", i, "post_attention_layernorm", "w")] = hf[
            pre + "post_attention_layernorm.weight"]
    flat = nnx.to_flat_state(state)
    for path, var in flat:
        if path in back:
            var.set_value(jnp.asarray(back[path]))
    return nnx.from_flat_state(flat)
