"""Accuracy of bfloat16 serving (issue 30): our engine in bfloat16 against transformers in
bfloat16 on the same weights (greedy ids), and against a float32 reference (logprobs);
our float32 engine against transformers in float32 as the baseline.

    PYTHONPATH=. python scripts/bf16_accuracy.py [--models smollm2 tiny-llama tiny-qwen2-moe]
                                                 [--steps 32] [--prompts 8]

Models:
- smollm2: the embedded default model (SmolLM2-135M-Instruct; a Q4_1 GGUF de-quantized to
  float32 at load). dtype "auto" serves it in float32 on a CPU (engine/base/dtype_choice.py:
  bfloat16 cannot hold the de-quantized values exactly), so both dtypes are forced here.
  Prompts: chat-templated questions (tests/model/test_default_model.py's).
- tiny-llama: the tests' tiny random Llama (tests/engine/conftest.py TINY_MODEL, hidden 64,
  2 layers, vocab 512) saved as a bfloat16 checkpoint, as the tiny_model_dir_bf16 fixture
  does (the same weights). Prompts: random ids.
- tiny-qwen2-moe: the tests' tiny Qwen2-MoE (tests/moe_checkpoints.py, seed 9) saved in
  bfloat16. Prompts: random ids.

Per model, each prompt generates STEPS greedy tokens (ignore_eos), and:
- div bf16: the first index where our bf16 engine's ids differ from transformers' bf16
  greedy loop (KV cache, as `generate`); STEPS = none. Where they differ, `gap`: the float32
  reference's logit gap between the two tokens at that position (a near-tie when small);
- div f32: the same for our float32 engine against transformers float32 (the baseline);
- lp chosen / lp top5: max |logprob diff| of our bf16 engine against log_softmax of the float32
  reference (transformers float32 on the same weights, teacher-forced on our bf16 engine's
  own ids), for the chosen token and for the top-5 alternatives; `f32 lp` the same for our
  float32 engine (the baseline); `hf bf16` the same (chosen and top-5 together) for
  transformers in bfloat16 on the same ids: the error scale of a peer's bf16;
- 16v32: the first index where our bf16 engine's ids differ from our float32 engine's;
  `hf 16v32` the same for transformers (how far bf16 greedy follows float32 greedy).
The last line is one JSON object with everything.

transformers' weights: the same checkpoint loaded with torch_dtype bfloat16 / float32 (the
default model's float32 de-quantized values rounded to bfloat16 by torch, to nearest even,
as the engine rounds them). torch runs on one thread (shared cores).
"""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(tempfile.gettempdir(), "multiserve-bf16-accuracy-jax-cache"))

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

from multiserve.types import SamplingParams  # noqa: E402

# the tests' helpers: the default model's chat prompts, the tiny Qwen2-MoE checkpoint
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from chat_prompts import DEFAULT_MODEL_PROMPTS  # noqa: E402

NEAR_TIE = 0.25  # tests/engine/test_bf16_accuracy.py's bound on a tiny model's swapped pair
# small engines: one 16-token step bucket (8 decode rows or a 16-token prefill chunk), one
# 8-row logits bucket, compiled before serving
ENGINE = dict(precompile_token_paddings=(16,), precompile_bs_paddings=(8,),
              max_running_requests=8, chunked_prefill_size=16, page_size=16,
              max_total_tokens=4096, max_context_len=256, show_progress=False,
              compile_in_background=False)
TINY_VOCAB = 512


def tiny_llama_dir(root: Path) -> Path:
    """tests/engine/conftest.py's tiny_model_dir_bf16: TINY_MODEL with tiny_params(seed 0)
    (multiserve.reliability.tiny_model.tiny_params draws the same values) in bfloat16."""
    import ml_dtypes

    from multiserve.config import ModelConfig
    from multiserve.model.loading.default_model import default_model_path
    from multiserve.model.loading.loader import save_hf_dir
    from multiserve.reliability.tiny_model import tiny_params

    cfg = ModelConfig(
        architecture="llama", vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=2048,
        tie_word_embeddings=False, bos_token_id=1, eos_token_ids=(2,))
    return save_hf_dir(root / "tiny-llama-bf16", cfg, tiny_params(cfg, 0),
                       tokenizer_dir=default_model_path(), dtype=ml_dtypes.bfloat16)


def tiny_qwen2_moe_dir(root: Path) -> Path:
    """tests/moe_checkpoints.py's Qwen2-MoE (seed 9), its weights rounded to bfloat16 and
    saved so (config.json torch_dtype bfloat16)."""
    import torch
    from moe_checkpoints import make_model, save

    return save(make_model("qwen2_moe", seed=9).to(torch.bfloat16), root / "tiny-qwen2-moe")


