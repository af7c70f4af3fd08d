"""The host-inputs room: everything a step's programs take, built from its ScheduledBatch.

One job per module: the padded token arrays and page table (`token_arrays`), the sampler's
row of every logits row (`row_specs`), those rows as a padded SamplingBatch
(`sampling_batch`), a plain decode step's SamplingBatch kept for the next ones
(`steady_rows`), the sampler's device zeros the penalty-free steps reuse
(`sampling_zeros`), a program's small inputs packed into one int32 array (`packed`) as
its programs take them (`program_inputs`). NumPy on the host; the device layer
(engine/device/) reads what this room builds and never builds it."""
