"""Writing small GGUF files for tests: a tiny byte-level BPE tokenizer and model weights
(from our params pytree), with a chosen tensor type per tensor, the way llama.cpp's
converter lays them out (llama's q/k rows permuted)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from multiserve.config import ModelConfig
from multiserve.model.loading.gguf import NORM_SHIFT, gguf_name, llama_permute
from multiserve.model.loading.hf_names import params_to_hf

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "a t", "e r"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")


def byte_alphabet() -> list[str]:
    """The 256 printable stand-ins GPT-2 byte-level BPE uses for the bytes 0..255."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + \
        list(range(0xAE, 0xFF + 1))
    extra = 0
    chars = {}
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def tiny_vocab(vocab_size: int) -> tuple[list[str], list[int]]:
    merged = ["".join(m.split(" ")) for m in MERGES]
    tokens = SPECIALS + byte_alphabet() + merged
    assert len(tokens) <= vocab_size
    tokens += [f"<unused{i}>" for i in range(vocab_size - len(tokens))]
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    return tokens, types


TypeFor = Callable[[str], Any]  # GGUF tensor name -> GGMLQuantizationType


def write_gguf(path: Path, cfg: ModelConfig, params: dict[str, Any],
               type_for: TypeFor = lambda name: gguf.GGMLQuantizationType.F32,
               architecture: str | None = None,
               skip: tuple[str, ...] = (), pre: str = "smollm") -> Path:
    arch = architecture or cfg.architecture
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_vocab_size(cfg.vocab_size)
    if cfg.sliding_window:
        w.add_sliding_window(cfg.sliding_window)
    tokens, types = tiny_vocab(cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    for hf, arr in params_to_hf(params, cfg).items():
        name = gguf_name(hf, arch)
        if name in skip:
            continue
        arr = np.asarray(arr, np.float32)
        if name.endswith("norm.weight") and arch in NORM_SHIFT:  # llama.cpp's 1 + w
            arr = (arr + np.float32(NORM_SHIFT[arch])).astype(np.float32)
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            arr = llama_permute(arr, cfg.num_heads if "attn_q" in name else cfg.num_kv_heads)
        add_tensor(w, name, arr, type_for(name))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def add_tensor(w: gguf.GGUFWriter, name: str, arr: np.ndarray, qtype: Any) -> None:
    t = gguf.GGMLQuantizationType
    if qtype == t.F32:
        w.add_tensor(name, arr.astype(np.float32))
    elif qtype == t.F16:
        w.add_tensor(name, arr.astype(np.float16))
    else:
        w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
