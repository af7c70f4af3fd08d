"""Build Hugging Face tokenizer files from a GGUF file's tokenizer metadata, without torch.

Byte-level BPE vocabularies (`tokenizer.ggml.model == "gpt2"`: SmolLM2, Llama 3, Qwen) are
built directly with `tokenizers` from the tokens + merges, with the pre-tokenizer the
`tokenizer.ggml.pre` name calls for; control tokens become special added tokens.
Sentencepiece-style vocabularies ("llama") go through transformers' GGUF tokenizer converter.
The result is saved as tokenizer.json + tokenizer_config.json (+ special_tokens_map.json) so
that `transformers.AutoTokenizer.from_pretrained(dir)` works.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from multiserve.model.errors import ModelLoadError

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
           "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}
CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types


def _pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    if pre in _SPLITS:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":  # GPT-2 split, digits one by one
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        byte_level])
    return byte_level  # "gpt2", "default", unknown names: plain GPT-2 byte-level split


def build_byte_level_bpe(tokens: list[str], merges: list[str], token_types: list[int],
                         pre: str | None) -> Tokenizer:
    """A byte-level BPE Tokenizer equivalent to the GGUF vocabulary."""
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    special = [AddedToken(t, special=True, normalized=False)
               for t, kind in zip(tokens, token_types, strict=False) if kind == CONTROL]
    plain = [AddedToken(t, special=False, normalized=False)
             for t, kind in zip(tokens, token_types, strict=False) if kind == USER_DEFINED]
    tok.add_special_tokens(special)
    tok.add_tokens(plain)
    return tok


def _sentencepiece_via_transformers(arch: str, fields: dict[str, Any]) -> Tokenizer:
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            convert_gguf_tokenizer,
        )
    except ImportError as e:  # pragma: no cover - depends on the transformers version
        raise ModelLoadError(f"sentencepiece GGUF tokenizers need transformers' GGUF "
                             f"converter, not available: {e}") from e
    tok, _ = convert_gguf_tokenizer(arch, fields)
    return tok


def write_tokenizer_files(out_dir: Path, arch: str, meta: dict[str, Any], source: Path,
                          max_length: int) -> None:
    """Write tokenizer.json, tokenizer_config.json, special_tokens_map.json into out_dir.

    `meta` maps GGUF keys ("tokenizer.ggml.tokens", ...) to decoded python values.
    """
    tokens = meta.get("tokenizer.ggml.tokens")
    kind = meta.get("tokenizer.ggml.model")
    if not tokens or not kind:
        raise ModelLoadError(f"{source}: no tokenizer in the GGUF metadata "
                             "(tokenizer.ggml.tokens / tokenizer.ggml.model)")
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    if kind == "gpt2":
        merges = meta.get("tokenizer.ggml.merges")
        if not merges:
            raise ModelLoadError(f"{source}: byte-level BPE tokenizer without merges")
        tok = build_byte_level_bpe(tokens, merges, types, meta.get("tokenizer.ggml.pre"))
    elif kind == "llama":
        fields = {"tokenizer_type": kind, "tokens": tokens, "token_type": types,
                  "scores": meta.get("tokenizer.ggml.scores"),
                  "merges": meta.get("tokenizer.ggml.merges")}
        tok = _sentencepiece_via_transformers(arch, {k: v for k, v in fields.items()
                                                     if v is not None})
    else:
        raise ModelLoadError(f"{source}: unsupported tokenizer model {kind!r} "
                             "(supported: gpt2, llama)")
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token") and isinstance(bos_id, int):
        bos = tokens[bos_id]
        template = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                 special_tokens=[(bos, bos_id)])
        tok.post_processor = (processors.Sequence([tok.post_processor, template])
                              if tok.post_processor is not None else template)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))

    def tok_name(key: str) -> str | None:
        idx = meta.get(f"tokenizer.ggml.{key}")
        return tokens[idx] if isinstance(idx, int) and 0 <= idx < len(tokens) else None

    specials = {"bos_token": tok_name("bos_token_id"), "eos_token": tok_name("eos_token_id"),
                "unk_token": tok_name("unknown_token_id"),
                "pad_token": tok_name("padding_token_id")}
    specials = {k: v for k, v in specials.items() if v is not None}
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast", **specials,
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False, "model_max_length": max_length,
        "additional_special_tokens": [t for t, k in zip(tokens, types, strict=False) if k == CONTROL
                                      and t not in specials.values()],
    }
    if meta.get("tokenizer.chat_template"):
        config["chat_template"] = meta["tokenizer.chat_template"]
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out_dir / "special_tokens_map.json").write_text(json.dumps(specials, indent=2))
