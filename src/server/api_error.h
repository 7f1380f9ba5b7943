// ApiError: the one mapping from m3::Error to an HTTP status and the OpenAI error body
// {"error": {"message", "type", "param", "code"}} (design.md §4).
// Called by every HTTP handler in server/ (and the SSE error event after streaming began).
// Invariant: every error the server sends goes through here, so status, type and code agree.
#pragma once

#include <string>
#include <utility>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace m3::server {

// HTTP status for an error: 400 bad input / context length, 401 bad key, 404 unknown model or
// path, 429 queue full, 503 draining, 500 otherwise.
int http_status(const Error& error);

// {"error": {"message", "type", "param", "code"}}. `code` is a string for the cases OpenAI
// clients branch on (context_length_exceeded, invalid_api_key, model_not_found, ...), else the
// HTTP status as a number (what vLLM sends).
nlohmann::json error_body(const Error& error);

// error_body(error).dump(), never throws (invalid UTF-8 in the message is replaced).
std::string error_json(const Error& error);

// A 400 that names the request field `param` (ErrorCode::kInvalidArgument): how every request
// parser reports bad input.
inline tl::unexpected<Error> invalid_param(const std::string& param, std::string message) {
  return make_error(ErrorCode::kInvalidArgument, std::move(message), param);
}
// The same for a field whose value is valid but not supported (ErrorCode::kUnsupported).
inline tl::unexpected<Error> unsupported_param(const std::string& param, std::string message) {
  return make_error(ErrorCode::kUnsupported, std::move(message), param);
}

}  // namespace m3::server
