"""Host arrays of one step: turns a ScheduledBatch into padded numpy inputs.

Padding rules (the runner and the model rely on them):
- Token rows beyond the batch write their K/V into page 0 (reserved) and read
  sequence row 0; their outputs are ignored.
- Sequence rows beyond the batch have seq_len 0 and an all-zero page table row.
- `from_prev[t] >= 0` means token t's id is the previous step's sampled id in device
  buffer row `from_prev[t]` (overlap: the host never waited for it); else `input_ids[t]`.
- `logit_rows[i]` is the token row whose logits logits row i holds: the batch's RowPlan
  (engine/sched/row_plan.py) says which (`LogitRow.token`), in its order: the sequence
  rows (row b: the last token of batch row b; a row that does not sample has its id
  ignored), then the prompt logprob rows, then the verify rows. Logits rows beyond the
  plan point at token row 0 and are ignored.
- `lora_slots[t]` (an engine with LoRA only, else None): token t's adapter slot, its
  Req's `lora_slot` (padding tokens 0: no adapter).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from multiserve.engine.sched.batch import ScheduledBatch
from multiserve.engine.sched.page_allocator import slot_for, slots_for


@dataclass
class StepArrays:
    input_ids: np.ndarray  # [T]
    from_prev: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    token_seq: np.ndarray  # [T]
    out_slots: np.ndarray  # [T]
    page_table: np.ndarray  # [B, max_pages], B = min(T, max_rows)
    seq_lens: np.ndarray  # [B]
    logit_rows: np.ndarray  # [max_rows]
    lora_slots: np.ndarray | None = None  # [T], only in an engine with LoRA


def empty_step_arrays(num_tokens: int, page_rows: int, logit_rows: int,
                      max_pages: int, lora: bool = False) -> StepArrays:
    """All-padding arrays of the given shapes (warm-up steps); `lora`: with (all-zero)
    LoRA slots."""
    return StepArrays(
        input_ids=np.zeros(num_tokens, np.int32), from_prev=np.full(num_tokens, -1, np.int32),
        positions=np.zeros(num_tokens, np.int32), token_seq=np.zeros(num_tokens, np.int32),
        out_slots=np.zeros(num_tokens, np.int32),
        page_table=np.zeros((page_rows, max_pages), np.int32),
        seq_lens=np.zeros(page_rows, np.int32), logit_rows=np.zeros(logit_rows, np.int32),
        lora_slots=np.zeros(num_tokens, np.int32) if lora else None)


def build_step_arrays(batch: ScheduledBatch, num_tokens: int, page_rows: int, logit_rows: int,
                      max_pages: int, page_size: int, lora: bool = False) -> StepArrays:
    """Arrays of `batch` padded to `num_tokens` tokens, `page_rows` sequence rows and
    `logit_rows` logits rows (the runner's fixed-size selection buffer); `lora`: with
    each token's LoRA slot."""
    t_pad = num_tokens
    input_ids = np.zeros(t_pad, np.int32)
    from_prev = np.full(t_pad, -1, np.int32)
    positions = np.zeros(t_pad, np.int32)
    token_seq = np.zeros(t_pad, np.int32)
    out_slots = np.zeros(t_pad, np.int32)  # page 0, offset 0: the padding sink
    page_table = np.zeros((page_rows, max_pages), np.int32)
    seq_lens = np.zeros(page_rows, np.int32)
    rows_out = np.zeros(logit_rows, np.int32)
    lora_slots = np.zeros(t_pad, np.int32) if lora else None
    rows_out[:len(batch.plan)] = batch.plan.token_rows
    a = StepArrays(input_ids, from_prev, positions, token_seq, out_slots, page_table,
                   seq_lens, rows_out, lora_slots)
    if batch.num_tokens == len(batch.rows):
        one_token_rows(batch, a, page_size)
    else:
        row_by_row(batch, a, page_size)
    return a


def row_by_row(batch: ScheduledBatch, a: StepArrays, page_size: int) -> None:
    """Write `batch`'s rows into the padding arrays `a`, one row after another (any
    batch)."""
    t = 0
    for b, row in enumerate(batch.rows):
        req = row.req
        n = row.end - row.start
        if row.from_prev:
            assert n == 1 and req.last_out_row >= 0
            a.from_prev[t] = req.last_out_row
        else:
            fill = req.fill_ids + list(row.draft) if row.draft else req.fill_ids
            a.input_ids[t:t + n] = fill[row.start:row.end]
        if n == 1:  # a decode row: scalar writes, cheaper than 1-element numpy slices
            a.positions[t] = row.start
            a.token_seq[t] = b
            a.out_slots[t] = slot_for(req.pages, row.start, page_size)
        else:
            a.positions[t:t + n] = np.arange(row.start, row.end, dtype=np.int32)
            a.token_seq[t:t + n] = b
            a.out_slots[t:t + n] = slots_for(req.pages, row.start, row.end, page_size)
        if a.lora_slots is not None:
            a.lora_slots[t:t + n] = req.lora_slot
        a.page_table[b, :len(req.pages)] = req.pages
        a.seq_lens[b] = row.end
        t += n


def one_token_rows(batch: ScheduledBatch, a: StepArrays, page_size: int) -> None:
    """`row_by_row` for a batch whose every row is one token (a decode step: token row b
    is batch row b): each array's first rows written by one slice store of a list, the
    same values `row_by_row` writes (tests/engine/test_host_path.py)."""
    rows = batch.rows
    n = len(rows)
    ids: list[int] = []
    prev: list[int] = []
    for b, row in enumerate(rows):
        req = row.req
        if row.from_prev:
            assert req.last_out_row >= 0
            ids.append(0)
            prev.append(req.last_out_row)
        else:  # fill_ids[start], without building fill_ids
            prompt = req.prompt_ids
            start = row.start
            ids.append(prompt[start] if start < len(prompt)
                       else req.output_ids[start - len(prompt)])
            prev.append(-1)
        a.page_table[b, :len(req.pages)] = req.pages
    starts = [row.start for row in rows]
    a.input_ids[:n] = ids
    a.from_prev[:n] = prev
    a.positions[:n] = starts
    a.token_seq[:n] = np.arange(n, dtype=np.int32)
    a.out_slots[:n] = [slot_for(row.req.pages, pos, page_size)
                       for row, pos in zip(rows, starts, strict=True)]
    a.seq_lens[:n] = [pos + 1 for pos in starts]
    if a.lora_slots is not None:
        a.lora_slots[:n] = [row.req.lora_slot for row in rows]