def cpu_name() -> str:
    """The CPU as lscpu names it: model name, family and model (from /proc/cpuinfo)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine()
    info: dict[str, str] = {}
    for line in lines:
        key, _, value = line.partition(":")
        info.setdefault(key.strip(), value.strip())
    return (f"{info.get('model name', platform.machine())}, family {info.get('cpu family', '?')}"
            f" model {info.get('model', '?')}, {os.cpu_count()} CPUs")


def random_prompts(n: int) -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, 500) for _ in range(rng.randrange(4, 30))] for _ in range(n)]


def chat_prompts(tokenizer_dir: Path, n: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    out = []
    for p in DEFAULT_MODEL_PROMPTS[:n]:
        text = tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                       add_generation_prompt=True)
        out.append(tok(text, add_special_tokens=False)["input_ids"])
    return out


def engine_run(model_path: str | None, dtype: str, prompts: list[list[int]], steps: int
               ) -> tuple[list[Any], dict[str, Any]]:
    """Our engine's greedy outputs (ids, logprobs with top-5) for every prompt, batched,
    and what it ran (dtype, the plan's kernels)."""
    from multiserve.config import EngineConfig
    from multiserve.engine.engine import Engine

    t0 = time.perf_counter()
    eng = Engine(EngineConfig(model_path=model_path, dtype=dtype, **ENGINE))
    try:
        params = SamplingParams(temperature=0.0, max_new_tokens=steps, ignore_eos=True,
                                return_logprob=True, top_logprobs_num=5)
        outs = eng.generate(input_ids=prompts, sampling_params=params)
        state = eng.get_internal_state()
    finally:
        eng.shutdown()
    det = state["determinism"]
    plan = det["plan"]
    info = {"dtype": state["dtype"], "verified": det["verified"],
            "attention": plan["attention"]["kernel"],
            "products": sorted({k for p in plan["products"] for _, k, _ in p["by_rows"]
                                if not p["name"].startswith("we_")}),
            "grouped": sorted({k for p in plan["products"] for _, k, _ in p["by_rows"]
                               if p["name"].startswith("we_")}),
            "seconds": round(time.perf_counter() - t0, 1)}
    return outs, info


def hf_greedy(model: Any, prompt: list[int], steps: int) -> list[int]:
    """transformers' greedy loop with its KV cache (what `generate` runs), argmax over the
    logits widened to float32."""
    import torch

    ids: list[int] = []
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        while True:
            tok = int(torch.argmax(out.logits[0, -1].float()))
            ids.append(tok)
            if len(ids) == steps:
                return ids
            out = model(torch.tensor([[tok]]), past_key_values=out.past_key_values,
                        use_cache=True)


def ref_logprobs(model: Any, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(logits, log_softmax) of a transformers model at every position of `ids` (one
    forward; its logits widened to float32)."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return logits.numpy(), torch.log_softmax(logits, -1).numpy()


def first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compare(name: str, path: Path | None, prompts: list[list[int]], steps: int
            ) -> dict[str, Any]:
    import torch
    import transformers

    hf_path = path
    if path is None:
        from multiserve.model.loading.default_model import default_model_path
        hf_path = default_model_path()
    ours = {}
    info = {}
    for dtype in ("bfloat16", "float32"):
        ours[dtype], info[dtype] = engine_run(None if path is None else str(path), dtype,
                                              prompts, steps)
    t0 = time.perf_counter()
    hf = {dt: transformers.AutoModelForCausalLM.from_pretrained(
        str(hf_path), dtype=tdt).eval()
        for dt, tdt in (("bfloat16", torch.bfloat16), ("float32", torch.float32))}
    rows = []
    for i, prompt in enumerate(prompts):
        row: dict[str, Any] = {"prompt": i, "len": len(prompt)}
        hf_ids = {dtype: hf_greedy(hf[dtype], prompt, steps) for dtype in hf}
        # bfloat16 against float32 greedy ids: ours, and transformers' own
        row["div_bf16_f32"] = first_divergence(list(ours["bfloat16"][i].output_ids),
                                               list(ours["float32"][i].output_ids))
        row["hf_div_bf16_f32"] = first_divergence(hf_ids["bfloat16"], hf_ids["float32"])
        for dtype, key in (("bfloat16", "bf16"), ("float32", "f32")):
            out = ours[dtype][i]
            mine = list(out.output_ids)
            theirs = hf_ids[dtype]
            logits, logp = ref_logprobs(hf["float32"], prompt + mine)
            first = first_divergence(mine, theirs)
            row[f"div_{key}"] = first
            if first < steps:
                at = logits[len(prompt) - 1 + first]
                row[f"gap_{key}"] = round(abs(float(at[mine[first]] - at[theirs[first]])), 4)
                row[f"pair_{key}"] = [mine[first], theirs[first]]
            chosen = top = 0.0
            for j, (tok, lp) in enumerate(zip(mine, out.logprobs, strict=True)):
                ref = logp[len(prompt) - 1 + j]
                chosen = max(chosen, abs(lp.logprob - float(ref[tok])))
                top = max(top, *(abs(v - float(ref[t])) for t, v in lp.top))
            row[f"lp_chosen_{key}"] = float(f"{chosen:.3g}")
            row[f"lp_top5_{key}"] = float(f"{top:.3g}")
            if dtype == "bfloat16":  # transformers' own bf16 error on the same ids
                _, hf_logp = ref_logprobs(hf["bfloat16"], prompt + mine)
                d = np.abs(hf_logp - logp)[len(prompt) - 1:len(prompt) - 1 + steps]
                chosen_hf = d[np.arange(steps), mine].max()
                top_hf = max(float(d[j, [t for t, _ in lp.top]].max())
                             for j, lp in enumerate(out.logprobs))
                row["hf_bf16_lp_chosen"] = float(f"{chosen_hf:.3g}")
                row["hf_bf16_lp_top5"] = float(f"{top_hf:.3g}")
        rows.append(row)
    return {"model": name, "steps": steps, "engines": info,
            "hf_seconds": round(time.perf_counter() - t0, 1), "prompts": rows}


def print_table(res: dict[str, Any]) -> None:
    print(f"\n== {res['model']}: {len(res['prompts'])} prompts x {res['steps']} greedy tokens")
    for dtype, e in res["engines"].items():
        grouped = f" grouped={e['grouped']}" if e["grouped"] else ""
        print(f"   {dtype} engine: plan verified={e['verified']} attention={e['attention']} "
              f"products={e['products']}{grouped} ({e['seconds']} s)")
    print(f"{'prompt':>6} {'len':>4} | {'div bf16':>8} {'gap':>7} | {'lp chosen':>9} "
          f"{'lp top5':>8} {'hf bf16':>8} | {'div f32':>7} {'gap':>7} | {'f32 lp':>8} | "
          f"{'16v32':>5} {'hf 16v32':>8}")
    for r in res["prompts"]:
        g16 = f"{r['gap_bf16']:.3f}" if "gap_bf16" in r else "-"
        g32 = f"{r['gap_f32']:.3f}" if "gap_f32" in r else "-"
        print(f"{r['prompt']:>6} {r['len']:>4} | {r['div_bf16']:>8} {g16:>7} | "
              f"{r['lp_chosen_bf16']:>9.4f} {r['lp_top5_bf16']:>8.4f} "
              f"{max(r['hf_bf16_lp_chosen'], r['hf_bf16_lp_top5']):>8.4f} | {r['div_f32']:>7} "
              f"{g32:>7} | {max(r['lp_chosen_f32'], r['lp_top5_f32']):>8.2e} | "
              f"{r['div_bf16_f32']:>5} {r['hf_div_bf16_f32']:>8}")


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    rows, steps = res["prompts"], res["steps"]
    gaps = [r["gap_bf16"] for r in rows if "gap_bf16" in r]
    return {
        "model": res["model"],
        "bf16_first_div": [r["div_bf16"] for r in rows],
        "bf16_diverged": sum(r["div_bf16"] < steps for r in rows),
        "bf16_max_gap": max(gaps, default=None),
        "bf16_all_near_ties": all(g <= NEAR_TIE for g in gaps),
        "bf16_lp_chosen_max": max(r["lp_chosen_bf16"] for r in rows),
        "bf16_lp_top5_max": max(r["lp_top5_bf16"] for r in rows),
        "hf_bf16_lp_max": max(max(r["hf_bf16_lp_chosen"], r["hf_bf16_lp_top5"]) for r in rows),
        "f32_first_div": [r["div_f32"] for r in rows],
        "f32_max_gap": max((r["gap_f32"] for r in rows if "gap_f32" in r), default=None),
        "f32_lp_max": max(max(r["lp_chosen_f32"], r["lp_top5_f32"]) for r in rows),
        "bf16_plan": res["engines"]["bfloat16"],
        "f32_plan": res["engines"]["float32"],
        "bf16_vs_f32_first_div": [r["div_bf16_f32"] for r in rows],
        "hf_bf16_vs_f32_first_div": [r["hf_div_bf16_f32"] for r in rows],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["smollm2", "tiny-llama", "tiny-qwen2-moe"],
                    choices=["smollm2", "tiny-llama", "tiny-qwen2-moe"])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=8)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")  # transformers' deprecation notes

    import torch

    torch.set_num_threads(1)  # several busy threads on 2 shared cores slow torch 10x
    from multiserve.model.kernels import native as native_kernels

    t0 = time.perf_counter()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            if name == "smollm2":
                from multiserve.model.loading.default_model import default_model_path
                path, prompts = None, chat_prompts(default_model_path(), args.prompts)
            elif name == "tiny-llama":
                path, prompts = tiny_llama_dir(Path(tmp)), random_prompts(args.prompts)
            else:
                path, prompts = tiny_qwen2_moe_dir(Path(tmp)), random_prompts(args.prompts)
            res = compare(name, path, prompts, args.steps)
            print_table(res)
            results.append(res)
    summary = {"near_tie": NEAR_TIE, "bf16_product_path": native_kernels.bf16_product_path(),
               "cpu": cpu_name(),
               "seconds": round(time.perf_counter() - t0, 1),
               "models": [summarize(r) for r in results]}
    print()
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
