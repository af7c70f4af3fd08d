"""GPT-OSS's MXFP4 experts (loading/mxfp4.py): de-quantized bit for bit as transformers
de-quantizes them (float32 and bfloat16); a checkpoint stored as the released ones are
(MXFP4 experts, `quantization_config`) loads with the experts transformers loads from it,
bit for bit, and serves its logits and greedy ids."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
from family_checkpoints import make_model, to_mxfp4
from model_helpers import PagedSim
from moe_checkpoints import save

from multiserve.model.loading import mxfp4
from multiserve.model.loading.loader import load_model
from multiserve.model.simple_generate import greedy_token_ids

torch.set_num_threads(1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_is_transformers_bit_for_bit(dtype: torch.dtype) -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (3, 40, 4, 16), dtype=np.uint8)  # every code
    scales = rng.integers(100, 150, (3, 40, 4), dtype=np.uint8)  # 2^-27 .. 2^22
    want = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                      dtype=dtype)
    got = torch.from_numpy(mxfp4.dequantize(blocks, scales)).to(dtype)
    assert got.shape == want.shape == (3, 128, 40)
    assert torch.equal(got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       want.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))


def test_an_mxfp4_checkpoint_loads_and_serves_as_transformers_does(tmp_path) -> None:
    import transformers

    path = to_mxfp4(save(make_model("gpt_oss", seed=4), tmp_path / "gpt-oss-mxfp4"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    loaded = load_model(str(path), "float32")
    cfg = loaded.config
    for i, layer in enumerate(hf.model.layers):
        experts = layer.mlp.experts
        assert np.array_equal(loaded.params["moe"]["we_gateup"][i],
                              experts.gate_up_proj.detach().numpy())
        assert np.array_equal(loaded.params["moe"]["we_down"][i],
                              experts.down_proj.detach().numpy())
    bf16 = load_model(str(path), "bfloat16")  # exact: every MXFP4 value is a bf16 value
    assert np.array_equal(bf16.params["moe"]["we_gateup"].astype(np.float32),
                          loaded.params["moe"]["we_gateup"])
    prompt = [int(t) for t in np.random.default_rng(1).integers(3, 500, 40)]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].numpy()
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    sim = PagedSim(jax.device_put(loaded.params), cfg, page_size=4, block_size=8)
    sim.add("p", prompt)
    got = sim.step([("p", len(prompt))], T=64, logits_for={"p": list(range(len(prompt)))})
    diff = max(float(np.max(np.abs(got[("p", i)] - ref[i]))) for i in range(len(prompt)))
    print(f"gpt_oss MXFP4: max|logits diff| = {diff:.2e}")
    assert diff <= 1e-3
    assert greedy_token_ids(jax.device_put(loaded.params), cfg, prompt, 16) == want
