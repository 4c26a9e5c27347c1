"""Tensor parallelism inside an instance (issue 54): how a model is split between ranks
(`layout`: a shard described as data), the shard's config and weights (`shard`), and
the ranks' process group (`group`: gloo on CPU, NCCL on CUDA). The ranks as processes of
an instance: pdserve/engine/ranks.py. docs/parallelism.md."""
