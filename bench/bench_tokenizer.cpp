// Tokenizer throughput: encodes a corpus file single-threaded with m3::text::Tokenizer and prints
// MB/s, plus a checksum of the ids that bench/bench_tokenizer.py compares with HF tokenizers.
// Usage: bench_tokenizer TOKENIZER_JSON CORPUS_FILE [REPEATS]
// The corpus is encoded in chunks (~4 KiB, ending after a newline), like prompts; the same
// chunking is used by the Python side.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "text/tokenizer.h"

namespace {

std::vector<std::string_view> chunks_of(const std::string& text) {
  constexpr size_t kChunk = 4096;
  std::vector<std::string_view> out;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = pos + kChunk;
    if (end >= text.size()) {
      end = text.size();
    } else {
      const size_t nl = text.find('\n', end);
      end = nl == std::string::npos ? text.size() : nl + 1;
    }
    out.push_back(std::string_view(text).substr(pos, end - pos));
    pos = end;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s TOKENIZER_JSON CORPUS_FILE [REPEATS]\n", argv[0]);
    return 2;
  }
  const int repeats = argc > 3 ? std::atoi(argv[3]) : 3;
  const auto t_load = std::chrono::steady_clock::now();
  auto tok = m3::text::Tokenizer::from_file(argv[1]);
  if (!tok) {
    std::fprintf(stderr, "error: %s\n", tok.error().message.c_str());
    return 1;
  }
  const double load_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t_load).count();
  std::ifstream in(argv[2], std::ios::binary);
  if (!in) {
    std::fprintf(stderr, "error: cannot open corpus %s\n", argv[2]);
    return 1;
  }
  std::ostringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();
  const auto chunks = chunks_of(text);

  uint64_t checksum = 1469598103934665603ULL;  // FNV-1a over all ids, as 32-bit little endian
  uint64_t n_tokens = 0;
  double best = 1e30, first = 0;
  for (int r = 0; r < repeats + 1; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    uint64_t count = 0;
    for (std::string_view c : chunks) {
      const std::vector<int32_t> ids = (*tok)->encode(c);
      count += ids.size();
      if (r == 0) {
        for (int32_t id : ids) {
          for (int b = 0; b < 4; ++b) {
            checksum ^= (static_cast<uint32_t>(id) >> (8 * b)) & 0xFF;
            checksum *= 1099511628211ULL;
          }
        }
      }
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (r == 0) {
      first = s;  // cold word cache (and includes checksum time)
      n_tokens = count;
    } else if (s < best) {
      best = s;
    }
  }
  const double mb = text.size() / 1e6;
  std::printf("load_s %.3f\n", load_s);
  std::printf("bytes %zu chunks %zu tokens %llu\n", text.size(), chunks.size(),
              static_cast<unsigned long long>(n_tokens));
  std::printf("checksum %016llx\n", static_cast<unsigned long long>(checksum));
  std::printf("cold_mb_s %.2f\n", mb / first);
  std::printf("mb_s %.2f\n", mb / best);
  return 0;
}
