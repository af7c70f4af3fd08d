"""`multiserve.server` and `multiserve.parsing` are device-agnostic: importing (and using)
them never imports jax."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_server_package_never_imports_jax(tokenizer_dir):
    code = textwrap.dedent(f"""
        import importlib, pkgutil, sys
        import multiserve.server as server
        for mod in pkgutil.iter_modules(server.__path__):
            importlib.import_module("multiserve.server." + mod.name)
        import multiserve.parsing as parsing  # the parsers, a library for RL callers
        for mod in pkgutil.iter_modules(parsing.__path__):
            importlib.import_module("multiserve.parsing." + mod.name)
        from multiserve.server import TokenizerManager, build_app, ServerMetrics
        tm = TokenizerManager({str(tokenizer_dir)!r}, 512, "m")
        tm.apply_chat_template([{{"role": "user", "content": "hi"}}])
        class E:
            model_name, context_len = "m", 512
            def health(self): return True, "ok"
        build_app(E(), tm, metrics=ServerMetrics())
        bad = sorted(m for m in sys.modules if m == "jax" or m.startswith(("jax.", "jaxlib",
                                                                          "flax")))
        assert not bad, bad
        assert "torch" not in sys.modules, "the serving path must not import torch"
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")
