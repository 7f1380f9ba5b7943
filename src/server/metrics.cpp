#include "server/metrics.h"

#include <cmath>
#include <cstdio>
#include <sstream>
#include <vector>

namespace m3::server {

namespace {

std::string num(double v) {
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  if (std::isnan(v)) return "NaN";
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.17g", v);
  return buf;
}

std::string escape_label(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '\\' || c == '"') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  return out;
}

class Writer {
 public:
  explicit Writer(std::string model) : labels_("model_name=\"" + escape_label(model) + "\"") {}

  void scalar(const std::string& name, const char* type, const char* help, double value,
              const std::string& extra_labels = "") {
    for (const char* prefix : {"vllm:", "m3:"}) {
      const std::string full = prefix + name;
      header(full, type, help);
      os_ << full << "{" << labels_ << extra_labels << "} " << num(value) << "\n";
    }
  }

  // Several label values of one counter family.
  void family(const std::string& name, const char* type, const char* help,
              const std::vector<std::pair<std::string, double>>& labelled) {
    for (const char* prefix : {"vllm:", "m3:"}) {
      const std::string full = prefix + name;
      header(full, type, help);
      for (const auto& [lab, v] : labelled)
        os_ << full << "{" << labels_ << "," << lab << "} " << num(v) << "\n";
    }
  }

  void histogram(const std::string& name, const char* help, const engine::Histogram& h) {
    for (const char* prefix : {"vllm:", "m3:"}) {
      const std::string full = prefix + name;
      header(full, "histogram", help);
      uint64_t cum = 0;
      for (size_t i = 0; i < h.bounds.size(); ++i) {
        cum += i < h.counts.size() ? h.counts[i] : 0;
        os_ << full << "_bucket{" << labels_ << ",le=\"" << num(h.bounds[i]) << "\"} " << cum
            << "\n";
      }
      // The +Inf bucket must equal _count even if the per-bucket vector is short.
      os_ << full << "_bucket{" << labels_ << ",le=\"+Inf\"} " << h.count << "\n";
      os_ << full << "_sum{" << labels_ << "} " << num(h.sum) << "\n";
      os_ << full << "_count{" << labels_ << "} " << h.count << "\n";
    }
  }

  std::string str() const { return os_.str(); }

 private:
  void header(const std::string& full, const char* type, const char* help) {
    os_ << "# HELP " << full << " " << help << "\n# TYPE " << full << " " << type << "\n";
  }
  std::string labels_;
  std::ostringstream os_;
};

}  // namespace

std::string format_metrics(const engine::EngineStats& s, const std::string& model_name,
                           const ServerGauges& g) {
  Writer w(model_name);
  w.scalar("num_requests_running", "gauge", "Number of requests in model execution batches.",
           s.num_running);
  w.scalar("num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
           s.num_waiting);
  w.scalar("kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
           s.kv_cache_usage);
  w.scalar("num_kv_blocks", "gauge", "Number of KV-cache blocks (128-token pages).",
           static_cast<double>(s.num_kv_blocks));
  {
    // The pool's capacity in its element format (docs/KV_CACHE.md): the same memory holds 2x
    // the tokens in bf16 and about 4x in fp8 of an fp32 cache. cache_config_info is vLLM's
    // info gauge (value 1, the configuration in labels).
    std::string fmt = ",kv_cache_dtype=\"" + escape_label(s.kv_cache_dtype) + "\"";
    if (!s.index_cache_dtype.empty())
      fmt += ",index_cache_dtype=\"" + escape_label(s.index_cache_dtype) + "\"";
    w.scalar("kv_cache_capacity_tokens", "gauge", "Tokens the KV cache holds in its format.",
             static_cast<double>(s.num_kv_blocks * s.block_size), fmt);
    w.scalar("kv_cache_bytes_per_token", "gauge",
             "Bytes of KV cache one token takes, in the cache's format.",
             static_cast<double>(s.kv_bytes_per_token), fmt);
    w.scalar("cache_config_info", "gauge", "Information of the LLMEngine CacheConfig.", 1.0,
             ",block_size=\"" + std::to_string(s.block_size) + "\",cache_dtype=\"" +
                 escape_label(s.kv_cache_dtype) + "\",num_gpu_blocks=\"" +
                 std::to_string(s.num_kv_blocks) + "\"" +
                 (s.index_cache_dtype.empty()
                      ? std::string()
                      : ",indexer_kv_dtype=\"" + escape_label(s.index_cache_dtype) + "\""));
  }
  w.scalar("prefix_cache_queries_total", "counter",
           "Prefix cache queries, in number of queried tokens.",
           static_cast<double>(s.prefix_cache_queries));
  w.scalar("prefix_cache_hits_total", "counter", "Prefix cache hits, in number of cached tokens.",
           static_cast<double>(s.prefix_cache_hits));
  w.scalar("num_preemptions_total", "counter", "Cumulative number of preemptions.",
           static_cast<double>(s.num_preemptions));
  w.scalar("prompt_tokens_total", "counter", "Number of prefill tokens processed.",
           static_cast<double>(s.prompt_tokens_total));
  w.scalar("generation_tokens_total", "counter", "Number of generation tokens processed.",
           static_cast<double>(s.generation_tokens_total));
  w.family("request_success_total", "counter", "Count of finished requests by finish reason.",
           {{"finished_reason=\"stop\"", static_cast<double>(s.requests_finished_stop)},
            {"finished_reason=\"length\"", static_cast<double>(s.requests_finished_length)},
            {"finished_reason=\"abort\"", static_cast<double>(s.requests_finished_abort)},
            {"finished_reason=\"error\"", static_cast<double>(s.requests_finished_error)}});
  w.histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
              s.time_to_first_token_s);
  w.histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
              s.inter_token_latency_s);
  w.histogram("e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.",
              s.e2e_request_latency_s);
  w.histogram("request_prompt_tokens", "Number of prefill tokens processed per request.",
              s.prompt_tokens_per_request);
  w.histogram("request_generation_tokens", "Number of generation tokens processed per request.",
              s.generation_tokens_per_request);
  w.scalar("http_requests_in_flight", "gauge", "HTTP generation requests being served.",
           static_cast<double>(g.http_requests_in_flight));
  w.scalar("server_draining", "gauge", "1 while the server drains after SIGTERM/SIGINT.",
           g.draining ? 1.0 : 0.0);
  w.scalar("client_aborts_total", "counter",
           "Generation requests aborted because their client went away.",
           static_cast<double>(g.client_aborts));
  w.scalar("http_connections_open", "gauge", "Open HTTP connections.",
           static_cast<double>(g.connections_open));
  w.scalar("http_requests_pending", "gauge", "Complete HTTP requests waiting for a worker thread.",
           static_cast<double>(g.requests_pending));
  w.scalar("http_workers_busy", "gauge", "HTTP worker threads running a request.",
           static_cast<double>(g.workers_busy));
  w.scalar("http_rejected_capacity_total", "counter",
           "Requests and connections refused with 429 at capacity.",
           static_cast<double>(g.rejected_capacity));
  w.scalar("http_connection_timeouts_total", "counter",
           "Connections closed for a header, body or idle deadline (or evicted for room).",
           static_cast<double>(g.connection_timeouts));
  w.scalar("http_bad_requests_total", "counter",
           "Malformed or over-limit HTTP requests refused by the front.",
           static_cast<double>(g.bad_http_requests));
  return w.str();
}

}  // namespace m3::server
