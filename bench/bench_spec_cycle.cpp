// Where a speculative-decoding cycle's time goes: C greedy requests of a target with an EAGLE-3
// draft at synthetic acceptance 2.78 (so the cycle's shape does not depend on the draft's quality)
// through the scheduler and the model runner as the engine loop drives them, each decode cycle
// split into scheduling, the target's forward (a timing wrapper around the backend; on the GPU it
// returns once the step and its copies to the host are done), the draft's proposals (a wrapper
// around the draft: the context pass and K - 1 draft steps, returning with the device idle), the
// runner's own host work (building the batch, verification, the draft's inputs) and the
// scheduler's update. Each C runs twice: verification as the backend allows (greedy verify rows
// drawn by its sampler, only ids back) and with every logits row to the host (a backend that
// reports no device sampling: what every verify step did before device verification).
// CPU: bench_spec_cycle MODEL_DIR DRAFT_DIR [C=16] [K=3] [max_tokens=64]; then also the host
//      verification of 4 x C rows at M3's vocabulary (200,064) alone.
// GPU: bench_spec_cycle --cuda synthetic:layers=N synthetic:mha|gqa [C list=1,16,64] [K=3]
//      [max_tokens=128] (prompt 32 tokens, as bench/bench_serve.py), GEMMs in bf16 as `serve`
//      runs them by default (M3_BENCH_GEMM=exact: the split-exact GEMMs). Each C runs once
//      unmeasured (its shapes: GEMM plans, graphs), then with the draft steps in CUDA graphs,
//      then eagerly; the draft's device time comes in parts (CUDA
//      events: staging copy, context pass, draft steps; host share = wall - device span), and
//      the same requests run once without drafts (the plain decode step, for the ratio).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/log.h"
#include "engine/model_runner.h"
#include "engine/sampler.h"
#include "engine/spec_decode.h"
#include "model/eagle3_draft.h"
#include "model/m3_model.h"
#include "runtime/forward_backend.h"
#include "sched/scheduler.h"
#ifdef M3_BENCH_CUDA
#include "kernels/cuda/ops.h"
#include "model/cuda/eagle3_draft_cuda.h"
#include "runtime/cuda/cuda_backend.h"
#endif

using Clock = std::chrono::steady_clock;
using namespace m3;

namespace {

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

// The CPU backend with its forward() timed; the rest passes through.
class TimedBackend final : public runtime::ForwardBackend {
 public:
  explicit TimedBackend(std::unique_ptr<runtime::ForwardBackend> b)
      : owned_(std::move(b)), b_(owned_.get()) {}
  // Over another's backend (a second runner without drafts over the same device and pool).
  explicit TimedBackend(runtime::ForwardBackend* b) : b_(b) {}
  // true: reports no device sampling, so the runner takes every logits row to the host.
  bool host_only = false;
  const model::M3Config& config() const override { return b_->config(); }
  int64_t num_pages() const override { return b_->num_pages(); }
  void forward(const model::ForwardBatch& batch, model::ForwardResult* out,
               bool capture_msa) override {
    const auto t0 = Clock::now();
    b_->forward(batch, out, capture_msa);
    ms += ms_since(t0);
    host_rows += static_cast<int64_t>(out->logits.size() / std::max<int64_t>(out->vocab_size, 1));
    device_rows += static_cast<int64_t>(batch.device_samples.size());
  }
  bool samples_on_device() const override { return !host_only && b_->samples_on_device(); }
  std::string device_name() const override { return b_->device_name(); }
  std::string kv_cache_flag() const override { return b_->kv_cache_flag(); }
  std::string speculative_refusal() const override { return b_->speculative_refusal(); }
  Result<std::unique_ptr<model::DraftProposer>> make_draft(
      const std::string& model, std::shared_ptr<const model::M3Weights> w) override {
    return b_->make_draft(model, std::move(w));
  }
  double ms = 0;
  int64_t host_rows = 0, device_rows = 0;  // logits rows returned / sampled by the backend

 private:
  std::unique_ptr<runtime::ForwardBackend> owned_;
  runtime::ForwardBackend* b_;
};

class TimedDraft final : public model::DraftProposer {
 public:
  explicit TimedDraft(std::unique_ptr<model::DraftProposer> d) : d_(std::move(d)) {}
  const model::Eagle3Config& config() const override { return d_->config(); }
  int64_t kv_bytes_per_token() const override { return d_->kv_bytes_per_token(); }
  std::string where() const override { return d_->where(); }
  bool aux_on_device() const override { return d_->aux_on_device(); }
  std::vector<std::vector<int32_t>> propose(const std::vector<model::DraftSeq>& seqs,
                                            std::span<const float> aux, int k) override {
    const auto t0 = Clock::now();
    auto out = d_->propose(seqs, aux, k);
    ms += ms_since(t0);
    return out;
  }
  double ms = 0;

