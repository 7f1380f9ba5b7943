#include "engine/pd_connector.h"

#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>
#include <zmq.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <sstream>

#include "core/log.h"
#include "engine/nixl_agent.h"

namespace m3::engine {

namespace {

using Clock = std::chrono::steady_clock;

constexpr char kMetaRequest[] = "M3PD1 META";
constexpr char kNotifPrefix[] = "m3pd:read:";

std::string random_engine_id() {
  std::random_device rd;
  std::mt19937_64 g((static_cast<uint64_t>(rd()) << 32) ^ rd());
  char buf[40];
  std::snprintf(buf, sizeof buf, "m3-%016llx", static_cast<unsigned long long>(g()));
  return buf;
}

bool recv_frame(void* sock, std::string* out, bool* more) {
  zmq_msg_t m;
  zmq_msg_init(&m);
  if (zmq_msg_recv(&m, sock, 0) < 0) {
    zmq_msg_close(&m);
    return false;
  }
  out->assign(static_cast<const char*>(zmq_msg_data(&m)), zmq_msg_size(&m));
  *more = zmq_msg_more(&m) != 0;
  zmq_msg_close(&m);
  return true;
}

// A TCP connect to the side channel, so a peer that is gone fails at once ("connection refused")
// instead of after ZeroMQ's reconnect attempts time out. "" when something listens there.
std::string probe_tcp(const std::string& host, int port, int timeout_ms) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res); rc != 0)
    return std::string("cannot resolve ") + host + " (" + ::gai_strerror(rc) + ")";
  std::string err = "nothing answers";
  for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK, a->ai_protocol);
    if (fd < 0) continue;
    int rc = ::connect(fd, a->ai_addr, a->ai_addrlen);
    if (rc != 0 && errno == EINPROGRESS) {
      pollfd pfd{fd, POLLOUT, 0};
      rc = ::poll(&pfd, 1, timeout_ms) == 1 ? 0 : -1;
      int so = 0;
      socklen_t len = sizeof so;
      if (rc == 0 && (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &so, &len) != 0 || so != 0)) {
        errno = so;
        rc = -1;
      } else if (rc != 0) {
        errno = ETIMEDOUT;
      }
    }
    const int e = errno;
    ::close(fd);
    if (rc == 0) {
      err.clear();
      break;
    }
    err = std::strerror(e);
  }
  ::freeaddrinfo(res);
  return err;
}

}  // namespace

const char* kv_role_name(KvRole role) {
  switch (role) {
    case KvRole::kProducer:
      return "kv_producer";
    case KvRole::kConsumer:
      return "kv_consumer";
    default:
      return "kv_both";
  }
}

struct PdConnector::Remote {
  std::string agent;
  int block_size = 0;
  std::vector<runtime::KvRegion> regions;  // the peer's addresses
};

struct PdConnector::Load {
  uint64_t id = 0;
  std::vector<int32_t> pages;  // local pages of blocks first, first + 1, ...
  size_t first = 0;
  KvTransferParams params;
  std::shared_ptr<Remote> remote;
  void* xfer = nullptr;
  Clock::time_point deadline;
};

std::string PdConnector::read_notification(const std::string& remote_request_id) {
  return kNotifPrefix + remote_request_id;
}

std::optional<uint64_t> PdConnector::parse_read_notification(const std::string& msg) {
  const size_t n = std::strlen(kNotifPrefix);
  if (msg.size() <= n || msg.compare(0, n, kNotifPrefix) != 0 || msg.size() - n > 20)
    return std::nullopt;
  uint64_t v = 0;
  for (size_t i = n; i < msg.size(); ++i) {
    if (msg[i] < '0' || msg[i] > '9') return std::nullopt;
    const uint64_t d = static_cast<uint64_t>(msg[i] - '0');
    if (v > (UINT64_MAX - d) / 10) return std::nullopt;
    v = v * 10 + d;
  }
  return v;
}

