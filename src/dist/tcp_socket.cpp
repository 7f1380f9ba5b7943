#include "dist/tcp_socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <thread>

namespace m3::dist {

void Socket::close() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

void Socket::shutdown_both() {
  if (fd_ >= 0) ::shutdown(fd_, SHUT_RDWR);
}

namespace {

std::string errno_text(int e) {
  return std::strerror(e);
}

std::string addr_text(const std::string& host, int port) {
  return host + ":" + std::to_string(port);
}

// getaddrinfo for IPv4 TCP; the first address.
Result<sockaddr_in> resolve(const std::string& host, int port, const std::string& flag_hint) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const int rc = getaddrinfo(host.c_str(), nullptr, &hints, &res);
  if (rc != 0 || res == nullptr) {
    return make_error(ErrorCode::kInvalidArgument,
                      "cannot resolve '" + host + "' (" + flag_hint + "): " + gai_strerror(rc),
                      flag_hint);
  }
  sockaddr_in a = *reinterpret_cast<const sockaddr_in*>(res->ai_addr);
  freeaddrinfo(res);
  a.sin_port = htons(static_cast<uint16_t>(port));
  return a;
}

int poll_ms(SteadyClock::time_point deadline) {
  const auto left =
      std::chrono::duration_cast<std::chrono::milliseconds>(deadline - SteadyClock::now()).count();
  if (left <= 0) return 0;
  return static_cast<int>(std::min<int64_t>(left, 1000));
}

}  // namespace

SteadyClock::time_point deadline_in(double seconds) {
  if (seconds <= 0) seconds = 1e7;
  return SteadyClock::now() + std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000.0));
}

double dist_timeout_s(double fallback) {
  if (const char* v = std::getenv("M3_DIST_TIMEOUT_S"); v && *v) {
    char* end = nullptr;
    const double d = std::strtod(v, &end);
    if (end != v && d > 0) return d;
  }
  return fallback;
}

