// Prometheus text exposition of the engine's statistics for GET /metrics, under vLLM's metric
// names (`vllm:*`, so existing dashboards work) and the same values again as `m3:*`.
// Called by HttpServer's /metrics handler with a fresh Engine::stats() snapshot.
// Invariant: histogram buckets are cumulative and end with le="+Inf" equal to _count, as the
// format requires (EngineStats keeps per-bucket counts).
#pragma once

#include <string>

#include "engine/engine.h"

namespace m3::server {

// Extra server-side gauges that the engine does not know.
struct ServerGauges {
  int64_t http_requests_in_flight = 0;
  bool draining = false;
  int64_t client_aborts = 0;     // generation requests aborted because the client left
  int64_t connections_open = 0;  // HttpFrontStats (http_front.h)
  int64_t requests_pending = 0;
  int64_t workers_busy = 0;
  int64_t rejected_capacity = 0;
  int64_t connection_timeouts = 0;
  int64_t bad_http_requests = 0;
};

std::string format_metrics(const engine::EngineStats& stats, const std::string& model_name,
                           const ServerGauges& gauges = {});

}  // namespace m3::server
