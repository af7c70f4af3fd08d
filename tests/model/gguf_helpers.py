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


def add_decoder_shape(w: gguf.GGUFWriter, conf: dict[str, Any]) -> None:
    """A transformers config.json's decoder shape as the converter writes it."""
    w.add_block_count(conf["num_hidden_layers"])
    w.add_context_length(conf["max_position_embeddings"])
    w.add_embedding_length(conf["hidden_size"])
    w.add_feed_forward_length(conf["intermediate_size"])
    w.add_head_count(conf["num_attention_heads"])
    w.add_head_count_kv(conf["num_key_value_heads"])
    w.add_key_length(conf["head_dim"])
    w.add_value_length(conf["head_dim"])
    w.add_layer_norm_rms_eps(conf["rms_norm_eps"])


def add_tiny_tokenizer(w: gguf.GGUFWriter, conf: dict[str, Any]) -> None:
    """The tiny byte-level BPE tokenizer (`tiny_vocab`) with the config's bos / eos."""
    tokens, types = tiny_vocab(conf["vocab_size"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(conf["bos_token_id"])
    w.add_eos_token_id(conf["eos_token_id"])
    w.add_chat_template(CHAT_TEMPLATE)


def write_mixtral_gguf(path: Path, hf_dir: Path, *, stacked: bool = True,
                       expert_type: Any = gguf.GGMLQuantizationType.F32) -> Path:
    """A transformers-written Mixtral checkpoint (`hf_dir`, one safetensors file) as
    llama.cpp's converter writes it: the llama architecture with expert_count /
    expert_used_count, q/k permuted, the tensor names of gguf's own tables (MODEL_TENSOR),
    each layer's experts stacked into ffn_gate_exps (w1) / ffn_up_exps (w3) /
    ffn_down_exps (w2) [E, rows, cols], or with `stacked=False` one tensor per expert
    (`blk.N.ffn_gate.E.weight`, the converter's names before it stacked them). The experts
    in `expert_type`, every other tensor float32."""
    import json

    from gguf.constants import MODEL_TENSOR as T
    from gguf.constants import TENSOR_NAMES
    from safetensors.numpy import load_file

    conf = json.loads((hf_dir / "config.json").read_text())
    (st,) = hf_dir.glob("*.safetensors")
    hf = load_file(str(st))
    w = gguf.GGUFWriter(str(path), "llama")
    add_decoder_shape(w, conf)
    w.add_rope_freq_base(conf["rope_parameters"]["rope_theta"])
    w.add_vocab_size(conf["vocab_size"])
    w.add_expert_count(conf["num_local_experts"])
    w.add_expert_used_count(conf["num_experts_per_tok"])
    if conf.get("sliding_window"):
        w.add_sliding_window(conf["sliding_window"])
    add_tiny_tokenizer(w, conf)
    heads, kv_heads = conf["num_attention_heads"], conf["num_key_value_heads"]
    name = {T.TOKEN_EMBD: "model.embed_tokens.weight", T.OUTPUT_NORM: "model.norm.weight",
            T.OUTPUT: "lm_head.weight"}
    for tensor, hf_name in name.items():
        add_tensor(w, TENSOR_NAMES[tensor] + ".weight", hf[hf_name], gguf.GGMLQuantizationType.F32)
    layer = {T.ATTN_NORM: "input_layernorm", T.ATTN_Q: "self_attn.q_proj",
             T.ATTN_K: "self_attn.k_proj", T.ATTN_V: "self_attn.v_proj",
             T.ATTN_OUT: "self_attn.o_proj", T.FFN_NORM: "post_attention_layernorm",
             T.FFN_GATE_INP: "block_sparse_moe.gate"}
    experts = {T.FFN_GATE_EXP: "w1", T.FFN_UP_EXP: "w3", T.FFN_DOWN_EXP: "w2"}
    for i in range(conf["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        for tensor, hf_name in layer.items():
            arr = hf[pre + hf_name + ".weight"]
            if tensor in (T.ATTN_Q, T.ATTN_K):
                arr = llama_permute(arr, heads if tensor == T.ATTN_Q else kv_heads)
            add_tensor(w, TENSOR_NAMES[tensor].format(bid=i) + ".weight", arr,
                       gguf.GGMLQuantizationType.F32)
        for tensor, proj in experts.items():
            parts = [hf[f"{pre}block_sparse_moe.experts.{e}.{proj}.weight"]
                     for e in range(conf["num_local_experts"])]
            if stacked:
                add_tensor(w, TENSOR_NAMES[tensor].format(bid=i) + ".weight",
                           np.stack(parts), expert_type)
            else:
                short = TENSOR_NAMES[tensor].format(bid=i).removesuffix("_exps")
                for e, part in enumerate(parts):
                    add_tensor(w, f"{short}.{e}.weight", part, expert_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def ggml_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """transformers' MXFP4 blocks [..., G, 16] (element 2j in byte j's low nibble, 2j + 1 in
    its high one) and scales [..., G] as ggml's MXFP4 bytes [..., G * 17]: each block its
    E8M0 scale byte, then byte j holding element j (low nibble) and j + 16 (high), as
    llama.cpp's converter repacks them."""
    codes = np.empty((*blocks.shape[:-1], 32), np.uint8)
    codes[..., 0::2], codes[..., 1::2] = blocks & 0x0F, blocks >> 4
    packed = (codes[..., :16] | (codes[..., 16:] << 4)).astype(np.uint8)
    out = np.concatenate([scales[..., None], packed], axis=-1)
    return out.reshape(*out.shape[:-2], -1)


def write_gpt_oss_gguf(path: Path, hf_dir: Path, *, fused: bool = False) -> Path:
    """A transformers-written GPT-OSS checkpoint (`hf_dir`, one safetensors file; its
    experts float32 or MXFP4 blocks and scales) as llama.cpp's converter writes it: the
    `gpt-oss` architecture, YaRN's factor and original context, gguf's own tensor names
    (MODEL_TENSOR), the sinks as `attn_sinks.weight`, each layer's interleaved gate_up
    split into ffn_gate_exps / ffn_up_exps [E, F, D] (`fused`: one ffn_gate_up_exps
    [E, 2F, D], gate rows first, the converter's newer form), down [E, D, F]; MXFP4 experts
    repacked into ggml's MXFP4 (`ggml_mxfp4`), every other tensor float32."""
    import json

    from gguf.constants import MODEL_TENSOR as T
    from gguf.constants import TENSOR_NAMES
    from safetensors.numpy import load_file

    conf = json.loads((hf_dir / "config.json").read_text())
    (st,) = hf_dir.glob("*.safetensors")
    hf = load_file(str(st))
    rope = conf["rope_parameters"]
    f32, mxfp4 = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.MXFP4
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    add_decoder_shape(w, conf)
    w.add_expert_feed_forward_length(conf["intermediate_size"])
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_sliding_window(conf["sliding_window"])
    w.add_vocab_size(conf["vocab_size"])
    w.add_expert_count(conf["num_local_experts"])
    w.add_expert_used_count(conf["num_experts_per_tok"])
    add_tiny_tokenizer(w, conf)
    name = {T.TOKEN_EMBD: "model.embed_tokens.weight", T.OUTPUT_NORM: "model.norm.weight",
            T.OUTPUT: "lm_head.weight"}
    for tensor, hf_name in name.items():
        add_tensor(w, TENSOR_NAMES[tensor] + ".weight", hf[hf_name], f32)
    layer = {T.ATTN_NORM: "input_layernorm.weight",
             T.ATTN_POST_NORM: "post_attention_layernorm.weight",
             T.ATTN_SINKS: "self_attn.sinks", T.FFN_GATE_INP: "mlp.router.weight"}
    for p, proj in ((T.ATTN_Q, "q"), (T.ATTN_K, "k"), (T.ATTN_V, "v"), (T.ATTN_OUT, "o")):
        layer[p] = f"self_attn.{proj}_proj.weight"
    biases = {T.ATTN_Q: "self_attn.q_proj.bias", T.ATTN_K: "self_attn.k_proj.bias",
              T.ATTN_V: "self_attn.v_proj.bias", T.ATTN_OUT: "self_attn.o_proj.bias",
              T.FFN_GATE_INP: "mlp.router.bias", T.FFN_DOWN_EXP: "mlp.experts.down_proj_bias"}

    def gname(tensor: Any, i: int, kind: str) -> str:
        return TENSOR_NAMES[tensor].format(bid=i) + "." + kind

    for i in range(conf["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        for tensor, hf_name in layer.items():
            add_tensor(w, gname(tensor, i, "weight"), hf[pre + hf_name], f32)
        for tensor, hf_name in biases.items():
            add_tensor(w, gname(tensor, i, "bias"), hf[pre + hf_name], f32)
        gate_b, up_b = (hf[pre + "mlp.experts.gate_up_proj_bias"][:, k::2] for k in (0, 1))
        gate_up = pre + "mlp.experts.gate_up_proj"
        if gate_up + "_blocks" in hf:  # MXFP4: rows are the outputs, blocks along the inputs
            blocks, scales = hf[gate_up + "_blocks"], hf[gate_up + "_scales"]
            halves = [ggml_mxfp4(blocks[:, k::2], scales[:, k::2]) for k in (0, 1)]
            down = pre + "mlp.experts.down_proj"
            w.add_tensor(gname(T.FFN_DOWN_EXP, i, "weight"),
                         ggml_mxfp4(hf[down + "_blocks"], hf[down + "_scales"]),
                         raw_dtype=mxfp4)
            kind = mxfp4
        else:  # float: [E, D, 2F] -> gate, up [E, F, D]; down [E, F, D] -> [E, D, F]
            halves = [np.ascontiguousarray(hf[gate_up][:, :, k::2].transpose(0, 2, 1))
                      for k in (0, 1)]
            add_tensor(w, gname(T.FFN_DOWN_EXP, i, "weight"),
                       np.ascontiguousarray(hf[pre + "mlp.experts.down_proj"].transpose(0, 2, 1)),
                       f32)
            kind = f32
        if fused:  # (a name gguf 0.19's tables do not have yet)
            both = np.concatenate(halves, axis=1)
            if kind == mxfp4:
                w.add_tensor(f"blk.{i}.ffn_gate_up_exps.weight", both, raw_dtype=mxfp4)
            else:
                add_tensor(w, f"blk.{i}.ffn_gate_up_exps.weight", both, f32)
            add_tensor(w, f"blk.{i}.ffn_gate_up_exps.bias", np.concatenate([gate_b, up_b], -1),
                       f32)
            continue
        for tensor, half, bias in ((T.FFN_GATE_EXP, halves[0], gate_b),
                                   (T.FFN_UP_EXP, halves[1], up_b)):
            if kind == mxfp4:
                w.add_tensor(gname(tensor, i, "weight"), half, raw_dtype=mxfp4)
            else:
                add_tensor(w, gname(tensor, i, "weight"), half, f32)
            add_tensor(w, gname(tensor, i, "bias"), np.ascontiguousarray(bias), f32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
