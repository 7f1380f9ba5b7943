// Routing (404 / 405 with Allow), API-key checks, and the routes that are not generation:
// /v1/models, /health, /ping (GET and POST), /load, /version, /metrics (answered on the front's
// loop thread, so they stay prompt under any load) and /tokenize, /detokenize (on workers); the
// generation routes are dispatched to serve_*.cpp. Part of HttpServerImpl.
#include <algorithm>
#include <array>
#include <cstring>
#include <string_view>

#include "server/json_limits.h"
#include "server/metrics.h"
#include "server/server_impl.h"

namespace m3::server {

namespace {

struct Route {
  const char* path;
  const char* method;
  bool on_worker;  // generation and tokenization: may take long, runs on a worker
};

constexpr std::string_view kResponsesPrefix = "/v1/responses/";
constexpr const char* kResponseById = "/v1/responses/{response_id}";
constexpr const char* kResponseCancel = "/v1/responses/{response_id}/cancel";
constexpr const char* kResponseInputItems = "/v1/responses/{response_id}/input_items";

constexpr std::array<Route, 18> kRoutes = {{
    {"/v1/completions", "POST", true},
    {"/v1/chat/completions", "POST", true},
    {"/v1/messages", "POST", true},
    {"/v1/messages/count_tokens", "POST", true},
    {"/v1/responses", "POST", true},
    {kResponseById, "GET", true},  // a stored response (serve_responses.cpp)
    {kResponseById, "DELETE", true},
    {kResponseCancel, "POST", true},  // a background response
    {kResponseInputItems, "GET", true},
    {"/tokenize", "POST", true},
    {"/detokenize", "POST", true},
    {"/v1/models", "GET", false},
    {"/health", "GET", false},
    {"/ping", "GET", false},
    {"/ping", "POST", false},  // vLLM answers both (SageMaker's health probe POSTs)
    {"/load", "GET", false},
    {"/version", "GET", false},
    {"/metrics", "GET", false},
}};

// The route of `path` taking `method`, else the first route of `path` (for 405), else null.
// The route template a path belongs to: "/v1/responses/resp_x" -> "/v1/responses/{response_id}".
std::string route_of(const std::string& path) {
  if (path.size() <= kResponsesPrefix.size() || path.rfind(kResponsesPrefix, 0) != 0) return path;
  const size_t slash = path.find('/', kResponsesPrefix.size());
  if (slash == std::string::npos) return kResponseById;
  if (slash == kResponsesPrefix.size()) return path;  // no id
  const std::string_view rest = std::string_view(path).substr(slash);
  if (rest == "/cancel") return kResponseCancel;
  if (rest == "/input_items") return kResponseInputItems;
  return path;
}

const Route* find_route(const std::string& raw_path, const std::string& method = "") {
  const std::string path = route_of(raw_path);
  const Route* any = nullptr;
  for (const auto& r : kRoutes) {
    if (path != r.path) continue;
    if (method == r.method) return &r;
    if (!any) any = &r;
  }
  return any;
}

// The methods `path` takes, for 405's Allow header ("GET, POST").
std::string allowed_methods(const std::string& raw_path) {
  const std::string path = route_of(raw_path);
  std::string out;
  for (const auto& r : kRoutes) {
    if (path == r.path) out += (out.empty() ? "" : ", ") + std::string(r.method);
  }
  return out;
}

}  // namespace

void send_error_for(const HttpRequest& req, HttpResponse& res, const Error& e) {
  if (req.path.rfind("/v1/messages", 0) == 0) return send_anthropic_error(res, e);
  send_error(res, e);
}

bool constant_time_equal(std::string_view a, std::string_view b) {
  // Every byte of the longer string is visited and differences are OR-ed together, so the
  // time does not reveal the length of the matching prefix.
  const size_t n = std::max(a.size(), b.size());
  unsigned diff = a.size() == b.size() ? 0u : 1u;
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff |= static_cast<unsigned>(x ^ y);
  }
  return diff == 0;
}