Result<Socket> tcp_listen(const std::string& host, int port, const std::string& flag_hint) {
  M3_TRY(sockaddr_in a, resolve(host, port, flag_hint));
  Socket s(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!s.valid())
    return make_error(ErrorCode::kIo, "socket() failed: " + errno_text(errno), flag_hint);
  int one = 1;
  setsockopt(s.fd(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (::bind(s.fd(), reinterpret_cast<const sockaddr*>(&a), sizeof a) != 0) {
    const int e = errno;
    std::string why = errno_text(e);
    if (e == EADDRNOTAVAIL) why += " (it is not an address of this machine)";
    if (e == EADDRINUSE) why += " (another process listens there: pick another port)";
    return make_error(ErrorCode::kUnavailable,
                      "cannot listen on " + addr_text(host, port) + " (" + flag_hint + "): " + why,
                      flag_hint);
  }
  if (::listen(s.fd(), 128) != 0) {
    return make_error(ErrorCode::kIo,
                      "listen on " + addr_text(host, port) + " failed: " + errno_text(errno),
                      flag_hint);
  }
  return s;
}

int bound_port(const Socket& s) {
  sockaddr_in a{};
  socklen_t len = sizeof a;
  if (getsockname(s.fd(), reinterpret_cast<sockaddr*>(&a), &len) != 0) return -1;
  return ntohs(a.sin_port);
}

std::string local_ip(const Socket& s) {
  sockaddr_in a{};
  socklen_t len = sizeof a;
  if (getsockname(s.fd(), reinterpret_cast<sockaddr*>(&a), &len) != 0) return "127.0.0.1";
  char buf[INET_ADDRSTRLEN] = {};
  inet_ntop(AF_INET, &a.sin_addr, buf, sizeof buf);
  return buf;
}

std::string peer_name(const Socket& s) {
  sockaddr_in a{};
  socklen_t len = sizeof a;
  if (getpeername(s.fd(), reinterpret_cast<sockaddr*>(&a), &len) != 0) return "?";
  char buf[INET_ADDRSTRLEN] = {};
  inet_ntop(AF_INET, &a.sin_addr, buf, sizeof buf);
  return std::string(buf) + ":" + std::to_string(ntohs(a.sin_port));
}

Result<Socket> tcp_connect(const std::string& host, int port, SteadyClock::time_point deadline,
                           const std::string& flag_hint) {
  M3_TRY(sockaddr_in a, resolve(host, port, flag_hint));
  const auto t0 = SteadyClock::now();
  std::string last = "no attempt";
  for (;;) {
    Socket s(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!s.valid())
      return make_error(ErrorCode::kIo, "socket() failed: " + errno_text(errno), flag_hint);
    if (::connect(s.fd(), reinterpret_cast<const sockaddr*>(&a), sizeof a) == 0) {
      tune_socket(s);
      return s;
    }
    last = errno_text(errno);
    if (SteadyClock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  const double waited = std::chrono::duration<double>(SteadyClock::now() - t0).count();
  char secs[32];
  std::snprintf(secs, sizeof secs, "%.0f", waited);
  return make_error(ErrorCode::kUnavailable,
                    "could not reach " + addr_text(host, port) + " (" + flag_hint + ") within " +
                        secs + " s: " + last +
                        "; start node 0 (--node-rank 0) first and check that the address and "
                        "port are node 0's and reachable from here (M3_DIST_TIMEOUT_S sets the "
                        "wait)",
                    flag_hint);
}

Result<Socket> tcp_accept(const Socket& listener, SteadyClock::time_point deadline,
                          const std::string& what) {
  for (;;) {
    pollfd p{listener.fd(), POLLIN, 0};
    const int ms = poll_ms(deadline);
    if (ms == 0 && SteadyClock::now() >= deadline) break;
    const int rc = ::poll(&p, 1, ms);
    if (rc < 0 && errno != EINTR)
      return make_error(ErrorCode::kIo, "poll() failed: " + errno_text(errno));
    if (rc > 0) {
      Socket c(::accept4(listener.fd(), nullptr, nullptr, SOCK_CLOEXEC));
      if (c.valid()) {
        tune_socket(c);
        return c;
      }
    }
  }
  return make_error(ErrorCode::kUnavailable, "timed out waiting for " + what);
}

void tune_socket(const Socket& s) {
  int one = 1;
  setsockopt(s.fd(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  setsockopt(s.fd(), SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
  int idle = 30, intvl = 5, cnt = 6;
  setsockopt(s.fd(), IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
  setsockopt(s.fd(), IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof intvl);
  setsockopt(s.fd(), IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof cnt);
}

void set_nonblocking(const Socket& s, bool on) {
  const int fl = fcntl(s.fd(), F_GETFL, 0);
  fcntl(s.fd(), F_SETFL, on ? (fl | O_NONBLOCK) : (fl & ~O_NONBLOCK));
}

Status send_all(const Socket& s, const void* data, size_t n, SteadyClock::time_point deadline,
                const std::string& what) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    pollfd pf{s.fd(), POLLOUT, 0};
    const int rc = ::poll(&pf, 1, poll_ms(deadline));
    if (rc < 0 && errno == EINTR) continue;
    if (rc == 0) {
      if (SteadyClock::now() >= deadline)
        return make_error(ErrorCode::kUnavailable, "timed out sending to " + what);
      continue;
    }
    const ssize_t k = ::send(s.fd(), p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (k < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) continue;
      return make_error(ErrorCode::kUnavailable,
                        "the connection to " + what + " failed: " + errno_text(errno));
    }
    p += k;
    n -= static_cast<size_t>(k);
  }
  return {};
}

Status recv_all(const Socket& s, void* data, size_t n, SteadyClock::time_point deadline,
                const std::string& what) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    pollfd pf{s.fd(), POLLIN, 0};
    const int rc = ::poll(&pf, 1, poll_ms(deadline));
    if (rc < 0 && errno == EINTR) continue;
    if (rc == 0) {
      if (SteadyClock::now() >= deadline)
        return make_error(ErrorCode::kUnavailable, "timed out waiting for " + what);
      continue;
    }
    const ssize_t k = ::recv(s.fd(), p, n, MSG_DONTWAIT);
    if (k == 0) return make_error(ErrorCode::kUnavailable, what + " closed the connection");
    if (k < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) continue;
      return make_error(ErrorCode::kUnavailable,
                        "the connection to " + what + " failed: " + errno_text(errno));
    }
    p += k;
    n -= static_cast<size_t>(k);
  }
  return {};
}

}  // namespace m3::dist
