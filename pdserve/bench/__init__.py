"""`pdserve bench`: workloads, an open-loop load generator, SLO attainment and goodput.

Works against any OpenAI-compatible streaming server; see docs/bench.md.
"""
