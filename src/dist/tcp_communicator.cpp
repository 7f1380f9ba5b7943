#include "dist/tcp_communicator.h"

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "core/check.h"
#include "core/log.h"

namespace m3::dist {

namespace {

enum Op : uint32_t {
  kAllReduce = 1,
  kGatherF32,
  kGatherI32,
  kReduceScatter,
  kA2aF32,
  kA2aI32,
  kBcastF32,
  kBcastI32,
  kBarrier,
};

// Every message of a collective starts with this: which collective, the sender, how many
// collectives it has issued (the same number on every rank of a healthy group) and the bytes
// that follow.
struct Header {
  uint32_t op;
  uint32_t from;
  uint64_t seq;
  int64_t bytes;
};

// Why a send or receive failed; a reset or broken connection means the peer went away.
std::string lost_text(const char* what, int e) {
  if (e == EPIPE || e == ECONNRESET)
    return std::string("it closed the connection (the process exited or was killed; ") + what +
           ": " + std::strerror(e) + ")";
  return std::string(what) + " failed: " + std::strerror(e);
}

std::string hello_what(int rank) {
  return "rank " + std::to_string(rank) + " of the TCP group";
}

}  // namespace

Result<std::unique_ptr<TcpCommunicator>> TcpCommunicator::create(TcpStore& store,
                                                                 const std::string& prefix,
                                                                 int rank, int world) {
  if (world < 1 || rank < 0 || rank >= world) {
    return make_error(ErrorCode::kInvalidArgument,
                      "TCP rank " + std::to_string(rank) + " is outside a group of " +
                          std::to_string(world) + " ranks",
                      "rank");
  }
  std::vector<Socket> peers(world);
  std::vector<std::string> addrs(world);
  const double timeout = store.timeout_s();
  if (world > 1) {
    const std::string flags = "--master-addr (this host's address as node 0 sees it)";
    M3_TRY(Socket listener, tcp_listen(store.local_address(), 0, flags));
    const std::string me = store.local_address() + ":" + std::to_string(bound_port(listener));
    addrs[rank] = me;
    M3_TRY_STATUS(store.set(prefix + "/addr/" + std::to_string(rank), me));
    const auto deadline = deadline_in(timeout);
    // Connect to every lower rank (its listener exists once its address is published) and say
    // who we are; then accept every higher rank.
    for (int j = 0; j < rank; ++j) {
      M3_TRY(std::string a, store.get(prefix + "/addr/" + std::to_string(j)));
      const size_t colon = a.rfind(':');
      M3_CHECK(colon != std::string::npos, "bad peer address '%s'", a.c_str());
      M3_TRY(Socket s, tcp_connect(a.substr(0, colon), std::stoi(a.substr(colon + 1)), deadline,
                                   "the listener of " + hello_what(j) + " at " + a));
      const uint32_t hello = static_cast<uint32_t>(rank);
      M3_TRY_STATUS(send_all(s, &hello, sizeof hello, deadline, hello_what(j)));
      peers[j] = std::move(s);
      addrs[j] = a;
    }
    for (int k = rank + 1; k < world; ++k) {
      M3_TRY(Socket s, tcp_accept(listener, deadline,
                                  "the higher ranks of the TCP group to connect to rank " +
                                      std::to_string(rank) + " at " + me));
      uint32_t who = 0;
      M3_TRY_STATUS(recv_all(s, &who, sizeof who, deadline, "a connecting rank"));
      if (who <= static_cast<uint32_t>(rank) || who >= static_cast<uint32_t>(world) ||
          peers[who].valid()) {
        return make_error(ErrorCode::kInternal, "rank " + std::to_string(rank) +
                                                    " got a connection claiming rank " +
                                                    std::to_string(who));
      }
      addrs[who] = peer_name(s);
      peers[who] = std::move(s);
    }
    for (int r = 0; r < world; ++r)
      if (r != rank) set_nonblocking(peers[r], true);
  }
  return std::unique_ptr<TcpCommunicator>(
      new TcpCommunicator(rank, world, std::move(peers), std::move(addrs), timeout));
}

TcpCommunicator::TcpCommunicator(int rank, int world, std::vector<Socket> peers,
                                 std::vector<std::string> peer_addrs, double timeout_s)
    : rank_(rank),
      world_(world),
      peers_(std::move(peers)),
      peer_addrs_(std::move(peer_addrs)),
      timeout_s_(timeout_s) {}

std::string TcpCommunicator::fault() const {
  std::lock_guard<std::mutex> lock(fault_mu_);
  return fault_;
}

bool TcpCommunicator::broken() const {
  std::lock_guard<std::mutex> lock(fault_mu_);
  return !fault_.empty();
}

void TcpCommunicator::fail(int peer, const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(fault_mu_);
    if (!fault_.empty()) return;
    fault_ = "rank " + std::to_string(peer) + " (" + peer_addrs_[peer] + ") of the " +
             std::to_string(world_) + "-rank group was lost: " + why;
  }
  M3_LOG_ERROR("rank %d: %s", rank_, fault().c_str());
  // The other ranks may be waiting on this one: shut every connection so they notice now.
  for (int r = 0; r < world_; ++r)
    if (r != rank_) peers_[r].shutdown_both();
}

