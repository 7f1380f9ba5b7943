// OutputBlocks: turns one chat choice's streamed deltas into a sequence of typed blocks, each
// opened, filled and closed in turn: reasoning, text, and one block per tool call. The Anthropic
// Messages stream (content_block_start / delta / stop) and the OpenAI Responses stream
// (output_item.added / *.delta / output_item.done) are both this sequence in their own words.
// Called by serve_messages.cpp and serve_responses.cpp on the HTTP worker thread, one per choice.
// Invariant: at most one block is open; a block's deltas concatenate to the `full` text its close
// event carries; block numbers count up from 0 in the order blocks open.
#pragma once

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

}  // namespace m3::server
