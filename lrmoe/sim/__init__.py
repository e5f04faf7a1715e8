"""Cluster simulator (numpy only, no torch): routing traces, synthetic workloads, hardware and cost
models that replay traces through the planners of :mod:`lrmoe.planning`. See docs/simulator.md."""