Result<std::unique_ptr<PdConnector>> PdConnector::create(const PdConfig& config,
                                                         std::vector<runtime::KvRegion> regions,
                                                         int block_size,
                                                         std::function<void()> wake) {
  std::unique_ptr<PdConnector> c(new PdConnector());
  c->cfg_ = config;
  c->engine_id_ = random_engine_id();
  c->block_size_ = block_size;
  c->regions_ = std::move(regions);
  c->wake_ = std::move(wake);
  M3_TRY(c->agent_, NixlAgent::create(c->engine_id_));
  std::vector<NixlDesc> descs;
  for (const auto& r : c->regions_)
    descs.push_back(
        {reinterpret_cast<uintptr_t>(r.base), static_cast<size_t>(r.page_bytes * r.num_pages)});
  M3_TRY_STATUS(c->agent_->register_dram(descs));
  M3_TRY(c->agent_metadata_, c->agent_->local_metadata());
  c->zmq_ctx_ = zmq_ctx_new();
  if (config.produces()) {
    c->side_channel_ = zmq_socket(c->zmq_ctx_, ZMQ_REP);
    const int linger = 0;
    zmq_setsockopt(c->side_channel_, ZMQ_LINGER, &linger, sizeof linger);
    // Port 0 asks the kernel for a free one; the bound port is then the one advertised.
    const std::string ep =
        "tcp://*:" + (config.port == 0 ? std::string("*") : std::to_string(config.port));
    if (zmq_bind(c->side_channel_, ep.c_str()) != 0) {
      const std::string why = zmq_strerror(zmq_errno());
      zmq_close(c->side_channel_);
      c->side_channel_ = nullptr;
      zmq_ctx_term(c->zmq_ctx_);
      c->zmq_ctx_ = nullptr;
      return make_error(ErrorCode::kInvalidArgument,
                        "the P/D side channel cannot listen on port " +
                            std::to_string(config.port) + " (" + why +
                            "); set VLLM_NIXL_SIDE_CHANNEL_PORT to a free port",
                        "VLLM_NIXL_SIDE_CHANNEL_PORT");
    }
    if (config.port == 0) {
      char bound[256] = {};
      size_t len = sizeof bound;
      zmq_getsockopt(c->side_channel_, ZMQ_LAST_ENDPOINT, bound, &len);
      const char* colon = std::strrchr(bound, ':');
      c->cfg_.port = colon != nullptr ? std::atoi(colon + 1) : 0;
    }
    c->producer_thread_ = std::thread([raw = c.get()] { raw->producer_loop(); });
  }
  if (config.consumes())
    c->consumer_thread_ = std::thread([raw = c.get()] { raw->consumer_loop(); });
  M3_LOG_INFO("P/D: NixlConnector %s, engine %s, NIXL %s, %zu KV regions%s",
              kv_role_name(config.role), c->engine_id_.c_str(), NixlAgent::library_path().c_str(),
              c->regions_.size(),
              config.produces()
                  ? (", side channel " + config.host + ":" + std::to_string(c->cfg_.port)).c_str()
                  : "");
  return c;
}

PdConnector::~PdConnector() {
  shutdown();
}

void PdConnector::shutdown() {
  if (stop_.exchange(true)) return;
  cv_.notify_all();
  if (producer_thread_.joinable()) producer_thread_.join();
  if (consumer_thread_.joinable()) consumer_thread_.join();
  if (side_channel_ != nullptr) zmq_close(side_channel_);
  side_channel_ = nullptr;
  if (zmq_ctx_ != nullptr) zmq_ctx_term(zmq_ctx_);
  zmq_ctx_ = nullptr;
  agent_.reset();  // deregisters the pool before the engine frees it
}

KvTransferParams PdConnector::hold(uint64_t request_id, const std::vector<int32_t>& pages) {
  KvTransferParams p;
  p.do_remote_prefill = true;  // what the decode worker is to do with these
  p.remote_engine_id = engine_id_;
  p.remote_request_id = std::to_string(request_id);
  p.remote_host = cfg_.host;
  p.remote_port = cfg_.port;
  p.remote_block_ids.assign(pages.begin(), pages.end());
  std::lock_guard<std::mutex> lock(mu_);
  held_[request_id] = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                         std::chrono::duration<double>(cfg_.abort_timeout_s));
  stats_.num_held = static_cast<int64_t>(held_.size());
  return p;
}

void PdConnector::start_load(uint64_t request_id, std::vector<int32_t> local_pages,
                             KvTransferParams remote, int first_block) {
  auto l = std::make_unique<Load>();
  l->id = request_id;
  l->pages = std::move(local_pages);
  l->first = static_cast<size_t>(std::max(0, first_block));
  l->params = std::move(remote);
  {
    std::lock_guard<std::mutex> lock(mu_);
    queued_.push_back(std::move(l));
  }
  cv_.notify_all();
}

