// Image and video input of chat requests (issue #20): the image_url / video_url parts' bytes
// (data: URLs; file:// URLs under --allowed-local-media-path; remote URLs refused, the server
// makes no network fetches), decoded and processed (vision/), cached by content hash
// (--mm-processor-cache-gb, an LRU of processed media), and the prompt's placeholders expanded
// as the HF processor does: an image to "]<]start of image[>[" + N x "]<]image[>[" +
// "]<]end of image[>[" (one token per merged patch, at the token level), a video to its text
// (vision::video_prompt_text: per temporal pair of frames a timestamp, start, N x "]<]video[>[",
// end) substituted into the rendered prompt before tokenizing, as the HF processor does.
// Called by the chat route on HTTP threads; MediaCache is thread-safe.
// Invariant: every error is a kInvalidArgument naming the part (`messages[i].content[j]`) and the
// reason; nothing here aborts on user input.
#pragma once

#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/error.h"
#include "engine/engine.h"
#include "server/openai_request.h"
#include "vision/image_processor.h"
#include "vision/video_decode.h"
#include "vision/video_processor.h"

namespace m3::server {

struct MediaConfig {
  std::string allowed_local_media_path;              // "" : file:// URLs are refused
  int max_images_per_prompt = 16;                    // --limit-mm-per-prompt '{"image": N}'
  int max_videos_per_prompt = 4;                     // --limit-mm-per-prompt '{"video": M}'
  int64_t processor_cache_bytes = int64_t{4} << 30;  // --mm-processor-cache-gb (0: off)
  int64_t max_image_pixels = int64_t{64} << 20;      // decoder limit (width * height; video frames)
  vision::ProcessorConfig image;                     // pixel budget (--mm-processor-kwargs)
  vision::VideoProcessorConfig video;                // sampling, frame budget, total_pixels
  int64_t max_video_frames = 1 << 17;                // frames a video may have (decoded or not)
  double video_timeout_s = 30;                       // decode wall time (VLLM_VIDEO_FETCH_TIMEOUT)
};

// A processed image or video: its patch rows and, for a video, the timestamp of each temporal
// pair (the prompt text depends on them).
struct ProcessedMedia {
  vision::ProcessedImage pixels;
  std::vector<std::string> timestamps;  // video only
};

// LRU of processed media by content hash (128-bit XXH3 of the file's bytes, videos keyed apart
// from images), bounded by the bytes of their pixel values.
class MediaCache {
 public:
  explicit MediaCache(int64_t capacity_bytes) : capacity_(capacity_bytes) {}
  std::shared_ptr<const ProcessedMedia> get(uint64_t h0, uint64_t h1);
  void put(uint64_t h0, uint64_t h1, std::shared_ptr<const ProcessedMedia> m);
  int64_t bytes() const;
  int64_t hits() const;

 private:
  struct Key {
    uint64_t a, b;
    bool operator==(const Key& o) const { return a == o.a && b == o.b; }
  };
  struct KeyHash {
    size_t operator()(const Key& k) const { return static_cast<size_t>(k.a ^ (k.b * 31)); }
  };
  using Entry = std::pair<Key, std::shared_ptr<const ProcessedMedia>>;
  mutable std::mutex mu_;
  int64_t capacity_;
  int64_t bytes_ = 0;
  int64_t hits_ = 0;
  std::list<Entry> lru_;  // most recent first
  std::unordered_map<Key, std::list<Entry>::iterator, KeyHash> index_;
};

// Strict base64 (RFC 4648 alphabet, '=' padding); nullopt on any other byte.
std::optional<std::vector<uint8_t>> base64_decode(std::string_view s);

// The bytes behind a part's URL. Errors: a remote URL, a data: URL that is not base64, a file
// outside the allowed path or unreadable, an unknown scheme.
Result<std::vector<uint8_t>> fetch_media_bytes(const MediaPart& part, const MediaConfig& cfg);

// Checks the parts against the limits and the model (before any decoding).
Status check_media_parts(const std::vector<MediaPart>& parts, const MediaConfig& cfg,
                         const engine::ModelInfo& info);

// Fetches, decodes and processes every image part (through `cache`), in order.
Result<std::vector<engine::ImageInput>> prepare_images(const std::vector<MediaPart>& parts,
                                                       const MediaConfig& cfg,
                                                       const engine::ModelInfo& info,
                                                       MediaCache* cache);

// A video part ready for the prompt: its engine input (video = true; token offsets set by
// locate_video_tokens) and the text that replaces its placeholder.
struct PreparedVideo {
  engine::ImageInput input;
  std::string prompt_text;
};

// Fetches, decodes (vision::decode_video, frames sampled by the video processor's rule) and
// processes every video part (through `cache`), in order. Errors name the part.
Result<std::vector<PreparedVideo>> prepare_videos(const std::vector<MediaPart>& parts,
                                                  const MediaConfig& cfg,
                                                  const engine::ModelInfo& info, MediaCache* cache);

// Replaces the k-th "]<]video[>[" of the rendered prompt by videos[k].prompt_text. Errors: the
// prompt holds a different number of video placeholders than there are videos.
Status expand_video_text(std::string& prompt, const std::vector<PreparedVideo>& videos);

// After tokenizing: finds each video's grid_t runs of `video_id` tokens (in order, each of
// num_tokens / grid_t) and sets token_offset and group_offsets. Errors: runs that do not match
// (e.g. the placeholder also typed as text).
Status locate_video_tokens(const std::vector<int32_t>& ids, std::vector<PreparedVideo>& videos,
                           int32_t video_id);

// Replaces the k-th `image_id` of `ids` by start + images[k].num_tokens x image_id + end (the
// ids of "]<]start of image[>[" / "]<]end of image[>[": one added token each in M3's tokenizer,
// else the tokens the text encodes to, as the HF processor's text expansion gives) and sets each
// image's token_offset. Errors: the prompt holds a different number of image placeholders than
// there are images (e.g. a chat template that ignores image parts, or the placeholder typed as
// text).
Status expand_image_placeholders(std::vector<int32_t>& ids, std::vector<engine::ImageInput>& images,
                                 int32_t image_id, const std::vector<int32_t>& start_ids,
                                 const std::vector<int32_t>& end_ids);

}  // namespace m3::server
