"""Types of the optional C kernel ``prefixkv.runner._cpu_attn`` (``_cpu_attn.c``; the caller is
``cpu_attention.py``, which checks every argument: the kernel reads raw addresses)."""

def supported() -> bool: ...
def attend(
    q: int, q_st: int, q_sh: int,
    o: int, o_st: int, o_sh: int,
    k: int, v: int, blk_st: int, tok_st: int,
    info: int, n_seqs: int, tables: int, n_heads: int, n_kv_heads: int, head_dim: int,
    block_size: int, scale: float, threads: int, bf16: bool, /,
) -> None: ...
