#include "sched/block_hash.h"

#include <cstring>
#include <vector>

#include <xxhash.h>

namespace m3::sched {

BlockHash hash_block(BlockHash parent, uint64_t extra, std::span<const int32_t> token_ids) {
  // One contiguous buffer [parent, extra, tokens...] so one XXH3 call covers it; thread_local keeps
  // the per-block cost an allocation-free memcpy on the engine thread.
  thread_local std::vector<unsigned char> buf;
  const size_t token_bytes = token_ids.size() * sizeof(int32_t);
  buf.resize(2 * sizeof(uint64_t) + token_bytes);
  std::memcpy(buf.data(), &parent, sizeof(parent));
  std::memcpy(buf.data() + sizeof(uint64_t), &extra, sizeof(extra));
  if (token_bytes > 0)
    std::memcpy(buf.data() + 2 * sizeof(uint64_t), token_ids.data(), token_bytes);
  return XXH3_64bits(buf.data(), buf.size());
}

}  // namespace m3::sched
