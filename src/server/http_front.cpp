#include "server/http_front.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "core/log.h"
#include "server/api_error.h"

namespace m3::server {

namespace {

using Clock = std::chrono::steady_clock;

Clock::duration seconds(double s) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

const char* reason_phrase(int status) {
  switch (status) {
    case 100:
      return "Continue";
    case 200:
      return "OK";
    case 400:
      return "Bad Request";
    case 401:
      return "Unauthorized";
    case 404:
      return "Not Found";
    case 405:
      return "Method Not Allowed";
    case 408:
      return "Request Timeout";
    case 411:
      return "Length Required";
    case 413:
      return "Payload Too Large";
    case 415:
      return "Unsupported Media Type";
    case 417:
      return "Expectation Failed";
    case 429:
      return "Too Many Requests";
    case 431:
      return "Request Header Fields Too Large";
    case 500:
      return "Internal Server Error";
    case 501:
      return "Not Implemented";
    case 503:
      return "Service Unavailable";
    case 505:
      return "HTTP Version Not Supported";
    default:
      return status < 400 ? "OK" : "Error";
  }
}

std::string ascii_lower(std::string_view s) {
  std::string out(s);
  for (auto& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

std::string_view trim_ows(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

bool is_token_char(char c) {
  if (std::isalnum(static_cast<unsigned char>(c))) return true;
  return std::strchr("!#$%&'*+-.^_`|~", c) != nullptr && c != '\0';
}

// The error body every front-made response carries (the OpenAI shape, status as the code).
std::string front_error_body(int status, const std::string& message) {
  Error e{status == 429   ? ErrorCode::kQueueFull
          : status == 503 ? ErrorCode::kUnavailable
                          : ErrorCode::kInvalidArgument,
          message, ""};
  nlohmann::json j = error_body(e);
  j["error"]["code"] = status;
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

std::string response_head(const HttpResponse& r, bool keep_alive, bool chunked) {
  std::string h = "HTTP/1.1 " + std::to_string(r.status) + " " + reason_phrase(r.status) + "\r\n";
  h += "Content-Type: " + r.content_type + "\r\n";
  for (const auto& [k, v] : r.headers) h += k + ": " + v + "\r\n";
  if (chunked)
    h += "Transfer-Encoding: chunked\r\n";
  else
    h += "Content-Length: " + std::to_string(r.body.size()) + "\r\n";
  h += keep_alive ? "Connection: keep-alive\r\n\r\n" : "Connection: close\r\n\r\n";
  return h;
}

// Writes all of `data` to a non-blocking socket, waiting for room up to `deadline`.
bool send_all(int fd, std::string_view data, Clock::time_point deadline) {
  while (!data.empty()) {
    const ssize_t n = ::send(fd, data.data(), data.size(), MSG_NOSIGNAL);
    if (n > 0) {
      data.remove_prefix(static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (left <= 0) return false;
      pollfd p{fd, POLLOUT, 0};
      const int r = ::poll(&p, 1, static_cast<int>(std::min<long long>(left, 1000)));
      if (r < 0 && errno != EINTR) return false;
      if (r > 0 && (p.revents & (POLLERR | POLLHUP | POLLNVAL))) return false;
      continue;
    }
    return false;
  }
  return true;
}

bool peer_gone(int fd) {
  pollfd p{fd, static_cast<short>(POLLIN | POLLRDHUP), 0};
  if (::poll(&p, 1, 0) <= 0) return false;
  if (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) return true;
  if (p.revents & POLLIN) {
    char c;
    const ssize_t n = ::recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
    return n == 0;
  }
  return false;
}

std::string peer_address(const sockaddr_storage& ss) {
  char buf[INET6_ADDRSTRLEN] = {0};
  if (ss.ss_family == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(&ss)->sin_addr, buf, sizeof buf);
  } else if (ss.ss_family == AF_INET6) {
    inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(&ss)->sin6_addr, buf, sizeof buf);
  } else if (ss.ss_family == AF_UNIX) {
    return "unix";  // local clients of a --uds socket share one per-client budget
  }
  return buf;
}

// kLinger: a refused request's answer is out and our side is shut down; what the client still
// sends is read and dropped for a moment, so closing does not reset the connection before the
// client has read the answer (a client sends its whole body before it reads).
enum class ConnState { kIdle, kHeaders, kBody, kWorker, kWriting, kLinger };

// Incremental decoder of a chunked body (RFC 9112 §7.1); chunk extensions and trailers ignored.
struct ChunkDecoder {
  enum class Step { kSize, kData, kDataEnd, kTrailer, kDone } step = Step::kSize;
  size_t remaining = 0;
};

struct Conn {
  int fd = -1;
  std::string addr;
  ConnState state = ConnState::kIdle;
  Clock::time_point deadline;
  Clock::time_point since;  // entered the current state (eviction picks the oldest)
  std::string in;           // bytes read and not consumed yet
  size_t scan_from = 0;     // where the search for the end of the headers resumes
  int num_requests = 0;
  // The request being read.
  HttpRequest req;
  bool keep_alive = true;
  bool chunked = false;
  size_t content_length = 0;
  ChunkDecoder chunk;
  // An inline response being written by the loop.
  std::string out;
  size_t out_pos = 0;
  bool close_after_write = false;
  // Set by a worker when it hands the connection back.
  bool worker_close = false;
};

}  // namespace

class HttpFrontImpl {
 public:
  HttpLimits lim;
  HttpHandler handler, inline_handler;
  std::function<bool(const HttpRequest&)> is_inline;
  int listen_fd = -1, epoll_fd = -1, wake_fd = -1;
  int port = 0;
  std::string unix_path;  // bind_unix: the socket file, removed at the end
  std::atomic<bool> stopping{false};
  std::atomic<bool> running{false};

  // Loop-thread state.
  std::unordered_map<int, std::unique_ptr<Conn>> conns;
  std::unordered_map<std::string, int> per_client;
  bool listen_paused = false;
  Clock::time_point listen_resume;

  // Shared with workers.
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Conn*> pending;
  std::vector<Conn*> returned;
  std::vector<std::thread> workers;

  std::atomic<int64_t> n_open{0}, n_pending{0}, n_busy{0}, n_rejected{0}, n_timeouts{0}, n_bad{0};

  ~HttpFrontImpl() {
    for (int fd : {listen_fd, epoll_fd, wake_fd}) {
      if (fd >= 0) ::close(fd);
    }
    if (!unix_path.empty()) ::unlink(unix_path.c_str());
  }

  // The event loop's descriptors around the bound listener.
  Status arm() {
    epoll_fd = ::epoll_create1(EPOLL_CLOEXEC);
    wake_fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (epoll_fd < 0 || wake_fd < 0)
      return make_error(ErrorCode::kIo, std::string("epoll/eventfd: ") + std::strerror(errno));
    epoll_event e{};
    e.events = EPOLLIN;
    e.data.fd = listen_fd;
    ::epoll_ctl(epoll_fd, EPOLL_CTL_ADD, listen_fd, &e);
    e.data.fd = wake_fd;
    ::epoll_ctl(epoll_fd, EPOLL_CTL_ADD, wake_fd, &e);
    return {};
  }

  void wake() {
    const uint64_t one = 1;
    [[maybe_unused]] ssize_t n = ::write(wake_fd, &one, sizeof one);
  }

  void set_events(Conn& c, uint32_t ev) {
    epoll_event e{};
    e.events = ev;
    e.data.fd = c.fd;
    ::epoll_ctl(epoll_fd, EPOLL_CTL_MOD, c.fd, &e);
  }

  void close_conn(int fd) {
    auto it = conns.find(fd);
    if (it == conns.end()) return;
    Conn& c = *it->second;
    ::epoll_ctl(epoll_fd, EPOLL_CTL_DEL, fd, nullptr);
    ::close(fd);
    auto pc = per_client.find(c.addr);
    if (pc != per_client.end() && --pc->second <= 0) per_client.erase(pc);
    conns.erase(it);
    --n_open;
  }

  // A response from the loop itself (errors, inline routes); written without blocking.
  void respond_inline(Conn& c, const HttpResponse& r, bool keep_alive) {
    c.out = response_head(r, keep_alive, false) + r.body;
    c.out_pos = 0;
    c.close_after_write = !keep_alive;
    c.state = ConnState::kWriting;
    c.since = Clock::now();
    c.deadline = c.since + seconds(lim.write_timeout_s);
    set_events(c, EPOLLOUT);
    flush(c);
  }

  void reject(Conn& c, int status, const std::string& message) {
    if (status != 429 && status != 408) ++n_bad;
    HttpResponse r;
    r.status = status;
    r.set_content(front_error_body(status, message), "application/json");
    if (status == 429 || status == 503) r.set_header("Retry-After", "1");
    respond_inline(c, r, false);
  }

  // Writes what it can of an inline response. Returns true when all is out and the connection is
  // idle again (the caller then processes what it has buffered; flush itself never does, so
  // pipelined requests are handled in a loop, not by recursion).
  bool flush(Conn& c) {
    while (c.out_pos < c.out.size()) {
      const ssize_t n =
          ::send(c.fd, c.out.data() + c.out_pos, c.out.size() - c.out_pos, MSG_NOSIGNAL);
      if (n > 0) {
        c.out_pos += static_cast<size_t>(n);
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return false;  // EPOLLOUT resumes
      close_conn(c.fd);
      return false;
    }
    c.out.clear();
    c.out_pos = 0;
    if (c.close_after_write || stopping) {
      if (stopping) {
        close_conn(c.fd);
        return false;
      }
      ::shutdown(c.fd, SHUT_WR);
      c.state = ConnState::kLinger;
      c.in.clear();
      c.deadline = Clock::now() + std::chrono::seconds(2);
      set_events(c, EPOLLIN | EPOLLRDHUP);
      return false;
    }
    begin_idle(c);
    set_events(c, EPOLLIN | EPOLLRDHUP);
    return true;
  }

  void begin_idle(Conn& c) {
    c.state = ConnState::kIdle;
    c.since = Clock::now();
    c.deadline = c.since + seconds(lim.keep_alive_timeout_s);
    c.req = HttpRequest{};
    c.scan_from = 0;
    c.chunked = false;
    c.content_length = 0;
    c.chunk = ChunkDecoder{};
    c.keep_alive = true;
  }

  // Parses the request line and headers in c.in[0, end). Returns 0, or the status to reject with
  // (and sets `why`).
  int parse_head(Conn& c, size_t end, std::string& why) {
    std::string_view head(c.in.data(), end);
    size_t line_end = head.find("\r\n");
    std::string_view line = head.substr(0, line_end);
    const size_t sp1 = line.find(' ');
    const size_t sp2 = sp1 == std::string_view::npos ? sp1 : line.find(' ', sp1 + 1);
    if (sp1 == std::string_view::npos || sp2 == std::string_view::npos ||
        line.find(' ', sp2 + 1) != std::string_view::npos) {
      why = "malformed request line; expected 'METHOD /path HTTP/1.1'";
      return 400;
    }
    const std::string_view method = line.substr(0, sp1),
                           target = line.substr(sp1 + 1, sp2 - sp1 - 1),
                           version = line.substr(sp2 + 1);
    if (method.empty() || !std::all_of(method.begin(), method.end(), is_token_char)) {
      why = "malformed request method";
      return 400;
    }
    if (version != "HTTP/1.1" && version != "HTTP/1.0") {
      why = "only HTTP/1.0 and HTTP/1.1 are served";
      return 400;
    }
    std::string_view path = target;
    if (path.rfind("http://", 0) == 0 || path.rfind("https://", 0) == 0) {  // absolute form
      const size_t s = path.find('/', path.find("//") + 2);
      path = s == std::string_view::npos ? std::string_view("/") : path.substr(s);
    }
    if (path.empty() || path[0] != '/') {
      why = "the request target must be a path starting with '/'";
      return 400;
    }
    c.req.method = std::string(method);
    const size_t q = path.find('?');
    c.req.path = std::string(path.substr(0, q));
    c.req.query = q == std::string_view::npos ? std::string() : std::string(path.substr(q + 1));
    c.keep_alive = version == "HTTP/1.1";

    bool have_length = false, have_te = false;
    std::string content_length;
    size_t pos = line_end + 2;
    while (pos < end) {
      size_t e = head.find("\r\n", pos);
      if (e == std::string_view::npos) e = end;
      std::string_view h = head.substr(pos, e - pos);
      pos = e + 2;
      if (h.empty()) continue;
      if (h[0] == ' ' || h[0] == '\t') {
        why = "folded header lines are not accepted";
        return 400;
      }
      const size_t colon = h.find(':');
      if (colon == std::string_view::npos || colon == 0 ||
          !std::all_of(h.begin(), h.begin() + static_cast<std::ptrdiff_t>(colon), is_token_char)) {
        why = "malformed header line (expected 'Name: value', no space before the colon)";
        return 400;
      }
      if (c.req.headers.size() >= lim.max_headers) {
        why = "more than " + std::to_string(lim.max_headers) + " header fields";
        return 431;
      }
      std::string name = ascii_lower(h.substr(0, colon));
      std::string value(trim_ows(h.substr(colon + 1)));
      if (name == "content-length") {
        // Repeated or list-valued Content-Length must agree, else the body's end is ambiguous
        // (request smuggling behind a proxy that picks the other one).
        size_t start = 0;
        std::string_view v(value);
        while (start <= v.size()) {
          size_t comma = v.find(',', start);
          if (comma == std::string_view::npos) comma = v.size();
          const std::string_view item = trim_ows(v.substr(start, comma - start));
          if (item.empty() || !std::all_of(item.begin(), item.end(),
                                           [](char ch) { return ch >= '0' && ch <= '9'; })) {
            why = "Content-Length '" + value + "' is not a number";
            return 400;
          }
          if (have_length && item != content_length) {
            why = "conflicting Content-Length headers";
            return 400;
          }
          content_length = std::string(item);
          have_length = true;
          start = comma + 1;
        }
      } else if (name == "transfer-encoding") {
        if (have_te || ascii_lower(value) != "chunked") {
          why = "Transfer-Encoding '" + value +
                "' is not supported; send 'chunked' or a Content-Length";
          return 501;
        }
        have_te = true;
      } else if (name == "content-encoding") {
        const std::string v = ascii_lower(value);
        if (!v.empty() && v != "identity") {
          why = "compressed request bodies (Content-Encoding: " + value +
                ") are not accepted; send it uncompressed";
          return 415;
        }
      } else if (name == "connection") {
        const std::string v = ascii_lower(value);
        if (v.find("close") != std::string::npos)
          c.keep_alive = false;
        else if (v.find("keep-alive") != std::string::npos)
          c.keep_alive = true;
      }
      c.req.headers.emplace_back(std::move(name), std::move(value));
    }
    if (have_length && have_te) {
      why = "both Content-Length and Transfer-Encoding given; send one";
      return 400;
    }
    if (have_length) {
      const size_t limit_digits = std::to_string(lim.max_body_bytes).size();
      const std::string digits = content_length.substr(
          std::min(content_length.find_first_not_of('0'), content_length.size()));
      if (digits.size() > limit_digits ||
          (digits.empty() ? 0 : std::stoull(digits)) > lim.max_body_bytes) {
        why = "the request body (" + content_length + " bytes) is over the limit of " +
              std::to_string(lim.max_body_bytes) + " bytes";
        return 413;
      }
      c.content_length = digits.empty() ? 0 : static_cast<size_t>(std::stoull(digits));
    }
    c.chunked = have_te;
    return 0;
  }

  // Decodes what c.in holds of a chunked body into c.req.body. Returns 0 (need more / done:
  // c.chunk.step == kDone) or a status to reject with.
  int decode_chunks(Conn& c, std::string& why) {
    size_t pos = 0;
    const std::string& in = c.in;
    int status = 0;
    while (c.chunk.step != ChunkDecoder::Step::kDone) {
      if (c.chunk.step == ChunkDecoder::Step::kSize ||
          c.chunk.step == ChunkDecoder::Step::kTrailer) {
        const size_t e = in.find("\r\n", pos);
        if (e == std::string::npos) {
          if (in.size() - pos > 4096) {
            why = "a chunk-size or trailer line is too long";
            status = 400;
          }
          break;
        }
        std::string_view line(in.data() + pos, e - pos);
        pos = e + 2;
        if (c.chunk.step == ChunkDecoder::Step::kTrailer) {
          if (line.empty()) c.chunk.step = ChunkDecoder::Step::kDone;
          continue;
        }
        line = trim_ows(line.substr(0, line.find(';')));
        size_t size = 0;
        if (line.empty() || line.size() > 15) {
          why = "malformed chunk size";
          status = 400;
          break;
        }
        bool ok = true;
        for (char ch : line) {
          const int d = std::isdigit(static_cast<unsigned char>(ch)) ? ch - '0'
                        : (ch >= 'a' && ch <= 'f')                   ? ch - 'a' + 10
                        : (ch >= 'A' && ch <= 'F')                   ? ch - 'A' + 10
                                                                     : -1;
          if (d < 0) ok = false;
          size = size * 16 + static_cast<size_t>(std::max(d, 0));
        }
        if (!ok) {
          why = "malformed chunk size";
          status = 400;
          break;
        }
        if (size > lim.max_body_bytes || c.req.body.size() + size > lim.max_body_bytes) {
          why = "the chunked request body is over the limit of " +
                std::to_string(lim.max_body_bytes) + " bytes";
          status = 413;
          break;
        }
        c.chunk.remaining = size;
        c.chunk.step = size == 0 ? ChunkDecoder::Step::kTrailer : ChunkDecoder::Step::kData;
      } else if (c.chunk.step == ChunkDecoder::Step::kData) {
        const size_t take = std::min(c.chunk.remaining, in.size() - pos);
        c.req.body.append(in, pos, take);
        pos += take;
        c.chunk.remaining -= take;
        if (c.chunk.remaining > 0) break;
        c.chunk.step = ChunkDecoder::Step::kDataEnd;
      } else {  // kDataEnd: the CRLF after a chunk's data
        if (in.size() - pos < 2) break;
        if (in.compare(pos, 2, "\r\n") != 0) {
          why = "a chunk's data is not followed by CRLF";
          status = 400;
          break;
        }
        pos += 2;
        c.chunk.step = ChunkDecoder::Step::kSize;
      }
    }
    c.in.erase(0, pos);
    return status;
  }

  // Advances connection `fd` through whatever its buffer holds.
  void process(int fd) {
    for (;;) {
      auto it = conns.find(fd);
      if (it == conns.end()) return;
      Conn& c = *it->second;
      const auto now = Clock::now();
      if (c.state == ConnState::kIdle) {
        if (c.in.empty()) return;
        c.state = ConnState::kHeaders;
        c.since = now;
        c.deadline = now + seconds(lim.header_timeout_s);
      }
      if (c.state == ConnState::kHeaders) {
        const size_t from = c.scan_from;
        const size_t end = c.in.find("\r\n\r\n", from);
        if (end == std::string::npos) {
          c.scan_from = c.in.size() > 3 ? c.in.size() - 3 : 0;
          if (c.in.size() > lim.max_header_bytes) {
            return reject(c, 431,
                          "the request line and headers are over " +
                              std::to_string(lim.max_header_bytes) + " bytes");
          }
          return;
        }
        if (end + 4 > lim.max_header_bytes) {
          return reject(c, 431,
                        "the request line and headers are over " +
                            std::to_string(lim.max_header_bytes) + " bytes");
        }
        std::string why;
        if (const int st = parse_head(c, end + 2, why); st != 0) return reject(c, st, why);
        c.in.erase(0, end + 4);
        c.state = ConnState::kBody;
        c.since = now;
        c.deadline = now + seconds(lim.body_timeout_s);
        const bool wants_body = c.chunked || c.content_length > 0;
        const std::string expect = ascii_lower(c.req.header("expect"));
        if (!expect.empty()) {
          if (expect != "100-continue")
            return reject(c, 417, "only 'Expect: 100-continue' is understood");
          if (wants_body && c.in.empty()) {
            static const std::string kContinue = "HTTP/1.1 100 Continue\r\n\r\n";
            [[maybe_unused]] ssize_t n =
                ::send(c.fd, kContinue.data(), kContinue.size(), MSG_NOSIGNAL);
          }
        }
      }
      if (c.state == ConnState::kBody) {
        if (c.chunked) {
          std::string why;
          if (const int st = decode_chunks(c, why); st != 0) return reject(c, st, why);
          if (c.chunk.step != ChunkDecoder::Step::kDone) return;
        } else {
          if (c.in.size() < c.content_length) return;
          c.req.body.assign(c.in, 0, c.content_length);
          c.in.erase(0, c.content_length);
        }
        dispatch(c);
        continue;  // idle again at once when answered inline: pipelined requests follow
      }
      return;
    }
  }

  // A complete request: answered inline, refused, or handed to a worker.
  void dispatch(Conn& c) {
    ++c.num_requests;
    if (c.num_requests >= lim.max_keep_alive_requests) c.keep_alive = false;
    c.req.remote_addr = c.addr;
    if (stopping) {
      return reject(c, 503, "the server is shutting down; retry on another replica");
    }
    if (is_inline(c.req)) {
      HttpResponse r;
      try {
        inline_handler(c.req, r);
      } catch (const std::exception& e) {
        r = HttpResponse{};
        r.status = 500;
        r.set_content(front_error_body(500, std::string("internal error: ") + e.what()),
                      "application/json");
      }
      return respond_inline(c, r, c.keep_alive);
    }
    {
      std::lock_guard<std::mutex> lock(mu);
      if (static_cast<int>(pending.size()) >= lim.max_pending) {
        ++n_rejected;
        reject(c, 429,
               "the server is at capacity (" + std::to_string(lim.num_workers) +
                   " requests being served and " + std::to_string(pending.size()) +
                   " waiting); retry after a second");
        return;
      }
      ::epoll_ctl(epoll_fd, EPOLL_CTL_DEL, c.fd, nullptr);
      c.state = ConnState::kWorker;
      pending.push_back(&c);
      ++n_pending;
    }
    cv.notify_one();
  }

  void worker_loop() {
    for (;;) {
      Conn* c = nullptr;
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return !pending.empty() || (stopping && !running); });
        if (pending.empty()) return;
        c = pending.front();
        pending.pop_front();
        --n_pending;
      }
      ++n_busy;
      c->worker_close = !serve(*c);
      --n_busy;
      {
        std::lock_guard<std::mutex> lock(mu);
        returned.push_back(c);
      }
      wake();
    }
  }

  // Runs the handler and writes its response on the worker. Returns whether to keep the
  // connection.
  bool serve(Conn& c) {
    const int fd = c.fd;
    c.req.client_gone = [fd] { return peer_gone(fd); };
    HttpResponse r;
    try {
      handler(c.req, r);
    } catch (const std::exception& e) {
      M3_LOG_ERROR("server: handler exception: %s", e.what());
      r = HttpResponse{};
      r.status = 500;
      r.set_content(front_error_body(500, std::string("internal error: ") + e.what()),
                    "application/json");
    }
    const bool keep = c.keep_alive && !stopping;
    auto deadline = [&] { return Clock::now() + seconds(lim.write_timeout_s); };
    if (!r.stream) {
      return send_all(fd, response_head(r, keep, false) + r.body, deadline()) && keep;
    }
    if (!send_all(fd, response_head(r, keep, true), deadline())) return false;
    struct ChunkSink : ResponseSink {
      int fd;
      std::function<Clock::time_point()> deadline;
      bool ok = true;
      bool write(std::string_view data) override {
        if (!ok) return false;
        if (data.empty()) return true;
        char size[32];
        const int n = std::snprintf(size, sizeof size, "%zx\r\n", data.size());
        std::string frame;
        frame.reserve(data.size() + 40);
        frame.append(size, static_cast<size_t>(n)).append(data).append("\r\n");
        ok = send_all(fd, frame, deadline());
        return ok;
      }
      bool client_gone() override { return !ok || peer_gone(fd); }
    } sink;
    sink.fd = fd;
    sink.deadline = deadline;
    bool done = false;
    try {
      done = r.stream(sink);
    } catch (const std::exception& e) {
      M3_LOG_ERROR("server: stream exception: %s", e.what());
    }
    r.stream =
        nullptr;  // releases what the stream held (the engine requests) before the next request
    if (!done || !sink.ok) return false;
    return send_all(fd, "0\r\n\r\n", deadline()) && keep;
  }

  void take_returned() {
    std::vector<Conn*> back;
    {
      std::lock_guard<std::mutex> lock(mu);
      back.swap(returned);
    }
    for (Conn* c : back) {
      const int fd = c->fd;
      if (c->worker_close || stopping) {
        // Not in epoll any more; close_conn's EPOLL_CTL_DEL is a harmless no-op.
        close_conn(fd);
        continue;
      }
      begin_idle(*c);
      epoll_event e{};
      e.events = EPOLLIN | EPOLLRDHUP;
      e.data.fd = fd;
      ::epoll_ctl(epoll_fd, EPOLL_CTL_ADD, fd, &e);
      process(fd);
    }
  }

  // Makes room for a new connection from `addr` (per_client_only: among that client's) by
  // closing the oldest idle keep-alive connection, else the oldest one still sending headers.
  bool evict(const std::string* addr) {
    Conn* best = nullptr;
    for (auto& [fd, cp] : conns) {
      Conn& c = *cp;
      if (addr && c.addr != *addr) continue;
      if (c.state != ConnState::kIdle && c.state != ConnState::kHeaders) continue;
      auto rank = [](const Conn& x) { return x.state == ConnState::kIdle ? 0 : 1; };
      if (!best || rank(c) < rank(*best) || (rank(c) == rank(*best) && c.since < best->since))
        best = &c;
    }
    if (!best) return false;
    ++n_timeouts;
    close_conn(best->fd);
    return true;
  }

  void accept_all() {
    for (;;) {
      sockaddr_storage ss{};
      socklen_t sl = sizeof ss;
      const int fd =
          ::accept4(listen_fd, reinterpret_cast<sockaddr*>(&ss), &sl, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EINTR) continue;
        if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
          // Out of descriptors: stop polling the listener for a moment instead of spinning.
          ::epoll_ctl(epoll_fd, EPOLL_CTL_DEL, listen_fd, nullptr);
          listen_paused = true;
          listen_resume = Clock::now() + std::chrono::milliseconds(100);
          M3_LOG_WARN("server: accept: %s; pausing new connections for 100 ms",
                      std::strerror(errno));
        }
        return;
      }
      const std::string addr = peer_address(ss);
      auto& mine = per_client[addr];
      bool room = true;
      if (mine >= lim.max_connections_per_client) room = evict(&addr);
      if (room && static_cast<int>(conns.size()) >= lim.max_connections) room = evict(nullptr);
      if (!room) {
        // Every connection is busy with a request: tell this one to come back.
        ++n_rejected;
        const std::string body =
            front_error_body(429, "too many open connections; retry after a second");
        HttpResponse r;
        r.status = 429;
        r.set_content(body, "application/json");
        r.set_header("Retry-After", "1");
        const std::string msg = response_head(r, false, false) + r.body;
        [[maybe_unused]] ssize_t n = ::send(fd, msg.data(), msg.size(), MSG_NOSIGNAL);
        ::close(fd);
        if (per_client[addr] == 0) per_client.erase(addr);
        continue;
      }
      const int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      auto c = std::make_unique<Conn>();
      c->fd = fd;
      c->addr = addr;
      begin_idle(*c);
      // A new connection must send its request within the header deadline, not the idle one.
      c->deadline = c->since + seconds(lim.header_timeout_s);
      epoll_event e{};
      e.events = EPOLLIN | EPOLLRDHUP;
      e.data.fd = fd;
      ::epoll_ctl(epoll_fd, EPOLL_CTL_ADD, fd, &e);
      ++per_client[addr];
      conns.emplace(fd, std::move(c));
      ++n_open;
    }
  }

