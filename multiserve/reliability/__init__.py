"""Reliability harnesses: schema fuzzing of the HTTP apps and the fleet chaos run.

Used by the test suite (tests/fuzz, tests/chaos) and by `multiserve fuzz` /
`multiserve chaos` for longer runs. Everything here talks to servers on loopback only
and is bounded in time and request count. `schemathesis` (the `test` extra) is imported
only by the fuzz harness.
"""
