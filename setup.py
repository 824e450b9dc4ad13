"""Build hook for the optional C extensions; everything else is in pyproject.toml.

All are built when a C compiler is present; without one the install still succeeds:
``prefixkv.cache._keypack`` (18-bit packed radix keys; without it the radix tree keeps 4-byte
keys above 2**16, ``prefixkv.cache.radix_node.PACKED`` says which),
``prefixkv.cache._evict`` (whole-leaf eviction steps of the radix index; without it the Python
loop takes every step, ``prefixkv.cache._native.evict`` is ``None``),
``prefixkv.runner._cpu_attn`` (the AVX-512 prefill-attention kernel, OpenMP; without it
prefill attention is torch SDPA, ``prefixkv.runner.cpu_attention.BUILT`` says which) and
``prefixkv.models._cpu_ops`` (fused RMSNorm / SwiGLU / RoPE; ``prefixkv.models.cpu_ops.BUILT``).
"""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("prefixkv.cache._keypack", ["prefixkv/cache/_keypack.c"],
              optional=True, extra_compile_args=["-O3"]),
    Extension("prefixkv.cache._evict", ["prefixkv/cache/_evict.c"],
              optional=True, extra_compile_args=["-O3"]),
    Extension("prefixkv.runner._cpu_attn", ["prefixkv/runner/_cpu_attn.c"],
              depends=["prefixkv/runner/_cpu_attn_tile.h", "prefixkv/models/_avx512.h"],
              include_dirs=["prefixkv/models"], optional=True,
              extra_compile_args=["-O3", "-fopenmp"], extra_link_args=["-fopenmp"]),
    Extension("prefixkv.models._cpu_ops", ["prefixkv/models/_cpu_ops.c"],
              depends=["prefixkv/models/_avx512.h"], optional=True,
              extra_compile_args=["-O3", "-fopenmp"], extra_link_args=["-fopenmp"]),
    Extension("prefixkv.models._cpu_gemv", ["prefixkv/models/_cpu_gemv.c"],
              depends=["prefixkv/models/_avx512.h"], optional=True,
              extra_compile_args=["-O3", "-fopenmp"], extra_link_args=["-fopenmp"]),
])