  void read_conn(Conn& c) {
    char buf[64 * 1024];
    size_t got = 0;
    const int fd = c.fd;
    if (c.state == ConnState::kLinger) {
      for (size_t dropped = 0; dropped < (size_t{1} << 20);) {
        const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
        if (n > 0) {
          dropped += static_cast<size_t>(n);
          continue;
        }
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
        return close_conn(fd);
      }
      return;
    }
    // At most 1 MiB per wake-up, so one fast sender cannot starve the others, and never more
    // than the current request needs plus one header block: pipelined requests wait in the
    // socket (level-triggered epoll brings them back), so one process() call stays short.
    const size_t want = c.state == ConnState::kBody && !c.chunked
                            ? c.content_length + lim.max_header_bytes
                            : lim.max_header_bytes + 1;
    while (got < (size_t{1} << 20) && c.in.size() < want) {
      const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
      if (n > 0) {
        c.in.append(buf, static_cast<size_t>(n));
        got += static_cast<size_t>(n);
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
      return close_conn(fd);  // closed by the peer, or reset
    }
    process(fd);
  }

  void sweep() {
    const auto now = Clock::now();
    std::vector<int> expired;
    for (auto& [fd, c] : conns) {
      if (c->state != ConnState::kWorker && c->deadline < now) expired.push_back(fd);
    }
    for (int fd : expired) {
      auto it = conns.find(fd);
      if (it == conns.end()) continue;
      Conn& c = *it->second;
      if (c.state == ConnState::kLinger) {
        close_conn(fd);
        continue;
      }
      ++n_timeouts;
      if ((c.state == ConnState::kHeaders && !c.in.empty()) || c.state == ConnState::kBody) {
        // Best effort: tell a slow client why, then close without waiting on it.
        const std::string body = front_error_body(
            408, c.state == ConnState::kBody ? "the request body did not arrive in time"
                                             : "the request headers did not arrive in time");
        HttpResponse r;
        r.status = 408;
        r.set_content(body, "application/json");
        const std::string msg = response_head(r, false, false) + r.body;
        [[maybe_unused]] ssize_t n =
            ::send(fd, msg.data(), msg.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
      }
      close_conn(fd);
    }
    if (listen_paused && now >= listen_resume) {
      epoll_event e{};
      e.events = EPOLLIN;
      e.data.fd = listen_fd;
      ::epoll_ctl(epoll_fd, EPOLL_CTL_ADD, listen_fd, &e);
      listen_paused = false;
    }
  }

  void loop() {
    std::vector<epoll_event> events(256);
    auto last_sweep = Clock::now();
    while (!stopping) {
      const int n = ::epoll_wait(epoll_fd, events.data(), static_cast<int>(events.size()), 100);
      for (int i = 0; i < n; ++i) {
        const int fd = events[i].data.fd;
        const uint32_t ev = events[i].events;
        if (fd == listen_fd) {
          accept_all();
          continue;
        }
        if (fd == wake_fd) {
          uint64_t v;
          [[maybe_unused]] ssize_t r = ::read(wake_fd, &v, sizeof v);
          take_returned();
          continue;
        }
        auto it = conns.find(fd);
        if (it == conns.end()) continue;
        Conn& c = *it->second;
        if (c.state == ConnState::kWriting || c.state == ConnState::kLinger) {
          if (c.state == ConnState::kLinger) {
            read_conn(c);
            continue;
          }
          if (ev & (EPOLLERR | EPOLLHUP))
            close_conn(fd);
          else if ((ev & EPOLLOUT) && flush(c))
            process(fd);
          continue;
        }
        if (ev & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR)) read_conn(c);
      }
      const auto now = Clock::now();
      if (now - last_sweep >= std::chrono::milliseconds(100)) {
        sweep();
        last_sweep = now;
      }
    }
  }
};

HttpFront::HttpFront(HttpLimits limits, HttpHandler handler,
                     std::function<bool(const HttpRequest&)> is_inline, HttpHandler inline_handler)
    : impl_(std::make_unique<HttpFrontImpl>()) {
  impl_->lim = limits;
  impl_->handler = std::move(handler);
  impl_->is_inline = std::move(is_inline);
  impl_->inline_handler = std::move(inline_handler);
}

HttpFront::~HttpFront() {
  stop();
}

Status HttpFront::bind(const std::string& host, int port) {
  auto& d = *impl_;
  // Each connection is a descriptor: allow as many as the hard limit lets us.
  rlimit rl{};
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = rl.rlim_max;
    setrlimit(RLIMIT_NOFILE, &rl);
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  const std::string port_s = std::to_string(port);
  if (const int rc =
          getaddrinfo(host.empty() ? nullptr : host.c_str(), port_s.c_str(), &hints, &res);
      rc != 0) {
    return make_error(ErrorCode::kInvalidArgument,
                      "cannot listen on " + host + ": " + gai_strerror(rc) + "; check --host",
                      "--host");
  }
  std::string last_error = "no address";
  int err_no = 0;
  for (addrinfo* a = res; a; a = a->ai_next) {
    const int fd =
        ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    // SO_REUSEADDR only lets us rebind over TIME_WAIT sockets; on Linux it never lets two
    // listeners share a port (that is SO_REUSEPORT, deliberately not set).
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, SOMAXCONN) == 0) {
      d.listen_fd = fd;
      break;
    }
    err_no = errno;
    last_error = std::strerror(errno);
    ::close(fd);
  }
  freeaddrinfo(res);
  if (d.listen_fd < 0) {
    const std::string where = host + ":" + port_s;
    if (err_no == EADDRINUSE) {
      return make_error(
          ErrorCode::kInvalidArgument,
          "cannot listen on " + where +
              ": address in use (another process listens there); stop it or choose another --port",
          "--port");
    }
    return make_error(ErrorCode::kInvalidArgument,
                      "cannot listen on " + where + ": " + last_error + "; check --host and --port",
                      "--port");
  }
  sockaddr_storage ss{};
  socklen_t sl = sizeof ss;
  getsockname(d.listen_fd, reinterpret_cast<sockaddr*>(&ss), &sl);
  d.port = ss.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port)
                                    : ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  return d.arm();
}

