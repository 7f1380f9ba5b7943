// Generation: the engine requests behind one HTTP generation request (prompts x n choices) and
// the loop that reads them: it sleeps on one StreamWaker the engine notifies on every output (no
// polling), applies outputs to each choice's ChoiceOutput, and aborts what is left when the
// request ends for any reason. SseEnvelope: what every streamed chunk of one request shares.
// Called by serve_completions.cpp and serve_chat.cpp on HTTP worker threads.
// Invariant: a Generation's destructor aborts every engine request that has not finished, so no
// path (client gone, error, exception) keeps KV pages.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine/engine.h"
#include "server/choice_output.h"
#include "server/http_types.h"
#include "server/response_json.h"

namespace m3::server {

// One engine request per choice (prompt x n).
struct ChoiceSlot {
  int index = 0;         // OpenAI choice index
  int prompt_index = 0;  // which prompt
  std::shared_ptr<engine::RequestStream> stream;
  std::unique_ptr<ChoiceOutput> out;
  bool aborted = false;  // engine.abort() sent
  // --stream-interval > 1: what is held back since the last delta handed out.
  ChoiceDelta pending;
  int64_t pending_tokens = 0;
  bool sent = false;  // a non-empty delta was handed out
};

// `into` followed by `next`, as one delta (text and reasoning appended, tool-call fragments of
// the same call joined).
void merge_delta(ChoiceDelta& into, ChoiceDelta&& next);

struct PromptData {
  std::vector<int32_t> ids;
  std::string text;                        // for echo
  std::vector<engine::ImageInput> images;  // the prompt's images (chat image parts)
};

class Generation {
 public:
  // stream_interval: poll() hands out a choice's delta once it holds this many new tokens, on its
  // first token and when it finishes (--stream-interval; 1: every output).
  explicit Generation(engine::Engine& engine, int stream_interval = 1)
      : engine_(engine),
        waker_(std::make_shared<engine::StreamWaker>()),
        stream_interval_(stream_interval < 1 ? 1 : stream_interval) {}
  ~Generation() { abort_all(); }
  Generation(const Generation&) = delete;
  Generation& operator=(const Generation&) = delete;

  std::vector<ChoiceSlot> slots;
  std::vector<PromptData> prompts;

  // Give this to every GenerateRequest of the generation.
  const std::shared_ptr<engine::StreamWaker>& waker() const { return waker_; }

  void abort_all();
  bool all_finished() const;

  // Applies every output already produced; when there was none, sleeps until the engine pushes
  // one or `wait` passes. Returns (slot, delta) pairs with something new or a newly finished
  // choice.
  std::vector<std::pair<size_t, ChoiceDelta>> poll(std::chrono::milliseconds wait);

  // Waits for all choices to finish, checking every `check` that the client is still there.
  // Returns false (everything aborted) when the client went away first.
  bool wait_all(const HttpRequest& req, std::chrono::milliseconds check);

 private:
  std::vector<std::pair<size_t, ChoiceDelta>> take_ready();

  engine::Engine& engine_;
  std::shared_ptr<engine::StreamWaker> waker_;
  int stream_interval_ = 1;
};

// What every streamed chunk of one request shares (id, object, created, model, the usage mode)
// and the stream's tail, for /v1/completions and /v1/chat/completions alike.
struct SseEnvelope {
  std::string id, object, model;
  int64_t created = 0;
  bool include_usage = false, continuous = false;

  // One chunk around `choice`: running usage when continuous_usage_stats, null usage when only
  // include_usage (vLLM's shape), no usage key otherwise. `extra`: more top-level keys (vLLM's
  // prompt_token_ids on a stream's first chunk).
  template <class UsageFn>
  std::string chunk(Json choice, UsageFn usage, const Json& extra = nullptr) const {
    Json j = {{"id", id}, {"object", object}, {"created", created}, {"model", model}};
    j["choices"] = Json::array({std::move(choice)});
    if (extra.is_object())
      for (auto it = extra.begin(); it != extra.end(); ++it) j[it.key()] = it.value();
    if (continuous)
      j["usage"] = usage_json(usage());
    else if (include_usage)
      j["usage"] = nullptr;
    return sse_event(j);
  }
  // The usage-only chunk when include_usage, then [DONE]. False when the client is gone.
  bool finish(ResponseSink& sink, const UsageCounts& usage) const;
};

}  // namespace m3::server
