"""Types of the optional C extension ``prefixkv.models._cpu_gemv`` (``_cpu_gemv.c``; the caller
is ``cpu_gemv.py``, which checks every argument: the function reads raw addresses)."""

def supported() -> bool: ...
def gemv(
    w: int, n: int, k: int, kb: int, x: int, x_st: int, y: int, y_st: int, b: int, rows: int,
    threads: int, /,
) -> None: ...
