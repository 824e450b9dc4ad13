"""Cache-core A/B in one process: the radix index of an older checkout against this one, both
packages loaded side by side (each keeps its own modules), on the `prefixkv bench ops`
workload (1,000 cached 1,024-token prompts + a 2,000-token system prompt, ids in [0, 150000)):
inserts of 1,024 tokens sharing 512 with a cached prompt, and evictions of ten 1,024-token
leaves' worth (10,240 tokens) on fresh loads; calls alternate between the two, medians.
Usage (from the repo root):
    git worktree add /tmp/oldtree <commit>
    PYTHONPATH=. python scripts/cache_ab.py /tmp/oldtree 1 3   # old checkout, block size, loads
"""
import gc, random, statistics, sys, time
from array import array

old_root = sys.argv[1]
bs = int(sys.argv[2]) if len(sys.argv) > 2 else 1
loads = int(sys.argv[3]) if len(sys.argv) > 3 else 3


def load_pkg(root):
    for k in [k for k in sys.modules if k.startswith("prefixkv")]:
        del sys.modules[k]
    sys.path.insert(0, root)
    from prefixkv.cache.block_pool import BlockPool
    from prefixkv.cache.radix import RadixPrefixCache
    sys.path.remove(root)
    return RadixPrefixCache, BlockPool


impls = {"old": load_pkg(old_root), "new": load_pkg(".")}
rng = random.Random(0)
fresh = lambda n: [rng.randrange(150000) for _ in range(n)]
system, prompts, suffixes = fresh(2000), [fresh(1024) for _ in range(1000)], [fresh(512) for _ in range(400)]


def load(name):
    cache_cls, pool_cls = impls[name]
    total = (2000 + 1024 * 1000 + 512 * 400) // bs + 64
    c, pool = cache_cls(total, bs), pool_cls(total)
    for p in [system, *prompts]:
        m = c.match_prefix(p)
        ids = pool.allocate(len(p) // bs - len(m.matched_kv_blocks), evict_from=c)
        pool.free(c.insert_prefix(p, [*m.matched_kv_blocks, *ids]).returned_block_ids)
    return c, pool


ev, ins = {"old": [], "new": []}, {"old": [], "new": []}
for _ in range(loads):
    caches = {k: load(k) for k in impls}
    seqs = [array("q", prompts[i % 1000][:512] + suffixes[i]) for i in range(400)]
    ids = {k: [[*c.match_prefix(s[:512]).matched_kv_blocks, *pool.allocate(512 // bs)] for s in seqs]
           for k, (c, pool) in caches.items()}
    gc.collect(); gc.disable()
    for i in range(0, 400, 20):
        for k in (["old", "new"] if (i // 20) % 2 == 0 else ["new", "old"]):
            for j in range(i, i + 20):
                t = time.perf_counter_ns(); caches[k][0].insert_prefix(seqs[j], ids[k][j]); ins[k].append(time.perf_counter_ns() - t)
    gc.enable()
    caches = {k: load(k) for k in impls}
    gc.collect(); gc.disable()
    for i in range(50):
        for k in (["old", "new"] if i % 2 == 0 else ["new", "old"]):
            t = time.perf_counter_ns(); caches[k][0].evict(10240 // bs); ev[k].append(time.perf_counter_ns() - t)
    gc.enable()
    del caches
med = lambda x: statistics.median(x) / 1000
print(f"block size {bs}: insert old {med(ins['old']):.1f} us, new {med(ins['new']):.1f} us "
      f"({med(ins['new']) / med(ins['old']):.2f}x time); evict old {med(ev['old']):.1f} us, "
      f"new {med(ev['new']):.1f} us ({med(ev['new']) / med(ev['old']):.2f}x time)")
