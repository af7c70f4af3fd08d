"""Row invariance, measured: the plan (plan.py: which formulation each primitive uses at each
size), the primitives that compute what it says (primitives.py), and the calibration that
probes candidate formulations on this machine and chooses a verified plan (calibration.py,
the driver, over workload.py, probes.py, choice.py and store.py); `multiserve doctor`
(multiserve/doctor/main.py) shows it. The choice (choice.py) is pure logic over probe results."""
