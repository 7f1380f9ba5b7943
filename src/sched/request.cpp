#include "sched/request.h"

#include <utility>

#include "core/check.h"

namespace m3::sched {

bool is_finished(RequestStatus status) {
  return status == RequestStatus::kFinishedStopped || status == RequestStatus::kFinishedLength ||
         status == RequestStatus::kFinishedAborted;
}

const char* finish_reason_name(FinishReason reason) {
  switch (reason) {
    case FinishReason::kNone:
      return "";
    case FinishReason::kStop:
      return "stop";
    case FinishReason::kLength:
      return "length";
    case FinishReason::kAbort:
      return "abort";
  }
  return "";
}

Request::Request(uint64_t id, std::vector<int32_t> prompt, StopCriteria stop_criteria,
                 int priority_value, uint64_t cache_salt_value)
    : request_id(id),
      prompt_token_ids(std::move(prompt)),
      stop(std::move(stop_criteria)),
      priority(priority_value),
      cache_salt(cache_salt_value) {}

int32_t Request::token_at(int idx) const {
  M3_CHECK(idx >= 0 && idx < num_tokens(), "token index %d outside [0, %d)", idx, num_tokens());
  const int num_prompt = num_prompt_tokens();
  return idx < num_prompt ? prompt_token_ids[idx] : output_token_ids[idx - num_prompt];
}

}  // namespace m3::sched
