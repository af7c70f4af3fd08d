"""Engine test fixtures: shared engines (built once) and the memory-integrity check.

Engines: `tiny_engine` (tiny random Llama, small buckets, chunked prefill forced small,
overlap on), `tiny_engine_no_overlap` (same, overlap off), `tiny_engine_pressure` (a KV
pool so small that decode must retract), `tiny_engine_spec` (n-gram speculation on),
`tiny_engine_bf16` (the same model as a bfloat16 checkpoint, dtype "auto"),
`tiny_engine_each_dtype` (a parametrized fixture: `tiny_engine`, then `tiny_engine_bf16`), and
`default_engine` (the embedded SmolLM2 model with the shipped main job's engine settings,
configs/cpu-4.toml's [engine]; only its KV pool is smaller, as the validate run's).

After every test, each engine the test used must be idle with all its KV back: the
autouse `memory_integrity` fixture checks that (see `engine_helpers.assert_idle_and_clean`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from engine_helpers import (
    TINY_ENGINE,
    TINY_VOCAB,
    DraftsAlwaysPay,
    Trigger,
    assert_idle_and_clean,
    restore,
)
from shipped_engine import shipped_engine_config

from multiserve.config import EngineConfig, ModelConfig

TINY_MODEL = ModelConfig(
    architecture="llama", vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128,
    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=2048,
    tie_word_embeddings=False, bos_token_id=1, eos_token_ids=(2,))


_USED: list[Any] = []  # engines handed to the current test


def tiny_params(cfg: ModelConfig, seed: int = 0) -> dict[str, Any]:
    """Random weights scaled so the model's greedy output is varied and depends on its
    whole context (unit-variance residual stream, 1/sqrt(fan_in) projections)."""
    from multiserve.model.loading.param_layout import param_shapes

    rng = np.random.default_rng(seed)

    def init(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if "norm" in name:
            return np.ones(shape, np.float32)
        if name == "embed":
            return rng.standard_normal(shape).astype(np.float32)
        return (rng.standard_normal(shape) / np.sqrt(shape[-2])).astype(np.float32)

    shapes = param_shapes(cfg)
    return {k: ({n: init(n, s) for n, s in v.items()} if k == "layers" else init(k, v))
            for k, v in shapes.items()}


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face style dir of TINY_MODEL with the SmolLM2 tokenizer: its first
    TINY_VOCAB ids (specials, bytes, early merges) decode normally; prompts are ids."""
    from multiserve.model.loading.default_model import default_tokenizer_dir
    from multiserve.model.loading.loader import save_hf_dir

    path = tmp_path_factory.mktemp("tiny-llama")
    save_hf_dir(path, TINY_MODEL, tiny_params(TINY_MODEL), tokenizer_dir=default_tokenizer_dir())
    return path


@pytest.fixture(scope="session")
def tiny_model_dir_bf16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """TINY_MODEL's weights rounded to bfloat16, saved as a bfloat16 checkpoint (config.json
    torch_dtype bfloat16): what a bfloat16 trainer ships."""
    import ml_dtypes

    from multiserve.model.loading.default_model import default_tokenizer_dir
    from multiserve.model.loading.loader import save_hf_dir

    path = tmp_path_factory.mktemp("tiny-llama-bf16")
    save_hf_dir(path, TINY_MODEL, tiny_params(TINY_MODEL), tokenizer_dir=default_tokenizer_dir(),
                dtype=ml_dtypes.bfloat16)
    return path


def _engine(**kw: Any) -> Iterator[Any]:
    from multiserve.engine.engine import Engine

    eng = Engine(EngineConfig(**kw))
    try:
        yield eng
    finally:
        eng.shutdown()


@pytest.fixture(scope="session")
def _tiny_engine(tiny_model_dir: Path) -> Iterator[Any]:
    yield from _engine(model_path=str(tiny_model_dir), **TINY_ENGINE)


@pytest.fixture(scope="session")
def _tiny_engine_no_overlap(tiny_model_dir: Path) -> Iterator[Any]:
    yield from _engine(model_path=str(tiny_model_dir), **TINY_ENGINE, disable_overlap=True)


@pytest.fixture(scope="session")
def _tiny_engine_pressure(tiny_model_dir: Path) -> Iterator[Any]:
    kw = {**TINY_ENGINE, "max_total_tokens": 256, "max_context_len": 256}
    yield from _engine(model_path=str(tiny_model_dir), **kw)


