"""A minimal, unbatched greedy generation loop over a model family's forward (one sequence).

`greedy_token_ids` is the reference the engine tests compare against: one sequence, its
steps padded to power-of-two token counts and one logits row. The model is row-invariant
(invariance/primitives.py, layers/attention.py), so this shares the engine's numerics bit
for bit whatever the engine's batch. `greedy_generate` is what
`multiserve generate PROMPT` runs: chat template, greedy decode, detokenize.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache, partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from multiserve.config import ModelConfig
from multiserve.model.invariance.calibration import default_plan
from multiserve.model.families import family_for
from multiserve.model.families.forward import forward
from multiserve.model.layers.forward_batch import ForwardBatch
from multiserve.model.invariance.plan import InvariancePlan
from multiserve.model.layers.kv_pool import make_kv_pool, pool_layout
from multiserve.model.invariance.primitives import is_compute_params
from multiserve.model.invariance.xla_options import step_options

TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
ROWS = 1  # B == R


def _greedy_step(params, kv_pool, batch, cfg, page_size, attn_block_size, plan):
    logits, kv_pool = forward(params, kv_pool, batch, cfg, page_size=page_size,
                              attn_block_size=attn_block_size, plan=plan)
    return jnp.argmax(logits[0]), kv_pool


@cache
def _step_program(platform: str, dtype: str) -> Any:
    """The jitted step of a `dtype` model on `platform`, compiled with the engine's step
    programs' XLA options (xla_options.step_options): its numerics are the engine's."""
    return jax.jit(_greedy_step, static_argnames=("cfg", "page_size", "attn_block_size", "plan"),
                   donate_argnums=(1,), compiler_options=step_options(platform, dtype))


def single_sequence_batch(token_ids: Sequence[int], start: int, pages: np.ndarray,
                          page_size: int) -> ForwardBatch:
    """A batch holding tokens [start, start+len) of one sequence (row 0) whose pages are
    `pages`; padded to the smallest fitting token bucket and ROWS rows."""
    n = len(token_ids)
    t = next(b for b in TOKEN_BUCKETS if b >= n) if n <= TOKEN_BUCKETS[-1] else -(-n // 512) * 512
    pos = np.zeros(t, np.int32)
    pos[:n] = np.arange(start, start + n)
    ids = np.zeros(t, np.int32)
    ids[:n] = token_ids
    slots = np.zeros(t, np.int32)  # padding tokens write into the garbage page 0
    slots[:n] = pages[pos[:n] // page_size] * page_size + pos[:n] % page_size
    table = np.zeros((ROWS, len(pages)), np.int32)
    table[0] = pages
    lens = np.zeros(ROWS, np.int32)
    lens[0] = start + n
    rows = np.zeros(ROWS, np.int32)
    rows[0] = n - 1
    return ForwardBatch(input_ids=jnp.asarray(ids), positions=jnp.asarray(pos),
                        token_seq=jnp.zeros(t, jnp.int32), out_slots=jnp.asarray(slots),
                        page_table=jnp.asarray(table), seq_lens=jnp.asarray(lens),
                        logit_rows=jnp.asarray(rows))


def greedy_token_ids(params: Any, cfg: ModelConfig, prompt_ids: Sequence[int],
                     max_new_tokens: int, page_size: int = 16, *, attn_block_size: int = 128,
                     stop_token_ids: Sequence[int] = (), chunk: int = 512,
                     plan: InvariancePlan | None = None) -> list[int]:
    """Greedy continuation of `prompt_ids`: up to `max_new_tokens` ids, ending early right
    after a token in `stop_token_ids`. Prefill in chunks of `chunk` tokens, then one token
    per step. `plan`: the invariance plan (default: a default engine's on this machine)."""
    assert len(prompt_ids) >= 1 and max_new_tokens >= 0
    dtype = jax.tree.leaves(params)[0].dtype
    if plan is None:
        plan = default_plan(cfg, dtype, page_size=page_size, block_size=attn_block_size)
    if not is_compute_params(params):
        params = family_for(cfg).compute_params(params, cfg, plan, TOKEN_BUCKETS)
    total = len(prompt_ids) + max_new_tokens
    num_pages = -(-total // page_size)
    pages = np.arange(1, num_pages + 1, dtype=np.int32)  # page 0 is the garbage page
    kv = make_kv_pool(cfg, num_pages + 1, page_size, dtype,
                      layout=pool_layout(plan.attention.kernel))
    step = _step_program(jax.devices()[0].platform, str(jnp.dtype(dtype)))
    run = partial(step, cfg=cfg, page_size=page_size, attn_block_size=attn_block_size,
                  plan=plan)
    out: list[int] = []
    if max_new_tokens == 0:
        return out
    prompt = list(prompt_ids)
    for start in range(0, len(prompt), chunk):
        piece = prompt[start:start + chunk]
        nxt, kv = run(params, kv, single_sequence_batch(piece, start, pages, page_size))
    pos = len(prompt)
    while True:
        token = int(nxt)
        out.append(token)
        if len(out) >= max_new_tokens or token in stop_token_ids:
            return out
        nxt, kv = run(params, kv, single_sequence_batch([token], pos, pages, page_size))
        pos += 1


def greedy_generate(model_path: str | None, prompt: str, max_new_tokens: int = 64,
                    chat: bool = True) -> str:
    """The greedy answer of a model (None: the default model) to `prompt`."""
    from transformers import PreTrainedTokenizerFast  # tokenizers-backed: no torch

    from multiserve.model.loading.loader import load_model

    model = load_model(model_path, "float32")
    tok = PreTrainedTokenizerFast.from_pretrained(str(model.tokenizer_dir))
    if chat:
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                       add_generation_prompt=True)
    else:
        text = prompt
    ids = tok(text, add_special_tokens=not chat)["input_ids"]
    params = jax.device_put(model.params)
    out = greedy_token_ids(params, model.config, ids, max_new_tokens,
                           stop_token_ids=model.config.eos_token_ids)
    return tok.decode(out, skip_special_tokens=True).strip()
