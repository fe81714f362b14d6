-- wrk script of bench/load.py: every request steps one of the env instances in INSTANCES (a
-- comma-separated list of ids), in turn, with an action the env refuses, so no instance ever
-- ends and every request is the same POST /instances/{id}/step. done() prints one JSON line
-- (errors.status: answers that were not 2xx or 3xx).

local ids = {}
for id in string.gmatch(os.getenv("INSTANCES") or "", "[^,]+") do
  ids[#ids + 1] = id
end
local next_id = 0
local body = '{"action": "no such action"}'

request = function()
  next_id = next_id % #ids + 1
  return wrk.format("POST", "/instances/" .. ids[next_id] .. "/step", {["Content-Type"] = "application/json"}, body)
end

done = function(summary, latency, requests)
  local errors = summary.errors
  io.write(string.format(
    '{"requests": %d, "duration_s": %.6f, "p50_ms": %.3f, "p90_ms": %.3f, "p99_ms": %.3f, '
      .. '"max_ms": %.3f, "socket_errors": %d, "non_2xx": %d}\n',
    summary.requests, summary.duration / 1e6, latency:percentile(50) / 1e3,
    latency:percentile(90) / 1e3, latency:percentile(99) / 1e3, latency.max / 1e3,
    errors.connect + errors.read + errors.write + errors.timeout, errors.status
  ))
end
