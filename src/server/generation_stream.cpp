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

namespace {

// Appends `more` to `into` (a later delta of the same choice); a tool call's argument pieces that
// continue the same call are joined.
void append_delta(ChoiceDelta& into, ChoiceDelta&& more) {
  into.text += more.text;
  into.reasoning += more.reasoning;
  for (auto& c : more.tool_calls) {
    if (!into.tool_calls.empty() && into.tool_calls.back().index == c.index && !c.id && !c.name) {
      into.tool_calls.back().arguments_delta += c.arguments_delta;
    } else {
      into.tool_calls.push_back(std::move(c));
    }
  }
  for (auto& l : more.logprobs) into.logprobs.push_back(std::move(l));
  into.token_ids.insert(into.token_ids.end(), more.token_ids.begin(), more.token_ids.end());
}

}  // namespace

std::vector<std::pair<size_t, ChoiceDelta>> Generation::take_ready() {
  // At most one entry per choice: its outputs so far merged. Callers look at the choice's state
  // (finished, finish_reason) when they emit an entry, so two entries of one choice taken after
  // it finished would both carry the finish (a stream with two finish_reason chunks).
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
      if (!d.empty() || (s.out->finished() && !was_finished)) {
        if (merged) {
          append_delta(*merged, std::move(d));
        } else {
          merged = std::move(d);
        }
      }
    }
    if (merged) got.emplace_back(i, std::move(*merged));
  }
  return got;
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
