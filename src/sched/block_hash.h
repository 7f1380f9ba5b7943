// Prefix-cache block hashes: a hash chain over full KV pages (design.md "The KV page is the MSA
// block"). Called by KVCacheManager when it looks up or registers full blocks of a request's
// tokens. Invariant: hash(block i) = XXH3-64(parent = hash(block i-1) or kRootBlockHash, extra key,
// the block's token ids), so equal hashes mean equal whole prefixes (up to a 2^-64 collision
// chance). `extra` is the request's cache salt, mixed with the content hash of every image span
// (Request::content_spans) the block touches; LoRA keys would go there too.
#pragma once

#include <cstdint>
#include <span>

namespace m3::sched {

using BlockHash = uint64_t;

// Parent of a request's first block. Any fixed value works; it only has to be the same everywhere.
inline constexpr BlockHash kRootBlockHash = 0x6d33736572766521ULL;  // "m3serve!"

BlockHash hash_block(BlockHash parent, uint64_t extra, std::span<const int32_t> token_ids);

}  // namespace m3::sched
