"""Runner layer: the paged KV pool, attention over it, the sampler and the model runner.

The only layer (with ``models``) that imports torch. The engine drives :class:`ModelRunner`
with :class:`RunItem` batches and owns the block ids; the runner owns the tensors.
"""

from prefixkv.runner.attention import PagedAttention
from prefixkv.runner.kv_pool import KVPool
from prefixkv.runner.model_runner import ModelRunner, RunItem
from prefixkv.runner.sampler import SamplingRow, filter_logits, make_generator, sample

__all__ = [
    "KVPool",
    "ModelRunner",
    "PagedAttention",
    "RunItem",
    "SamplingRow",
    "filter_logits",
    "make_generator",
    "sample",
]
