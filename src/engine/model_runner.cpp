#include "engine/model_runner.h"

#include "core/check.h"

namespace m3::engine {

namespace {
TokenLogprobOut to_out(const TokenLogprob& lp) {
  TokenLogprobOut o;
  o.token = lp.token;
  o.logprob = lp.logprob;
  o.top = lp.top;
  return o;
}
}  // namespace

ModelRunner::ModelRunner(std::unique_ptr<model::ForwardBackend> backend, int64_t num_sampleable)
    : backend_(std::move(backend)), num_sampleable_(num_sampleable) {
  M3_CHECK(backend_ != nullptr);
}

sched::RunnerOutput ModelRunner::execute(
    const sched::SchedulerOutput& out, std::unordered_map<uint64_t, RunnerRequestState>& states) {
  model::ForwardBatch b;
  // Logits rows wanted per scheduled request: prompt-logprob rows (position -> row), and the
  // sampling row (-1 when the request does not sample this step).
  struct Want {
    std::vector<std::pair<int, int32_t>> prompt_rows;
    int32_t sample_row = -1;
  };
  std::vector<Want> want(out.requests.size());
  b.block_table_offsets.push_back(0);
  for (size_t i = 0; i < out.requests.size(); ++i) {
    const sched::ScheduledRequest& r = out.requests[i];
    auto it = states.find(r.request_id);
    M3_CHECK(it != states.end(), "runner: no state for request %llu",
             (unsigned long long)r.request_id);
    const RunnerRequestState& st = it->second;
    b.block_table.insert(b.block_table.end(), r.block_ids.begin(), r.block_ids.end());
    b.block_table_offsets.push_back(static_cast<int32_t>(b.block_table.size()));
    const int n = r.num_new_tokens();
    for (int j = 0; j < n; ++j) {
      const int32_t t = static_cast<int32_t>(b.token_ids.size());
      const int pos = r.start_idx + j;
      // Row at `pos` scores prompt token pos+1 (prompt logprobs), once per request.
      if (st.params.prompt_logprobs >= 0 && pos < st.num_prompt_tokens - 1 &&
          pos + 1 > st.prompt_logprobs_filled) {
        want[i].prompt_rows.push_back({pos, static_cast<int32_t>(b.logits_indices.size())});
        b.logits_indices.push_back(t);
      }
      if (j == n - 1 && r.will_sample) {
        want[i].sample_row = static_cast<int32_t>(b.logits_indices.size());
        b.logits_indices.push_back(t);
      }
      b.token_ids.push_back(r.token_ids[j]);
      b.positions.push_back(pos);
      b.seq_ids.push_back(static_cast<int32_t>(i));
    }
  }
  model::ForwardResult res;
  backend_->forward(b, &res, /*capture_msa=*/false);
  const int64_t V = res.vocab_size;

  sched::RunnerOutput ro;
  for (size_t i = 0; i < out.requests.size(); ++i) {
    const sched::ScheduledRequest& r = out.requests[i];
    RunnerRequestState& st = states.at(r.request_id);
    st.step_logprobs.clear();
    for (const auto& [pos, row] : want[i].prompt_rows) {
      std::span<const float> lr(res.logits.data() + static_cast<int64_t>(row) * V, V);
      st.prompt_logprobs[pos + 1] =
          to_out(Sampler::logprobs(lr, st.history[pos + 1], st.params.prompt_logprobs));
      st.prompt_logprobs_filled = pos + 1;
    }
    if (want[i].sample_row < 0) continue;
    std::span<float> lr(res.logits.data() + static_cast<int64_t>(want[i].sample_row) * V, V);
    std::vector<float> raw;
    if (st.params.logprobs >= 0) raw.assign(lr.begin(), lr.end());
    std::span<const int32_t> gen(st.history.data() + st.num_prompt_tokens,
                                 st.history.size() - st.num_prompt_tokens);
    const int32_t tok = Sampler::sample(lr, st.params, st.history, gen, st.rng, num_sampleable_);
    if (st.params.logprobs >= 0)
      st.step_logprobs.push_back(to_out(Sampler::logprobs(raw, tok, st.params.logprobs)));
    st.history.push_back(tok);
    ro.sampled.push_back({r.request_id, {tok}});
  }
  return ro;
}

}  // namespace m3::engine
