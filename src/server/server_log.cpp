// What the server logs besides errors: one access-log line per answered request (vLLM's
// uvicorn line: `ADDR - "METHOD PATH HTTP/1.1" STATUS`) and, every stats_interval_s while there
// is work, vLLM's stats line (throughput of the interval, running / waiting requests, KV usage,
// prefix-cache hit rate), and with --enable-log-requests one line per generation request (its
// id, sampling params and prompt length; never the prompt's text). Part of HttpServerImpl; lines
// go to the process log (stderr).
#include <chrono>
#include <cstdio>
#include <sstream>

#include "core/log.h"
#include "server/server_impl.h"

namespace m3::server {

namespace {
// The client's bytes as a log shows them: printable ASCII as is, every other byte %XX (as in a
// URL; "%" itself stays, so an encoded path reads as sent), so a request cannot write control
// characters, quotes or bytes that are not UTF-8 to the log.
std::string loggable(const std::string& s, size_t max_bytes = 2048) {
  std::string out;
  for (size_t i = 0; i < s.size() && i < max_bytes; ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c >= 0x20 && c < 0x7f && c != '"') {
      out += static_cast<char>(c);
    } else {
      char buf[4];
      std::snprintf(buf, sizeof(buf), "%%%02X", c);
      out += buf;
    }
  }
  if (s.size() > max_bytes) out += "...";
  return out;
}
}  // namespace

void HttpServerImpl::access_log(const HttpRequest& req, const HttpResponse& res) const {
  if (!cfg_.access_log) return;
  M3_LOG_INFO("%s - \"%s %s HTTP/1.1\" %d", req.remote_addr.c_str(), loggable(req.method).c_str(),
              loggable(req.path).c_str(), res.status);
}

void HttpServerImpl::log_request(const std::string& request_id, const Generation& gen,
                                 const engine::SamplingParams& sp, const CommonParams& p) const {
  std::ostringstream os;
  os << "Received request " << request_id << ": prompt_tokens: [";
  for (size_t i = 0; i < gen.prompts.size(); ++i)
    os << (i ? ", " : "") << gen.prompts[i].ids.size();
  os << "], params: SamplingParams(n=" << p.n << ", temperature=" << sp.temperature
     << ", top_p=" << sp.top_p << ", top_k=" << sp.top_k << ", min_p=" << sp.min_p
     << ", presence_penalty=" << sp.presence_penalty
     << ", frequency_penalty=" << sp.frequency_penalty
     << ", repetition_penalty=" << sp.repetition_penalty << ", seed=";
  if (sp.seed)
    os << *sp.seed;
  else
    os << "None";
  os << ", max_tokens=" << sp.max_tokens << ", min_tokens=" << sp.min_tokens
     << ", stop=" << p.stop.size() << " strings, stop_token_ids=" << sp.stop_token_ids.size()
     << ", ignore_eos=" << (sp.ignore_eos ? "True" : "False") << ", logprobs=" << sp.logprobs
     << ", prompt_logprobs=" << sp.prompt_logprobs << ", logit_bias=" << sp.logit_bias.size()
     << ", allowed_token_ids=" << sp.allowed_token_ids.size()
     << ", bad_words=" << sp.bad_words.size()
     << ", constrained=" << (sp.constraint ? "True" : "False") << ")";
  M3_LOG_INFO("%s", os.str().c_str());
}

void HttpServerImpl::start_stats() {
  if (cfg_.stats_interval_s <= 0 || stats_thread_.joinable()) return;
  stats_stop_ = false;
  stats_thread_ = std::thread([this] {
    using Clock = std::chrono::steady_clock;
    engine::EngineStats last = engine_.stats();
    auto last_t = Clock::now();
    const auto interval = std::chrono::duration_cast<Clock::duration>(
        std::chrono::duration<double>(cfg_.stats_interval_s));
    std::unique_lock<std::mutex> lock(stats_mu_);
    while (!stats_cv_.wait_for(lock, interval, [&] { return stats_stop_; })) {
      const engine::EngineStats now = engine_.stats();
      const auto t = Clock::now();
      const double dt = std::chrono::duration<double>(t - last_t).count();
      const int64_t prompt = now.prompt_tokens_total - last.prompt_tokens_total;
      const int64_t gen = now.generation_tokens_total - last.generation_tokens_total;
      // An idle server stays quiet (vLLM logs only while it has work).
      if (prompt > 0 || gen > 0 || now.num_running > 0 || now.num_waiting > 0) {
        const int64_t queries = now.prefix_cache_queries - last.prefix_cache_queries;
        const int64_t hits = now.prefix_cache_hits - last.prefix_cache_hits;
        M3_LOG_INFO(
            "Engine 000: Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f "
            "tokens/s, Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache "
            "hit rate: %.1f%%",
            dt > 0 ? static_cast<double>(prompt) / dt : 0.0,
            dt > 0 ? static_cast<double>(gen) / dt : 0.0, now.num_running, now.num_waiting,
            100.0 * now.kv_cache_usage,
            queries > 0 ? 100.0 * static_cast<double>(hits) / static_cast<double>(queries) : 0.0);
      }
      const engine::SpecDecodeStats &sn = now.spec_decode, &sl = last.spec_decode;
      if (sn.enabled && sn.num_drafts > sl.num_drafts) {
        // vLLM's SpecDecodingLogging line over the interval.
        const double drafts = static_cast<double>(sn.num_drafts - sl.num_drafts);
        const double drafted = static_cast<double>(sn.num_draft_tokens - sl.num_draft_tokens);
        const double accepted =
            static_cast<double>(sn.num_accepted_tokens - sl.num_accepted_tokens);
        std::string per;
        for (size_t i = 0; i < sn.accepted_per_pos.size(); ++i) {
          const int64_t before = i < sl.accepted_per_pos.size() ? sl.accepted_per_pos[i] : 0;
          char buf[32];
          std::snprintf(buf, sizeof buf, "%s%.3f", i ? ", " : "",
                        static_cast<double>(sn.accepted_per_pos[i] - before) / drafts);
          per += buf;
        }
        M3_LOG_INFO(
            "SpecDecoding metrics: Mean acceptance length: %.2f, Accepted throughput: %.2f "
            "tokens/s, Drafted throughput: %.2f tokens/s, Accepted: %.0f tokens, Drafted: %.0f "
            "tokens, Per-position acceptance rate: %s, Avg Draft acceptance rate: %.1f%%",
            1.0 + accepted / drafts, dt > 0 ? accepted / dt : 0.0, dt > 0 ? drafted / dt : 0.0,
            accepted, drafted, per.c_str(), drafted > 0 ? 100.0 * accepted / drafted : 0.0);
      }
      last = now;
      last_t = t;
    }
  });
}

void HttpServerImpl::stop_stats() {
  {
    std::lock_guard<std::mutex> lock(stats_mu_);
    stats_stop_ = true;
  }
  stats_cv_.notify_all();
  if (stats_thread_.joinable()) stats_thread_.join();
}

}  // namespace m3::server
