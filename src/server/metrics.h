// Prometheus text exposition of the engine's statistics for GET /metrics, under vLLM's metric
// names and labels (`vllm:*{model_name, engine="0"}`, numbers printed as prometheus_client
// prints them: "1.0", "0.005", "+Inf"), so existing dashboards work; the same values again as
// `m3:*` (vLLM's `cache_config_info` among them); and the HTTP request counts by method, status
// class and route under the names vLLM's instrumentator uses (`http_requests_total`). Called by
// HttpServer's /metrics handler with a fresh Engine::stats() snapshot. Invariant: histogram buckets
// are cumulative and end with le="+Inf" equal to _count, as the format requires (EngineStats keeps
// per-bucket counts).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/engine.h"

namespace m3::server {

// Requests answered, by (method, status class "2xx".."5xx", route; "none" for unknown paths).
struct HttpRequestCount {
  std::string method, status, handler;
  int64_t count = 0;
};

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
  std::vector<HttpRequestCount> http_requests;
};

std::string format_metrics(const engine::EngineStats& stats, const std::string& model_name,
                           const ServerGauges& gauges = {},
                           const engine::ModelInfo* info = nullptr);

// A number as prometheus_client writes it (Python's repr, ".0" on whole numbers, Go's exponent
// form past 6 integer digits): 1 -> "1.0", 0.1 -> "0.1", 1e6 -> "1e+06".
std::string prometheus_number(double v);

}  // namespace m3::server
