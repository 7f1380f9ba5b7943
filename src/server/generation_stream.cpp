#include "server/generation_stream.h"

#include <optional>

namespace m3::server {

void Generation::abort_all() {
  for (auto& s : slots) {
    if (s.stream && !s.aborted && !(s.out && s.out->finished())) {
      engine_.abort(s.stream->id());
      s.aborted = true;
    }
  }
}

bool Generation::all_finished() const {
  for (const auto& s : slots) {
    if (!s.out->finished()) return false;
  }
  return true;
}

std::vector<std::pair<size_t, ChoiceDelta>> Generation::take_ready() {
  // At most one entry per choice and poll. Callers look at the choice's state (finished,
  // finish_reason) when they emit an entry, so two entries of one choice taken after it finished
  // would both carry the finish (a stream with two finish_reason chunks): with one token per
  // release, everything the stream holds is merged into one entry.
  std::vector<std::pair<size_t, ChoiceDelta>> got;
  for (size_t i = 0; i < slots.size(); ++i) {
    ChoiceSlot& s = slots[i];
    std::optional<ChoiceDelta> merged;
    while (!s.out->finished()) {
      auto o = s.stream->next(std::chrono::milliseconds(0));
      if (!o) break;
      const bool was_finished = s.out->finished();
      ChoiceDelta d = s.out->add(*o);
      if (s.out->stop_string_hit() && !s.aborted) {
        engine_.abort(s.stream->id());  // the engine keeps generating otherwise
        s.aborted = true;
      }
      const bool ended = s.out->finished() && !was_finished;
      if (stream_interval_ > 1) {
        // Held back until the interval's tokens are in, except the first token and the end.
        merge_delta(s.pending, std::move(d));
        s.pending_tokens += static_cast<int64_t>(o->new_token_ids.size());
        if (!ended && s.sent && s.pending_tokens < stream_interval_) continue;
        d = std::move(s.pending);
        s.pending = ChoiceDelta{};
        s.pending_tokens = 0;
      }
      if (!d.empty()) s.sent = true;
      if (!d.empty() || ended) {
        if (merged) {
          merge_delta(*merged, std::move(d));
        } else {
          merged = std::move(d);
        }
      }
      // One release per poll: later outputs wait in the stream, so what a caller reads from the
      // choice's accumulated state (completions) is exactly what was released.
      if (stream_interval_ > 1) break;
    }
    if (merged) got.emplace_back(i, std::move(*merged));
  }
  return got;
}

void merge_delta(ChoiceDelta& into, ChoiceDelta&& next) {
  into.text += next.text;
  into.reasoning += next.reasoning;
  for (auto& c : next.tool_calls) {
    if (!into.tool_calls.empty() && into.tool_calls.back().index == c.index) {
      auto& last = into.tool_calls.back();
      if (!last.id) last.id = std::move(c.id);
      if (!last.name) last.name = std::move(c.name);
      last.arguments_delta += c.arguments_delta;
    } else {
      into.tool_calls.push_back(std::move(c));
    }
  }
  into.logprobs.insert(into.logprobs.end(), std::make_move_iterator(next.logprobs.begin()),
                       std::make_move_iterator(next.logprobs.end()));
  into.token_ids.insert(into.token_ids.end(), next.token_ids.begin(), next.token_ids.end());
}

std::vector<std::pair<size_t, ChoiceDelta>> Generation::poll(std::chrono::milliseconds wait) {
  // Read the sequence before draining: a push after the drain changes it, so the wait below
  // cannot miss it.
  const uint64_t seen = waker_->sequence();
  auto got = take_ready();
  if (!got.empty() || all_finished()) return got;
  waker_->wait(seen, wait);
  return take_ready();
}

bool Generation::wait_all(const HttpRequest& req, std::chrono::milliseconds check) {
  while (!all_finished()) {
    poll(check);
    if (!all_finished() && req.client_gone()) {
      abort_all();
      return false;
    }
  }
  return true;
}

bool SseEnvelope::finish(ResponseSink& sink, const UsageCounts& usage) const {
  if (include_usage) {
    Json j = {{"id", id}, {"object", object}, {"created", created}, {"model", model}};
    j["choices"] = Json::array();
    j["usage"] = usage_json(usage);
    if (!sink.write(sse_event(j))) return false;
  }
  return sink.write(sse_done());
}

}  // namespace m3::server
