"""The device side of one engine: its device state and step launch (`runner`), the step's
math (`step_functions`), its compiled programs (`step_programs`, `programs`) and the host
arrays they take (`batch_arrays`, `step_inputs`, `sampling_batches`)."""
