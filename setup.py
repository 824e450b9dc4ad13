"""Build hook for the optional C helper; everything else is in pyproject.toml.

``prefixkv.cache._keypack`` (18-bit packed radix keys) is built when a C compiler is present;
without one the install still succeeds and the radix tree keeps 4-byte keys above 2**16
(``prefixkv.cache.radix_keys.PACKED`` says which).
"""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("prefixkv.cache._keypack", ["prefixkv/cache/_keypack.c"],
              optional=True, extra_compile_args=["-O3"]),
    Extension("prefixkv.runner._cpu_attn", ["prefixkv/runner/_cpu_attn.c"],
              optional=True, extra_compile_args=["-O3", "-fopenmp"], extra_link_args=["-fopenmp"]),
])
