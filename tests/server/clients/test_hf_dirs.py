"""Hugging Face model directories as `transformers` writes them (`save_pretrained`), with
the config.json of a model loaded from GGUF: no `architectures` key, only `model_type`
(transformers then picks the class from `model_type`). Such a directory must load
everywhere a model directory is accepted: at engine start-up and in
/update_weights_from_disk (one engine, and the supervisor).

Issue 10 item shown here: 11.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from client_helpers import Live

PROMPT = [1, 300, 4100, 27, 9, 618]


@pytest.fixture(scope="module")
def transformers_dir(tmp_path_factory: pytest.TempPathFactory, _live: Live) -> Path:
    """A random LlamaForCausalLM with the tiny model's shapes, saved by transformers (and
    the tokenizer beside it), then stripped of `architectures`."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from multiserve.reliability.tiny_model import TINY_RELIABILITY_MODEL as T

    cfg = LlamaConfig(vocab_size=T.vocab_size, hidden_size=T.hidden_size,
                      intermediate_size=T.intermediate_size, num_hidden_layers=T.num_layers,
                      num_attention_heads=T.num_heads, num_key_value_heads=T.num_kv_heads,
                      head_dim=T.head_dim, max_position_embeddings=T.max_position_embeddings,
                      rms_norm_eps=T.rms_norm_eps, rope_theta=T.rope_theta,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    with torch.no_grad():  # transformers' init is near-zero: make the output vary
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 1.0 / p.shape[-1] ** 0.5)
        model.model.embed_tokens.weight.normal_(0.0, 1.0)
    root = tmp_path_factory.mktemp("transformers")
    # one file, and sharded with an index (what save_pretrained writes for a larger model)
    for name, shard in (("saved", "10GB"), ("sharded", "2MB")):
        out = root / name
        model.save_pretrained(out, max_shard_size=shard)
        AutoTokenizer.from_pretrained(_live.base).save_pretrained(out)
        config = json.loads((out / "config.json").read_text())
        config.pop("architectures", None)
        assert config["model_type"] == "llama"
        (out / "config.json").write_text(json.dumps(config, indent=2))
    assert (root / "sharded" / "model.safetensors.index.json").exists()
    assert len(list((root / "sharded").glob("*.safetensors"))) > 1
    return root / "saved"


def test_update_weights_from_a_transformers_dir(live: Live, transformers_dir: Path) -> None:
    h = live.http
    before = h.post(f"{live.url}/generate", json={
        "input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}).json()
    r = h.post(f"{live.url}/update_weights_from_disk",
               json={"model_path": str(transformers_dir), "weight_version": "hf-saved"})
    assert r.status_code == 200 and r.json()["success"], r.text
    after = h.post(f"{live.url}/generate", json={
        "input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}).json()
    assert after["meta_info"]["weight_version"] == "hf-saved"
    assert after["output_ids"] != before["output_ids"]
    r = h.post(f"{live.supervisor}/update_weights_from_disk",
               json={"model_path": str(transformers_dir)})
    assert r.status_code == 200 and r.json()["success"], r.text
    # the same weights in shards: the same answer
    r = h.post(f"{live.url}/update_weights_from_disk",
               json={"model_path": str(transformers_dir.parent / "sharded")})
    assert r.status_code == 200 and r.json()["success"], r.text
    sharded = h.post(f"{live.url}/generate", json={
        "input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}).json()
    assert sharded["output_ids"] == after["output_ids"]


def test_engine_starts_from_a_transformers_dir(live: Live, transformers_dir: Path) -> None:
    """Start-up: an engine built on that directory answers what the updated engines
    answer (same weights, same greedy tokens)."""
    from multiserve.config import EngineConfig
    from multiserve.engine.engine import Engine
    from multiserve.reliability.tiny_model import tiny_engine_fields

    r = live.http.post(f"{live.url}/update_weights_from_disk",
                       json={"model_path": str(transformers_dir)})
    assert r.status_code == 200, r.text
    served = live.http.post(f"{live.url}/generate", json={
        "input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}).json()
    with Engine(EngineConfig(model_path=str(transformers_dir), device_indexes=(3,),
                             **tiny_engine_fields())) as engine:
        assert engine.model_config.architecture == "llama"
        out = engine.generate(input_ids=PROMPT,
                              sampling_params={"max_new_tokens": 8, "temperature": 0})
    assert list(out.output_ids) == served["output_ids"]