bool HttpServerImpl::authorized(const HttpRequest& req, HttpResponse& res) const {
  if (cfg_.api_keys.empty() || req.path.rfind("/v1", 0) != 0) return true;
  const std::string& auth = req.header("authorization");
  static constexpr std::string_view kPrefix = "Bearer ";
  std::string key = auth.rfind(kPrefix, 0) == 0 ? auth.substr(kPrefix.size()) : std::string();
  if (key.empty()) key = req.header("x-api-key");
  // Every key is compared (no early exit), so the time tells neither which key nor how much of one
  // matched.
  bool ok = false;
  for (const std::string& k : cfg_.api_keys) ok = constant_time_equal(key, k) | ok;
  if (ok) return true;
  send_error_for(req, res,
                 Error{ErrorCode::kUnauthorized,
                       key.empty() ? "missing API key: send 'Authorization: Bearer <key>' or "
                                     "'x-api-key: <key>'"
                                   : "invalid API key",
                       ""});
  return false;
}

bool HttpServerImpl::cors(const HttpRequest& req, HttpResponse& res) const {
  if (cfg_.allowed_origins.empty()) return false;
  const std::string& origin = req.header("origin");
  if (origin.empty()) return false;
  const bool any = std::find(cfg_.allowed_origins.begin(), cfg_.allowed_origins.end(), "*") !=
                   cfg_.allowed_origins.end();
  const bool listed = std::find(cfg_.allowed_origins.begin(), cfg_.allowed_origins.end(), origin) !=
                      cfg_.allowed_origins.end();
  if (!any && !listed) return false;  // the browser refuses the response: no CORS headers
  // With credentials a browser needs the origin itself, never "*".
  res.set_header("Access-Control-Allow-Origin", any && !cfg_.allow_credentials ? "*" : origin);
  res.set_header("Vary", "Origin");
  if (cfg_.allow_credentials) res.set_header("Access-Control-Allow-Credentials", "true");
  if (req.method != "OPTIONS" || req.header("access-control-request-method").empty()) return false;
  // A preflight: answered here, before the API-key check (browsers send no credentials in it).
  res.set_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS");
  const std::string& want = req.header("access-control-request-headers");
  res.set_header("Access-Control-Allow-Headers",
                 want.empty() ? "Authorization, Content-Type" : want);
  res.set_header("Access-Control-Max-Age", "600");
  res.status = 204;
  return true;
}

void HttpServerImpl::count_request(const HttpRequest& req, const HttpResponse& res) const {
  const Route* r = find_route(req.path);
  const int cls = std::clamp(res.status / 100, 1, 5);
  std::lock_guard<std::mutex> lock(http_counts_mu_);
  // Labels from a fixed set only: a client cannot grow the series with odd methods or paths.
  static constexpr std::array<std::string_view, 7> kMethods = {"GET",   "POST", "PUT",    "DELETE",
                                                               "PATCH", "HEAD", "OPTIONS"};
  const bool known = std::find(kMethods.begin(), kMethods.end(), req.method) != kMethods.end();
  ++http_counts_[{known ? req.method : std::string("other"), std::to_string(cls) + "xx",
                  r ? r->path : "none"}];
}

std::vector<HttpRequestCount> HttpServerImpl::http_request_counts() const {
  std::lock_guard<std::mutex> lock(http_counts_mu_);
  std::vector<HttpRequestCount> out;
  for (const auto& [k, n] : http_counts_)
    out.push_back({std::get<0>(k), std::get<1>(k), std::get<2>(k), n});
  return out;
}

bool HttpServerImpl::is_inline(const HttpRequest& req) const {
  const Route* r = find_route(req.path, req.method);
  return !(r && r->on_worker && req.method == r->method);
}

// 404 for an unknown path, 405 (with Allow) for a known path and another method.
static bool check_method(const HttpRequest& req, HttpResponse& res) {
  const Route* r = find_route(req.path, req.method);
  if (!r) {
    send_error(res, Error{ErrorCode::kNotFound, "no route for " + req.method + " " + req.path, ""});
    return false;
  }
  if (req.method != r->method) {
    const std::string allow = allowed_methods(req.path);
    nlohmann::json body = error_body(Error{
        ErrorCode::kInvalidArgument, req.path + " takes " + allow + ", not " + req.method, ""});
    body["error"]["code"] = 405;
    res.set_content(dump_json(body), "application/json");
    res.status = 405;
    res.set_header("Allow", allow);
    return false;
  }
  return true;
}