@pytest.fixture(scope="session")
def _tiny_engine_spec(tiny_model_dir: Path) -> Iterator[Any]:
    yield from _engine(model_path=str(tiny_model_dir), **TINY_ENGINE,
                       speculative_algorithm="ngram", speculative_num_draft_tokens=4)


@pytest.fixture(scope="session")
def _tiny_engine_bf16(tiny_model_dir_bf16: Path) -> Iterator[Any]:
    """The tiny engine on the bfloat16 checkpoint, dtype "auto" (hence bfloat16 where the
    native bfloat16 kernels run)."""
    yield from _engine(model_path=str(tiny_model_dir_bf16), **TINY_ENGINE)


@pytest.fixture(scope="session")
def _default_engine() -> Iterator[Any]:
    from multiserve.engine.engine import Engine

    eng = Engine(shipped_engine_config())
    try:
        yield eng
    finally:
        eng.shutdown()


def _used(eng: Any) -> Any:
    _USED.append(eng)
    return eng


@pytest.fixture
def tiny_engine(_tiny_engine: Any) -> Any:
    return _used(_tiny_engine)


@pytest.fixture
def tiny_engine_no_overlap(_tiny_engine_no_overlap: Any) -> Any:
    return _used(_tiny_engine_no_overlap)


@pytest.fixture
def tiny_engine_pressure(_tiny_engine_pressure: Any) -> Any:
    return _used(_tiny_engine_pressure)


@pytest.fixture
def tiny_engine_spec(_tiny_engine_spec: Any) -> Iterator[Any]:
    """The tiny engine with n-gram speculation; a test may swap its draft source (the
    scheduler's DraftPlanner's `source`): the n-gram drafter is put back afterwards."""
    from multiserve.engine.commands import Call

    def swap(drafter: Any = None, costs: Any = None) -> tuple[Any, Any]:
        def run(core: Any) -> tuple[Any, Any]:
            planner = core.scheduler.planner
            old = planner.source, planner.step_costs
            if drafter is not None:
                planner.set_source(drafter)
                planner.step_costs = costs
            return old
        return _tiny_engine_spec.call(Call(run)).result()

    own, costs = swap()
    swap(own, DraftsAlwaysPay())  # every draft verified: no test depends on step timings
    yield _used(_tiny_engine_spec)
    swap(own, costs)


@pytest.fixture
def tiny_engine_bf16(_tiny_engine_bf16: Any) -> Any:
    return _used(_tiny_engine_bf16)


@pytest.fixture(params=["float32", "bfloat16"])
def tiny_engine_each_dtype(request: pytest.FixtureRequest) -> Any:
    """`tiny_engine`, then `tiny_engine_bf16` (the same settings on the bfloat16 checkpoint,
    served in bfloat16): a determinism test run in both compute dtypes. The bfloat16 case is
    skipped where the native bfloat16 kernels do not run ("auto" would serve float32)."""
    if request.param == "bfloat16":
        from multiserve.model.kernels import native as native_kernels

        if native_kernels.unavailable_reason("bfloat16") is not None:
            pytest.skip("the native bfloat16 kernels do not run here")
        eng = request.getfixturevalue("_tiny_engine_bf16")
        assert eng.get_internal_state()["dtype"] == "bfloat16"
        return _used(eng)
    return _used(request.getfixturevalue("_tiny_engine"))


@pytest.fixture
def default_engine(_default_engine: Any) -> Any:
    return _used(_default_engine)


@pytest.fixture(autouse=True)
def memory_integrity(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test: every engine it used is idle, its page accounting holds, and a
    cache flush gives back every KV token (no page leaked)."""
    _USED.clear()
    yield
    engines, failed = list(_USED), request.node.stash.get(_FAILED, False)
    _USED.clear()
    for eng in engines:
        if failed or not eng.health()[0]:
            restore(eng)  # the test already failed: only clean up for the next one
            continue
        assert_idle_and_clean(eng)


_FAILED = pytest.StashKey[bool]()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Any:
    rep = yield
    if rep.when == "call" and rep.failed:
        item.stash[_FAILED] = True
    return rep


@pytest.fixture
def trigger() -> Iterator[Trigger]:
    t = Trigger()
    yield t
    t.close()
