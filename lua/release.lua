-- release.lua: batched compare-and-delete of rig entries (CONTRACT.md section 3, "disconnect").
-- Run by EVALSHA from src/registry/scripts.rs, at most 1000 keys per call.
--
-- KEYS[1..n]  rig:<rig_id>
-- ARGV[1..n]  "<boot_id>|<broker_id>": KEYS[i] is deleted only if it holds exactly ARGV[i]
--
-- Returns the number of keys deleted (integer).
-- Errors  "ERR fleetlink release: ..." when #ARGV ~= #KEYS, before any write.

if #ARGV ~= #KEYS then
  return redis.error_reply('ERR fleetlink release: expected one value per key')
end

local deleted = 0
for i = 1, #KEYS do
  -- pcall: a key of another type answers WRONGTYPE as a table, never equal to ARGV[i].
  if redis.pcall('GET', KEYS[i]) == ARGV[i] then
    redis.call('DEL', KEYS[i])
    deleted = deleted + 1
  end
end
return deleted