Status HttpFront::bind_unix(const std::string& path) {
  auto& d = *impl_;
  sockaddr_un sa{};
  sa.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof sa.sun_path) {
    return make_error(ErrorCode::kInvalidArgument,
                      "--uds '" + path + "' is not a Unix socket path (1 to " +
                          std::to_string(sizeof sa.sun_path - 1) + " bytes)",
                      "--uds");
  }
  std::memcpy(sa.sun_path, path.data(), path.size());
  struct stat st {};
  if (::lstat(path.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) {
      return make_error(ErrorCode::kInvalidArgument,
                        "--uds " + path + " exists and is not a socket; choose another path",
                        "--uds");
    }
    // A socket file: in use if something answers there, else left by a process that is gone.
    const int probe = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    const bool live =
        probe >= 0 && ::connect(probe, reinterpret_cast<const sockaddr*>(&sa), sizeof sa) == 0;
    if (probe >= 0) ::close(probe);
    if (live) {
      return make_error(ErrorCode::kInvalidArgument,
                        "--uds " + path +
                            ": another process listens on this socket; stop it or choose "
                            "another path",
                        "--uds");
    }
    ::unlink(path.c_str());
  }
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return make_error(ErrorCode::kIo, std::string("socket: ") + std::strerror(errno));
  if (::bind(fd, reinterpret_cast<const sockaddr*>(&sa), sizeof sa) != 0 ||
      ::listen(fd, SOMAXCONN) != 0) {
    const std::string why = std::strerror(errno);
    ::close(fd);
    return make_error(ErrorCode::kInvalidArgument,
                      "cannot listen on the Unix socket " + path + ": " + why +
                          "; check that its directory exists and is writable",
                      "--uds");
  }
  d.listen_fd = fd;
  d.unix_path = path;
  d.port = 0;
  return d.arm();
}

