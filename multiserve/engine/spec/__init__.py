"""Speculative decoding that cannot change an output (no jax).

Drafts come from the host: `ngram_index.NgramIndex` (the latest earlier occurrence of the
context's last n tokens, and what followed it), over the request's own prompt + output and
over the finished outputs of earlier requests with the same prompt (`group_store`); the
`drafter.Drafter` chooses per request and step, tracks acceptance and backs off where
drafts miss; `planner.DraftPlanner`, which the scheduler asks, decides which decode rows of
a step verify a draft and how many tokens (by `step_costs.StepCosts`). Verification is the
scheduler's (engine/sched/scheduler.py): a draft of k tokens makes a decode row k + 1
tokens long, every one of its positions is sampled by the
request's own sampler (position-keyed noise, penalties over the prefix as of that
position), and the draft is accepted while it equals those samples; the first sample that
differs is emitted in its place. The model is row-invariant, so every emitted token (and
its logprobs) is bitwise the token decoding without speculation would have drawn.
"""