bool TcpCommunicator::exchange(uint32_t op, const std::vector<Part>& sends,
                               const std::vector<Part>& recvs) {
  if (broken()) return false;
  ++seq_;
  struct Out {
    int peer;
    Header h;
    const char* data;
    int64_t done;
  };
  struct In {
    int peer;
    Header h;
    char* data;
    int64_t bytes;
    int64_t done;
  };
  std::vector<Out> outs;
  std::vector<In> ins;
  for (const Part& p : sends)
    outs.push_back({p.peer, Header{op, static_cast<uint32_t>(rank_), seq_, p.bytes}, p.send, 0});
  for (const Part& p : recvs) ins.push_back({p.peer, Header{}, p.recv, p.bytes, 0});
  constexpr int64_t kH = sizeof(Header);
  auto deadline = deadline_in(timeout_s_);
  size_t open = outs.size() + ins.size();
  std::vector<pollfd> fds;
  std::vector<int> who;  // fds[i] -> index into outs (>= 0) or -(index into ins) - 1
  while (open > 0) {
    fds.clear();
    who.clear();
    for (size_t i = 0; i < outs.size(); ++i) {
      if (outs[i].done < kH + outs[i].h.bytes) {
        fds.push_back({peers_[outs[i].peer].fd(), POLLOUT, 0});
        who.push_back(static_cast<int>(i));
      }
    }
    for (size_t i = 0; i < ins.size(); ++i) {
      if (ins[i].done < kH + ins[i].bytes) {
        fds.push_back({peers_[ins[i].peer].fd(), POLLIN, 0});
        who.push_back(-static_cast<int>(i) - 1);
      }
    }
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - SteadyClock::now())
            .count();
    const int rc =
        ::poll(fds.data(), fds.size(), static_cast<int>(std::clamp<int64_t>(left, 0, 1000)));
    if (rc < 0 && errno != EINTR) {
      fail(who[0] >= 0 ? outs[who[0]].peer : ins[-who[0] - 1].peer,
           std::string("poll failed: ") + std::strerror(errno));
      return false;
    }
    if (rc <= 0) {
      if (SteadyClock::now() >= deadline) {
        const int peer = who[0] >= 0 ? outs[who[0]].peer : ins[-who[0] - 1].peer;
        char secs[32];
        std::snprintf(secs, sizeof secs, "%.1f", timeout_s_);
        fail(peer, std::string("no progress for ") + secs +
                       " s in a collective (the process is stuck or its host unreachable)");
        return false;
      }
      continue;
    }
    bool progress = false;
    for (size_t f = 0; f < fds.size(); ++f) {
      if (fds[f].revents == 0) continue;
      if (who[f] >= 0) {
        Out& o = outs[who[f]];
        const int fd = fds[f].fd;
        while (o.done < kH + o.h.bytes) {
          const char* p =
              o.done < kH ? reinterpret_cast<const char*>(&o.h) + o.done : o.data + (o.done - kH);
          const int64_t n = o.done < kH ? kH - o.done : o.h.bytes - (o.done - kH);
          const ssize_t k = ::send(fd, p, static_cast<size_t>(n), MSG_NOSIGNAL | MSG_DONTWAIT);
          if (k < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) break;
            fail(o.peer, lost_text("sending", errno));
            return false;
          }
          o.done += k;
          progress = true;
        }
        if (o.done == kH + o.h.bytes) --open;
      } else {
        In& in = ins[-who[f] - 1];
        const int fd = fds[f].fd;
        while (in.done < kH + in.bytes) {
          char* p =
              in.done < kH ? reinterpret_cast<char*>(&in.h) + in.done : in.data + (in.done - kH);
          const int64_t n = in.done < kH ? kH - in.done : in.bytes - (in.done - kH);
          const ssize_t k = ::recv(fd, p, static_cast<size_t>(n), MSG_DONTWAIT);
          if (k == 0) {
            fail(in.peer, "it closed the connection (the process exited or was killed)");
            return false;
          }
          if (k < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) break;
            fail(in.peer, lost_text("receiving", errno));
            return false;
          }
          const bool had_header = in.done >= kH;
          in.done += k;
          progress = true;
          if (!had_header && in.done >= kH) {
            // Every rank issues the same collectives in the same order (communicator.h).
            M3_CHECK(in.h.op == op && in.h.seq == seq_,
                     "TcpCommunicator: rank %d is in collective %u (#%llu), rank %d in %u (#%llu)",
                     rank_, op, (unsigned long long)seq_, in.peer, in.h.op,
                     (unsigned long long)in.h.seq);
            M3_CHECK(in.h.bytes == in.bytes,
                     "TcpCommunicator: rank %d sends %lld bytes to rank %d, which expects %lld",
                     in.peer, (long long)in.h.bytes, rank_, (long long)in.bytes);
          }
        }
        if (in.done == kH + in.bytes) --open;
      }
    }
    if (progress) deadline = deadline_in(timeout_s_);
  }
  return true;
}

