"""The typed messages between pdserve's processes: plain data, no torch, no transport.

- `core`: a front end and one engine core (requests in; outputs, stats, load out).
- `handoff`: the prefill / decode hand-off of a request's KV, through the front end.
- `wire`: the unions each side decodes, the encoder guard, and `Handlers` (dispatch by
  message type).
- `timing`: `RequestTimes`, the one record of a request's timestamps, and the latency
  breakdowns computed from it (`RequestMetrics`).
- `sampling_params`: `SamplingParams`, what a request asks of the sampler, validated.
- `validation`: the checks of a request that need the model's limits (vocabulary,
  context), wherever a request enters.

The HTTP process imports this package to decode what instances send; it must stay free
of torch and of the KV transfer library (tests/test_imports.py checks).
"""