int HttpFront::port() const {
  return impl_->port;
}

Status HttpFront::run() {
  auto& d = *impl_;
  if (d.listen_fd < 0) return make_error(ErrorCode::kInternal, "HttpFront::run before bind");
  d.running = true;
  for (int i = 0; i < std::max(1, d.lim.num_workers); ++i)
    d.workers.emplace_back([&d] { d.worker_loop(); });
  d.loop();
  // Stopping: no new connections; let the workers finish what they hold.
  ::epoll_ctl(d.epoll_fd, EPOLL_CTL_DEL, d.listen_fd, nullptr);
  ::close(d.listen_fd);
  d.listen_fd = -1;
  {
    std::unique_lock<std::mutex> lock(d.mu);
    d.running = false;
  }
  d.cv.notify_all();
  for (auto& t : d.workers) t.join();
  d.workers.clear();
  d.take_returned();
  std::vector<int> fds;
  for (auto& [fd, c] : d.conns) fds.push_back(fd);
  for (int fd : fds) d.close_conn(fd);
  return {};
}

void HttpFront::stop() {
  if (!impl_ || impl_->stopping.exchange(true)) return;
  if (impl_->wake_fd >= 0) impl_->wake();
  impl_->cv.notify_all();
}

HttpFrontStats HttpFront::stats() const {
  const auto& d = *impl_;
  HttpFrontStats s;
  s.connections_open = d.n_open;
  s.requests_pending = d.n_pending;
  s.workers_busy = d.n_busy;
  s.rejected_capacity_total = d.n_rejected;
  s.timeouts_total = d.n_timeouts;
  s.bad_requests_total = d.n_bad;
  return s;
}

}  // namespace m3::server