PdConnector::Events PdConnector::take_events() {
  std::lock_guard<std::mutex> lock(mu_);
  Events e = std::move(events_);
  events_ = Events{};
  return e;
}

bool PdConnector::has_events() const {
  std::lock_guard<std::mutex> lock(mu_);
  return !events_.released.empty() || !events_.loaded.empty();
}

PdStats PdConnector::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void PdConnector::producer_loop() {
  while (!stop_) {
    zmq_pollitem_t item{side_channel_, 0, ZMQ_POLLIN, 0};
    if (zmq_poll(&item, 1, 10) > 0 && (item.revents & ZMQ_POLLIN)) {
      std::string req;
      bool more = false;
      bool ok = recv_frame(side_channel_, &req, &more);
      while (ok && more) ok = recv_frame(side_channel_, &req, &more);  // drop extra frames
      std::ostringstream head;
      if (ok && req == kMetaRequest) {
        head << "M3PD1 " << engine_id_ << ' ' << block_size_ << ' ' << regions_.size() << '\n';
        for (const auto& r : regions_)
          head << reinterpret_cast<uintptr_t>(r.base) << ' ' << r.page_bytes << ' ' << r.num_pages
               << '\n';
      } else {
        head << "M3PD1 ERROR unknown request\n";
      }
      const std::string h = head.str();
      zmq_send(side_channel_, h.data(), h.size(), ZMQ_SNDMORE);
      zmq_send(side_channel_, agent_metadata_.data(), agent_metadata_.size(), 0);
    }
    std::vector<uint64_t> read;
    for (const std::string& n : agent_->take_notifications())
      if (auto id = parse_read_notification(n)) read.push_back(*id);
    bool any = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (uint64_t id : read) {
        if (held_.erase(id) == 0) continue;  // expired already, or not ours
        events_.released.push_back(id);
        ++stats_.num_released_read;
        any = true;
      }
      const auto now = Clock::now();
      for (auto it = held_.begin(); it != held_.end();) {
        if (it->second > now) {
          ++it;
          continue;
        }
        M3_LOG_WARN(
            "P/D: no decode worker read request %llu's KV within %g s "
            "(VLLM_NIXL_ABORT_REQUEST_TIMEOUT); freeing its pages",
            static_cast<unsigned long long>(it->first), cfg_.abort_timeout_s);
        events_.released.push_back(it->first);
        ++stats_.num_released_expired;
        it = held_.erase(it);
        any = true;
      }
      stats_.num_held = static_cast<int64_t>(held_.size());
    }
    if (any && wake_) wake_();
  }
}

std::string PdConnector::fetch_metadata(const KvTransferParams& p, std::string* head,
                                        std::string* md) const {
  const std::string where = p.remote_host + ":" + std::to_string(p.remote_port);
  if (std::string why = probe_tcp(p.remote_host, p.remote_port, 2000); !why.empty())
    return "the prefill worker's side channel " + where + " is not reachable (" + why +
           "): the prefill worker is gone?";
  void* s = zmq_socket(zmq_ctx_, ZMQ_REQ);
  const int linger = 0;
  const int ms = static_cast<int>(cfg_.side_channel_timeout_s * 1000);
  zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof linger);
  zmq_setsockopt(s, ZMQ_RCVTIMEO, &ms, sizeof ms);
  zmq_setsockopt(s, ZMQ_SNDTIMEO, &ms, sizeof ms);
  bool more = false;
  std::string err;
  if (zmq_connect(s, ("tcp://" + where).c_str()) != 0) {
    err = "cannot connect to the prefill worker's side channel " + where + " (" +
          zmq_strerror(zmq_errno()) + ")";
  } else if (zmq_send(s, kMetaRequest, std::strlen(kMetaRequest), 0) < 0 ||
             !recv_frame(s, head, &more) || !more || !recv_frame(s, md, &more)) {
    err = "the prefill worker's side channel " + where + " did not answer within " +
          std::to_string(static_cast<int>(cfg_.side_channel_timeout_s)) + " s";
  }
  zmq_close(s);
  return err;
}

