// OutputBlocks: turns one chat choice's streamed deltas into a sequence of typed blocks, each
// opened, filled and closed in turn: reasoning, text, and one block per tool call. The Anthropic
// Messages stream (content_block_start / delta / stop) and the OpenAI Responses stream
// (output_item.added / *.delta / output_item.done) are both this sequence in their own words.
// Called by serve_messages.cpp and serve_responses.cpp on the HTTP worker thread, one per choice.
// Invariant: at most one block is open; a block's deltas concatenate to the `full` text its close
// event carries; block numbers count up from 0 in the order blocks open.
#pragma once

#include <chrono>
#include <string>
#include <vector>

#include "server/choice_output.h"

namespace m3::server {

enum class BlockKind { kReasoning, kText, kToolCall };

struct BlockEvent {
  enum class Type { kOpen, kDelta, kClose };
  Type type = Type::kOpen;
  BlockKind kind = BlockKind::kText;
  int block = 0;     // the block's number in the output
  std::string text;  // kDelta: the new text (tool call: arguments JSON); kClose: the whole block
  std::string tool_id, tool_name;  // tool-call blocks (every event)
};

class OutputBlocks {
 public:
  // The events one delta makes, in order (reasoning, then text, then tool calls).
  std::vector<BlockEvent> feed(const ChoiceDelta& delta);
  // Closes the open block, if any.
  std::vector<BlockEvent> finish();
  int num_blocks() const { return next_block_; }

 private:
  void open(BlockKind kind, std::vector<BlockEvent>& out, int tool_index = -1,
            const std::string& id = "", const std::string& name = "");
  void close(std::vector<BlockEvent>& out);
  void append(const std::string& text, std::vector<BlockEvent>& out);

  bool is_open_ = false;
  BlockKind kind_ = BlockKind::kText;
  int block_ = -1;
  int tool_index_ = -1;  // the parser's call index of the open tool block
  int next_block_ = 0;
  std::string full_, tool_id_, tool_name_;
};

// Streams choice 0 of `gen` (a server::Generation) through `blocks` into emit(events) until the
// choice finishes. Returns false, with the generation aborted, when emit fails or client_gone()
// says the client left; the caller then closes the stream. Shared by the Messages and Responses
// streams (only their event names differ, in `emit`).
template <class Gen, class Emit, class Gone>
bool stream_blocks(Gen& gen, OutputBlocks& blocks, Emit&& emit, Gone&& client_gone) {
  const auto& out = *gen.slots[0].out;
  for (;;) {
    auto got = gen.poll(std::chrono::milliseconds(100));
    for (auto& [i, d] : got) {
      if (!emit(blocks.feed(d))) {
        gen.abort_all();
        return false;
      }
    }
    if (out.finished()) return true;
    if (got.empty() && client_gone()) {
      gen.abort_all();
      return false;
    }
  }
}

}  // namespace m3::server
