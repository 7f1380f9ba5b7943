// HttpFront: the server's own HTTP/1.1 front. One event-loop thread (epoll) accepts connections
// and reads requests under deadlines and caps; only complete requests reach the worker threads,
// so slow, idle or numerous clients hold a file descriptor, never a worker. Cheap routes
// (health, metrics) are answered on the loop itself and stay prompt when every worker is busy.
// Called by HttpServer (http_server.cpp), which supplies the handlers.
// Invariants: a connection is owned by exactly one of the loop or one worker at a time; a request
// over a cap or past a deadline is answered 4xx (or dropped, when idle) without reaching a handler;
// past capacity a request gets 429 with Retry-After.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "core/error.h"
#include "server/http_types.h"

namespace m3::server {

struct HttpLimits {
  int max_connections = 4096;             // open connections in all
  int max_connections_per_client = 2048;  // open connections from one client address
  double header_timeout_s = 10.0;         // first byte to the end of the headers
  double body_timeout_s = 60.0;           // end of the headers to the end of the body
  double keep_alive_timeout_s = 5.0;      // idle time between requests on one connection
  double write_timeout_s = 60.0;          // a stalled response write gives up after this
  int max_keep_alive_requests = 1000;     // requests on one connection before it is closed
  size_t max_header_bytes = 32 * 1024;    // request line + headers
  size_t max_headers = 100;
  size_t max_body_bytes = size_t{32} << 20;  // after de-chunking; compressed bodies are refused
  int num_workers = 256;                     // threads running the (blocking) handlers
  int max_pending = 1024;                    // complete requests waiting for a worker
};

struct HttpFrontStats {
  int64_t connections_open = 0;
  int64_t requests_pending = 0;  // complete, waiting for a worker
  int64_t workers_busy = 0;
  int64_t rejected_capacity_total = 0;  // 429 for lack of a worker or a connection slot
  int64_t timeouts_total = 0;           // header/body/idle deadlines that closed a connection
  int64_t bad_requests_total = 0;       // malformed HTTP, caps exceeded (4xx from the front)
};

using HttpHandler = std::function<void(const HttpRequest&, HttpResponse&)>;

class HttpFrontImpl;

class HttpFront {
 public:
  // `inline_handler` answers the requests for which `is_inline` is true, on the loop thread: it
  // must not block. `handler` answers the rest on the workers.
  HttpFront(HttpLimits limits, HttpHandler handler,
            std::function<bool(const HttpRequest&)> is_inline, HttpHandler inline_handler);
  ~HttpFront();
  HttpFront(const HttpFront&) = delete;
  HttpFront& operator=(const HttpFront&) = delete;

  // Listens on host:port (port 0 picks one). A port in use is an error ("address in use"):
  // the socket is never shared (no SO_REUSEPORT).
  Status bind(const std::string& host, int port);
  // Listens on a Unix domain socket instead (vLLM's --uds): a stale socket file at `path` is
  // replaced, any other file is refused; the file is removed when the front is destroyed.
  Status bind_unix(const std::string& path);
  int port() const;
  // Runs the loop and the workers until stop(); blocks the calling thread.
  Status run();
  // Closes the listener and every connection, and joins the workers. Handlers still running
  // finish first (their writes fail once their connection is gone). Safe from any thread.
  void stop();
  HttpFrontStats stats() const;

 private:
  std::unique_ptr<HttpFrontImpl> impl_;
};

}  // namespace m3::server
