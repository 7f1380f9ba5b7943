// HttpServer's core: construction (the HTTP front and its limits), context fitting, submission,
// waiting on non-streamed generations, drain with a timeout, and loading the model's assets.
// The routes are in routes.cpp, the generation handlers in serve_completions.cpp and
// serve_chat.cpp, the per-request engine stream in generation_stream.cpp.
#include "server/http_server.h"

#include <malloc.h>

#include <algorithm>
#include <chrono>
#include <ctime>
#include <random>
#include <thread>

#include "core/log.h"
#include "server/server_impl.h"

namespace m3::server {

using Clock = std::chrono::steady_clock;

std::string random_id(size_t len) {
  static constexpr char kAlphabet[] =
      "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ";
  thread_local std::mt19937_64 rng{std::random_device{}() ^
                                   static_cast<uint64_t>(Clock::now().time_since_epoch().count())};
  std::string s(len, '0');
  for (auto& c : s) c = kAlphabet[rng() % (sizeof(kAlphabet) - 1)];
  return s;
}

int64_t unix_now() {
  return static_cast<int64_t>(std::time(nullptr));
}

void send_error(HttpResponse& res, const Error& e) {
  res.status = http_status(e);
  res.set_content(error_json(e), "application/json");
  if (res.status == 429 || res.status == 503) res.set_header("Retry-After", "1");
}

void send_json(HttpResponse& res, const Json& j, int status) {
  res.status = status;
  res.set_content(dump_json(j), "application/json");
}

HttpServerImpl::HttpServerImpl(engine::Engine& engine, ServerAssets assets, ServerConfig config)
    : engine_(engine), assets_(std::move(assets)), cfg_(std::move(config)) {
  if (cfg_.served_model_names.empty()) cfg_.served_model_names.push_back("m3");
  // glibc gives each thread that allocates its own arena (up to 8 per core) and rarely returns
  // their memory: with hundreds of workers, rejected large requests ratcheted RSS up by GBs.
  // A few shared arenas keep it bounded; the workers start after this.
  mallopt(M_ARENA_MAX, 4);
  for (int32_t id = 0; id < assets_.tokenizer->vocab_size(); ++id) {
    max_token_bytes_ = std::max(max_token_bytes_, assets_.tokenizer->id_to_token(id).size());
  }
  structured_ = std::make_unique<text::StructuredOutputCompiler>(
      assets_.tokenizer, engine_.model_info().vocab_size, engine_.model_info().eos_token_ids);
  structured_->warm_up();  // at start, so the first structured request does not pay for it
  if (cfg_.media.processor_cache_bytes > 0)
    media_cache_ = std::make_unique<MediaCache>(cfg_.media.processor_cache_bytes);
  auto marker_ids = [&](const char* text) {
    if (auto id = assets_.tokenizer->token_to_id(text)) return std::vector<int32_t>{*id};
    return assets_.tokenizer->encode(text);
  };
  image_start_ids_ = marker_ids("]<]start of image[>[");
  image_end_ids_ = marker_ids("]<]end of image[>[");
  HttpLimits lim;
  int threads = cfg_.num_http_threads;
  if (threads <= 0) threads = std::clamp(cfg_.max_num_seqs * 4, 256, 1024);
  lim.num_workers = threads;
  lim.max_pending = std::max(1024, 4 * threads);
  lim.max_connections = cfg_.max_connections;
  lim.max_connections_per_client = cfg_.max_connections_per_client;
  lim.header_timeout_s = cfg_.header_timeout_s;
  lim.body_timeout_s = cfg_.body_timeout_s;
  lim.keep_alive_timeout_s = cfg_.keep_alive_timeout_s;
  lim.max_body_bytes = cfg_.max_body_bytes;
  front_ = std::make_unique<HttpFront>(
      lim,
      [this](const HttpRequest& q, HttpResponse& s) {
        route(q, s);
        access_log(q, s);
        count_request(q, s);
        // A large request leaves large free blocks behind; hand them back to the system.
        if (q.body.size() > (size_t{1} << 20)) malloc_trim(0);
      },
      [this](const HttpRequest& q) { return is_inline(q); },
      [this](const HttpRequest& q, HttpResponse& s) {
        route_inline(q, s);
        access_log(q, s);
        count_request(q, s);
      });
}

Status HttpServerImpl::check_model(const std::string& model) const {
  if (model.empty()) return {};
  for (const auto& n : cfg_.served_model_names) {
    if (n == model) return {};
  }
  return make_error(ErrorCode::kModelNotFound,
                    "The model `" + model + "` does not exist. This server serves `" +
                        model_name() + "` (see GET /v1/models).",
                    "model");
}

std::vector<int32_t> HttpServerImpl::encode_prompt(const std::string& text) const {
  auto r = assets_.tokenizer->encode(text, true);
  if (r) return *r;
  return assets_.tokenizer->encode(text);
}

Status HttpServerImpl::check_text_fits(size_t text_bytes, const std::string& param) const {
  const int64_t max_len = engine_.model_info().max_model_len;
  // Each token covers at most max_token_bytes_ bytes, so a text longer than max_len tokens of
  // that size cannot fit; x2 leaves room for normalisation that shrinks text (NFC).
  const uint64_t limit = static_cast<uint64_t>(max_len) * max_token_bytes_ * 2;
  if (text_bytes <= limit) return {};
  return make_error(ErrorCode::kContextLength,
                    "This model's maximum context length is " + std::to_string(max_len) +
                        " tokens. However, your prompt is " + std::to_string(text_bytes) +
                        " bytes, more than that many tokens can hold (at most " +
                        std::to_string(max_token_bytes_) +
                        " bytes per token). Please shorten the prompt.",
                    param);
}

Status HttpServerImpl::fit_context(engine::SamplingParams& sp, const CommonParams& p,
                                   size_t prompt_len, const std::string& param) const {
  const int64_t max_len = engine_.model_info().max_model_len;
  const int64_t n = static_cast<int64_t>(prompt_len);
  if (n == 0) {
    return make_error(ErrorCode::kInvalidArgument,
                      "the prompt is empty after tokenization; send some text", param);
  }
  M3_TRY_STATUS(engine::check_context_length(n, -1, max_len, param));
  if (p.max_tokens) {
    // As vLLM: min(max_tokens, max_model_len - prompt); the prompt leaves at least one token.
    sp.max_tokens = static_cast<int32_t>(std::min<int64_t>(*p.max_tokens, max_len - n));
  } else {
    int64_t room = max_len - n;
    if (assets_.defaults.max_new_tokens && *assets_.defaults.max_new_tokens > 0) {
      room = std::min<int64_t>(room, *assets_.defaults.max_new_tokens);
    }
    sp.max_tokens = static_cast<int32_t>(room);
  }
  if (sp.min_tokens > sp.max_tokens) sp.min_tokens = sp.max_tokens;
  return {};
}

Status HttpServerImpl::truncate_prompt(std::vector<int32_t>& ids, const CommonParams& p) const {
  if (!p.truncate_prompt_tokens) return {};
  const int64_t max_len = engine_.model_info().max_model_len;
  const int64_t k = *p.truncate_prompt_tokens == -1 ? max_len : *p.truncate_prompt_tokens;
  if (k > max_len) {
    return make_error(ErrorCode::kInvalidArgument,
                      "truncate_prompt_tokens value (" + std::to_string(k) +
                          ") is greater than max_model_len (" + std::to_string(max_len) +
                          "). Please select a smaller truncation size.",
                      "truncate_prompt_tokens");
  }
  if (static_cast<int64_t>(ids.size()) > k) ids.erase(ids.begin(), ids.end() - k);
  return {};
}

namespace {
// splitmix64: one well-mixed seed per (--seed, request number).
uint64_t mix_seed(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
}  // namespace

Status HttpServerImpl::submit_all(Generation& gen, const engine::SamplingParams& sp_in,
                                  const CommonParams& p, const ChoiceOptions& base,
                                  const std::string& request_id) const {
  engine::SamplingParams sp0 = sp_in;
  if (!sp0.seed && cfg_.seed) sp0.seed = mix_seed(*cfg_.seed ^ mix_seed(num_seeded_++));
  if (cfg_.log_requests) log_request(request_id, gen, sp0, p);
  if (p.kv_transfer && gen.prompts.size() != 1) {
    return make_error(ErrorCode::kInvalidArgument,
                      "kv_transfer_params with " + std::to_string(gen.prompts.size()) +
                          " prompts: prefill/decode disaggregation serves one prompt per request",
                      "kv_transfer_params");
  }
  int index = 0;
  for (size_t pi = 0; pi < gen.prompts.size(); ++pi) {
    for (int i = 0; i < p.n; ++i) {
      engine::GenerateRequest gr;
      gr.prompt_token_ids = gen.prompts[pi].ids;
      gr.images = gen.prompts[pi].images;
      gr.params = sp0;
      // Distinct but reproducible streams for the n choices of a seeded request.
      if (sp0.seed && i > 0) gr.params.seed = *sp0.seed + static_cast<uint64_t>(i);
      gr.priority = p.priority;
      gr.kv_transfer = p.kv_transfer;
      gr.waker = gen.waker();
      auto st = engine_.submit(std::move(gr));
      if (!st) {
        gen.abort_all();
        gen.slots.clear();
        return tl::unexpected(st.error());
      }
      ChoiceSlot slot;
      slot.index = index++;
      slot.prompt_index = static_cast<int>(pi);
      slot.stream = *st;
      slot.out = std::make_unique<ChoiceOutput>(base);
      gen.slots.push_back(std::move(slot));
    }
  }
  return {};
}

HttpServerImpl::~HttpServerImpl() {
  std::shared_ptr<ResponseStore> store;
  {
    std::lock_guard<std::mutex> lock(responses_mu_);
    store = responses_;
  }
  if (store) stop_background_responses(*store);
}

bool HttpServerImpl::wait_or_abort(Generation& gen, const HttpRequest& req) {
  // The socket is checked every 100 ms: a client that hung up stops costing tokens within that.
  if (gen.wait_all(req, std::chrono::milliseconds(100))) return true;
  ++client_aborts_;
  return false;
}

// ---------------------------------------------------------------------------------- public

HttpServer::HttpServer(engine::Engine& engine, ServerAssets assets, ServerConfig config)
    : impl_(std::make_unique<HttpServerImpl>(engine, std::move(assets), std::move(config))) {}

HttpServer::~HttpServer() {
  impl_->stop_stats();
}

Status HttpServer::bind() {
  auto& c = impl_->cfg_;
  if (!c.uds.empty()) return impl_->front_->bind_unix(c.uds);
  if (c.port < 0 || c.port > 65535) {
    return make_error(ErrorCode::kInvalidArgument,
                      "--port " + std::to_string(c.port) + " is not a TCP port (0..65535)",
                      "--port");
  }
  return impl_->front_->bind(c.host, c.port);
}

int HttpServer::bound_port() const {
  return impl_->front_->port();
}

Status HttpServer::run() {
  impl_->start_stats();
  Status st = impl_->front_->run();
  impl_->stop_stats();
  return st;
}

void HttpServer::drain_and_stop() {
  auto& d = *impl_;
  d.draining_ = true;
  // Generation handlers that are running finish (their streams complete); new ones get 503.
  const auto deadline =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(
                         std::chrono::duration<double>(d.cfg_.shutdown_timeout_s));
  while (d.in_flight_.load() > 0 && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (d.in_flight_.load() > 0) {
    M3_LOG_WARN(
        "server: %lld requests still running after --shutdown-timeout %.1f s: aborting them",
        static_cast<long long>(d.in_flight_.load()), d.cfg_.shutdown_timeout_s);
    d.engine_.abort_all();
    // Aborted handlers end with their streams; bound the wait anyway (a stalled client write
    // gives up after the front's write timeout).
    const auto hard = Clock::now() + std::chrono::seconds(5);
    while (d.in_flight_.load() > 0 && Clock::now() < hard)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  // Background responses have no client waiting on a connection: they are cancelled (stored as
  // "cancelled"), not drained.
  std::shared_ptr<ResponseStore> store;
  {
    std::lock_guard<std::mutex> lock(d.responses_mu_);
    store = d.responses_;
  }
  if (store) stop_background_responses(*store);
  d.stop_stats();
  d.front_->stop();
}

bool HttpServer::draining() const {
  return impl_->draining_;
}

// ------------------------------------------------------------------------------------ assets

Result<ServerAssets> load_server_assets(const std::string& model_dir,
                                        const std::string& chat_template_path,
                                        const OrderedJson& default_kwargs,
                                        const std::string& generation_config) {
  ServerAssets a;
  const std::string tok_path = model_dir + "/tokenizer.json";
  auto tok = text::Tokenizer::from_file(tok_path);
  if (!tok) {
    return make_error(tok.error().code,
                      "cannot load the tokenizer " + tok_path + ": " + tok.error().message);
  }
  a.tokenizer = *tok;
  M3_TRY(auto chat, ChatPrompt::load(model_dir, chat_template_path, default_kwargs));
  a.chat = std::make_shared<const ChatPrompt>(std::move(chat));
  if (generation_config == "vllm") {
    a.defaults = GenerationDefaults{};
  } else {
    const std::string dir =
        (generation_config.empty() || generation_config == "auto") ? model_dir : generation_config;
    M3_TRY(a.defaults, GenerationDefaults::from_dir(dir));
  }
  return a;
}

}  // namespace m3::server
