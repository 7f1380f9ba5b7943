// Error and Result<T>: how expected failures travel (design.md §4).
// Called by every module that can fail on user input (loader, tokenizer, templates, requests).
// Invariant: messages name the thing that is wrong and the fix; `param` names the request
// parameter or flag when there is one. Core types live in namespace m3 directly.
#pragma once

#include <string>
#include <utility>

#include <tl/expected.hpp>

namespace m3 {

enum class ErrorCode {
  kInvalidArgument,  // bad value from a user: flag, request field, prompt id
  kNotFound,         // a file, tensor or model that is not there
  kIo,               // read/write/mmap failure
  kFormat,           // a file whose content is malformed (json, safetensors header, truncated)
  kUnsupported,      // a valid value we do not support (config, dtype, block size)
  kContextLength,    // prompt + max_tokens over the model length
  kUnauthorized,     // bad API key
  kModelNotFound,    // unknown model name in a request
  kQueueFull,        // admission bound reached
  kUnavailable,      // draining / not ready
  kInternal,         // a bug surfaced as an error (should not happen)
};

const char* error_code_name(ErrorCode code);

struct Error {
  ErrorCode code = ErrorCode::kInternal;
  std::string message;
  std::string param;  // offending request parameter / flag / tensor, when there is one
};

template <class T>
using Result = tl::expected<T, Error>;
using Status = tl::expected<void, Error>;

inline tl::unexpected<Error> make_error(ErrorCode code, std::string message,
                                        std::string param = {}) {
  return tl::unexpected<Error>(Error{code, std::move(message), std::move(param)});
}

}  // namespace m3

// M3_TRY(var, expr): evaluate a Result, return its error from the enclosing function on failure.
#define M3_TRY_CONCAT2(a, b) a##b
#define M3_TRY_CONCAT(a, b) M3_TRY_CONCAT2(a, b)
#define M3_TRY(var, expr)                                                       \
  auto M3_TRY_CONCAT(m3_try_, __LINE__) = (expr);                               \
  if (!M3_TRY_CONCAT(m3_try_, __LINE__))                                        \
    return tl::unexpected(std::move(M3_TRY_CONCAT(m3_try_, __LINE__).error())); \
  var = std::move(*M3_TRY_CONCAT(m3_try_, __LINE__))
#define M3_TRY_STATUS(expr)                                                        \
  do {                                                                             \
    auto m3_try_status_ = (expr);                                                  \
    if (!m3_try_status_) return tl::unexpected(std::move(m3_try_status_.error())); \
  } while (0)
