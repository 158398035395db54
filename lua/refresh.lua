-- refresh.lua: extend this broker's rig leases, one batch per call (CONTRACT.md section 3).
-- Run by EVALSHA from src/registry/scripts.rs; the caller sends at most 1000 keys per call, so
-- one call blocks Redis for about 1.5 ms (2 ms when restoring), not for the whole table
-- (redis 7.0, measured by registry_upkeep_cost in tests/lua_scripts.rs).
--
-- KEYS[1..n]    rig:<rig_id>, one per rig this broker holds
-- ARGV[1]       ttl_ms: decimal integer, 1 to 15 digits, no leading zero
-- ARGV[2..n+1]  "<boot_id>|<broker_id>": the value this broker expects in KEYS[i] at ARGV[i+1];
--               prefixed for a boot whose hello this broker decided alone while Redis was
--               away, where hello.lua would have let it in over a free lease or an older
--               boot's whatever boot sessof names (a newer boot that came and went before
--               it, an older boot back: review bb150):
--               "+" asks: where that rule and the refresh's differ (sessof names a newer
--                   boot), answers "vacant" and touches nothing. The newer boot may be
--                   connected still, its lease not yet put back after the outage (its hello
--                   decided alone elsewhere, or its lease lapsed meanwhile): its broker's
--                   refresh restores it first (review bb151)
--               "!" takes, by hello's rule: asked again a refresh interval and the longest
--                   reconnect later, no one has put a lease back
--
-- Returns an array of n statuses, in KEYS order:
--   "ok"          value == expected: PEXPIRE ttl_ms
--   "restored"    key missing (expired, or Redis restarted empty): SET expected PX ttl_ms,
--                 unless sessof:<rig_id> names a boot newer than the expected one's
--   "restored|<b>"  the same, where sessof:<rig_id> names b, a boot older than the expected
--                 one's: that older session outlived its lease (an outage longer than the
--                 lease, or the older boot's broker released it), and the caller runs
--                 resume.lua to report it rig_rebooted, as this boot's hello would have.
--                 For a "!" value b may be newer: a newer boot's session its rig left, which
--                 this hello ended as hello.lua and resume.lua would have
--   "vacant"      a "+" value's key is missing, or holds an older boot, and sessof names a
--                 boot newer than the expected one's: nothing touched
--   "taken|<v>"   the key held v = "<boot>|<broker>" of an older boot than the expected one's,
--                 and no newer boot is on record (or the value is "!"): SET expected PX
--                 ttl_ms. Only a broker that welcomed the newer boot while Redis was away
--                 gets here (hello.lua never lets an older boot in over a newer one), or
--                 one that welcomed an older boot then ("!"); the rule is hello's, newer
--                 boot wins, so the older boot's broker must be told (its channel, evict),
--                 and the boot on record's session reported rig_rebooted (the caller runs
--                 resume.lua for it)
--   "superseded"  any other value, of any type (a newer or equal boot elsewhere, or garbage),
--                 or a missing key whose rig has a newer boot on record and an unmarked value
--                 (the newer boot said hello since this broker's connection did; that
--                 connection is a stale process's): nothing touched. An equal boot elsewhere
--                 wins even over "!": it reached Redis, so its hello is the one Redis saw last
-- Errors "ERR fleetlink refresh: ..." on malformed ARGV, before any write.
-- sessof:<rig_id> is derived from KEYS[i] (single-instance Redis; not cluster-safe, as in
-- resume.lua).

local ttl = ARGV[1]
if #ARGV ~= #KEYS + 1 or type(ttl) ~= 'string' or #ttl > 15
    or not ttl:match('^[1-9]%d*$') then
  return redis.error_reply('ERR fleetlink refresh: expected ARGV ttl_ms, then one value per key')
end

-- a > b for two canonical boot ids, byte by byte (Lua's '<' follows the locale; see hello.lua).
local function newer(a, b)
  for i = 1, #a do
    local x, y = a:byte(i), b:byte(i)
    if x ~= y then
      return x > y
    end
  end
  return false
end

-- The boot on record for the rig of `key` (sessof:<rig_id>) and the one `expected` names;
-- nil when either is missing or they differ in form.
local function on_record(key, expected)
  local rig = key:match('^rig:(.+)$')
  local boot = expected:match('^([^|]+)|')
  if not rig or not boot then
    return nil
  end
  local latest = redis.pcall('GET', 'sessof:' .. rig)
  if type(latest) ~= 'string' or #latest ~= #boot then
    return nil
  end
  return latest, boot
end

-- Whether the rig of `key` has, on record, a boot newer than the one `expected` names.
local function newer_boot_on_record(key, expected)
  local latest, boot = on_record(key, expected)
  return latest ~= nil and newer(latest, boot)
end

-- Whether `current` names a boot older than the one `expected` names (both "<boot>|<broker>";
-- anything not of that form is never older).
local function older_tuple(current, expected)
  if type(current) ~= 'string' then
    return false
  end
  local theirs = current:match('^([^|]+)|')
  local ours = expected:match('^([^|]+)|')
  return theirs ~= nil and ours ~= nil and #theirs == #ours and newer(ours, theirs)
end

local out = {}
for i = 1, #KEYS do
  local key, expected = KEYS[i], ARGV[i + 1]
  local mark = expected:sub(1, 1)
  local claim, take = mark == '+' or mark == '!', mark == '!'
  if claim then
    expected = expected:sub(2)
  end
  -- pcall: a key of another type answers WRONGTYPE as a table; that is "superseded".
  local current = redis.pcall('GET', key)
  if current == expected then
    redis.call('PEXPIRE', key, ttl)
    out[i] = 'ok'
  elseif (current == false or older_tuple(current, expected)) and claim and not take
      and newer_boot_on_record(key, expected) then
    out[i] = 'vacant'
  elseif current == false and (take or not newer_boot_on_record(key, expected)) then
    redis.call('SET', key, expected, 'PX', ttl)
    local latest, boot = on_record(key, expected)
    if latest ~= nil and latest ~= boot then
      out[i] = 'restored|' .. latest
    else
      out[i] = 'restored'
    end
  elseif older_tuple(current, expected) and (take or not newer_boot_on_record(key, expected)) then
    redis.call('SET', key, expected, 'PX', ttl)
    out[i] = 'taken|' .. current
  else
    out[i] = 'superseded'
  end
end
return out
