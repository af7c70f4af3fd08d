"""Benchmark peer: Hugging Face transformers batched `generate` (torch, CPU, fp32).

Run as a subprocess by `multiserve bench --peer hf` (torch never enters the
multiserve process), with .venv-peers/hf/bin/python if `scripts/peer-envs.sh hf` made
it, else multiserve's own interpreter. Reads token-id prompts from a JSON file,
generates exactly `--output-len` tokens per prompt with left-padded batches (greedy, or
with `--temperature T > 0` sampled at T, top_k / top_p off), and
prints ONE JSON line with its figures (and the generated ids, so the caller can compare
outputs); protocol: plugins/peers/protocol.py. Every generated token is timed (a step
clock), so `--stream` changes nothing here: one prompt is the single-stream run.

Exact token count: EOS is disabled for generation (`eos_token_id=None`), the same
semantics as multiserve's `ignore_eos` (an EOS may be generated and decoding goes on),
rather than `min_new_tokens`, which would mask EOS and change the greedy choice.

Seeds: `generate` draws from torch's global generator and takes no per-request seed,
so each batch is seeded once, `torch.manual_seed(--seed + index of its first prompt)`:
per request only with --batch-size 1 (the single stream). The result says so
(`seeding`).

Usage: python plugins/peers/hf_generate.py --prompts-file P.json --output-len 128
       --model DIR [--batch-size 0] [--threads N] [--stream] [--no-warmup]
       [--temperature T] [--seed S]
P.json: {"prompts": [[id, id, ...], ...]}
"""

from __future__ import annotations

import sys
import time
from typing import Any

from multiserve.bench.stats import peak_rss_mb
from multiserve.bench.stats import percentile as _percentile
from plugins.peers.protocol import emit, load_prompts, parse_args, sampling_record

SEEDING = ("per batch: torch.manual_seed(seed + index of the batch's first prompt); "
           "transformers' generate takes no per-request seed (per request only with "
           "--peer-batch-size 1)")


def _left_pad(batch: list[list[int]], pad_id: int) -> tuple[Any, Any]:
    import torch

    width = max(len(p) for p in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, p in enumerate(batch):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids, mask


def _make_step_clock() -> Any:
    """A StoppingCriteria that never stops and records when each new token exists."""
    import torch
    from transformers import StoppingCriteria

    class StepClock(StoppingCriteria):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool,
                               device=input_ids.device)

    return StepClock()


def _sampling(temperature: float, seed: int) -> dict[str, Any]:
    """generate()'s sampling arguments; seeds torch's global generator when sampling."""
    import torch

    if temperature <= 0:
        return {"do_sample": False}
    torch.manual_seed(seed)
    return {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}


def _generate(model: Any, batch: list[list[int]], output_len: int, pad_id: int,
              temperature: float = 0.0, seed: int = 0
              ) -> tuple[list[list[int]], list[float]]:
    import torch
    from transformers import StoppingCriteriaList

    ids, mask = _left_pad(batch, pad_id)
    clock = _make_step_clock()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=output_len,
            pad_token_id=pad_id, eos_token_id=None,
            stopping_criteria=StoppingCriteriaList([clock]),
            **_sampling(temperature, seed))
    new = out[:, ids.shape[1]:].tolist()
    return new, clock.times


def run(prompts: list[list[int]], output_len: int, model_dir: str, batch_size: int,
        threads: int, warmup: bool, temperature: float = 0.0, seed: int = 0,
        dtype: str = "float32") -> dict[str, Any]:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    t_load = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    model.eval()
    gen_cfg = model.generation_config
    gen_cfg.eos_token_id = None
    # the model's own sampling defaults are cleared: greedy, or exactly `_sampling`'s
    for name in ("temperature", "top_p", "top_k"):
        if hasattr(gen_cfg, name):
            setattr(gen_cfg, name, None)
    gen_cfg.do_sample = False
    pad_id = model.config.pad_token_id
    if pad_id is None:
        eos = model.config.eos_token_id
        pad_id = (eos[0] if isinstance(eos, list) else eos) or 0
    load_s = time.perf_counter() - t_load

    if warmup:  # first-call costs (allocator, kernels) stay out of the measurement
        _generate(model, [prompts[0][:8], prompts[-1][:4]], 2, pad_id, temperature, seed)

    bs = batch_size if batch_size > 0 else len(prompts)
    outputs: list[list[int]] = []
    ttft: list[float] = []
    itl: list[float] = []
    t0 = time.perf_counter()
    for start in range(0, len(prompts), bs):
        batch = prompts[start:start + bs]
        new, times = _generate(model, batch, output_len, pad_id, temperature, seed + start)
        outputs.extend(new)
        if times:
            ttft.extend([times[0] - t0] * len(batch))
            steps = [b - a for a, b in zip(times, times[1:], strict=False)]
            itl.extend(s for s in steps for _ in batch)
    wall = time.perf_counter() - t0
    total = sum(len(o) for o in outputs)
    return {
        "peer": "hf",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "threads": threads,
        "batch_size": bs,
        "num_prompts": len(prompts),
        "output_len": output_len,
        "output_tokens": total,
        "wall_s": wall,
        "tokens_per_s": total / wall if wall > 0 else 0.0,
        "ttft_p50_s": _percentile(ttft, 50),
        "ttft_p99_s": _percentile(ttft, 99),
        "itl_p50_s": _percentile(itl, 50),
        "itl_p99_s": _percentile(itl, 99),
        "load_s": load_s,
        "peak_rss_mb": peak_rss_mb(),
        "exact_length": all(len(o) == output_len for o in outputs),
        "output_ids": outputs,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args((__doc__ or "").splitlines()[0], argv)
    prompts = load_prompts(args.prompts_file)
    result = run(prompts, args.output_len, args.model, args.batch_size, args.threads,
                 warmup=not args.no_warmup, temperature=args.temperature, seed=args.seed,
                 dtype=args.dtype)
    emit({**result, **sampling_record(args, SEEDING)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
