#include "server/metrics.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <vector>

namespace m3::server {

namespace {

std::string num(double v) {
  return prometheus_number(v);
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

using Labels = std::vector<std::pair<std::string, std::string>>;

// `{a="x",b="y"}` with the names sorted, as prometheus_client writes them.
std::string label_text(Labels labels) {
  std::sort(labels.begin(), labels.end());
  std::string out = "{";
  for (size_t i = 0; i < labels.size(); ++i)
    out += (i ? "," : "") + labels[i].first + "=\"" + escape_label(labels[i].second) + "\"";
  return out + "}";
}

class Writer {
 public:
  // vLLM's labels: model_name and engine (this server has one engine, "0").
  explicit Writer(std::string model) : base_{{"model_name", std::move(model)}, {"engine", "0"}} {}

  void scalar(const std::string& name, const char* type, const char* help, double value) {
    family(name, type, help, {{{}, value}});
  }

  // Several label values of one family (each with the model labels).
  void family(const std::string& name, const char* type, const char* help,
              const std::vector<std::pair<Labels, double>>& labelled) {
    for (const char* prefix : {"vllm:", "m3:"}) {
      const std::string full = prefix + name;
      header(full, type, help);
      for (const auto& [lab, v] : labelled) os_ << full << with_base(lab) << " " << num(v) << "\n";
    }
  }

  void histogram(const std::string& name, const char* help, const engine::Histogram& h) {
    for (const char* prefix : {"vllm:", "m3:"}) {
      const std::string full = prefix + name;
      header(full, "histogram", help);
      uint64_t cum = 0;
      for (size_t i = 0; i < h.bounds.size(); ++i) {
        cum += i < h.counts.size() ? h.counts[i] : 0;
        os_ << full << "_bucket" << with_base({{"le", num(h.bounds[i])}}) << " "
            << num(static_cast<double>(cum)) << "\n";
      }
      // The +Inf bucket must equal _count even if the per-bucket vector is short.
      os_ << full << "_bucket" << with_base({{"le", "+Inf"}}) << " "
          << num(static_cast<double>(h.count)) << "\n";
      os_ << full << "_sum" << with_base({}) << " " << num(h.sum) << "\n";
      os_ << full << "_count" << with_base({}) << " " << num(static_cast<double>(h.count)) << "\n";
    }
  }

  // A family without the model labels (the HTTP counters).
  void raw(const std::string& full, const char* type, const char* help,
           const std::vector<std::pair<Labels, double>>& labelled) {
    if (labelled.empty()) return;
    header(full, type, help);
    for (const auto& [lab, v] : labelled) os_ << full << label_text(lab) << " " << num(v) << "\n";
  }

  std::string str() const { return os_.str(); }

 private:
  void header(const std::string& full, const char* type, const char* help) {
    os_ << "# HELP " << full << " " << help << "\n# TYPE " << full << " " << type << "\n";
  }
  std::string with_base(Labels extra) const {
    extra.insert(extra.end(), base_.begin(), base_.end());
    return label_text(std::move(extra));
  }
  Labels base_;
  std::ostringstream os_;
};

}  // namespace

std::string prometheus_number(double v) {
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  if (std::isnan(v)) return "NaN";
  if (v == 0) return std::signbit(v) ? "-0.0" : "0.0";
  // The shortest digits that read back as v, then Python's repr layout: fixed notation for
  // decimal exponents in [-4, 16), else d.ddde+XX.
  char sci[64];
  const auto r = std::to_chars(sci, sci + sizeof(sci), v, std::chars_format::scientific);
  std::string t(sci, r.ptr);
  const size_t e = t.find('e');
  const int exp10 = std::atoi(t.c_str() + e + 1);
  std::string sign = t[0] == '-' ? "-" : "";
  std::string digits;
  for (size_t i = sign.size(); i < e; ++i)
    if (t[i] != '.') digits += t[i];
  std::string out;
  if (exp10 >= -4 && exp10 < 16) {
    if (exp10 < 0) {
      out = "0." + std::string(static_cast<size_t>(-exp10 - 1), '0') + digits;
    } else if (static_cast<size_t>(exp10) + 1 >= digits.size()) {
      out = digits + std::string(static_cast<size_t>(exp10) + 1 - digits.size(), '0') + ".0";
    } else {
      out = digits.substr(0, static_cast<size_t>(exp10) + 1) + "." +
            digits.substr(static_cast<size_t>(exp10) + 1);
    }
    // prometheus_client (like Go) switches to the exponent form past 6 integer digits.
    const size_t dot = out.find('.');
    if (v > 0 && dot != std::string::npos && dot > 6) {
      std::string mant = digits.substr(0, 1) + "." + digits.substr(1);
      while (!mant.empty() && (mant.back() == '0' || mant.back() == '.')) mant.pop_back();
      char ebuf[16];
      std::snprintf(ebuf, sizeof(ebuf), "e+%02d", static_cast<int>(dot) - 1);
      return mant + ebuf;
    }
    return sign + out;
  }
  std::string mant = digits.substr(0, 1) + (digits.size() > 1 ? "." + digits.substr(1) : "");
  char ebuf[16];
  std::snprintf(ebuf, sizeof(ebuf), "e%c%02d", exp10 < 0 ? '-' : '+', std::abs(exp10));
  return sign + mant + ebuf;
}

std::string format_metrics(const engine::EngineStats& s, const std::string& model_name,
                           const ServerGauges& g, const engine::ModelInfo* info) {
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
    Labels fmt = {{"kv_cache_dtype", s.kv_cache_dtype}};
    if (!s.index_cache_dtype.empty()) fmt.push_back({"index_cache_dtype", s.index_cache_dtype});
    w.family("kv_cache_capacity_tokens", "gauge", "Tokens the KV cache holds in its format.",
             {{fmt, static_cast<double>(s.num_kv_blocks * s.block_size)}});
    w.family("kv_cache_bytes_per_token", "gauge",
             "Bytes of KV cache one token takes, in the cache's format.",
             {{fmt, static_cast<double>(s.kv_bytes_per_token)}});
    Labels cfg = {{"block_size", std::to_string(s.block_size)},
                  {"cache_dtype", s.kv_cache_dtype},
                  {"num_gpu_blocks", std::to_string(s.num_kv_blocks)}};
    if (!s.index_cache_dtype.empty()) cfg.push_back({"indexer_kv_dtype", s.index_cache_dtype});
    if (info) {
      cfg.push_back({"enable_prefix_caching", info->enable_prefix_caching ? "True" : "False"});
      cfg.push_back({"device", info->device});
    }
    w.family("cache_config_info", "gauge", "Information of the LLMEngine CacheConfig.",
             {{cfg, 1.0}});
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
  if (s.spec_decode.enabled) {
    // vLLM's SpecDecodingProm counters: mean acceptance length = 1 + accepted / drafts.
    const engine::SpecDecodeStats& sd = s.spec_decode;
    w.scalar("spec_decode_num_drafts_total", "counter", "Number of spec decoding drafts.",
             static_cast<double>(sd.num_drafts));
    w.scalar("spec_decode_num_draft_tokens_total", "counter", "Number of draft tokens.",
             static_cast<double>(sd.num_draft_tokens));
    w.scalar("spec_decode_num_accepted_tokens_total", "counter", "Number of accepted tokens.",
             static_cast<double>(sd.num_accepted_tokens));
    std::vector<std::pair<Labels, double>> per;
    for (size_t i = 0; i < sd.accepted_per_pos.size(); ++i)
      per.push_back(
          {{{"position", std::to_string(i)}}, static_cast<double>(sd.accepted_per_pos[i])});
    w.family("spec_decode_num_accepted_tokens_per_pos_total", "counter",
             "Accepted tokens per draft position.", per);
  }
  w.family("request_success_total", "counter", "Count of finished requests by finish reason.",
           {{{{"finished_reason", "stop"}}, static_cast<double>(s.requests_finished_stop)},
            {{{"finished_reason", "length"}}, static_cast<double>(s.requests_finished_length)},
            {{{"finished_reason", "abort"}}, static_cast<double>(s.requests_finished_abort)},
            {{{"finished_reason", "error"}}, static_cast<double>(s.requests_finished_error)}});
  w.scalar("prompt_tokens_cached_total", "counter", "Number of cached tokens processed.",
           static_cast<double>(s.prompt_tokens_cached_total));
  w.family("prompt_tokens_by_source_total", "counter",
           "Number of prompt tokens by source (computed here or prefix-cache hits).",
           {{{{"source", "local_compute"}},
             static_cast<double>(s.prompt_tokens_total - s.prompt_tokens_cached_total)},
            {{{"source", "local_cache_hit"}}, static_cast<double>(s.prompt_tokens_cached_total)}});
  w.histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
              s.time_to_first_token_s);
  w.histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
              s.inter_token_latency_s);
  // vLLM's older name for the same observations (still read by many dashboards).
  w.histogram("time_per_output_token_seconds",
              "Histogram of time per output token in seconds (inter-token latency).",
              s.inter_token_latency_s);
  w.histogram("request_time_per_output_token_seconds",
              "Histogram of time_per_output_token_seconds per request.",
              s.request_time_per_output_token_s);
  w.histogram("e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.",
              s.e2e_request_latency_s);
  w.histogram("request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
              s.request_queue_time_s);
  w.histogram("request_inference_time_seconds",
              "Histogram of time spent in RUNNING phase for request.", s.request_inference_time_s);
  w.histogram("request_prefill_time_seconds",
              "Histogram of time spent in PREFILL phase for request.", s.request_prefill_time_s);
  w.histogram("request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.",
              s.request_decode_time_s);
  w.histogram("request_prompt_tokens", "Number of prefill tokens processed.",
              s.prompt_tokens_per_request);
  w.histogram("request_generation_tokens", "Number of generation tokens processed.",
              s.generation_tokens_per_request);
  w.histogram("request_prefill_kv_computed_tokens",
              "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
              s.prefill_computed_tokens_per_request);
  w.histogram("request_params_max_tokens", "Histogram of the max_tokens request parameter.",
              s.max_tokens_per_request);
  w.histogram("iteration_tokens_total", "Histogram of number of tokens per engine_step.",
              s.iteration_tokens);
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
  // ---- KV events and the host KV tier (issue #21) ----
  w.scalar("kv_event_batches_published_total", "counter",
           "KV event batches sent on the --kv-events-config stream (all data-parallel ranks).",
           static_cast<double>(s.kv_event_batches_published));
  w.scalar("kv_event_batches_dropped_total", "counter",
           "KV event batches dropped because max_queue_size batches were waiting.",
           static_cast<double>(s.kv_event_batches_dropped));
  w.scalar("host_kv_cache_pages", "gauge",
           "Pages the host KV tier holds at most (--kv-transfer-config, --kv-offloading-size).",
           static_cast<double>(s.num_host_kv_pages));
  w.scalar("host_kv_cache_cached_pages", "gauge", "Prefix-cache pages held in the host KV tier.",
           static_cast<double>(s.num_host_kv_cached));
  w.scalar("kv_offloaded_pages_total", "counter",
           "Evicted prefix-cache pages copied from the device pool to the host KV tier.",
           static_cast<double>(s.kv_offloaded_pages_total));
  w.scalar("kv_restored_pages_total", "counter",
           "Prefix-cache pages restored from the host KV tier on a prefix hit.",
           static_cast<double>(s.kv_restored_pages_total));
  if (s.pd_enabled) {  // --kv-transfer-config NixlConnector
    w.scalar("pd_held_requests", "gauge",
             "Prefilled requests whose KV pages wait for a decode worker to read them.",
             static_cast<double>(s.pd.num_held));
    w.family("pd_released_requests_total", "counter",
             "Held prefills released: read by a decode worker, or expired "
             "(VLLM_NIXL_ABORT_REQUEST_TIMEOUT).",
             {{{{"reason", "read"}}, static_cast<double>(s.pd.num_released_read)},
              {{{"reason", "expired"}}, static_cast<double>(s.pd.num_released_expired)}});
    w.family("pd_kv_loads_total", "counter",
             "Decode requests whose prompt KV was read from a prefill worker (ok) or recomputed "
             "here after the read failed (failed).",
             {{{{"outcome", "ok"}}, static_cast<double>(s.pd.num_loads_ok)},
              {{{"outcome", "failed"}}, static_cast<double>(s.pd.num_loads_failed)}});
    w.scalar("pd_kv_pages_read_total", "counter", "KV pages read from prefill workers over NIXL.",
             static_cast<double>(s.pd.num_pages_read));
  }
  std::vector<std::pair<Labels, double>> http;
  for (const auto& c : g.http_requests) {
    http.push_back({{{"handler", c.handler}, {"method", c.method}, {"status", c.status}},
                    static_cast<double>(c.count)});
  }
  w.raw("http_requests_total", "counter", "Total number of requests by method, status and handler.",
        http);
  return w.str();
}

}  // namespace m3::server
