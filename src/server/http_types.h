// HttpRequest / HttpResponse / ResponseSink: what a route handler sees of one HTTP exchange.
// Made by HttpFront (http_front.h) once a request is complete (headers and whole body, within
// their deadlines and size caps) and handed to a worker thread; read by the route handlers.
// Invariant: a handler never touches the socket except through ResponseSink (streaming) and
// `client_gone`, so every deadline and cap stays the front's.
#pragma once

#include <functional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace m3::server {

struct HttpRequest {
  std::string method;  // as sent, e.g. "POST"
  std::string path;    // the target without its query string
  std::string query;   // after the '?', undecoded ("" if none)
  std::vector<std::pair<std::string, std::string>> headers;  // names lower-cased
  std::string body;                                          // de-chunked
  std::string remote_addr;
  // True once the client has closed or reset its connection (checked without blocking).
  std::function<bool()> client_gone = [] { return false; };

  // The first value of header `lower_name`, or "" when absent.
  const std::string& header(std::string_view lower_name) const {
    static const std::string kEmpty;
    for (const auto& [k, v] : headers) {
      if (k == lower_name) return v;
    }
    return kEmpty;
  }
};

// Writes a streamed (chunked) response body. write() returns false once the client is gone or a
// write stalls past the write deadline; the stream should then stop.
class ResponseSink {
 public:
  virtual ~ResponseSink() = default;
  virtual bool write(std::string_view data) = 0;
  virtual bool client_gone() = 0;
};

struct HttpResponse {
  int status = 200;
  std::string content_type = "text/plain";
  std::string body;
  std::vector<std::pair<std::string, std::string>> headers;
  // Set for a streamed body: called on the worker after the status line and headers went out;
  // returns true when the body ended normally (the connection may be kept), false to close it.
  std::function<bool(ResponseSink&)> stream;

  void set_content(std::string b, std::string type) {
    body = std::move(b);
    content_type = std::move(type);
  }
  void set_header(std::string name, std::string value) {
    headers.emplace_back(std::move(name), std::move(value));
  }
};

}  // namespace m3::server
