#include "core/error.h"

namespace m3 {

const char* error_code_name(ErrorCode code) {
  switch (code) {
    case ErrorCode::kInvalidArgument:
      return "invalid_argument";
    case ErrorCode::kNotFound:
      return "not_found";
    case ErrorCode::kIo:
      return "io_error";
    case ErrorCode::kFormat:
      return "format_error";
    case ErrorCode::kUnsupported:
      return "unsupported";
    case ErrorCode::kContextLength:
      return "context_length_exceeded";
    case ErrorCode::kUnauthorized:
      return "unauthorized";
    case ErrorCode::kModelNotFound:
      return "model_not_found";
    case ErrorCode::kQueueFull:
      return "queue_full";
    case ErrorCode::kUnavailable:
      return "unavailable";
    case ErrorCode::kInternal:
      return "internal_error";
  }
  return "internal_error";
}

}  // namespace m3