std::string PdConnector::install_remote(const KvTransferParams& p, const std::string& head,
                                        const std::string& md, std::shared_ptr<Remote>* out) {
  const std::string where = p.remote_host + ":" + std::to_string(p.remote_port);
  std::istringstream in(head);
  std::string magic, engine;
  auto r = std::make_shared<Remote>();
  size_t n = 0;
  in >> magic >> engine >> r->block_size >> n;
  if (magic != "M3PD1" || !in || n > (1u << 20))
    return "the side channel " + where + " is not an m3serve prefill worker";
  if (engine != p.remote_engine_id)
    return "the side channel " + where + " belongs to engine " + engine + ", not " +
           p.remote_engine_id + " (the prefill worker restarted?)";
  for (size_t i = 0; i < n; ++i) {
    uintptr_t addr = 0;
    runtime::KvRegion reg;
    in >> addr >> reg.page_bytes >> reg.num_pages;
    reg.base = reinterpret_cast<void*>(addr);
    r->regions.push_back(reg);
  }
  if (!in) return "the side channel " + where + " sent a truncated layout";
  if (r->block_size != block_size_ || r->regions.size() != regions_.size())
    return "the prefill worker's KV layout (block size " + std::to_string(r->block_size) + ", " +
           std::to_string(r->regions.size()) + " arrays) differs from ours (" +
           std::to_string(block_size_) + ", " + std::to_string(regions_.size()) +
           "): serve the same model with the same --kv-cache-dtype on both";
  for (size_t i = 0; i < regions_.size(); ++i) {
    if (r->regions[i].page_bytes != regions_[i].page_bytes)
      return "the prefill worker's KV page layout differs from ours (array " + std::to_string(i) +
             ": " + std::to_string(r->regions[i].page_bytes) + " vs " +
             std::to_string(regions_[i].page_bytes) +
             " bytes): serve the same model with the same --kv-cache-dtype on both";
  }
  auto name = agent_->load_remote(md);
  if (!name) return name.error().message;
  r->agent = *name;
  remotes_[p.remote_engine_id] = r;
  *out = r;
  return "";
}

std::string PdConnector::connect_remote(const KvTransferParams& p, std::shared_ptr<Remote>* out) {
  auto it = remotes_.find(p.remote_engine_id);
  if (it != remotes_.end()) {
    *out = it->second;
    return "";
  }
  std::string head, md;
  if (std::string err = fetch_metadata(p, &head, &md); !err.empty()) return err;
  return install_remote(p, head, md, out);
}

void PdConnector::begin(Load& load) {
  const KvTransferParams& p = load.params;
  std::string err = connect_remote(p, &load.remote);
  if (err.empty() && p.remote_block_ids.size() < load.first + load.pages.size()) {
    err = "the prefill worker sent " + std::to_string(p.remote_block_ids.size()) +
          " pages for a prompt of " + std::to_string(load.first + load.pages.size()) + " pages";
  }
  if (err.empty()) {
    const int64_t np = load.remote->regions.empty() ? 0 : load.remote->regions[0].num_pages;
    for (size_t i = load.first; i < load.first + load.pages.size() && err.empty(); ++i)
      if (p.remote_block_ids[i] < 0 || p.remote_block_ids[i] >= np)
        err = "remote page " + std::to_string(p.remote_block_ids[i]) +
              " is outside the prefill "
              "worker's pool of " +
              std::to_string(np) + " pages";
  }
  if (!err.empty()) {
    finish(load, false, err);
    return;
  }
  std::vector<NixlDesc> local, remote;
  local.reserve(regions_.size() * load.pages.size());
  remote.reserve(local.capacity());
  for (size_t r = 0; r < regions_.size(); ++r) {
    const auto& L = regions_[r];
    const auto& R = load.remote->regions[r];
    const size_t pb = static_cast<size_t>(L.page_bytes);
    for (size_t i = 0; i < load.pages.size(); ++i) {
      local.push_back({reinterpret_cast<uintptr_t>(L.base) + load.pages[i] * pb, pb});
      remote.push_back({reinterpret_cast<uintptr_t>(R.base) +
                            static_cast<size_t>(p.remote_block_ids[load.first + i]) * pb,
                        pb});
    }
  }
  auto x =
      agent_->start_read(local, remote, load.remote->agent, read_notification(p.remote_request_id));
  if (!x) {
    finish(load, false, x.error().message);
    return;
  }
  load.xfer = *x;
  load.deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                     std::chrono::duration<double>(cfg_.transfer_timeout_s));
}

