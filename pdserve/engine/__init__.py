"""The engine: one instance's scheduler, model runner and KV cache, in-process
(`Engine`, `LLM`) or in its own process (`engine_process`)."""

from pdserve.runtime import quiet_openmp_waits

# Before any engine module imports torch (and with it libgomp, which reads its
# environment once): OpenMP threads that wait sleep instead of spinning.
quiet_openmp_waits()
