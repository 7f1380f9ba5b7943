#include "server/api_error.h"

namespace m3::server {

int http_status(const Error& error) {
  switch (error.code) {
    case ErrorCode::kInvalidArgument:
    case ErrorCode::kFormat:
    case ErrorCode::kUnsupported:
    case ErrorCode::kContextLength:
      return 400;
    case ErrorCode::kUnauthorized:
      return 401;
    case ErrorCode::kNotFound:
    case ErrorCode::kModelNotFound:
      return 404;
    case ErrorCode::kQueueFull:
      return 429;
    case ErrorCode::kUnavailable:
      return 503;
    case ErrorCode::kIo:
    case ErrorCode::kInternal:
      return 500;
  }
  return 500;
}

nlohmann::json error_body(const Error& error) {
  const int status = http_status(error);
  std::string type;
  nlohmann::json code = status;
  switch (error.code) {
    case ErrorCode::kInvalidArgument:
    case ErrorCode::kFormat:
      type = "invalid_request_error";
      break;
    case ErrorCode::kUnsupported:
      type = "invalid_request_error";
      code = "unsupported_value";
      break;
    case ErrorCode::kContextLength:
      type = "invalid_request_error";
      code = "context_length_exceeded";
      break;
    case ErrorCode::kUnauthorized:
      type = "authentication_error";
      code = "invalid_api_key";
      break;
    case ErrorCode::kNotFound:
      type = "not_found_error";
      code = "not_found";
      break;
    case ErrorCode::kModelNotFound:
      type = "not_found_error";
      code = "model_not_found";
      break;
    case ErrorCode::kQueueFull:
      type = "rate_limit_error";
      code = "queue_full";
      break;
    case ErrorCode::kUnavailable:
      type = "service_unavailable_error";
      code = "server_unavailable";
      break;
    case ErrorCode::kIo:
    case ErrorCode::kInternal:
      type = "server_error";
      break;
  }
  nlohmann::json err = {
      {"message", error.message},
      {"type", type},
      {"param", error.param.empty() ? nlohmann::json(nullptr) : nlohmann::json(error.param)},
      {"code", code}};
  return {{"error", err}};
}

std::string error_json(const Error& error) {
  return error_body(error).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace m3::server
