#include "engine/model_runner.h"

#include <algorithm>
#include <thread>

#include "core/check.h"

namespace m3::engine {

namespace {
TokenLogprobOut to_out(const TokenLogprob& lp) {
  TokenLogprobOut o;
  o.token = lp.token;
  o.logprob = lp.logprob;
  o.rank = lp.rank;
  o.top = lp.top;
  return o;
}

// Speculative decoding under a constraint: feeds `drafts` to `c` in order up to the first it
// refuses (or once it is complete), calling taken(j) after draft j went in, then steps `c` back
// over them. Returns how many it took. `c` must be able to roll back.
template <class F>
size_t take_drafts(TokenConstraint& c, const std::vector<int32_t>& drafts, F taken) {
  size_t n = 0;
  while (n < drafts.size() && !c.is_terminated() && c.accept(drafts[n])) taken(n++);
  if (n > 0) c.rollback(static_cast<int>(n));
  return n;
}
}  // namespace

ModelRunner::ModelRunner(std::unique_ptr<runtime::ForwardBackend> backend, int64_t num_sampleable,
                         std::unique_ptr<SpecDecoder> spec, int max_model_len)
    : backend_(std::move(backend)),
      num_sampleable_(num_sampleable),
      spec_(std::move(spec)),
      max_model_len_(max_model_len) {
  M3_CHECK(backend_ != nullptr);
}

void ModelRunner::copy_host_kv_pages(const sched::SchedulerOutput& out) {
  if (out.kv_offloads.empty() && out.kv_restores.empty()) return;
  // The host tier's copies come first: offloaded pages are rewritten by this step's forward,
  // restored ones are read by it. (A GPU backend enqueues them on its copy stream, after the
  // steps launched before, and the step's layers wait for them.)
  auto convert = [](const std::vector<sched::KvPageCopy>& in) {
    std::vector<runtime::HostPageCopy> c;
    c.reserve(in.size());
    for (const auto& x : in) c.push_back({x.device_page, x.host_slot});
    return c;
  };
  const auto offloads = convert(out.kv_offloads);
  const auto restores = convert(out.kv_restores);
  backend_->copy_host_kv_pages(offloads, restores);
}

sched::RunnerOutput ModelRunner::execute(const sched::SchedulerOutput& out,
                                         std::unordered_map<uint64_t, RunnerRequestState>& states) {
  copy_host_kv_pages(out);
  if (out.requests.empty()) return {};
  LaunchedStep step;
  prepare(step, out, states, /*async=*/false);
  model::ForwardResult res;
  backend_->forward(step.batch, &res, /*capture_msa=*/false);
  if (!backend_->fault().empty()) return {};  // no usable result: the engine fails the step
  return finish_with(step, out, res, states);
}

std::unique_ptr<LaunchedStep> ModelRunner::launch(
    sched::SchedulerOutput out, std::unordered_map<uint64_t, RunnerRequestState>& states) {
  M3_CHECK(!out.requests.empty(), "runner: launch() of a step without requests");
  auto step = std::make_unique<LaunchedStep>();
  step->out = std::move(out);
  copy_host_kv_pages(step->out);  // first: a GPU's copies run while the batch is prepared
  prepare(*step, step->out, states, /*async=*/true);
  backend_->launch(step->batch);
  step->launched = true;
  // What the next launch's placeholders read.
  last_slots_.clear();
  for (size_t i = 0; i < step->out.requests.size(); ++i)
    if (step->device_slot[i] >= 0)
      last_slots_[step->out.requests[i].request_id] = step->device_slot[i];
  return step;
}

sched::RunnerOutput ModelRunner::finish(LaunchedStep& step,
                                        std::unordered_map<uint64_t, RunnerRequestState>& states) {
  M3_CHECK(step.launched, "runner: finish() of a step that was not launched");
  model::ForwardResult res;
  backend_->collect(&res);
  step.launched = false;
  if (!backend_->fault().empty()) return {};  // no usable result: the engine fails the step
  return finish_with(step, step.out, res, states);
}

void ModelRunner::prepare(LaunchedStep& step, const sched::SchedulerOutput& out,
                          std::unordered_map<uint64_t, RunnerRequestState>& states, bool async) {
  model::ForwardBatch& b = step.batch;
  using Want = LaunchedStep::Want;
  std::vector<Want>& want = step.want;
  want.assign(out.requests.size(), Want{});
  b.block_table_offsets.push_back(0);
  if (spec_) {
    b.aux_layers = spec_->aux_layers();
    b.aux_on_device = spec_->aux_on_device();  // the device draft reads them where they are
  }
  for (size_t i = 0; i < out.requests.size(); ++i) {
    const sched::ScheduledRequest& r = out.requests[i];
    auto it = states.find(r.request_id);
    M3_CHECK(it != states.end(), "runner: no state for request %llu",
             (unsigned long long)r.request_id);
    RunnerRequestState& st = it->second;
    b.block_table.insert(b.block_table.end(), r.block_ids.begin(), r.block_ids.end());
    b.block_table_offsets.push_back(static_cast<int32_t>(b.block_table.size()));
    const int n = r.num_new_tokens();
    const int k = r.num_spec_tokens;
    M3_CHECK(k == 0 || (spec_ && r.will_sample && k < n), "runner: %d draft tokens of %d", k, n);
    want[i].first_token = static_cast<int>(b.token_ids.size());
    for (int j = 0; j < n; ++j) {
      const int32_t t = static_cast<int32_t>(b.token_ids.size());
      const int pos = r.start_idx + j;
      if (k > 0 && j >= n - 1 - k) {
        // The last known token and the drafts: verified this step, one logits row each.
        if (j == n - 1 - k) want[i].sample_row = static_cast<int32_t>(b.logits_indices.size());
        want[i].verify_rows.push_back(static_cast<int32_t>(b.logits_indices.size()));
        b.logits_indices.push_back(t);
        b.token_ids.push_back(r.token_ids[j]);
        b.positions.push_back(pos);
        b.seq_ids.push_back(static_cast<int32_t>(i));
        continue;
      }
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
      if (r.token_ids[j] == sched::kPlaceholderToken) {
        // Sampled by the step in flight: the backend reads it from that step's samples.
        auto slot = last_slots_.find(r.request_id);
        M3_CHECK(async && slot != last_slots_.end(),
                 "runner: request %llu has an unknown token at %d but no sample in flight",
                 (unsigned long long)r.request_id, pos);
        b.prev_sample_tokens.push_back(t);
        b.prev_sample_slots.push_back(slot->second);
        b.token_ids.push_back(0);
      } else {
        b.token_ids.push_back(r.token_ids[j]);
      }
      b.positions.push_back(pos);
      b.seq_ids.push_back(static_cast<int32_t>(i));
    }
    // Image placeholder positions of this chunk take their embeddings from the tower, run over
    // the request's images the first time a chunk reaches one of them.
    const int64_t H = backend_->config().hidden_size;
    if (!st.images.empty()) {
      bool touches = false;
      for (const auto& [start, count] : st.image_spans)
        touches |= start < r.start_idx + n && start + count > r.start_idx;
      if (touches) {
        // Images in one tower call and videos in another (transformers' get_image_features /
        // get_video_features), then the rows back in prompt order.
        std::vector<model::VisionImage> imgs, vids;
        for (const ImageInput& im : st.images)
          (im.video ? vids : imgs).push_back({im.grid_t, im.grid_h, im.grid_w, im.patches.data()});
        std::vector<float> e_img, e_vid;
        if (!imgs.empty()) backend_->encode_images(imgs, &e_img);
        if (!vids.empty()) backend_->encode_images(vids, &e_vid);
        st.image_embeds.clear();
        size_t at_img = 0, at_vid = 0;
        for (const ImageInput& im : st.images) {
          const size_t len = static_cast<size_t>(im.num_tokens) * static_cast<size_t>(H);
          const std::vector<float>& src = im.video ? e_vid : e_img;
          size_t& at = im.video ? at_vid : at_img;
          M3_CHECK(at + len <= src.size(), "the tower returned fewer rows than tokens");
          st.image_embeds.insert(st.image_embeds.end(), src.begin() + static_cast<ptrdiff_t>(at),
                                 src.begin() + static_cast<ptrdiff_t>(at + len));
          at += len;
        }
        ++num_image_encodes_;
        st.images.clear();
        st.images.shrink_to_fit();
      }
    }
    int32_t emb_row = 0;
    for (const auto& [start, count] : st.image_spans) {
      const int lo = std::max(start, r.start_idx), hi = std::min(start + count, r.start_idx + n);
      M3_CHECK(lo >= hi || !st.image_embeds.empty(), "image positions without embeddings");
      for (int pos = lo; pos < hi; ++pos) {
        const int32_t t = static_cast<int32_t>(b.token_ids.size()) - n + (pos - r.start_idx);
        b.embed_rows.push_back(t);
        const float* src = st.image_embeds.data() + (emb_row + pos - start) * H;
        b.embed_values.insert(b.embed_values.end(), src, src + H);
      }
      emb_row += count;
    }
  }
  // Rows the device can sample (no penalties or logprobs need the raw row on the host); the
  // rest of the rows come back as logits. A request's verify rows are sampled there too when
  // its verification needs only the draw it would make without drafts at each row (greedy, or
  // synthetic acceptance): one device sample per row, consecutive from device_slot[i].
  const bool on_device = backend_->samples_on_device();
  std::vector<int32_t>& device_slot = step.device_slot;
  device_slot.assign(out.requests.size(), -1);
  for (size_t i = 0; i < out.requests.size(); ++i) {
    if (want[i].sample_row < 0) continue;
    const RunnerRequestState& st = states.at(out.requests[i].request_id);
    // (Drafts: the next step's tokens and drafts are decided on the host from this one's.)
    if (!on_device || st.params.needs_host_sampling() || st.constraint ||
        !want[i].verify_rows.empty())
      step.host_samples = true;
  }
  if (on_device) {
    b.num_sampleable = num_sampleable_;
    std::vector<bool> host_row(b.logits_indices.size(), false);
    for (size_t i = 0; i < out.requests.size(); ++i) {
      for (const auto& pr : want[i].prompt_rows) host_row[pr.second] = true;
      if (want[i].sample_row < 0) continue;
      RunnerRequestState& st = states.at(out.requests[i].request_id);
      const SamplingParams& p = st.params;
      const bool verifies = !want[i].verify_rows.empty();
      if (p.needs_host_sampling() || st.constraint || (verifies && !device_verifies(p))) {
        for (int32_t vr : want[i].verify_rows) host_row[vr] = true;
        host_row[want[i].sample_row] = true;
        continue;
      }
      // The output index of this token: the tokens the host has, and those still in flight.
      const uint64_t first = st.history.size() - static_cast<size_t>(st.num_prompt_tokens) +
                             static_cast<size_t>(st.num_pending_samples);
      device_slot[i] = static_cast<int32_t>(b.device_samples.size());
      if (verifies) {
        // Row j decides output index first + j (each accepted draft moves the next draw on).
        for (size_t j = 0; j < want[i].verify_rows.size(); ++j)
          b.device_samples.push_back(
              Sampler::draw_row(p, st.seed, first + j, want[i].verify_rows[j]));
        continue;
      }
      b.device_samples.push_back(Sampler::draw_row(p, st.seed, first, want[i].sample_row));
      ++st.num_pending_samples;
    }
    for (size_t r = 0; r < host_row.size(); ++r)
      if (host_row[r]) b.host_logits_rows.push_back(static_cast<int32_t>(r));
  }
  // The constraints' allowed sets for the rows sampled this step: they depend only on the tokens
  // accepted so far (and, for verify rows, the drafts before them), so a helper thread fills
  // them while the forward runs. One bitmask of mask_words per sampled row of a request with a
  // constraint: its sampling row at mask_at[i], verify row j at mask_at[i] + j.
  step.mask_words = (backend_->config().vocab_size + 31) / 32;
  step.mask_at.assign(out.requests.size(), -1);
  size_t num_masks = 0;
  for (size_t i = 0; i < out.requests.size(); ++i) {
    if (want[i].sample_row < 0) continue;
    const sched::ScheduledRequest& r = out.requests[i];
    RunnerRequestState& st = states.at(r.request_id);
    if (!st.constraint || st.constraint->is_terminated()) continue;
    LaunchedStep::Constrained c{st.constraint, {}};
    if (!want[i].verify_rows.empty()) {
      const int k = r.num_spec_tokens, n = r.num_new_tokens();
      M3_CHECK(st.constraint->can_rollback(), "runner: drafts for a constraint without rollback");
      c.drafts.assign(r.token_ids.begin() + (n - k), r.token_ids.begin() + n);
    }
    step.mask_at[i] = static_cast<int32_t>(num_masks);
    num_masks += 1 + c.drafts.size();
    step.constrained.push_back(std::move(c));
  }
  step.masks.assign(num_masks * static_cast<size_t>(step.mask_words), 0u);
  if (!step.constrained.empty()) {
    LaunchedStep* sp = &step;
    step.filler = std::thread([sp] {
      const size_t w = static_cast<size_t>(sp->mask_words);
      uint32_t* m = sp->masks.data();
      for (const LaunchedStep::Constrained& c : sp->constrained) {
        TokenConstraint& tc = *c.constraint;
        tc.fill_allowed(std::span<uint32_t>(m, w));
        // Verify row j + 1: the state after drafts 1..j + 1 (checked against the constraint when
        // they were proposed). Rows after a draft it refuses, or after one that completes it (its
        // end token: verification stops there), keep no allowed token.
        take_drafts(tc, c.drafts, [&](size_t j) {
          if (!tc.is_terminated()) tc.fill_allowed(std::span<uint32_t>(m + (j + 1) * w, w));
        });
        m += (1 + c.drafts.size()) * w;
      }
    });
  }
}

sched::RunnerOutput ModelRunner::finish_with(
    LaunchedStep& step, const sched::SchedulerOutput& out, model::ForwardResult& res,
    std::unordered_map<uint64_t, RunnerRequestState>& states) {
  if (step.filler.joinable()) step.filler.join();
  const model::ForwardBatch& b = step.batch;
  const std::vector<LaunchedStep::Want>& want = step.want;
  const std::vector<int32_t>& device_slot = step.device_slot;
  const std::vector<int32_t>& mask_at = step.mask_at;
  const int64_t mask_words = step.mask_words;
  const bool on_device = backend_->samples_on_device();
  const int64_t V = res.vocab_size;
  // Where logits row r (of logits_indices) sits in res.logits.
  std::vector<int32_t> row_at;
  if (!b.device_samples.empty()) {  // then res.logits holds exactly res.logits_rows
    row_at.assign(b.logits_indices.size(), -1);
    for (size_t j = 0; j < res.logits_rows.size(); ++j)
      row_at[res.logits_rows[j]] = static_cast<int32_t>(j);
  }
  auto logits_row = [&](int32_t r) {
    const int32_t at = row_at.empty() ? r : row_at[r];
    M3_CHECK(at >= 0, "runner: logits row %d was not copied to the host", r);
    return res.logits.data() + static_cast<int64_t>(at) * V;
  };
  M3_CHECK(res.sampled.size() == b.device_samples.size() || !on_device,
           "runner: backend sampled %zu of %zu rows", res.sampled.size(), b.device_samples.size());

  sched::RunnerOutput ro;
  for (size_t i = 0; i < out.requests.size(); ++i) {
    const sched::ScheduledRequest& r = out.requests[i];
    auto sit = states.find(r.request_id);
    if (sit == states.end()) continue;  // aborted, or finished by the step before (async)
    RunnerRequestState& st = sit->second;
    st.step_logprobs.clear();
    for (const auto& [pos, row] : want[i].prompt_rows) {
      std::span<const float> lr(logits_row(row), V);
      st.prompt_logprobs[pos + 1] =
          to_out(Sampler::logprobs(lr, st.history[pos + 1], st.params.prompt_logprobs));
      st.prompt_logprobs_filled = pos + 1;
    }
    if (want[i].sample_row < 0) continue;
    if (!want[i].verify_rows.empty()) {
      // Device-verified: the draw of each verify row came back (consecutive samples).
      const int32_t* drawn = device_slot[i] >= 0 ? res.sampled.data() + device_slot[i] : nullptr;
      auto allowed = [&](int j) {
        if (mask_at[i] < 0) return std::span<const uint32_t>();
        return std::span<const uint32_t>(step.masks.data() + (mask_at[i] + j) * mask_words,
                                         mask_words);
      };
      bool stop = false;
      auto toks = verify(r, want[i].verify_rows, st, logits_row, drawn, V, allowed, &stop);
      ro.sampled.push_back({r.request_id, std::move(toks), stop});
      continue;
    }
    if (device_slot[i] >= 0) {
      const int32_t tok = res.sampled[device_slot[i]];
      --st.num_pending_samples;
      st.history.push_back(tok);
      ro.sampled.push_back({r.request_id, {tok}});
      continue;
    }
    std::span<float> lr(logits_row(want[i].sample_row), V);
    std::vector<float> raw;
    if (st.params.logprobs >= 0) raw.assign(lr.begin(), lr.end());
    std::span<const int32_t> gen(st.history.data() + st.num_prompt_tokens,
                                 st.history.size() - st.num_prompt_tokens);
    SampleRng rng{st.seed, gen.size()};  // the draw the device would make for this token
    std::span<const uint32_t> allowed;
    if (mask_at[i] >= 0)
      allowed = std::span<const uint32_t>(step.masks.data() + mask_at[i] * mask_words, mask_words);
    bool none_allowed = false;
    const int32_t tok = Sampler::sample(lr, st.params, st.history, gen, rng, num_sampleable_,
                                        allowed, &none_allowed);
    if (st.params.logprobs >= 0)
      st.step_logprobs.push_back(to_out(Sampler::logprobs(raw, tok, st.params.logprobs)));
    st.history.push_back(tok);
    // A constraint that completed (or could take nothing more) ends the request as EOS would.
    bool stop = none_allowed;
    if (st.constraint) stop = !st.constraint->accept(tok) || st.constraint->is_terminated() || stop;
    ro.sampled.push_back({r.request_id, {tok}, stop});
  }
  if (spec_) propose(out, states, res, ro, [&](size_t i) { return want[i].first_token; });
  return ro;
}

bool ModelRunner::device_verifies(const SamplingParams& p) const {
  // Greedy: a draft is accepted iff it is the argmax; synthetic: accepted at random, else the
  // ordinary draw. Either needs the row's draw only, which the device sampler makes bit for bit
  // as the host would (no penalties or masks: needs_host_sampling() is false here).
  return spec_ != nullptr && (p.temperature <= 0.f || spec_->config().synthetic);
}

std::vector<int32_t> ModelRunner::verify(
    const sched::ScheduledRequest& r, const std::vector<int32_t>& rows, RunnerRequestState& st,
    const std::function<float*(int32_t)>& logits_row, const int32_t* drawn, int64_t V,
    const std::function<std::span<const uint32_t>(int)>& allowed, bool* stop) {
  const int k = r.num_spec_tokens, n = r.num_new_tokens();
  const SamplingParams& p = st.params;
  std::vector<int32_t> toks;
  std::vector<double> probs;
  int accepted = 0;
  *stop = false;
  for (int j = 0; j <= k; ++j) {
    std::span<const int32_t> gen(st.history.data() + st.num_prompt_tokens,
                                 st.history.size() - st.num_prompt_tokens);
    const uint64_t step = gen.size();  // the output index decided here, as without drafts
    const int32_t draft = j < k ? r.token_ids[n - k + j] : -1;
    // Benchmark mode: accepted at random whatever the target says.
    const bool synthetic_accept =
        draft >= 0 && spec_->config().synthetic &&
        kernels::cpu::sample_uniform(st.seed, step, V + 1) < spec_->accept_probability();
    int32_t tok = 0;
    bool none_allowed = false;
    // The constraint's allowed set at this row (empty without one).
    const std::span<const uint32_t> mask = allowed(j);
    if (drawn != nullptr) {
      // Sampled on the device with this row's draw (seed, step) (prepare()).
      tok = synthetic_accept ? draft : drawn[j];
    } else {
      std::span<float> lr(logits_row(rows[j]), V);
      std::vector<float> raw;
      if (p.logprobs >= 0) raw.assign(lr.begin(), lr.end());
      if (synthetic_accept) {
        tok = draft;
      } else if (draft < 0 || p.temperature <= 0.f || spec_->config().synthetic) {
        // The bonus token, a greedy row (the draft is accepted iff it is the argmax, so the
        // output is exactly the one without speculation) or a synthetic rejection: the draw the
        // request would make without drafts.
        SampleRng rng{st.seed, step};
        tok = Sampler::sample(lr, p, st.history, gen, rng, num_sampleable_, mask, &none_allowed);
      } else {
        // Rejection sampling against the greedy draft (one-hot): the token is distributed as
        // the target's processed distribution (penalties, masks, temperature, top_k/top_p/min_p).
        Sampler::prepare(lr, p, st.history, gen, num_sampleable_, mask, &none_allowed);
        Sampler::probs(lr, p, num_sampleable_, &probs);
        bool ok = false;
        tok = Sampler::rejection_sample(probs, {}, draft,
                                        kernels::cpu::sample_uniform(st.seed, step, V + 1),
                                        kernels::cpu::sample_uniform(st.seed, step, V + 2), &ok);
      }
      if (p.logprobs >= 0)
        st.step_logprobs.push_back(to_out(Sampler::logprobs(raw, tok, p.logprobs)));
    }
    st.history.push_back(tok);
    toks.push_back(tok);
    // A constraint that refuses the token, completes, or whose masks left nothing ends the
    // request after it, as without drafts.
    if (st.constraint)
      *stop = !st.constraint->accept(tok) || st.constraint->is_terminated() || none_allowed;
    else
      *stop = none_allowed;
    if (*stop || tok != draft) break;
    ++accepted;
  }
  spec_->count(k, accepted);
  return toks;
}

void ModelRunner::propose(const sched::SchedulerOutput& out,
                          std::unordered_map<uint64_t, RunnerRequestState>& states,
                          const model::ForwardResult& res, sched::RunnerOutput& ro,
                          const std::function<int(size_t)>& first_token) {
  std::unordered_map<uint64_t, size_t> sampled_at;
  for (size_t j = 0; j < ro.sampled.size(); ++j) sampled_at[ro.sampled[j].request_id] = j;
  const int K = spec_->num_speculative_tokens();
  const int bs = static_cast<int>(backend_->config().sparse_block_size);
  std::vector<DraftSeq> seqs(out.requests.size());
  for (size_t i = 0; i < out.requests.size(); ++i) {
    const sched::ScheduledRequest& r = out.requests[i];
    const RunnerRequestState& st = states.at(r.request_id);
    DraftSeq& s = seqs[i];
    s.request_id = r.request_id;
    s.block_table = r.block_ids;
    s.first_row = first_token(i);
    s.start_pos = r.start_idx;
    s.capacity = static_cast<int>(r.block_ids.size()) * bs;
    int num_valid = r.num_new_tokens();
    auto it = sampled_at.find(r.request_id);
    if (it != sampled_at.end()) {
      // Drafts after the first rejection are not verified: their positions are left out.
      const int accepted = static_cast<int>(ro.sampled[it->second].token_ids.size()) - 1;
      num_valid -= r.num_spec_tokens - accepted;
      const int num_tokens = static_cast<int>(st.history.size());
      const int outputs = num_tokens - st.num_prompt_tokens;
      // Drafts beyond max_tokens or the model length could never be used; none under a
      // constraint that cannot step back over a rejected draft (or is complete).
      int np = std::min(K, st.params.max_tokens - outputs - 1);
      if (max_model_len_ > 0) np = std::min(np, max_model_len_ - num_tokens);
      if (st.constraint && (!st.constraint->can_rollback() || st.constraint->is_terminated()))
        np = 0;
      if (ro.sampled[it->second].stop) np = 0;
      s.num_propose = std::max(0, np);
    }
    s.num_valid = num_valid;
    for (int j = 0; j < num_valid; ++j) {
      const size_t next = static_cast<size_t>(r.start_idx + j + 1);
      M3_CHECK(next < st.history.size(), "draft: no token after position %d", r.start_idx + j);
      s.next_tokens.push_back(st.history[next]);
    }
  }
  auto proposals = spec_->propose(seqs, res.aux_hidden);
  for (size_t i = 0; i < out.requests.size(); ++i) {
    auto it = sampled_at.find(out.requests[i].request_id);
    if (it == sampled_at.end()) continue;
    // Under a constraint only the drafts it takes, up to the first it refuses (a draft it
    // refuses could never be accepted); the constraint steps back to where it was.
    const std::shared_ptr<TokenConstraint>& c = states.at(out.requests[i].request_id).constraint;
    if (c && !proposals[i].empty())
      proposals[i].resize(take_drafts(*c, proposals[i], [](size_t) {}));
    ro.sampled[it->second].spec_token_ids = proposals[i];
  }
}

}  // namespace m3::engine
