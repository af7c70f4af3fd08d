"""The sampler: on device (`sampler`, jitted, batch-invariant) and its logprob records
read back on the host (`logprobs`); its host inputs are built in engine/step_inputs/."""
