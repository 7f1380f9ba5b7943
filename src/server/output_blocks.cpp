#include "server/output_blocks.h"

namespace m3::server {

void OutputBlocks::open(BlockKind kind, std::vector<BlockEvent>& out, int tool_index,
                        const std::string& id, const std::string& name) {
  close(out);
  is_open_ = true;
  kind_ = kind;
  block_ = next_block_++;
  tool_index_ = tool_index;
  tool_id_ = id;
  tool_name_ = name;
  full_.clear();
  BlockEvent e;
  e.type = BlockEvent::Type::kOpen;
  e.kind = kind;
  e.block = block_;
  e.tool_id = id;
  e.tool_name = name;
  out.push_back(std::move(e));
}

void OutputBlocks::close(std::vector<BlockEvent>& out) {
  if (!is_open_) return;
  BlockEvent e;
  e.type = BlockEvent::Type::kClose;
  e.kind = kind_;
  e.block = block_;
  e.text = full_;
  e.tool_id = tool_id_;
  e.tool_name = tool_name_;
  out.push_back(std::move(e));
  is_open_ = false;
}

void OutputBlocks::append(const std::string& text, std::vector<BlockEvent>& out) {
  if (text.empty()) return;
  full_ += text;
  BlockEvent e;
  e.type = BlockEvent::Type::kDelta;
  e.kind = kind_;
  e.block = block_;
  e.text = text;
  e.tool_id = tool_id_;
  e.tool_name = tool_name_;
  out.push_back(std::move(e));
}

std::vector<BlockEvent> OutputBlocks::feed(const ChoiceDelta& d) {
  std::vector<BlockEvent> out;
  if (!d.reasoning.empty()) {
    if (!is_open_ || kind_ != BlockKind::kReasoning) open(BlockKind::kReasoning, out);
    append(d.reasoning, out);
  }
  if (!d.text.empty()) {
    if (!is_open_ || kind_ != BlockKind::kText) open(BlockKind::kText, out);
    append(d.text, out);
  }
  for (const auto& c : d.tool_calls) {
    // A call's first delta carries its id and name (tool_parser.h); later ones extend it.
    if (!is_open_ || kind_ != BlockKind::kToolCall || tool_index_ != c.index) {
      open(BlockKind::kToolCall, out, c.index, c.id.value_or(""), c.name.value_or(""));
    }
    append(c.arguments_delta, out);
  }
  return out;
}

std::vector<BlockEvent> OutputBlocks::finish() {
  std::vector<BlockEvent> out;
  close(out);
  return out;
}

}  // namespace m3::server
