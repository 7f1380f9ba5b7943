#include "runtime/multi_node.h"

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <type_traits>

#include "core/check.h"
#include "core/log.h"

namespace m3::runtime {

namespace {

const char* kFlags = "--master-addr / --master-port";

// ------------------------------------------------------------------ the step's wire format

class Writer {
 public:
  template <class T>
  void pod(const T& v) {
    static_assert(std::is_trivially_copyable_v<T>);
    const size_t at = out_.size();
    out_.resize(at + sizeof v);
    std::memcpy(out_.data() + at, &v, sizeof v);
  }
  template <class T>
  void vec(const std::vector<T>& v) {
    static_assert(std::is_trivially_copyable_v<T>);
    pod(static_cast<uint64_t>(v.size()));
    const size_t at = out_.size();
    out_.resize(at + v.size() * sizeof(T));
    if (!v.empty()) std::memcpy(out_.data() + at, v.data(), v.size() * sizeof(T));
  }
  std::string take() { return std::move(out_); }

 private:
  std::string out_;
};

class Reader {
 public:
  explicit Reader(const std::string& s) : s_(s) {}
  template <class T>
  bool pod(T* v) {
    if (s_.size() - at_ < sizeof *v) return false;
    std::memcpy(v, s_.data() + at_, sizeof *v);
    at_ += sizeof *v;
    return true;
  }
  template <class T>
  bool vec(std::vector<T>* v) {
    uint64_t n = 0;
    if (!pod(&n) || n > (s_.size() - at_) / sizeof(T)) return false;
    v->resize(n);
    if (n > 0) std::memcpy(v->data(), s_.data() + at_, n * sizeof(T));
    at_ += n * sizeof(T);
    return true;
  }
  bool done() const { return at_ == s_.size(); }

