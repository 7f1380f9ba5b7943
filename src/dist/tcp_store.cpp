#include "dist/tcp_store.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include "core/log.h"

namespace m3::dist {

namespace {

enum Op : uint8_t { kSet = 1, kTryGet = 2, kAdd = 3 };
enum Reply : uint8_t { kOk = 0, kMissing = 1, kBad = 2 };

// A request: op, key length, value length (u32 each after the op byte), key, value. A reply:
// status byte, value length, value. Little-endian host order: all nodes run the same binary.
struct ReqHead {
  uint8_t op;
  uint32_t key_len;
  uint32_t value_len;
} __attribute__((packed));
struct ReplyHead {
  uint8_t status;
  uint32_t value_len;
} __attribute__((packed));

constexpr uint32_t kMaxField = 64u << 20;  // a key or value above 64 MiB is a protocol error
const char* kFlags = "--master-addr / --master-port";

}  // namespace

Result<std::unique_ptr<TcpStore>> TcpStore::create(const TcpStoreOptions& o) {
  std::unique_ptr<TcpStore> s(new TcpStore());
  s->opts_ = o;
  const auto deadline = deadline_in(o.timeout_s);
  std::string where = o.host + ":" + std::to_string(o.port);
  if (o.is_server) {
    M3_TRY(s->listener_, tcp_listen(o.host, o.port, kFlags));
    s->port_ = bound_port(s->listener_);
    if (pipe2(s->wake_, O_CLOEXEC) != 0)
      return make_error(ErrorCode::kIo, std::string("pipe() failed: ") + std::strerror(errno));
    TcpStore* raw = s.get();
    s->server_ = std::thread([raw] { raw->serve(); });
  } else {
    s->port_ = o.port;
  }
  M3_TRY(s->conn_, tcp_connect(o.host, s->port_, deadline, kFlags));
  s->local_address_ = local_ip(s->conn_);
  return s;
}

TcpStore::~TcpStore() {
  conn_.close();
  if (server_.joinable()) {
    const char c = 'x';
    (void)!::write(wake_[1], &c, 1);
    server_.join();
  }
  for (int& fd : wake_) {
    if (fd >= 0) ::close(fd);
    fd = -1;
  }
}

void TcpStore::serve() {
  std::vector<Socket> clients;
  for (;;) {
    std::vector<pollfd> fds;
    fds.push_back({wake_[0], POLLIN, 0});
    fds.push_back({listener_.fd(), POLLIN, 0});
    for (const Socket& c : clients) fds.push_back({c.fd(), POLLIN, 0});
    const int rc = ::poll(fds.data(), fds.size(), -1);
    if (rc < 0) {
      if (errno == EINTR) continue;
      M3_LOG_ERROR("tcp store: poll failed: %s", std::strerror(errno));
      return;
    }
    if (fds[0].revents != 0) return;
    if (fds[1].revents & POLLIN) {
      auto c = tcp_accept(listener_, deadline_in(1.0), "a store client");
      if (c) clients.push_back(std::move(*c));
    }
    std::vector<size_t> dead;
    for (size_t i = 0; i < clients.size(); ++i) {
      if (fds[i + 2].revents == 0) continue;
      const Socket& c = clients[i];
      // A request is sent whole by the client; a stalled one is dropped after 10 s.
      const auto dl = deadline_in(10.0);
      ReqHead h{};
      std::string key, value;
      bool ok = static_cast<bool>(recv_all(c, &h, sizeof h, dl, "a store client")) &&
                h.key_len <= kMaxField && h.value_len <= kMaxField;
      if (ok) {
        key.resize(h.key_len);
        value.resize(h.value_len);
        ok = recv_all(c, key.data(), key.size(), dl, "a store client") &&
             recv_all(c, value.data(), value.size(), dl, "a store client");
      }
      if (!ok) {
        dead.push_back(i);
        continue;
      }
      ReplyHead r{kOk, 0};
      std::string out;
      if (h.op == kSet) {
        data_[key] = value;
      } else if (h.op == kTryGet) {
        auto it = data_.find(key);
        if (it == data_.end())
          r.status = kMissing;
        else
          out = it->second;
      } else if (h.op == kAdd) {
        int64_t delta = 0, cur = 0;
        if (value.size() == sizeof delta) std::memcpy(&delta, value.data(), sizeof delta);
        auto it = data_.find(key);
        if (it != data_.end() && it->second.size() == sizeof cur)
          std::memcpy(&cur, it->second.data(), sizeof cur);
        cur += delta;
        std::string v(sizeof cur, '\0');
        std::memcpy(v.data(), &cur, sizeof cur);
        data_[key] = v;
        out = v;
      } else {
        r.status = kBad;
      }
      r.value_len = static_cast<uint32_t>(out.size());
      if (!send_all(c, &r, sizeof r, dl, "a store client") ||
          !send_all(c, out.data(), out.size(), dl, "a store client"))
        dead.push_back(i);
    }
    for (auto it = dead.rbegin(); it != dead.rend(); ++it)
      clients.erase(clients.begin() + static_cast<std::ptrdiff_t>(*it));
  }
}

Result<std::string> TcpStore::request(uint8_t op, const std::string& key,
                                      const std::string& value) {
  std::lock_guard<std::mutex> lock(mu_);
  const std::string what =
      "the rendezvous store on node 0 (" + opts_.host + ":" + std::to_string(port_) + ")";
  if (!conn_.valid())
    return make_error(ErrorCode::kUnavailable, "no connection to " + what, kFlags);
  const auto dl = deadline_in(opts_.timeout_s);
  ReqHead h{op, static_cast<uint32_t>(key.size()), static_cast<uint32_t>(value.size())};
  Status st = send_all(conn_, &h, sizeof h, dl, what);
  if (st) st = send_all(conn_, key.data(), key.size(), dl, what);
  if (st) st = send_all(conn_, value.data(), value.size(), dl, what);
  ReplyHead r{};
  if (st) st = recv_all(conn_, &r, sizeof r, dl, what);
  std::string out;
  if (st && r.value_len <= kMaxField) {
    out.resize(r.value_len);
    st = recv_all(conn_, out.data(), out.size(), dl, what);
  }
  if (!st) {
    conn_.close();  // the stream is out of step now
    return make_error(ErrorCode::kUnavailable,
                      st.error().message + " (node 0 exited, or the network failed)", kFlags);
  }
  if (r.status == kBad)
    return make_error(ErrorCode::kInternal, "the rendezvous store refused a request");
  if (r.status == kMissing) return make_error(ErrorCode::kNotFound, key);
  return out;
}

Status TcpStore::set(const std::string& key, const std::string& value) {
  M3_TRY(std::string unused, request(kSet, key, value));
  (void)unused;
  return {};
}

Result<std::string> TcpStore::try_get(const std::string& key, bool* found) {
  auto r = request(kTryGet, key, "");
  if (!r && r.error().code == ErrorCode::kNotFound) {
    *found = false;
    return std::string();
  }
  if (!r) return r;
  *found = true;
  return r;
}

Result<std::string> TcpStore::get(const std::string& key) {
  const auto t0 = SteadyClock::now();
  const auto deadline = deadline_in(opts_.timeout_s);
  int sleep_ms = 1;
  for (;;) {
    bool found = false;
    M3_TRY(std::string v, try_get(key, &found));
    if (found) return v;
    if (SteadyClock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(sleep_ms));
    sleep_ms = std::min(sleep_ms * 2, 50);
  }
  char secs[32];
  std::snprintf(secs, sizeof secs, "%.0f",
                std::chrono::duration<double>(SteadyClock::now() - t0).count());
  return make_error(ErrorCode::kUnavailable,
                    "waited " + std::string(secs) + " s for '" + key +
                        "' in the rendezvous store on " + opts_.host + ":" + std::to_string(port_) +
                        " and no process set it: every node of the group (--nnodes) must be "
                        "started with the same --master-addr / --master-port (M3_DIST_TIMEOUT_S "
                        "sets the wait)",
                    kFlags);
}

Result<int64_t> TcpStore::add(const std::string& key, int64_t delta) {
  std::string v(sizeof delta, '\0');
  std::memcpy(v.data(), &delta, sizeof delta);
  M3_TRY(std::string out, request(kAdd, key, v));
  int64_t cur = 0;
  if (out.size() == sizeof cur) std::memcpy(&cur, out.data(), sizeof cur);
  return cur;
}

Status TcpStore::barrier(const std::string& name, int count) {
  M3_TRY(int64_t arrived, add("barrier/" + name, 1));
  if (arrived == count) M3_TRY_STATUS(set("barrier/" + name + "/open", "1"));
  M3_TRY(std::string unused, get("barrier/" + name + "/open"));
  (void)unused;
  return {};
}

}  // namespace m3::dist
