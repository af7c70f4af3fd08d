"""The device side of one engine: the jitted bucketed step (`model_runner`) and the padded
host arrays it takes (`batch_arrays`)."""
