"""The device side of one engine: its device state and step launch (`runner`), the step's
math (`step_functions`), its compiled programs (`step_programs`, `programs`). The host
inputs they take are built in engine/step_inputs/."""
