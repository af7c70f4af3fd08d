"""Rollout backend over HTTP: the fleet's per-engine ports (native /generate, streamed) and,
when given, the supervisor (fleet-wide control); otherwise control calls go to every
engine port and the two-phase weight update is driven from here.

Uses only multiserve's HTTP API. Generation runs on a private event loop in a daemon
thread, so `start()` returns at once with a handle that fills as chunks arrive.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from plugins.rollout.results import RolloutError, RolloutHandle, RolloutResult

Prompt = str | Sequence[int]
TIMEOUT = httpx.Timeout(600.0, connect=10.0)


class HttpBackend:
    def __init__(self, urls: Sequence[str], supervisor_url: str | None = None) -> None:
        assert urls, "need at least one engine URL"
        self.urls = [u.rstrip("/") for u in urls]
        self.supervisor_url = supervisor_url.rstrip("/") if supervisor_url else None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="rollout-http")
        self._thread.start()
        self._http = httpx.Client(timeout=TIMEOUT)
        self._batches = 0

    @property
    def num_engines(self) -> int:
        return len(self.urls)

    def close(self) -> None:
        self._http.close()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    # ---- generation --------------------------------------------------------------------
    def start(self, prompts: Sequence[Prompt], sampling: dict[str, Any],
              assign: Sequence[int]) -> RolloutHandle:
        n = int(sampling.get("n", 1))
        handle = RolloutHandle(len(prompts) * n)
        self._batches += 1
        batch = self._batches

        async def run_all() -> None:
            async with httpx.AsyncClient(timeout=TIMEOUT) as client:
                jobs = [self._one(client, handle, p, prompt, e, sampling, f"rollout-h{batch}-{p}")
                        for p, (prompt, e) in enumerate(zip(prompts, assign, strict=True))]
                results = await asyncio.gather(*jobs, return_exceptions=True)
            errors = [r for r in results if isinstance(r, BaseException)]
            if errors:
                handle.fail(errors[0])

        asyncio.run_coroutine_threadsafe(run_all(), self._loop)
        return handle

    async def _one(self, client: httpx.AsyncClient, handle: RolloutHandle, p: int,
                   prompt: Prompt, e: int, sampling: dict[str, Any], rid: str) -> None:
        body: dict[str, Any] = {"sampling_params": sampling, "stream": True,
                                "return_logprob": True, "rid": rid}
        if isinstance(prompt, str):
            body["text"] = prompt
        else:
            body["input_ids"] = [int(t) for t in prompt]
        n = int(sampling.get("n", 1))
        last: dict[int, dict[str, Any]] = {}
        async with client.stream("POST", f"{self.urls[e]}/generate", json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                raise RolloutError(f"engine {e}: /generate answered {resp.status_code}: {text}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RolloutError(f"engine {e}: {chunk['error'].get('message')}")
                i = int(chunk["index"]) % n
                last[i] = chunk
                handle.progress((p, i), len(chunk["output_ids"]))
        prompt_ids = tuple(int(t) for t in prompt) if not isinstance(prompt, str) else ()
        for i, chunk in sorted(last.items()):
            handle.finish(_to_result(chunk, p, i, prompt_ids, e))

    # ---- control ---------------------------------------------------------------------------
    def _post(self, url: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        r = self._http.post(f"{url}{path}", json=body or {})
        try:
            out = r.json()
        except ValueError:
            out = {"message": r.text}
        if r.status_code != 200:
            msg = out.get("message") or out.get("error", {}).get("message") or r.text
            raise RolloutError(f"{url}{path} answered {r.status_code}: {msg}")
        return out

    def _control(self, path: str, body: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        if self.supervisor_url is not None:
            return [self._post(self.supervisor_url, path, body)]
        return [self._post(u, path, body) for u in self.urls]

    def pause(self, mode: str) -> list[dict[str, Any]]:
        return self._control("/pause_generation", {"mode": mode})

    def resume(self) -> list[dict[str, Any]]:
        return self._control("/continue_generation")

    def abort_all(self) -> list[dict[str, Any]]:
        return self._control("/abort_request", {"abort_all": True})

    def release_memory(self, tags: Any, mode: str, preserve_state: bool) -> list[dict]:
        return self._control("/release_memory_occupation", {
            "tags": list(tags) if tags else None, "mode": mode,
            "preserve_state": preserve_state})

    def resume_memory(self, tags: Any) -> list[dict[str, Any]]:
        return self._control("/resume_memory_occupation",
                             {"tags": list(tags) if tags else None})

    def update_params(self, params: Any, version: str,
                      abort_running: bool) -> list[dict[str, Any]]:
        """`params`: an HF safetensors dir (path), or a flat {HF name: numpy array} dict
        (written to a temporary dir that every engine reads)."""
        if isinstance(params, (str, Path)):
            return self._update_from_disk(str(params), version, abort_running)
        if not isinstance(params, Mapping) or any(isinstance(v, Mapping)
                                                  for v in params.values()):
            raise RolloutError("over HTTP, params must be a path or a flat {HF name: array}")
        from safetensors.numpy import save_file

        tmp = Path(tempfile.mkdtemp(prefix="rollout-weights-"))
        try:
            save_file({k: np.ascontiguousarray(np.asarray(v)) for k, v in params.items()},
                      str(tmp / "model.safetensors"))
            return self._update_from_disk(str(tmp), version, abort_running)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _update_from_disk(self, path: str, version: str, abort: bool) -> list[dict[str, Any]]:
        body = {"path": path, "weight_version": version, "abort_running": abort}
        if self.supervisor_url is not None:
            return [self._post(self.supervisor_url, "/update_weights_from_disk", body)]
        staged: list[tuple[str, str]] = []
        try:
            for u in self.urls:
                staged.append((u, self._post(u, "/stage_weights_from_disk", body)["token"]))
        except RolloutError as e:
            for u, tok in staged:
                self._post(u, "/discard_staged_weights", {"token": tok})
            raise RolloutError(f"weight update to {version!r} not applied: {e}") from e
        return [self._post(u, "/publish_staged_weights", {"token": tok, "abort_running": abort})
                for u, tok in staged]

    def weight_versions(self) -> list[str]:
        out = []
        for u in self.urls:
            r = self._http.get(f"{u}/get_server_info")
            r.raise_for_status()
            out.append(r.json()["weight_version"])
        return out


def _to_result(chunk: dict[str, Any], p: int, i: int, prompt_ids: tuple[int, ...],
               e: int) -> RolloutResult:
    meta = chunk["meta_info"]
    fr = meta.get("finish_reason") or {}
    lps = tuple(float(x[0]) for x in meta.get("output_token_logprobs") or ())
    segs = tuple((int(s["start"]), str(s["weight_version"]))
                 for s in meta.get("weight_segments") or ())
    return RolloutResult(p, i, prompt_ids, tuple(chunk["output_ids"]), lps, chunk["text"],
                         fr.get("type"), meta["weight_version"], segs, e, meta["id"])
