"""How long a test lets a child process (a CLI run, a build, a compile) take.

The limit exists only to turn a hang into a failure: it is far above what any child takes on a
slow, busy machine (the slowest, the conformance suite on 2 busy cores, took about 7 minutes),
so no test fails because the machine is slow. Tests that check a product time limit (probe
timeouts, a benchmark child killed at its limit) set their own, small limits on purpose.
"""

#: seconds a test's child process may run before the test calls it hung
HANG_LIMIT_S = 1800.0