void TcpCommunicator::all_reduce_sum(float* data, int64_t n) {
  const int W = world_;
  if (W == 1) return;
  const int64_t bytes = n * static_cast<int64_t>(sizeof(float));
  scratch_.resize(static_cast<size_t>(W * n));
  std::vector<Part> sends, recvs;
  for (int r = 0; r < W; ++r) {
    if (r == rank_) continue;
    sends.push_back({r, reinterpret_cast<const char*>(data), nullptr, bytes});
    recvs.push_back({r, nullptr, reinterpret_cast<char*>(scratch_.data() + r * n), bytes});
  }
  if (!exchange(kAllReduce, sends, recvs)) {
    std::fill(data, data + n, 0.f);
    return;
  }
  // CpuCommunicator's order: rank 0's buffer, then += rank 1, 2, ... (bitwise the same sums).
  auto src = [&](int r) -> const float* { return r == rank_ ? data : scratch_.data() + r * n; };
  std::vector<float> sum(src(0), src(0) + n);
  for (int r = 1; r < W; ++r) {
    const float* s = src(r);
    for (int64_t i = 0; i < n; ++i) sum[i] += s[i];
  }
  std::memcpy(data, sum.data(), static_cast<size_t>(bytes));
}

template <class T>
void TcpCommunicator::gather_impl(const T* send, int64_t n, T* recv, uint32_t op) {
  const int64_t bytes = n * static_cast<int64_t>(sizeof(T));
  std::memmove(recv + rank_ * n, send, static_cast<size_t>(bytes));
  std::vector<Part> sends, recvs;
  for (int r = 0; r < world_; ++r) {
    if (r == rank_) continue;
    sends.push_back({r, reinterpret_cast<const char*>(recv + rank_ * n), nullptr, bytes});
    recvs.push_back({r, nullptr, reinterpret_cast<char*>(recv + r * n), bytes});
  }
  if (!exchange(op, sends, recvs)) std::fill(recv, recv + world_ * n, T{});
}

void TcpCommunicator::all_gather(const float* send, int64_t n, float* recv) {
  gather_impl(send, n, recv, kGatherF32);
}
void TcpCommunicator::all_gather(const int32_t* send, int64_t n, int32_t* recv) {
  gather_impl(send, n, recv, kGatherI32);
}