 private:
  const std::string& s_;
  size_t at_ = 0;
};

constexpr uint32_t kStepMagic = 0x4d335354;  // "M3ST"

enum FrameType : uint32_t { kStep = 1, kShutdown = 2 };
struct FrameHead {
  uint32_t type;
  uint32_t pad;
  uint64_t bytes;
};
struct Hello {
  uint32_t node_rank;
  uint32_t ok;  // 0: the node refuses to join; a message of msg_bytes follows
  uint32_t msg_bytes;
};

}  // namespace

Status check_node_split(int world, const MultiNodeSpec& spec, const std::string& flag) {
  if (!spec.active()) return {};
  if (world < spec.nnodes || world % spec.nnodes != 0) {
    return make_error(ErrorCode::kInvalidArgument,
                      flag + " " + std::to_string(world) + " ranks do not split evenly over " +
                          "--nnodes " + std::to_string(spec.nnodes) +
                          " (each node holds world / nnodes ranks, as vLLM splits them): use a " +
                          flag + " that is a multiple of --nnodes",
                      flag);
  }
  return {};
}

std::string encode_step(const ForwardBatch& b, bool capture_msa) {
  Writer w;
  w.pod(kStepMagic);
  w.pod(static_cast<uint8_t>(capture_msa));
  w.vec(b.token_ids);
  w.vec(b.positions);
  w.vec(b.seq_ids);
  w.vec(b.block_table_offsets);
  w.vec(b.block_table);
  w.vec(b.logits_indices);
  w.vec(b.device_samples);
  w.vec(b.host_logits_rows);
  w.pod(b.num_sampleable);
  w.vec(b.prev_sample_tokens);
  w.vec(b.prev_sample_slots);
  w.vec(b.embed_rows);
  w.vec(b.embed_values);
  w.vec(b.aux_layers);
  w.pod(static_cast<uint8_t>(b.aux_on_device));
  return w.take();
}

Status decode_step(const std::string& bytes, ForwardBatch* b, bool* capture_msa) {
  Reader r(bytes);
  uint32_t magic = 0;
  uint8_t capture = 0, aux_dev = 0;
  const bool ok = r.pod(&magic) && magic == kStepMagic && r.pod(&capture) && r.vec(&b->token_ids) &&
                  r.vec(&b->positions) && r.vec(&b->seq_ids) && r.vec(&b->block_table_offsets) &&
                  r.vec(&b->block_table) && r.vec(&b->logits_indices) &&
                  r.vec(&b->device_samples) && r.vec(&b->host_logits_rows) &&
                  r.pod(&b->num_sampleable) && r.vec(&b->prev_sample_tokens) &&
                  r.vec(&b->prev_sample_slots) && r.vec(&b->embed_rows) &&
                  r.vec(&b->embed_values) && r.vec(&b->aux_layers) && r.pod(&aux_dev) && r.done();
  if (!ok) {
    return make_error(ErrorCode::kFormat,
                      "a step from node 0 is malformed (" + std::to_string(bytes.size()) +
                          " bytes): every node must run the same m3serve build");
  }
  *capture_msa = capture != 0;
  b->aux_on_device = aux_dev != 0;
  return {};
}

// ------------------------------------------------------------------ NodeGroup

Result<std::unique_ptr<NodeGroup>> NodeGroup::join(const MultiNodeSpec& spec,
                                                   const std::string& layout) {
  std::unique_ptr<NodeGroup> g(new NodeGroup());
  g->spec_ = spec;
  dist::TcpStoreOptions so;
  so.host = spec.master_addr;
  so.port = spec.master_port;
  so.is_server = spec.node_rank == 0;
  so.timeout_s = spec.timeout_s;
  M3_TRY(g->store_, dist::TcpStore::create(so));
  dist::TcpStore& store = *g->store_;
  const auto deadline = dist::deadline_in(spec.timeout_s);
  if (spec.node_rank == 0) {
    M3_TRY_STATUS(store.set("m3/layout", layout));
    M3_TRY(dist::Socket listener, dist::tcp_listen(spec.master_addr, 0, kFlags));
    M3_TRY_STATUS(
        store.set("m3/steps", spec.master_addr + ":" + std::to_string(dist::bound_port(listener))));
    g->followers_.resize(spec.nnodes);
    g->follower_names_.resize(spec.nnodes);
    M3_LOG_INFO("node 0: waiting for %d more node(s) on %s:%d", spec.nnodes - 1,
                spec.master_addr.c_str(), spec.master_port);
    for (int k = 1; k < spec.nnodes; ++k) {
      auto s = dist::tcp_accept(listener, deadline,
                                std::to_string(spec.nnodes - k) +
                                    " more node(s) to join (start every node with --nnodes " +
                                    std::to_string(spec.nnodes) + " and --master-addr " +
                                    spec.master_addr + " --master-port " +
                                    std::to_string(spec.master_port) + ")");
      if (!s) return tl::unexpected(s.error());
      Hello h{};
      M3_TRY_STATUS(dist::recv_all(*s, &h, sizeof h, deadline, "a joining node"));
      std::string msg(std::min<uint32_t>(h.msg_bytes, 1 << 16), '\0');
      M3_TRY_STATUS(dist::recv_all(*s, msg.data(), msg.size(), deadline, "a joining node"));
      if (!h.ok) {
        return make_error(ErrorCode::kInvalidArgument,
                          "node " + std::to_string(h.node_rank) + " refused to join: " + msg,
                          "--nnodes");
      }
      if (h.node_rank < 1 || h.node_rank >= static_cast<uint32_t>(spec.nnodes) ||
          g->followers_[h.node_rank].valid()) {
        return make_error(ErrorCode::kInvalidArgument,
                          "two nodes joined as --node-rank " + std::to_string(h.node_rank) +
                              " (or it is outside [1, --nnodes)): give every node its own "
                              "--node-rank",
                          "--node-rank");
      }
      g->follower_names_[h.node_rank] =
          "node " + std::to_string(h.node_rank) + " (" + dist::peer_name(*s) + ")";
      g->followers_[h.node_rank] = std::move(*s);
      M3_LOG_INFO("node 0: %s joined", g->follower_names_[h.node_rank].c_str());
    }
  } else {
    M3_TRY(std::string theirs, store.get("m3/layout"));
    M3_TRY(std::string steps, store.get("m3/steps"));
    const size_t colon = steps.rfind(':');
    M3_TRY(g->leader_, dist::tcp_connect(steps.substr(0, colon), std::stoi(steps.substr(colon + 1)),
                                         deadline, kFlags));
    std::string msg;
    if (theirs != layout) {
      msg = "its model or parallel flags differ from node 0's: node 0 runs [" + theirs +
            "], node " + std::to_string(spec.node_rank) + " [" + layout +
            "]; start every node with the same model, --tensor-parallel-size, "
            "--enable-expert-parallel, --nnodes and KV cache format";
    }
    Hello h{static_cast<uint32_t>(spec.node_rank), msg.empty() ? 1u : 0u,
            static_cast<uint32_t>(msg.size())};
    M3_TRY_STATUS(dist::send_all(g->leader_, &h, sizeof h, deadline, "node 0"));
    M3_TRY_STATUS(dist::send_all(g->leader_, msg.data(), msg.size(), deadline, "node 0"));
    if (!msg.empty())
      return make_error(ErrorCode::kInvalidArgument, "this node " + msg, "--nnodes");
  }
  return g;
}

NodeGroup::~NodeGroup() {
  stop_ = true;
  if (watcher_.joinable()) watcher_.join();
}

Result<int64_t> NodeGroup::agree_pages(int64_t offered) {
  dist::TcpStore& store = *store_;
  M3_TRY_STATUS(store.set("m3/pages/" + std::to_string(spec_.node_rank), std::to_string(offered)));
  int64_t pages = INT64_MAX;
  for (int n = 0; n < spec_.nnodes; ++n) {
    M3_TRY(std::string v, store.get("m3/pages/" + std::to_string(n)));
    pages = std::min<int64_t>(pages, std::stoll(v));
  }
  return pages;
}

Status NodeGroup::ready() {
  M3_TRY_STATUS(store_->barrier("m3/ready", spec_.nnodes));
  if (spec_.node_rank == 0) watcher_ = std::thread([this] { watch(); });
  return {};
}

void NodeGroup::set_lost(const std::string& why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (lost_.empty()) {
    lost_ = why;
    M3_LOG_ERROR("multi-node group: %s", why.c_str());
  }
}

std::string NodeGroup::lost() const {
  std::lock_guard<std::mutex> lock(mu_);
  return lost_;
}

void NodeGroup::watch() {
  // The other nodes never send on their step connection after joining: readable means closed.
  std::vector<bool> gone(followers_.size(), false);
  while (!stop_) {
    std::vector<pollfd> fds;
    std::vector<int> node;
    for (size_t n = 1; n < followers_.size(); ++n) {
      if (gone[n]) continue;
      fds.push_back({followers_[n].fd(), POLLIN, 0});
      node.push_back(static_cast<int>(n));
    }
    if (fds.empty()) return;
    const int rc = ::poll(fds.data(), fds.size(), 200);
    if (rc <= 0) continue;
    for (size_t i = 0; i < fds.size(); ++i) {
      if (fds[i].revents == 0) continue;
      char c = 0;
      const ssize_t k = ::recv(fds[i].fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
      if (k > 0) continue;  // not expected; leave it
      gone[node[i]] = true;
      set_lost(follower_names_[node[i]] +
               " closed its step connection: the node exited or was killed");
    }
  }
}

Status NodeGroup::send_step(const std::string& payload) {
  if (auto why = lost(); !why.empty()) return make_error(ErrorCode::kUnavailable, why);
  const auto deadline = dist::deadline_in(spec_.timeout_s);
  const FrameHead h{kStep, 0, payload.size()};
  for (size_t n = 1; n < followers_.size(); ++n) {
    Status st = dist::send_all(followers_[n], &h, sizeof h, deadline, follower_names_[n]);
    if (st)
      st = dist::send_all(followers_[n], payload.data(), payload.size(), deadline,
                          follower_names_[n]);
    if (!st) {
      set_lost(st.error().message + " (the node is lost)");
      return st;
    }
  }
  return {};
}

void NodeGroup::send_shutdown() {
  const auto deadline = dist::deadline_in(5.0);
  const FrameHead h{kShutdown, 0, 0};
  for (size_t n = 1; n < followers_.size(); ++n)
    if (followers_[n].valid())
      (void)dist::send_all(followers_[n], &h, sizeof h, deadline, follower_names_[n]);
}

Status NodeGroup::next_step(std::string* payload, bool* shutdown) {
  *shutdown = false;
  const auto forever = dist::deadline_in(0);
  const std::string what = "node 0 (" + spec_.master_addr + ")";
  FrameHead h{};
  Status st = dist::recv_all(leader_, &h, sizeof h, forever, what);
  if (st && h.type == kStep) {
    payload->resize(h.bytes);
    st = dist::recv_all(leader_, payload->data(), payload->size(), forever, what);
  }
  if (!st) {
    return make_error(ErrorCode::kUnavailable,
                      st.error().message +
                          " without a shutdown: node 0 exited or was killed, or the network "
                          "failed");
  }
  if (h.type == kShutdown) {
    *shutdown = true;
    return {};
  }
  if (h.type != kStep)
    return make_error(ErrorCode::kFormat, "node 0 sent an unknown frame " + std::to_string(h.type));
  return {};
}

// ------------------------------------------------------------------ node 0's backend

namespace {

class LeaderBackend final : public ForwardBackend {
 public:
  LeaderBackend(std::unique_ptr<ForwardBackend> local, std::unique_ptr<NodeGroup> group)
      : local_(std::move(local)), group_(std::move(group)) {}
  ~LeaderBackend() override {
    group_->send_shutdown();  // the other nodes exit 0 on it
    local_.reset();
  }

  const M3Config& config() const override { return local_->config(); }
  int64_t num_pages() const override { return local_->num_pages(); }
  bool samples_on_device() const override { return local_->samples_on_device(); }
  std::string device_name() const override {
    return local_->device_name() + " on node 0 of " + std::to_string(group_->spec().nnodes) +
           " nodes";
  }
  std::string kv_cache_flag() const override { return local_->kv_cache_flag(); }
  int num_kv_partitions() const override { return local_->num_kv_partitions(); }
  std::string speculative_refusal() const override {
    return "speculative decoding over several nodes (--nnodes) is refused: the draft and its "
           "verification run on one process's ranks only; serve --speculative-config on one "
           "node (--tensor-parallel-size within it)";
  }
  bool supports_image_input() const override { return local_->supports_image_input(); }
  std::string image_refusal() const override { return local_->image_refusal(); }
  void encode_images(std::span<const model::VisionImage> images,
                     std::vector<float>* embeds) override {
    local_->encode_images(images, embeds);
  }
  std::string fault() const override {
    if (std::string why = group_->lost(); !why.empty()) return why;
    return local_->fault();
  }

  void forward(const ForwardBatch& batch, ForwardResult* out, bool capture_msa) override {
    // A lost node: nothing runs (the runner sees fault() and drops the step).
    if (!fault().empty()) return;
    if (!group_->send_step(encode_step(batch, capture_msa))) return;
    local_->forward(batch, out, capture_msa);
  }

 private:
  std::unique_ptr<ForwardBackend> local_;
  std::unique_ptr<NodeGroup> group_;
};

}  // namespace

std::unique_ptr<ForwardBackend> make_leader_backend(std::unique_ptr<ForwardBackend> local,
                                                    std::unique_ptr<NodeGroup> group) {
  return std::make_unique<LeaderBackend>(std::move(local), std::move(group));
}

Status run_headless(ForwardBackend& local, NodeGroup& group) {
  std::string payload;
  ForwardBatch batch;
  ForwardResult scratch;
  int64_t steps = 0;
  for (;;) {
    bool shutdown = false;
    M3_TRY_STATUS(group.next_step(&payload, &shutdown));
    if (shutdown) {
      M3_LOG_INFO("node %d: node 0 shut down after %lld steps; exiting", group.spec().node_rank,
                  static_cast<long long>(steps));
      return {};
    }
    bool capture_msa = false;
    batch = ForwardBatch{};
    M3_TRY_STATUS(decode_step(payload, &batch, &capture_msa));
    local.forward(batch, &scratch, capture_msa);
    ++steps;
    if (std::string why = local.fault(); !why.empty()) {
      return make_error(ErrorCode::kUnavailable, "node " + std::to_string(group.spec().node_rank) +
                                                     "'s ranks lost the group: " + why);
    }
  }
}

}  // namespace m3::runtime
