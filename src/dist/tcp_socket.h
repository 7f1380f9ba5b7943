// TCP socket helpers of the multi-process parts of dist (tcp_store, tcp_communicator) and of the
// runtime's step channel (runtime/multi_node.cpp): resolving an address, listening, connecting
// with retries until a deadline, and whole-buffer sends/receives that give up at a deadline.
// Invariant: nothing here raises SIGPIPE (sends use MSG_NOSIGNAL); every error names the peer
// address; a Socket closes its descriptor exactly once.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "core/error.h"

namespace m3::dist {

using SteadyClock = std::chrono::steady_clock;

// An owned file descriptor (-1: none).
class Socket {
 public:
  Socket() = default;
  explicit Socket(int fd) : fd_(fd) {}
  ~Socket() { close(); }
  Socket(Socket&& o) noexcept : fd_(o.release()) {}
  Socket& operator=(Socket&& o) noexcept {
    if (this != &o) {
      close();
      fd_ = o.release();
    }
    return *this;
  }
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;
  int fd() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release() {
    const int f = fd_;
    fd_ = -1;
    return f;
  }
  void close();
  // shutdown(SHUT_RDWR): the peer sees EOF at once; the descriptor stays open until close().
  void shutdown_both();

 private:
  int fd_ = -1;
};

// Listens on host:port (port 0: any free port) with SO_REUSEADDR. `flag_hint` is named in the
// error (e.g. "--master-addr / --master-port").
Result<Socket> tcp_listen(const std::string& host, int port, const std::string& flag_hint);
// The port a listening socket is bound to.
int bound_port(const Socket& s);
// The local IP address of a connected socket (the address peers can reach this host at).
std::string local_ip(const Socket& s);
// The peer's "ip:port" of a connected socket (for messages).
std::string peer_name(const Socket& s);

// Connects to host:port, retrying every ~100 ms until `deadline`. Errors name the address,
// `flag_hint`, the seconds waited and the last errno.
Result<Socket> tcp_connect(const std::string& host, int port, SteadyClock::time_point deadline,
                           const std::string& flag_hint);
// Accepts one connection before `deadline` (nullopt-like error on timeout, naming `what`).
Result<Socket> tcp_accept(const Socket& listener, SteadyClock::time_point deadline,
                          const std::string& what);

// TCP_NODELAY + keep-alive probes (a dead host is noticed within ~a minute even when idle).
void tune_socket(const Socket& s);
void set_nonblocking(const Socket& s, bool on);

// Sends / receives exactly `n` bytes (blocking socket or not) before `deadline`. Errors: the
// peer closed the connection, a socket error, the deadline; messages say which and name `what`.
Status send_all(const Socket& s, const void* data, size_t n, SteadyClock::time_point deadline,
                const std::string& what);
Status recv_all(const Socket& s, void* data, size_t n, SteadyClock::time_point deadline,
                const std::string& what);

// A deadline `seconds` from now (seconds <= 0: practically never).
SteadyClock::time_point deadline_in(double seconds);

// The seconds multi-process start-up and collectives wait for a peer before giving up:
// $M3_DIST_TIMEOUT_S when set to a positive number, else `fallback`.
double dist_timeout_s(double fallback = 600.0);

}  // namespace m3::dist
