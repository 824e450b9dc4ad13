"""The Valkey tier's server-side scripts for per-tenant quotas (:mod:`prefixkv.tiers.remote`).

A block write is one script call (:data:`SET`): it stores the block (once, with the tier's
expiry unless a pin names it) and, with a quota, adds it to its tenant's sorted set
``pkv:tq:<label>`` (scored by the write's time in microseconds) and deletes that tenant's
oldest unpinned blocks past the quota. :data:`COUNTS` reads every tenant's count in one call.
Both name keys they are not handed (pin counters, tenants' sets): fine on a standalone Valkey
or Redis, not on a cluster. Keys: ``pkv:<key>`` (a block, 36 bytes), ``pkv:pin:<key>`` (its pin
counter), ``pkv:tq:<label>`` and ``pkv:tenants``, so a ``reset --tiers remote`` (every
``pkv:*``) clears the counting too.
"""

from __future__ import annotations

TENANTS = b"pkv:tenants"
"""The set of tenant labels with a sorted set (``pkv:tq:<label>``) on the server."""
TENANT_PREFIX = b"pkv:tq:"
QUOTA_SCAN = 64
"""Members a quota trim looks at beyond the tenant's excess (pinned ones are skipped), and
members written more than a ttl ago that a count checks, per tenant."""

# KEYS: block, pin counter, tenant's sorted set, set of tenants. ARGV: record, ttl seconds
# (0: none), now (us), tenant quota (-1: none), tenant label. Stored once (NX: every writer of a
# key writes the same bytes); an expiry only while no pin names the block. With a quota, the
# tenant's oldest unpinned blocks beyond it are deleted (at most QUOTA_SCAN members looked at
# past the excess; a pinned one is moved to the back, a gone one just leaves the set).
SET = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX') and tonumber(ARGV[2]) > 0
   and redis.call('EXISTS', KEYS[2]) == 0 then
  redis.call('EXPIRE', KEYS[1], ARGV[2])
end
local quota = tonumber(ARGV[4])
if quota < 0 then return 0 end
redis.call('ZADD', KEYS[3], ARGV[3], KEYS[1])
redis.call('SADD', KEYS[4], ARGV[5])
local over = redis.call('ZCARD', KEYS[3]) - quota
if over <= 0 then return 0 end
local evicted = 0
for _, name in ipairs(redis.call('ZRANGE', KEYS[3], 0, over + QUOTA_SCAN - 1)) do
  if over <= 0 then break end
  if redis.call('EXISTS', name) == 0 then
    redis.call('ZREM', KEYS[3], name)
    over = over - 1
  elseif redis.call('EXISTS', 'pkv:pin:' .. string.sub(name, 5)) == 1 then
    redis.call('ZADD', KEYS[3], ARGV[3], name)
  else
    redis.call('UNLINK', name)
    redis.call('ZREM', KEYS[3], name)
    over = over - 1
    evicted = evicted + 1
  end
end
return evicted
""".replace("QUOTA_SCAN", str(QUOTA_SCAN))
# KEYS: set of tenants. ARGV: sorted-set name prefix, cutoff (-1: none), now. Label, size,
# label, size, ... Members older than the cutoff (written more than a ttl ago: most have
# expired) are checked first, at most QUOTA_SCAN per tenant: gone ones leave, live ones (pinned,
# retained) are re-scored now; empty sets leave the set of tenants.
COUNTS = """
local out = {}
local cutoff = tonumber(ARGV[2])
for _, t in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local name = ARGV[1] .. t
  if cutoff >= 0 then
    for _, m in ipairs(redis.call('ZRANGEBYSCORE', name, '-inf', cutoff, 'LIMIT', 0, QUOTA_SCAN)) do
      if redis.call('EXISTS', m) == 0 then
        redis.call('ZREM', name, m)
      else
        redis.call('ZADD', name, ARGV[3], m)
      end
    end
  end
  local n = redis.call('ZCARD', name)
  if n > 0 then
    out[#out + 1] = t
    out[#out + 1] = n
  else
    redis.call('SREM', KEYS[1], t)
  end
end
return out
""".replace("QUOTA_SCAN", str(QUOTA_SCAN))