void TcpCommunicator::reduce_scatter_sum(const float* send, int64_t n, float* recv) {
  const int W = world_;
  const int64_t bytes = n * static_cast<int64_t>(sizeof(float));
  scratch_.resize(static_cast<size_t>(W * n));
  std::vector<Part> sends, recvs;
  for (int r = 0; r < W; ++r) {
    if (r == rank_) continue;
    sends.push_back({r, reinterpret_cast<const char*>(send + r * n), nullptr, bytes});
    recvs.push_back({r, nullptr, reinterpret_cast<char*>(scratch_.data() + r * n), bytes});
  }
  if (W > 1 && !exchange(kReduceScatter, sends, recvs)) {
    std::fill(recv, recv + n, 0.f);
    return;
  }
  // Rank order, as CpuCommunicator: rank 0's chunk, then += rank 1, 2, ...; recv may alias send.
  auto src = [&](int r) -> const float* {
    return r == rank_ ? send + rank_ * n : scratch_.data() + r * n;
  };
  std::vector<float> sum(src(0), src(0) + n);
  for (int r = 1; r < W; ++r) {
    const float* s = src(r);
    for (int64_t i = 0; i < n; ++i) sum[i] += s[i];
  }
  std::memcpy(recv, sum.data(), static_cast<size_t>(bytes));
}

template <class T>
void TcpCommunicator::a2a_impl(const T* send, const int64_t* send_counts, T* recv,
                               const int64_t* recv_counts, uint32_t op) {
  std::vector<Part> sends, recvs;
  int64_t soff = 0, roff = 0;
  int64_t total_recv = 0;
  for (int r = 0; r < world_; ++r) {
    if (r == rank_) {
      M3_CHECK(send_counts[r] == recv_counts[r],
               "all_to_all_v: rank %d sends %lld elements to itself and expects %lld", rank_,
               (long long)send_counts[r], (long long)recv_counts[r]);
      std::memmove(recv + roff, send + soff, static_cast<size_t>(send_counts[r]) * sizeof(T));
    } else {
      sends.push_back({r, reinterpret_cast<const char*>(send + soff), nullptr,
                       send_counts[r] * static_cast<int64_t>(sizeof(T))});
      recvs.push_back({r, nullptr, reinterpret_cast<char*>(recv + roff),
                       recv_counts[r] * static_cast<int64_t>(sizeof(T))});
    }
    soff += send_counts[r];
    roff += recv_counts[r];
    total_recv += recv_counts[r];
  }
  if (world_ > 1 && !exchange(op, sends, recvs)) std::fill(recv, recv + total_recv, T{});
}

void TcpCommunicator::all_to_all_v(const float* send, const int64_t* send_counts, float* recv,
                                   const int64_t* recv_counts) {
  a2a_impl(send, send_counts, recv, recv_counts, kA2aF32);
}
void TcpCommunicator::all_to_all_v(const int32_t* send, const int64_t* send_counts, int32_t* recv,
                                   const int64_t* recv_counts) {
  a2a_impl(send, send_counts, recv, recv_counts, kA2aI32);
}

template <class T>
void TcpCommunicator::bcast_impl(T* data, int64_t n, int root, uint32_t op) {
  M3_CHECK(root >= 0 && root < world_, "broadcast: root %d outside [0, %d)", root, world_);
  if (world_ == 1) return;
  const int64_t bytes = n * static_cast<int64_t>(sizeof(T));
  std::vector<Part> sends, recvs;
  if (rank_ == root) {
    for (int r = 0; r < world_; ++r)
      if (r != root) sends.push_back({r, reinterpret_cast<const char*>(data), nullptr, bytes});
  } else {
    recvs.push_back({root, nullptr, reinterpret_cast<char*>(data), bytes});
  }
  if (!exchange(op, sends, recvs) && rank_ != root) std::fill(data, data + n, T{});
}

void TcpCommunicator::broadcast(float* data, int64_t n, int root) {
  bcast_impl(data, n, root, kBcastF32);
}
void TcpCommunicator::broadcast(int32_t* data, int64_t n, int root) {
  bcast_impl(data, n, root, kBcastI32);
}

void TcpCommunicator::barrier() {
  if (world_ == 1) return;
  std::vector<Part> sends, recvs;
  for (int r = 0; r < world_; ++r) {
    if (r == rank_) continue;
    sends.push_back({r, nullptr, nullptr, 0});
    recvs.push_back({r, nullptr, nullptr, 0});
  }
  exchange(kBarrier, sends, recvs);
}

}  // namespace m3::dist