void PdConnector::finish(Load& load, bool ok, const std::string& why) {
  if (load.xfer != nullptr) agent_->release(load.xfer);
  load.xfer = nullptr;
  if (!ok) {
    M3_LOG_WARN("P/D: reading request %llu's KV from %s:%d failed: %s; computing its prompt here",
                static_cast<unsigned long long>(load.id), load.params.remote_host.c_str(),
                load.params.remote_port, why.c_str());
    // The peer may be gone or restarted: fetch its metadata afresh next time.
    auto it = remotes_.find(load.params.remote_engine_id);
    if (it != remotes_.end()) {
      agent_->forget_remote(it->second->agent);
      remotes_.erase(it);
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    events_.loaded.emplace_back(load.id, ok);
    if (ok) {
      ++stats_.num_loads_ok;
      stats_.num_pages_read += static_cast<int64_t>(load.pages.size());
    } else {
      ++stats_.num_loads_failed;
    }
  }
  if (wake_) wake_();
}

// A prefill worker's metadata fetched on its own thread (its side channel may take up to
// side_channel_timeout_s to answer, or never: other peers' loads go on meanwhile), and the loads
// that wait for it. The thread touches only its own fields (and the const config and ZeroMQ
// context); the consumer thread installs the result.
struct PdConnector::Fetch {
  KvTransferParams params;  // where to ask (the first waiting load's peer)
  std::string head, md, err;
  std::atomic<bool> done{false};
  std::thread thread;
  std::vector<std::unique_ptr<Load>> loads;
};

void PdConnector::consumer_loop() {
  std::vector<std::unique_ptr<Load>> inflight;
  std::map<std::string, std::unique_ptr<Fetch>> fetching;  // by engine id @ host:port
  while (true) {
    std::deque<std::unique_ptr<Load>> fresh;
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (inflight.empty() && fetching.empty())
        cv_.wait(lock, [&] { return stop_ || !queued_.empty(); });
      else
        cv_.wait_for(lock, std::chrono::microseconds(200), [&] { return stop_.load(); });
      if (stop_) break;
      fresh.swap(queued_);
    }
    auto start = [&](std::unique_ptr<Load> l) {
      begin(*l);
      if (l->xfer != nullptr) inflight.push_back(std::move(l));
    };
    for (auto& l : fresh) {
      const KvTransferParams& p = l->params;
      if (remotes_.count(p.remote_engine_id) != 0) {
        start(std::move(l));
        continue;
      }
      const std::string key =
          p.remote_engine_id + "@" + p.remote_host + ":" + std::to_string(p.remote_port);
      auto f = fetching.find(key);
      if (f != fetching.end()) {
        f->second->loads.push_back(std::move(l));
        continue;
      }
      auto fetch = std::make_unique<Fetch>();
      fetch->params = p;
      fetch->loads.push_back(std::move(l));
      Fetch* raw = fetch.get();
      raw->thread = std::thread([this, raw] {
        raw->err = fetch_metadata(raw->params, &raw->head, &raw->md);
        raw->done = true;
        cv_.notify_all();
      });
      fetching.emplace(key, std::move(fetch));
    }
    for (auto f = fetching.begin(); f != fetching.end();) {
      Fetch& fe = *f->second;
      if (!fe.done) {
        ++f;
        continue;
      }
      fe.thread.join();
      std::shared_ptr<Remote> r;
      const std::string err =
          fe.err.empty() ? install_remote(fe.params, fe.head, fe.md, &r) : fe.err;
      for (auto& l : fe.loads) {
        if (err.empty())
          start(std::move(l));  // begin() finds the peer installed
        else
          finish(*l, false, err);
      }
      f = fetching.erase(f);
    }
    const auto now = Clock::now();
    for (size_t i = 0; i < inflight.size();) {
      Load& l = *inflight[i];
      const int st = agent_->status(l.xfer);
      if (st == 1 && now < l.deadline) {
        ++i;
        continue;
      }
      if (st == 0)
        finish(l, true, "");
      else if (st == 1)
        finish(l, false,
               "the READ did not complete within " +
                   std::to_string(static_cast<int>(cfg_.transfer_timeout_s)) + " s");
      else
        finish(l, false,
               "the READ failed (NIXL status " + std::to_string(st) +
                   "): the prefill worker went away?");
      inflight.erase(inflight.begin() + static_cast<std::ptrdiff_t>(i));
    }
  }
  // Shutting down: cancel reads into pages the engine is about to free; metadata fetches end
  // within their timeout.
  for (auto& l : inflight) agent_->release(l->xfer);
  for (auto& f : fetching) f.second->thread.join();
}

}  // namespace m3::engine
