"""Scheduler: decides what the next step computes, and owns every request's state.
Plain Python (never imports jax).

Every step is one ragged batch: one token for each decoding request, plus prefill
chunks (new admissions or the continuation of a chunked prefill) filling the rest of
the token budget. `schedule()` returns the step whole: a `ScheduledBatch` (its
`BatchRow`s, token count and RowPlan: engine/sched/batch.py, engine/sched/row_plan.py, the
one layout of its logits rows); the runner turns it into padded arrays. Which decode rows
verify drafts (speculative decoding) it asks of the DraftPlanner (engine/spec/planner.py,
`self.planner`); it obtains the pages a draft's positions need itself.

Its parts, one job each, joined here: the state and the moves of a Req's state
(state.py), the decode rows with their drafts and K decode steps (decode_rows.py), the
prefill rows (prefill_rows.py), the step's results (postprocess.py); `schedule` and
`launch` are this module's.

The Scheduler is the one writer of Req state (engine/sched/request.py): it admits,
launches, retracts, records a step's results (`postprocess`: tokens, logprobs, the stop
verdict of StopRules) and finishes (`finish`, the one finish path of a Req's state; the
core then delivers). Everything else reads Reqs.

Invariants:
- `reqs` holds every live Req (added, not finished), by (rid, index); `finish` removes it.
- `running` holds every admitted Req that holds KV (decoding or mid-prefill), in
  admission order; `waiting` holds the rest, front first. A Req is in at most one.
- A waiting Req with `pending > 0` (retracted while a step that samples for it was
  in flight) is not admitted until the host has read that token.
- Nothing writes a ScheduledBatch once `schedule()` returned it (frozen, rows too).
- A dispatch of K decode steps (`ScheduledBatch.decode_steps`, `_decode_steps`: decode
  rows that need no host decision between tokens, of a size the compiled sizes the core
  gave have the program of) holds every row's pages for its K
  positions before it is launched; `launch` advances each row K positions, and
  `postprocess_decode_steps` records its K tokens a row in order, up to the first that
  ends the sample.
- `launch(batch)` is called once the runner enqueued the step: only then do kv_len,
  pending and the prefix cache move, so a schedule that was never launched has no
  effect on state beyond page allocation (which `launch` makes permanent).
- When KV runs out for decode, the newest running Reqs are retracted (KV freed into
  the prefix cache or the free list, output kept) to the front of `waiting`.
- After a weight update (`invalidate_kv`), Reqs that kept their K/V hold K/V of the old
  weights: while any of them holds it the prefix cache is suspended (so no other Req
  matches or extends it); when the last gives it back (finish, abort, retract:
  `release_kv`) the cache is emptied and reopened.
- A model whose every layer slides (`kv_window` W > 0) reads no K/V more than W - 1
  positions behind a query: before each step, the pages of a running Req that lie wholly
  before its next query's window (position kv_len - W + 1; every later query's window
  starts later) are dropped (`_drop_out_of_window`). Where the prefix cache can extend
  the Req's chain, its full pages are inserted first and the dropped ones released to
  the cache (evictable: reused by a later request with the same prefix, or evicted under
  pressure, LRU), the chain's last page kept as the anchor of later inserts; elsewhere
  (cache off or suspended) its private ones are freed and it caches nothing more. A Req
  that replays its routed experts keeps every page (its ids are read from them).
- The prefix cache is namespaced by adapter version and cache salt
  (engine/sched/prefix_cache.py roots): a base-model Req (LoRA slot 0) matches and fills
  root 0; a LoRA Req its slot's root, new each time that slot is written
  (`lora_slot_written`); a salted Req (its request's cache_salt) the root of its salt
  under that root, so requests with different salts never share a page and those with
  the same salt share as unsalted ones do. A slot is written only while
  no live Req uses it (engine/core.py `load_lora`, `unload_lora`), so every Req matches
  and fills the root of the version it computes with, and K/V of an adapter version is
  never matched by another version, another adapter or the base model; a replaced
  version's pages are never matched again and age out by LRU.
"""

from __future__ import annotations

from multiserve.engine.sched.batch import ScheduledBatch
from multiserve.engine.sched.decode_rows import DecodeRows
from multiserve.engine.sched.postprocess import Postprocess
from multiserve.engine.sched.prefill_rows import PrefillRows
from multiserve.engine.sched.row_plan import logit_rows_of


class Scheduler(DecodeRows, PrefillRows, Postprocess):
    """One engine's scheduler (module docstring): its state and parts are its bases."""

    def schedule(self) -> ScheduledBatch | None:
        """The next step, complete (rows, token count, row plan); None: nothing to run.
        Nothing writes the batch after this returns."""
        if self.kv_window:
            for req in self.running:
                self._drop_out_of_window(req)
        rows = self._decode_rows()
        if self.planner.on and not self._prefill_pending():
            # (a prefill's step is compute-bound: drafts would slow it)
            rows = self._add_drafts(rows)
        tokens = sum(r.end - r.start for r in rows)
        logit_rows = sum(logit_rows_of(r) for r in rows)
        budget = min(self.cfg.chunked_prefill_size, self.max_tokens_per_step - tokens)
        rows += self._prefill_rows(budget, self.max_rows - logit_rows)
        if not rows:
            return None
        return ScheduledBatch.of(rows, self._decode_steps(rows))

    def launch(self, batch: ScheduledBatch) -> None:
        """The runner enqueued `batch`: advance positions and cache new full prefill pages."""
        decoded = False
        for b, row in enumerate(batch.rows):
            req = row.req
            was_prefill = req.in_prefill
            req.kv_len = row.end + batch.decode_steps - 1
            if row.samples:
                req.pending += batch.decode_steps
                req.last_out_row = b
            if was_prefill:
                self._extend_chain(req, row.end // self.page_size)
            else:
                decoded = True
        if decoded:
            self.new_token_ratio = max(self.cfg.min_new_token_ratio,
                                       self.new_token_ratio - self.cfg.new_token_ratio_decay)