 private:
  std::unique_ptr<model::DraftProposer> d_;
};

// C greedy requests of prompt_len random ids and max_tokens outputs through a scheduler and a
// runner over `tb` (which the runner owns from here) and the draft `td`; prints the decode
// cycles' split. The backend and draft keep their KV between calls (fresh requests each time).
struct Setup {
  TimedBackend* tb = nullptr;
  TimedDraft* td = nullptr;
  std::unique_ptr<engine::ModelRunner> runner;
  std::unique_ptr<engine::ModelRunner> plain_runner;  // no drafts, over the same backend (GPU)
  int num_pages = 0, max_model_len = 0;
#ifdef M3_BENCH_CUDA
  model::Eagle3DraftCuda* dev_draft = nullptr;  // the GPU draft (its graphs and profile)
#endif
  bool plain = false;  // this run through plain_runner: plain decode steps, no draft
};

void run_cycles(Setup& su, int C, int K, int prompt_len, int max_tokens, const char* label) {
  engine::ModelRunner& runner = su.plain ? *su.plain_runner : *su.runner;
  const model::M3Config& cfg = runner.backend().config();
  const int bs = static_cast<int>(cfg.sparse_block_size);
  sched::SchedulerConfig scfg;
  scfg.max_num_seqs = C;
  scfg.max_num_batched_tokens = std::max(2048, C * prompt_len);
  scfg.max_model_len = su.max_model_len;
  scfg.block_size = bs;
  scfg.num_blocks = su.num_pages;
  scfg.enable_prefix_caching = false;
  scfg.num_lookahead_tokens = su.plain ? 0 : K;
  sched::Scheduler sched(scfg);
  std::unordered_map<uint64_t, engine::RunnerRequestState> states;
  std::mt19937 g(7 + C);
  std::uniform_int_distribution<int32_t> tok(10, 2600);  // ids every vocabulary here has
  static uint64_t next_id = 1;
  for (int i = 0; i < C; ++i) {
    std::vector<int32_t> prompt(prompt_len);
    for (auto& t : prompt) t = tok(g);
    sched::StopCriteria stop;
    stop.max_tokens = max_tokens;
    stop.ignore_eos = true;
    const uint64_t id = next_id++;
    if (!sched.add_request(std::make_unique<sched::Request>(id, prompt, stop))) std::exit(1);
    engine::RunnerRequestState st;
    st.params.temperature = 0.f;
    st.params.max_tokens = max_tokens;
    st.seed = id;
    st.history = prompt;
    st.num_prompt_tokens = prompt_len;
    states.emplace(id, std::move(st));
  }
  TimedBackend* tb = su.tb;
  TimedDraft* td = su.td;
  const engine::SpecDecodeStats s0 =
      su.plain ? engine::SpecDecodeStats{} : runner.spec_decoder()->stats();
#ifdef M3_BENCH_CUDA
  if (su.dev_draft != nullptr) su.dev_draft->reset_profile();
#endif
  // Decode cycles only (every request past its prompt): the prefill steps are left out.
  double t_sched = 0, t_exec = 0, t_update = 0, t_fwd = 0, t_draft = 0;
  int64_t steps = 0, tokens = 0, rows_host = 0, rows_dev = 0;
  // Cycles with all C requests still running (what one request's TPOT sees; the run's tail,
  // where random acceptance lets some finish first, has fewer and cheaper rows).
  double full_ms = 0;
  int64_t full_steps = 0, full_tokens = 0;
  while (sched.has_unfinished()) {
    auto t0 = Clock::now();
    sched::SchedulerOutput so = sched.schedule();
    const double s_ms = ms_since(t0);
    bool decode = !so.requests.empty();
    for (const auto& r : so.requests) decode = decode && r.start_idx >= prompt_len;
    const double f0 = tb->ms, d0 = td->ms;
    const int64_t h0 = tb->host_rows, v0 = tb->device_rows;
    t0 = Clock::now();
    sched::RunnerOutput ro;
    if (!so.empty()) ro = runner.execute(so, states);
    const double e_ms = ms_since(t0);
    t0 = Clock::now();
    const auto updates = sched.update_from_output(so, ro);
    const double u_ms = ms_since(t0);
    if (!decode) continue;
    ++steps;
    t_sched += s_ms;
    t_exec += e_ms;
    t_update += u_ms;
    t_fwd += tb->ms - f0;
    t_draft += td->ms - d0;
    rows_host += tb->host_rows - h0;
    rows_dev += tb->device_rows - v0;
    int64_t step_tokens = 0;
    for (const auto& u : updates) step_tokens += static_cast<int64_t>(u.new_token_ids.size());
    tokens += step_tokens;
    if (static_cast<int>(so.requests.size()) == C) {
      ++full_steps;
      full_tokens += step_tokens;
      full_ms += s_ms + e_ms + u_ms;
    }
  }
  const engine::SpecDecodeStats ss =
      su.plain ? engine::SpecDecodeStats{} : runner.spec_decoder()->stats();
  const double total = t_sched + t_exec + t_update;
  const double per = 1.0 / static_cast<double>(std::max<int64_t>(steps, 1));
  const double tok_per_req = static_cast<double>(tokens) * per / C;
  std::printf(
      "%s, C=%d: %lld decode cycles, %.2f tokens per request per cycle (acceptance "
      "length %.2f), %.3f ms per cycle = %.3f ms per output token of a request\n",
      label, C, static_cast<long long>(steps), tok_per_req,
      1.0 + static_cast<double>(ss.num_accepted_tokens - s0.num_accepted_tokens) /
                static_cast<double>(std::max<int64_t>(ss.num_drafts - s0.num_drafts, 1)),
      total * per, total * per / std::max(tok_per_req, 1e-9));
  auto line = [&](const char* what, double ms) {
    std::printf("  %-46s %8.3f ms/cycle %5.1f%%\n", what, ms * per,
                100.0 * ms / std::max(total, 1e-9));
  };
  line("schedule", t_sched);
  line("target forward (1 + K tokens per request)", t_fwd);
  line("draft proposals (context pass + K - 1 steps)", t_draft);
  line("runner host work (batch, verification)", t_exec - t_fwd - t_draft);
  line("scheduler update", t_update);
  std::printf("  logits rows per cycle: %.1f to the host, %.1f sampled by the backend\n",
              static_cast<double>(rows_host) * per, static_cast<double>(rows_dev) * per);
  if (full_steps > 0) {
    const double fpt = static_cast<double>(full_tokens) / static_cast<double>(full_steps) / C;
    std::printf(
        "  cycles with all %d requests running: %lld, %.3f ms each, %.2f tokens per request = "
        "%.3f ms per output token (a request's TPOT)\n",
        C, static_cast<long long>(full_steps), full_ms / static_cast<double>(full_steps), fpt,
        full_ms / static_cast<double>(full_steps) / std::max(fpt, 1e-9));
  }
#ifdef M3_BENCH_CUDA
  if (su.dev_draft != nullptr && su.dev_draft->profile().calls > 0) {
    const auto& p = su.dev_draft->profile();
    const double pc = 1.0 / static_cast<double>(p.calls);
    std::printf(
        "  draft on the device, per propose() (%lld calls, %.2f draft steps each, graphs %s): "
        "staging copy %.3f, context pass %.3f, draft steps %.3f ms (device span %.3f, host-only "
        "%.3f of the %.3f ms call); graph replays %lld, captures %lld so far\n",
        static_cast<long long>(p.calls), static_cast<double>(p.draft_steps) * pc,
        su.dev_draft->use_graphs() ? "on" : "off", p.stage_ms * pc, p.context_ms * pc,
        p.steps_ms * pc, p.span_ms * pc, (p.wall_ms - p.span_ms) * pc, p.wall_ms * pc,
        static_cast<long long>(su.dev_draft->graph_replays()),
        static_cast<long long>(su.dev_draft->graph_captures()));
  }
#endif
}

// The host verification of every verify row at M3's vocabulary, as it ran before device
// verification: a fresh [4C, V] result per step (ForwardResult is per step), then a greedy
// sample of each row.
void host_verify_alone(int C, int K) {
  const int64_t V = 200064, R = static_cast<int64_t>(C) * (K + 1);
  std::mt19937 g(11);
  std::vector<float> src(static_cast<size_t>(V));
  std::normal_distribution<float> nd(0.f, 3.f);
  for (auto& x : src) x = nd(g);
  engine::SamplingParams p;
  p.temperature = 0.f;
  std::vector<int32_t> hist(8, 1);
  double t_alloc = 0, t_sample = 0;
  const int reps = 5;
  int64_t sink = 0;
  for (int rep = 0; rep < reps; ++rep) {
    auto t0 = Clock::now();
    std::vector<float> logits;
    logits.resize(static_cast<size_t>(R * V));  // the result vector, zeroed on first touch
    for (int64_t r = 0; r < R; ++r) std::copy(src.begin(), src.end(), logits.begin() + r * V);
    t_alloc += ms_since(t0);
    t0 = Clock::now();
    for (int64_t r = 0; r < R; ++r) {
      engine::SampleRng rng{1, static_cast<uint64_t>(r)};
      sink += engine::Sampler::sample(
          std::span<float>(logits.data() + r * V, static_cast<size_t>(V)), p, hist, {}, rng, V);
    }
    t_sample += ms_since(t0);
  }
  std::printf("host verification of %lld rows x %lld vocab (%.1f MB of logits), per cycle:\n",
              static_cast<long long>(R), static_cast<long long>(V), R * V * 4.0 / 1e6);
  std::printf("  %-46s %8.3f ms\n", "fresh result vector + writing the rows", t_alloc / reps);
  std::printf("  %-46s %8.3f ms\n", "greedy Sampler::sample per row", t_sample / reps);
  if (sink == -1) std::printf("?");
}

engine::SpeculativeConfig spec_config(const std::string& draft, int K) {
  engine::SpeculativeConfig sc;
  sc.method = "eagle3";
  sc.model = draft;
  sc.num_speculative_tokens = K;
  sc.synthetic = true;
  sc.synthetic_acceptance_length = 2.78;
  return sc;
}

void run_both(Setup& su, int C, int K, int prompt_len, int max_tokens) {
  su.tb->host_only = false;
  run_cycles(su, C, K, prompt_len, max_tokens, "verify on the backend's sampler");
  su.tb->host_only = true;
  run_cycles(su, C, K, prompt_len, max_tokens, "every logits row to the host");
  su.tb->host_only = false;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc >= 2 && std::string(argv[1]) == "--cuda") {
#ifdef M3_BENCH_CUDA
    if (argc < 4) {
      std::fprintf(stderr,
                   "usage: bench_spec_cycle --cuda synthetic:layers=N synthetic:gqa "
                   "[C list=1,16,64] [K=3] [max_tokens=128]\n");
      return 2;
    }
    const std::string target = argv[2], draft = argv[3];
    std::vector<int> cs;
    for (const char* c = argc > 4 ? argv[4] : "1,16,64"; *c != 0;) {
      cs.push_back(std::atoi(c));
      while (*c != 0 && *c != ',') ++c;
      if (*c == ',') ++c;
    }
    const int K = argc > 5 ? std::atoi(argv[5]) : 3;
    const int max_tokens = argc > 6 ? std::atoi(argv[6]) : 128;
    const int prompt_len = 32;
    const char* gemm = std::getenv("M3_BENCH_GEMM");
    const bool exact = gemm != nullptr && std::string(gemm) == "exact";
    kernels::cuda::set_gemm_precision(exact ? kernels::cuda::GemmPrecision::kExact
                                            : kernels::cuda::GemmPrecision::kBf16);
    auto m = model::M3Model::load(target);
    if (!m) {
      std::fprintf(stderr, "%s\n", m.error().message.c_str());
      return 1;
    }
    runtime::CudaBackendOptions opts;
    opts.gpu_memory_utilization = 0.5;
    opts.draft_model = draft;
    opts.warmup_tokens = 2048;
    auto b = runtime::make_cuda_backend(std::move(*m), opts);
    if (!b) {
      std::fprintf(stderr, "%s\n", b.error().message.c_str());
      return 1;
    }
    auto tbo = std::make_unique<TimedBackend>(std::move(*b));
    auto d = tbo->make_draft(draft, nullptr);
    if (!d) {
      std::fprintf(stderr, "%s\n", d.error().message.c_str());
      return 1;
    }
    Setup su;
    su.tb = tbo.get();
    su.dev_draft = dynamic_cast<model::Eagle3DraftCuda*>(d->get());
    if (su.dev_draft != nullptr) su.dev_draft->set_profile(true);
    auto tdo = std::make_unique<TimedDraft>(std::move(*d));
    su.td = tdo.get();
    su.num_pages = static_cast<int>(std::min<int64_t>(tbo->num_pages(), 1 << 20));
    su.max_model_len = prompt_len + max_tokens + 128;
    auto spec = std::make_unique<engine::SpecDecoder>(spec_config(draft, K), std::move(tdo));
    std::printf(
        "bench_spec_cycle: %s + %s on %s, K=%d, synthetic acceptance 2.78, greedy, "
        "prompt %d, %d output tokens, GEMMs %s\n",
        target.c_str(), draft.c_str(), tbo->device_name().c_str(), K, prompt_len, max_tokens,
        exact ? "split-exact" : "bf16 (serve's default)");
    su.plain_runner = std::make_unique<engine::ModelRunner>(std::make_unique<TimedBackend>(su.tb),
                                                            200064, nullptr, su.max_model_len);
    su.runner = std::make_unique<engine::ModelRunner>(std::move(tbo), 200064, std::move(spec),
                                                      su.max_model_len);
    run_cycles(su, 1, K, prompt_len, 16, "warm-up");  // graphs and plans of the first sizes
    for (int C : cs) {
      // An unmeasured pass first: the shapes of this C (the context pass's and the verify step's
      // token counts, GEMM plans, graphs) are then seen, so the runs below compare warm steps.
      run_cycles(su, C, K, prompt_len, max_tokens, "warm-up (shapes of this C, graphs captured)");
      run_cycles(su, C, K, prompt_len, max_tokens, "draft steps in CUDA graphs");
      if (su.dev_draft != nullptr) {
        su.dev_draft->set_use_graphs(false);
        run_cycles(su, C, K, prompt_len, max_tokens, "draft steps eager");
        su.dev_draft->set_use_graphs(true);
      }
      su.plain = true;
      run_cycles(su, C, K, prompt_len, max_tokens, "no drafts (plain decode, verify-free)");
      su.plain = false;
    }
    return 0;
#else
    std::fprintf(stderr, "bench_spec_cycle: built without CUDA (--cuda needs -DM3_CUDA=ON)\n");
    return 2;
#endif
  }
  if (argc < 3) {
    std::fprintf(stderr,
                 "usage: bench_spec_cycle MODEL_DIR DRAFT_DIR [C=16] [K=3] [max_tokens=64]\n"
                 "       bench_spec_cycle --cuda synthetic:layers=N synthetic:gqa [C list] [K] "
                 "[max_tokens]\n");
    return 2;
  }
  const std::string model_dir = argv[1], draft_dir = argv[2];
  const int C = argc > 3 ? std::atoi(argv[3]) : 16;
  const int K = argc > 4 ? std::atoi(argv[4]) : 3;
  const int max_tokens = argc > 5 ? std::atoi(argv[5]) : 64;
  const int prompt_len = 64;
  auto m = model::M3Model::load(model_dir);
  if (!m) {
    std::fprintf(stderr, "%s\n", m.error().message.c_str());
    return 1;
  }
  const model::M3Config& cfg = (*m)->config();
  const int bs = static_cast<int>(cfg.sparse_block_size);
  Setup su;
  su.max_model_len = prompt_len + max_tokens + 2 * bs;
  su.num_pages = 2 * C * ((su.max_model_len + bs - 1) / bs + 1);  // both runs' requests
  auto draft = model::Eagle3Draft::load(draft_dir, cfg, (*m)->base_weights(), su.num_pages);
  if (!draft) {
    std::fprintf(stderr, "%s\n", draft.error().message.c_str());
    return 1;
  }
  auto tdo = std::make_unique<TimedDraft>(model::host_draft_proposer(std::move(*draft)));
  su.td = tdo.get();
  auto spec = std::make_unique<engine::SpecDecoder>(spec_config(draft_dir, K), std::move(tdo));
  auto tbo = std::make_unique<TimedBackend>(runtime::borrow_cpu_backend(**m, su.num_pages));
  su.tb = tbo.get();
  std::printf(
      "bench_spec_cycle: %s + %s on the CPU, K=%d, synthetic acceptance 2.78, greedy, "
      "prompt %d, %d output tokens, vocab %lld\n",
      model_dir.c_str(), draft_dir.c_str(), K, prompt_len, max_tokens,
      static_cast<long long>(cfg.vocab_size));
  su.runner = std::make_unique<engine::ModelRunner>(std::move(tbo), cfg.vocab_size, std::move(spec),
                                                    su.max_model_len);
  run_both(su, C, K, prompt_len, max_tokens);
  host_verify_alone(C, K);
  return 0;
}