void HttpServerImpl::route_inline(const HttpRequest& req, HttpResponse& res) {
  if (cors(req, res) || !authorized(req, res) || !check_method(req, res)) return;
  if (req.path == "/v1/models") {
    const auto& info = engine_.model_info();
    Json data = Json::array();
    for (const auto& name : cfg_.served_model_names) {
      data.push_back({{"id", name},
                      {"object", "model"},
                      {"created", unix_now()},
                      {"owned_by", "m3serve"},
                      {"root", info.model_dir},
                      {"parent", nullptr},
                      {"max_model_len", info.max_model_len}});
    }
    return send_json(res, Json{{"object", "list"}, {"data", data}});
  }
  if (req.path == "/health" || req.path == "/ping") {
    if (draining_ || !engine_.healthy()) {
      res.status = 503;
      res.set_content(draining_ ? "draining" : "unhealthy", "text/plain");
      return;
    }
    res.status = 200;
    return;
  }
  if (req.path == "/version") return send_json(res, Json{{"version", cfg_.version}});
  if (req.path == "/load") {
    // vLLM's /load: the requests this server is working on (queued or running).
    return send_json(res, Json{{"server_load", in_flight_.load()}});
  }
  if (req.path == "/metrics") {
    ServerGauges g;
    g.http_requests_in_flight = in_flight_.load();
    g.draining = draining_.load();
    g.client_aborts = client_aborts_.load();
    if (front_) {
      const HttpFrontStats fs = front_->stats();
      g.connections_open = fs.connections_open;
      g.requests_pending = fs.requests_pending;
      g.workers_busy = fs.workers_busy;
      g.rejected_capacity = fs.rejected_capacity_total;
      g.connection_timeouts = fs.timeouts_total;
      g.bad_http_requests = fs.bad_requests_total;
    }
    g.http_requests = http_request_counts();
    res.set_content(format_metrics(engine_.stats(), model_name(), g, &engine_.model_info()),
                    "text/plain; version=0.0.4; charset=utf-8");
    return;
  }
}

void HttpServerImpl::route(const HttpRequest& req, HttpResponse& res) {
  if (cors(req, res) || !authorized(req, res) || !check_method(req, res)) return;
  if (req.path == "/v1/completions") return handle_completions(req, res);
  if (req.path == "/v1/chat/completions") return handle_chat(req, res);
  if (req.path == "/v1/messages") return handle_messages(req, res);
  if (req.path == "/v1/messages/count_tokens") return handle_count_tokens(req, res);
  if (req.path == "/v1/responses") return handle_responses(req, res);
  const std::string route = route_of(req.path);
  if (route == kResponseById && req.method == "DELETE") return handle_delete_response(req, res);
  if (route == kResponseById) return handle_get_response(req, res);
  if (route == kResponseCancel) return handle_cancel_response(req, res);
  if (route == kResponseInputItems) return handle_response_input_items(req, res);
  if (req.path == "/tokenize") return handle_tokenize(req, res);
  if (req.path == "/detokenize") return handle_detokenize(req, res);
}

