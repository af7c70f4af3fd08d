"""Serving never imports torch (it is a test/benchmark reference only): an engine on the
default model, generating through the Engine API and the tokenizer, in a fresh process."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_engine_generates_without_importing_torch():
    code = textwrap.dedent("""
        import os, sys
        os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
        from multiserve import Engine, EngineConfig, SamplingParams
        # test_fleet_four.py's engine settings (one 64-token, 8-row bucket pair, a 4096-token
        # pool): the same step programs, so they come from the persistent compilation cache
        eng = Engine(EngineConfig(precompile_token_paddings=(64,), precompile_bs_paddings=(8,),
                                  max_running_requests=8, chunked_prefill_size=64,
                                  max_total_tokens=4096, show_progress=False))
        out = eng.generate("The capital of France is",
                           SamplingParams(temperature=0, max_new_tokens=4))
        assert len(out.output_ids) >= 1 and out.text, out
        eng.shutdown()
        assert "torch" not in sys.modules, "serving imported torch"
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")
