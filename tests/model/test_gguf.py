"""GGUF loading: the same weights as GGUF (F32/F16) and as safetensors give identical params
(llama's permuted q/k undone; qwen2 biases; qwen3 q/k norms; a llama GGUF with a sliding
window is Mistral; one with experts is Mixtral, stacked or per-expert tensors; Gemma 3's
norm names and 1 + w weights); quantized tensors (Q8_0, Q4_1)
de-quantize exactly as the gguf package does; the tokenizer rebuilt from the GGUF metadata
loads with AutoTokenizer; unsupported tensor types fail naming the file and tensor."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf_helpers import SPECIALS, write_gguf, write_mixtral_gguf
from transformers import AutoTokenizer

from multiserve.config import ModelConfig
from multiserve.model.errors import ModelLoadError
from multiserve.model.loading.gguf import gguf_name, llama_unpermute
from multiserve.model.loading.hf import save_hf_dir
from multiserve.model.loading.hf_names import params_to_hf
from multiserve.model.loading.loader import load_model
from multiserve.model.loading.param_layout import init_random_params

Q = gguf.GGMLQuantizationType
BASE = dict(vocab_size=272, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=16, rms_norm_eps=2.0 ** -16, rope_theta=10000.0,
            max_position_embeddings=512, bos_token_id=1, eos_token_ids=(2,))
CONFIGS = {
    "llama": ModelConfig(architecture="llama", tie_word_embeddings=True, **BASE),
    "qwen2": ModelConfig(architecture="qwen2", attention_bias=True, **BASE),
    "qwen3": ModelConfig(architecture="qwen3", qk_norm=True, **{**BASE, "head_dim": 32}),
    # llama.cpp's llama architecture with a sliding window in its metadata
    "mistral": ModelConfig(architecture="mistral", sliding_window=24, sliding_layers=(0, 1),
                           **BASE),
    # llama.cpp's rules: every 6th layer global, the local base 10 000, head_dim's scale
    "gemma3": ModelConfig(architecture="gemma3", qk_norm=True, sliding_window=24,
                          sliding_layers=(0, 1), rope_local_theta=10000.0,
                          query_pre_attn_scalar=16.0, norm_plus_one=True, sandwich_norms=True,
                          scale_embeddings=True, hidden_act="gelu_tanh",
                          tie_word_embeddings=True, **{**BASE, "rope_theta": 1e6}),
}
GGUF_ARCH = {"mistral": "llama"}  # how llama.cpp's converter names the architecture


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MULTISERVE_CACHE_DIR", str(tmp_path / "cache"))


def half_for_mlp(name: str):
    mlp = name.endswith(("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"))
    return Q.F16 if mlp or name == "token_embd.weight" else Q.F32


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_gguf_and_safetensors_give_identical_params(arch: str, tmp_path: Path) -> None:
    cfg = CONFIGS[arch]
    params = init_random_params(cfg, seed=11)
    # the F16 tensors of the GGUF hold f16-rounded values: store the same in safetensors
    for key in ("w_gate", "w_up", "w_down"):
        params["layers"][key] = params["layers"][key].astype(np.float16).astype(np.float32)
    if cfg.norm_plus_one:  # norms whose llama.cpp form 1 + w gives w back exactly
        for key, leaf in params["layers"].items():
            if key.endswith("norm"):
                params["layers"][key] = (np.round(leaf * 64) / 64).astype(np.float32)
        params["final_norm"] = (np.round(params["final_norm"] * 64) / 64).astype(np.float32)
    params["embed"] = params["embed"].astype(np.float16).astype(np.float32)
    gguf_path = write_gguf(tmp_path / f"{arch}.gguf", cfg, params, half_for_mlp,
                           architecture=GGUF_ARCH.get(arch))
    hf_dir = save_hf_dir(tmp_path / "hf", cfg, params)
    from_gguf = load_model(str(gguf_path), "float32")
    from_hf = load_model(str(hf_dir), "float32")
    assert from_gguf.config == from_hf.config == cfg
    a, b = params_to_hf(from_gguf.params, cfg), params_to_hf(from_hf.params, cfg)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype == np.float32
        assert np.array_equal(a[name], b[name]), name


def test_quantized_tensors_dequantize_like_gguf(tmp_path: Path) -> None:
    cfg = CONFIGS["llama"]
    params = init_random_params(cfg, seed=12)
    qtypes = {"blk.0.attn_q.weight": Q.Q8_0, "blk.0.ffn_up.weight": Q.Q8_0,
              "blk.1.attn_k.weight": Q.Q4_1, "blk.1.ffn_down.weight": Q.Q4_1,
              "token_embd.weight": Q.Q8_0}
    path = write_gguf(tmp_path / "q.gguf", cfg, params, lambda n: qtypes.get(n, Q.F32))
    loaded = params_to_hf(load_model(str(path), "float32").params, cfg)
    reader = gguf.GGUFReader(str(path))
    for tensor in reader.tensors:
        assert tensor.tensor_type == qtypes.get(tensor.name, Q.F32)
        expected = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        if tensor.name.endswith(("attn_q.weight", "attn_k.weight")):
            expected = llama_unpermute(expected, 4 if "attn_q" in tensor.name else 2)
        hf = next(n for n in loaded if gguf_name(n) == tensor.name)
        assert np.array_equal(loaded[hf], expected), tensor.name
        if tensor.name in qtypes:  # quantization is lossy but close to the original
            original = params_to_hf(params, cfg)[hf]
            assert 0 < np.max(np.abs(loaded[hf] - original)) < 0.05


def test_tokenizer_from_gguf_metadata(tmp_path: Path) -> None:
    cfg = CONFIGS["llama"]
    path = write_gguf(tmp_path / "t.gguf", cfg, init_random_params(cfg, seed=1))
    loaded = load_model(str(path), "float32")
    tok = AutoTokenizer.from_pretrained(str(loaded.tokenizer_dir))
    assert tok.bos_token == "<|im_start|>" and tok.eos_token == "<|im_end|>"
    assert len(tok) == cfg.vocab_size
    ids = tok("the thin cat 42", add_special_tokens=False)["input_ids"]
    pieces = tok.convert_ids_to_tokens(ids)
    # merges applied by rank within each pre-token; smollm pre-tokenizer: digits one by one
    assert pieces == ["t", "he", "Ġt", "h", "in", "Ġ", "c", "at", "Ġ", "4", "2"]
    assert tok.decode(ids) == "the thin cat 42"
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    chat_ids = tok(text, add_special_tokens=False)["input_ids"]
    assert chat_ids[0] == 1 and chat_ids.count(2) == 1  # special tokens stay whole
    assert tok.decode(chat_ids, skip_special_tokens=True) == "user\nhi\nassistant\n"
    assert all(t in tok.all_special_tokens for t in SPECIALS)


def test_unsupported_tensor_type_names_file_and_tensor(tmp_path: Path) -> None:
    cfg = CONFIGS["llama"]
    path = write_gguf(tmp_path / "iq.gguf", cfg, init_random_params(cfg, seed=2),
                      lambda n: Q.Q5_1 if n == "blk.1.ffn_gate.weight" else Q.F32)
    from multiserve.model.loading import gguf as gguf_loader

    supported = tuple(t for t in gguf_loader.SUPPORTED_TYPES if t != "Q5_1")
    mp = pytest.MonkeyPatch()
    mp.setattr(gguf_loader, "SUPPORTED_TYPES", supported)  # pretend Q5_1 is unknown
    try:
        with pytest.raises(ModelLoadError) as err:
            load_model(str(path), "float32")
    finally:
        mp.undo()
    msg = str(err.value)
    assert str(path) in msg and "blk.1.ffn_gate.weight" in msg and "Q5_1" in msg


def test_gguf_missing_and_misshaped_tensor_and_unknown_architecture(tmp_path: Path) -> None:
    cfg = CONFIGS["qwen2"]
    params = init_random_params(cfg, seed=3)
    missing = write_gguf(tmp_path / "m.gguf", cfg, params, skip=("blk.1.attn_v.bias",))
    with pytest.raises(ModelLoadError, match=r"m\.gguf.*missing tensor 'blk\.1\.attn_v\.bias'"):
        load_model(str(missing), "float32")
    bad = dict(params, layers=dict(params["layers"]))
    bad["layers"]["w_up"] = np.zeros((2, 64, 64), np.float32)
    shaped = write_gguf(tmp_path / "s.gguf", cfg, bad)
    with pytest.raises(ModelLoadError, match=r"s\.gguf.*'blk\.0\.ffn_up\.weight' has shape"):
        load_model(str(shaped), "float32")
    unknown = write_gguf(tmp_path / "u.gguf", cfg, params, architecture="mamba")
    with pytest.raises(ModelLoadError, match=r"u\.gguf.*unknown architecture 'mamba'"):
        load_model(str(unknown), "float32")
    with pytest.raises(ModelLoadError, match="nope.gguf.*not found"):
        load_model(str(tmp_path / "nope.gguf"), "float32")


def test_concurrent_loads_convert_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Four threads (a fleet's engines) loading one GGUF with no cache yet: one converts,
    the others wait for it and read its result."""
    import threading

    from multiserve.model.loading import model_cache

    cfg = CONFIGS["llama"]
    gguf_path = write_gguf(tmp_path / "m.gguf", cfg, init_random_params(cfg, seed=3),
                           half_for_mlp)
    conversions: list[str] = []
    convert = model_cache.convert_gguf

    def counted(src: Path, out: Path) -> None:
        conversions.append(threading.current_thread().name)
        convert(src, out)

    monkeypatch.setattr(model_cache, "convert_gguf", counted)
    dirs: list[Path] = []
    threads = [threading.Thread(target=lambda: dirs.append(model_cache.cached_gguf_dir(
        gguf_path)), name=f"engine-{i}") for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(conversions) == 1, conversions
    assert len(dirs) == 4 and len(set(dirs)) == 1
    assert load_model(str(dirs[0]), "float32").config == cfg


@pytest.mark.parametrize("stacked", [True, False])
def test_mixtral_gguf_loads_as_its_checkpoint(stacked: bool, tmp_path: Path) -> None:
    """A transformers-written Mixtral checkpoint converted as llama.cpp does (the llama
    architecture with experts; stacked `_exps` tensors, or one per expert as older files
    have them) loads as Mixtral with the checkpoint's config and every tensor equal."""
    from family_checkpoints import write

    hf_dir = write("mixtral", tmp_path / "hf")
    path = write_mixtral_gguf(tmp_path / "mixtral.gguf", hf_dir, stacked=stacked)
    from_gguf = load_model(str(path), "float32")
    from_hf = load_model(str(hf_dir), "float32")
    # GGUF stores eps as float32: the same number once the model's float32 arithmetic has it
    assert np.float32(from_gguf.config.rms_norm_eps) == np.float32(from_hf.config.rms_norm_eps)
    assert replace(from_gguf.config, rms_norm_eps=from_hf.config.rms_norm_eps) == from_hf.config
    assert from_gguf.config.architecture == "mixtral" and from_gguf.config.num_experts == 4
    cfg = from_hf.config
    a, b = params_to_hf(from_gguf.params, cfg), params_to_hf(from_hf.params, cfg)
    assert a.keys() == b.keys()
    assert any(".experts.3.w2." in name for name in a)
    for name in a:
        assert np.array_equal(a[name], b[name]), name


def test_mixtral_gguf_quantized_experts_dequantize_like_gguf(tmp_path: Path) -> None:
    """Stacked Q8_0 experts come back per expert as gguf's own de-quantization of the
    stacked tensor."""
    from family_checkpoints import write
    from safetensors.numpy import load_file

    hf_dir = write("mixtral", tmp_path / "hf")
    path = write_mixtral_gguf(tmp_path / "q8.gguf", hf_dir, expert_type=Q.Q8_0)
    loaded = load_model(str(path), "float32")
    got = params_to_hf(loaded.params, loaded.config)
    (st,) = hf_dir.glob("*.safetensors")
    hf = load_file(str(st))
    stacked = np.stack([hf[f"model.layers.1.block_sparse_moe.experts.{e}.w2.weight"]
                        for e in range(4)])
    want = gguf.quants.dequantize(gguf.quants.quantize(stacked, Q.Q8_0), Q.Q8_0)
    for e in range(4):
        name = f"model.layers.1.block_sparse_moe.experts.{e}.w2.weight"
        assert np.array_equal(got[name], want[e]), name
        assert not np.array_equal(got[name], hf[name])  # quantized, not the float32 values
    reader_names = [t.name for t in gguf.GGUFReader(str(path)).tensors]
    assert "blk.1.ffn_down_exps.weight" in reader_names