void HttpServerImpl::handle_tokenize(const HttpRequest& req, HttpResponse& res) {
  auto parsed_body = parse_json_bounded(req.body, "the request body");
  if (!parsed_body) return send_error(res, parsed_body.error());
  OrderedJson& j = *parsed_body;
  if (!j.is_object()) {
    return send_error(res,
                      Error{ErrorCode::kInvalidArgument, "request body must be a JSON object", ""});
  }
  bool return_strs = false;
  if (j.contains("return_token_strs") && !j["return_token_strs"].is_null()) {
    if (!j["return_token_strs"].is_boolean()) {
      return send_error(res, Error{ErrorCode::kInvalidArgument,
                                   "'return_token_strs' must be a boolean", "return_token_strs"});
    }
    return_strs = j["return_token_strs"].get<bool>();
  }
  if (j.contains("model") && !j["model"].is_null()) {
    if (!j["model"].is_string()) {
      return send_error(res,
                        Error{ErrorCode::kInvalidArgument, "'model' must be a string", "model"});
    }
    if (auto st = check_model(j["model"].get<std::string>()); !st)
      return send_error(res, st.error());
  }
  std::vector<int32_t> ids;
  if (j.contains("messages")) {
    auto parsed = parse_chat_request(req.body);
    if (!parsed) return send_error(res, parsed.error());
    auto rendered = assets_.chat->render(*parsed);
    if (!rendered) return send_error(res, rendered.error());
    if (auto st = check_text_fits(rendered->prompt.size(), "messages"); !st)
      return send_error(res, st.error());
    ids = assets_.tokenizer->encode(rendered->prompt);
  } else if (j.contains("prompt") && j["prompt"].is_string()) {
    bool add_special = true;
    if (j.contains("add_special_tokens")) {
      if (!j["add_special_tokens"].is_boolean()) {
        return send_error(
            res, Error{ErrorCode::kInvalidArgument, "'add_special_tokens' must be a boolean",
                       "add_special_tokens"});
      }
      add_special = j["add_special_tokens"].get<bool>();
    }
    const std::string& text = j["prompt"].get_ref<const std::string&>();
    if (auto st = check_text_fits(text.size(), "prompt"); !st) return send_error(res, st.error());
    ids = add_special ? encode_prompt(text) : assets_.tokenizer->encode(text);
  } else {
    return send_error(
        res, Error{ErrorCode::kInvalidArgument,
                   "give 'prompt' (a string) or 'messages' (a chat) to tokenize", "prompt"});
  }
  Json out;
  out["count"] = ids.size();
  out["max_model_len"] = engine_.model_info().max_model_len;
  out["tokens"] = ids;
  if (return_strs) {
    Json strs = Json::array();
    for (int32_t id : ids) strs.push_back(assets_.tokenizer->id_to_token(id));
    out["token_strs"] = strs;
  } else {
    out["token_strs"] = nullptr;
  }
  send_json(res, out);
}

void HttpServerImpl::handle_detokenize(const HttpRequest& req, HttpResponse& res) {
  auto parsed_body = parse_json_bounded(req.body, "the request body");
  if (!parsed_body) return send_error(res, parsed_body.error());
  OrderedJson& j = *parsed_body;
  if (!j.is_object()) {
    return send_error(res,
                      Error{ErrorCode::kInvalidArgument, "request body must be a JSON object", ""});
  }
  if (j.contains("model") && !j["model"].is_null()) {
    if (!j["model"].is_string()) {
      return send_error(res,
                        Error{ErrorCode::kInvalidArgument, "'model' must be a string", "model"});
    }
    if (auto st = check_model(j["model"].get<std::string>()); !st)
      return send_error(res, st.error());
  }
  if (!j.contains("tokens") || !j["tokens"].is_array()) {
    return send_error(res, Error{ErrorCode::kInvalidArgument,
                                 "'tokens' must be an array of token ids", "tokens"});
  }
  if (j["tokens"].size() > static_cast<size_t>(engine_.model_info().max_model_len) * 4) {
    return send_error(res,
                      Error{ErrorCode::kInvalidArgument,
                            "'tokens' holds " + std::to_string(j["tokens"].size()) +
                                " ids; at most 4 x max_model_len (" +
                                std::to_string(int64_t{engine_.model_info().max_model_len} * 4) +
                                ") are detokenized at once",
                            "tokens"});
  }
  std::vector<int32_t> ids;
  const int64_t vocab =
      std::max<int64_t>(assets_.tokenizer->vocab_size(), engine_.model_info().vocab_size);
  for (const auto& t : j["tokens"]) {
    if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() >= vocab) {
      return send_error(
          res,
          Error{ErrorCode::kInvalidArgument,
                "'tokens' must hold token ids in [0, " + std::to_string(vocab) + ")", "tokens"});
    }
    ids.push_back(static_cast<int32_t>(t.get<int64_t>()));
  }
  send_json(res, Json{{"prompt", assets_.tokenizer->decode(ids, false)}});
}

}  // namespace m3::server
