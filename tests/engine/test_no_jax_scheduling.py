"""The scheduling part of the engine (every module of engine/sched/: scheduler, prefix
cache, page allocator, request, admission), the engine's leaf utilities (engine/base/: stop
strings, pause reasons, ...), its command types, its output side (streams) and the types
and config they use import and run without jax:
checked in a fresh interpreter where importing jax, jaxlib or flax raises."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ENGINE = REPO / "multiserve" / "engine"
SCHEDULING = (*sorted(f"multiserve.engine.{room}.{p.stem}" for room in ("sched", "base")
                      for p in (ENGINE / room).glob("*.py")),
              "multiserve.engine.commands", "multiserve.engine.streams",
              "multiserve.types", "multiserve.config")


def test_the_contract_covers_the_whole_sched_package() -> None:
    assert {"scheduler", "prefix_cache", "page_allocator", "request", "admission"} <= {
        m.rsplit(".", 1)[1] for m in SCHEDULING}


def test_scheduling_imports_and_runs_without_jax() -> None:
    code = textwrap.dedent(f"""
        import importlib, sys

        class NoJax:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("jax", "jaxlib", "flax"):
                    raise ImportError(f"blocked by the no-jax contract: {{name}}")
                return None

        sys.meta_path.insert(0, NoJax())
        for name in {SCHEDULING!r}:
            importlib.import_module(name)
        from multiserve.config import EngineConfig
        from multiserve.engine.sched.page_allocator import PageAllocator
        from multiserve.engine.sched.prefix_cache import PrefixCache
        from multiserve.engine.sched.request import Req
        from multiserve.engine.sched.scheduler import Scheduler
        from multiserve.types import SamplingParams
        cfg = EngineConfig(page_size=4, chunked_prefill_size=16)
        alloc = PageAllocator(9, 4)
        sched = Scheduler(cfg, alloc, PrefixCache(alloc, 4), 32, 16, 4)
        sched.add(Req("a", 0, list(range(10)), SamplingParams(max_new_tokens=2), 0,
                      lambda out: None))
        batch = sched.schedule()
        assert batch is not None and batch.num_tokens == 10
        sched.launch(batch)
        sched.check_integrity()
        bad = sorted(m for m in sys.modules if m.split(".")[0] in ("jax", "jaxlib", "flax"))
        assert not bad, bad
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")
