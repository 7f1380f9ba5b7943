#include "server/media_input.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>

#include <xxhash.h>

#include "server/api_error.h"
#include "vision/image_decode.h"
#include "vision/image_resize.h"

namespace m3::server {

std::shared_ptr<const ProcessedMedia> MediaCache::get(uint64_t h0, uint64_t h1) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = index_.find(Key{h0, h1});
  if (it == index_.end()) return nullptr;
  lru_.splice(lru_.begin(), lru_, it->second);
  ++hits_;
  return it->second->second;
}

void MediaCache::put(uint64_t h0, uint64_t h1, std::shared_ptr<const ProcessedMedia> img) {
  const int64_t sz = static_cast<int64_t>(img->pixels.pixel_values.size() * sizeof(float));
  std::lock_guard<std::mutex> lock(mu_);
  if (sz > capacity_ || index_.count(Key{h0, h1})) return;
  lru_.emplace_front(Key{h0, h1}, std::move(img));
  index_[Key{h0, h1}] = lru_.begin();
  bytes_ += sz;
  while (bytes_ > capacity_ && !lru_.empty()) {
    auto& last = lru_.back();
    bytes_ -= static_cast<int64_t>(last.second->pixels.pixel_values.size() * sizeof(float));
    index_.erase(last.first);
    lru_.pop_back();
  }
}

int64_t MediaCache::bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return bytes_;
}
int64_t MediaCache::hits() const {
  std::lock_guard<std::mutex> lock(mu_);
  return hits_;
}

std::optional<std::vector<uint8_t>> base64_decode(std::string_view s) {
  auto val = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
  };
  size_t n = s.size();
  if (n % 4 != 0) return std::nullopt;
  size_t pad = 0;
  while (pad < 2 && n > 0 && s[n - 1] == '=') {
    --n;
    ++pad;
  }
  std::vector<uint8_t> out;
  out.reserve(n * 3 / 4);
  uint32_t acc = 0;
  int bits = 0;
  for (size_t i = 0; i < n; ++i) {
    const int v = val(s[i]);
    if (v < 0) return std::nullopt;
    acc = (acc << 6) | static_cast<uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out.push_back(static_cast<uint8_t>((acc >> bits) & 0xFF));
    }
  }
  return out;
}

Result<std::vector<uint8_t>> fetch_media_bytes(const MediaPart& part, const MediaConfig& cfg) {
  const std::string& url = part.url;
  const std::string where = part.param;
  auto starts = [&](const char* p) { return url.rfind(p, 0) == 0; };
  if (starts("http://") || starts("https://")) {
    return invalid_param(
        where,
        where + ": remote " + part.kind +
            " URLs are not fetched (this server makes no network requests); send "
            "the " +
            part.kind + " inline as a data: URL, e.g. " +
            (part.kind == "video" ? "data:video/mp4;base64,..." : "data:image/png;base64,..."));
  }
  if (starts("data:")) {
    const size_t comma = url.find(',');
    if (comma == std::string::npos) {
      return invalid_param(where, where + ": the data: URL has no ',' before its payload");
    }
    const std::string_view meta(url.data() + 5, comma - 5);
    if (meta.size() < 7 || meta.substr(meta.size() - 7) != ";base64") {
      return invalid_param(
          where, where + ": the data: URL is not base64 (expected data:<type>;base64,...)");
    }
    auto bytes = base64_decode(std::string_view(url).substr(comma + 1));
    if (!bytes)
      return invalid_param(where, where + ": the data: URL's payload is not valid base64");
    if (bytes->empty()) return invalid_param(where, where + ": the data: URL's payload is empty");
    return std::move(*bytes);
  }
  if (starts("file://")) {
    namespace fs = std::filesystem;
    if (cfg.allowed_local_media_path.empty()) {
      return invalid_param(where, where +
                                      ": local files are refused; start the server with "
                                      "--allowed-local-media-path DIR to allow files under DIR");
    }
    std::error_code ec;
    const fs::path file = fs::canonical(fs::path(url.substr(7)), ec);
    if (ec)
      return invalid_param(where, where + ": cannot open " + url.substr(7) + ": " + ec.message());
    const fs::path root = fs::canonical(cfg.allowed_local_media_path, ec);
    if (ec) return invalid_param(where, where + ": --allowed-local-media-path is not readable");
    const std::string fr = file.string(), rr = root.string();
    if (fr.size() <= rr.size() || fr.compare(0, rr.size(), rr) != 0 ||
        (rr.back() != '/' && fr[rr.size()] != '/')) {
      return invalid_param(where, where + ": " + url.substr(7) +
                                      " is outside --allowed-local-media-path (" + rr + ")");
    }
    if (!fs::is_regular_file(file, ec))
      return invalid_param(where, where + ": " + fr + " is not a file");
    const auto size = fs::file_size(file, ec);
    if (ec || size > (uint64_t{256} << 20))
      return invalid_param(where, where + ": " + fr + " is unreadable or over 256 MiB");
    std::ifstream f(file, std::ios::binary);
    std::vector<uint8_t> bytes{std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
    if (bytes.size() != size) return invalid_param(where, where + ": could not read " + fr);
    return bytes;
  }
  return invalid_param(where, where + ": unsupported " + part.kind +
                                  " URL (supported: data:...;base64, and file:// under "
                                  "--allowed-local-media-path)");
}

Status check_media_parts(const std::vector<MediaPart>& parts, const MediaConfig& cfg,
                         const engine::ModelInfo& info) {
  int images = 0, videos = 0;
  for (const auto& p : parts) {
    if (p.kind == "video") {
      ++videos;
      if (!vision::video_decoding_available()) {
        return invalid_param(p.param,
                             p.param +
                                 ": this build has no video decoding (built without libavformat/"
                                 "libavcodec); send sampled frames as image_url parts");
      }
      if (videos > cfg.max_videos_per_prompt) {
        return invalid_param(p.param,
                             p.param + ": the prompt has more than " +
                                 std::to_string(cfg.max_videos_per_prompt) + " video" +
                                 (cfg.max_videos_per_prompt == 1 ? "" : "s") +
                                 " (--limit-mm-per-prompt '{\"video\": M}' sets the limit)");
      }
    } else {
      ++images;
    }
  }
  if (images > cfg.max_images_per_prompt) {
    return invalid_param("messages", "the prompt has " + std::to_string(images) +
                                         " images; at most " +
                                         std::to_string(cfg.max_images_per_prompt) +
                                         " are allowed (--limit-mm-per-prompt '{\"image\": N}')");
  }
  if ((images > 0 || videos > 0) && !info.image_input) {
    return invalid_param(parts.front().param, parts.front().param + ": " + parts.front().kind +
                                                  " input is not available: " + info.image_refusal);
  }
  return {};
}

Result<std::vector<engine::ImageInput>> prepare_images(const std::vector<MediaPart>& parts,
                                                       const MediaConfig& cfg,
                                                       const engine::ModelInfo& info,
                                                       MediaCache* cache) {
  vision::ProcessorConfig pc = cfg.image;
  pc.patch_size = info.vision_patch_size;
  pc.temporal_patch_size = info.vision_temporal_patch_size;
  pc.merge_size = info.vision_merge_size;
  std::vector<engine::ImageInput> out;
  for (const auto& p : parts) {
    if (p.kind != "image") continue;
    M3_TRY(std::vector<uint8_t> bytes, fetch_media_bytes(p, cfg));
    const XXH128_hash_t h = XXH3_128bits(bytes.data(), bytes.size());
    std::shared_ptr<const ProcessedMedia> m =
        cache != nullptr ? cache->get(h.low64, h.high64) : nullptr;
    if (!m) {
      auto rgb = vision::decode_image(bytes, cfg.max_image_pixels);
      if (!rgb) return invalid_param(p.param, p.param + ": " + rgb.error().message);
      auto proc = vision::preprocess_image(*rgb, pc);
      if (!proc) return invalid_param(p.param, p.param + ": " + proc.error().message);
      m = std::make_shared<const ProcessedMedia>(ProcessedMedia{std::move(*proc), {}});
      if (cache != nullptr) cache->put(h.low64, h.high64, m);
    }
    const vision::ProcessedImage* img = &m->pixels;
    engine::ImageInput in;
    in.grid_t = img->grid_t;
    in.grid_h = img->grid_h;
    in.grid_w = img->grid_w;
    in.patches = img->pixel_values;
    in.num_tokens = static_cast<int32_t>(vision::num_image_tokens(*img, pc.merge_size));
    in.content_hash = h.low64 ^ (h.high64 * 0x9e3779b97f4a7c15ULL);
    out.push_back(std::move(in));
  }
  return out;
}

Result<std::vector<PreparedVideo>> prepare_videos(const std::vector<MediaPart>& parts,
                                                  const MediaConfig& cfg,
                                                  const engine::ModelInfo& info,
                                                  MediaCache* cache) {
  vision::VideoProcessorConfig vc = cfg.video;
  vc.frame.patch_size = info.vision_patch_size;
  vc.frame.temporal_patch_size = info.vision_temporal_patch_size;
  vc.frame.merge_size = info.vision_merge_size;
  vision::VideoLimits lim;
  lim.max_frame_pixels = cfg.max_image_pixels;
  lim.max_decoded_frames = cfg.max_video_frames;
  lim.max_seconds = cfg.video_timeout_s;
  // Sampling, then the frame size and the sampled-pixel budget from the header before any frame
  // is converted; each kept frame is resized as soon as it is decoded.
  std::pair<int64_t, int64_t> size{0, 0};
  const vision::FrameSampler sample =
      [&vc, &size](const vision::VideoHeader& hd) -> Result<std::vector<int64_t>> {
    std::vector<int64_t> idx = vision::sample_frame_indices(hd.total_frames, hd.fps, vc);
    M3_TRY(size, vision::video_frame_size(hd.height, hd.width, vc));
    M3_TRY_STATUS(
        vision::check_video_budget(static_cast<int64_t>(idx.size()), size.first, size.second, vc));
    return idx;
  };
  const vision::FrameMap resize = [&size](vision::RgbImage f) -> Result<vision::RgbImage> {
    if (f.height == size.first && f.width == size.second) return f;
    vision::RgbImage r;
    r.height = size.first;
    r.width = size.second;
    r.rgb = vision::resize_bicubic_aa(f.rgb.data(), f.height, f.width, 3, r.height, r.width);
    return r;
  };
  std::vector<PreparedVideo> out;
  for (const auto& p : parts) {
    if (p.kind != "video") continue;
    M3_TRY(std::vector<uint8_t> bytes, fetch_media_bytes(p, cfg));
    const XXH128_hash_t h = XXH3_128bits(bytes.data(), bytes.size());
    // Keyed apart from an image of the same bytes (a GIF is both).
    const uint64_t k1 = h.high64 ^ 0x766964656f000000ULL;
    std::shared_ptr<const ProcessedMedia> m = cache != nullptr ? cache->get(h.low64, k1) : nullptr;
    if (!m) {
      auto dec = vision::decode_video(bytes, sample, lim, resize);
      if (!dec) return invalid_param(p.param, p.param + ": " + dec.error().message);
      auto proc = vision::preprocess_video(dec->frames, dec->indices, dec->header.fps, vc,
                                           dec->header.height, dec->header.width);
      if (!proc) return invalid_param(p.param, p.param + ": " + proc.error().message);
      m = std::make_shared<const ProcessedMedia>(
          ProcessedMedia{std::move(proc->pixels), std::move(proc->timestamps)});
      if (cache != nullptr) cache->put(h.low64, k1, m);
    }
    vision::ProcessedVideo view;  // for the prompt text: grid and timestamps only
    view.pixels.grid_t = m->pixels.grid_t;
    view.pixels.grid_h = m->pixels.grid_h;
    view.pixels.grid_w = m->pixels.grid_w;
    view.timestamps = m->timestamps;
    PreparedVideo v;
    v.prompt_text = vision::video_prompt_text(view, vc.frame.merge_size);
    engine::ImageInput& in = v.input;
    in.video = true;
    in.grid_t = m->pixels.grid_t;
    in.grid_h = m->pixels.grid_h;
    in.grid_w = m->pixels.grid_w;
    in.patches = m->pixels.pixel_values;
    in.num_tokens = static_cast<int32_t>(vision::num_image_tokens(m->pixels, vc.frame.merge_size));
    in.content_hash = (h.low64 ^ (k1 * 0x9e3779b97f4a7c15ULL)) + 0x76;
    out.push_back(std::move(v));
  }
  return out;
}

namespace {
constexpr std::string_view kVideoPlaceholder = "]<]video[>[";
}  // namespace

Status expand_video_text(std::string& prompt, const std::vector<PreparedVideo>& videos) {
  size_t found = 0;
  for (size_t at = prompt.find(kVideoPlaceholder); at != std::string::npos;
       at = prompt.find(kVideoPlaceholder, at + kVideoPlaceholder.size()))
    ++found;
  if (found != videos.size()) {
    return invalid_param("messages",
                         "the rendered prompt holds " + std::to_string(found) +
                             " video placeholders for " + std::to_string(videos.size()) +
                             " video parts (a chat template that ignores video parts, or the "
                             "placeholder written as text)");
  }
  std::string out;
  size_t from = 0, k = 0;
  for (size_t at = prompt.find(kVideoPlaceholder); at != std::string::npos;
       at = prompt.find(kVideoPlaceholder, from)) {
    out.append(prompt, from, at - from);
    out += videos[k++].prompt_text;
    from = at + kVideoPlaceholder.size();
  }
  out.append(prompt, from, std::string::npos);
  prompt = std::move(out);
  return {};
}

Status locate_video_tokens(const std::vector<int32_t>& ids, std::vector<PreparedVideo>& videos,
                           int32_t video_id) {
  size_t i = 0;
  auto mismatch = [&](const std::string& why) {
    return invalid_param("messages",
                         "the tokenized prompt's video placeholders do not match the "
                         "video parts (" +
                             why + "); do not write ]<]video[>[ as text");
  };
  for (size_t k = 0; k < videos.size(); ++k) {
    engine::ImageInput& in = videos[k].input;
    in.group_offsets.clear();
    const int64_t per = in.num_tokens / in.grid_t;
    for (int64_t g = 0; g < in.grid_t; ++g) {
      while (i < ids.size() && ids[i] != video_id) ++i;
      if (i == ids.size()) return mismatch("video " + std::to_string(k) + " is cut short");
      size_t j = i;
      while (j < ids.size() && ids[j] == video_id) ++j;
      if (static_cast<int64_t>(j - i) != per) {
        return mismatch("a run of " + std::to_string(j - i) + " tokens where video " +
                        std::to_string(k) + " has " + std::to_string(per) + " per frame pair");
      }
      in.group_offsets.push_back(static_cast<int32_t>(i));
      i = j;
    }
    in.token_offset = in.group_offsets.front();
  }
  while (i < ids.size() && ids[i] != video_id) ++i;
  if (i != ids.size()) return mismatch("more placeholder tokens than the videos have");
  return {};
}

Status expand_image_placeholders(std::vector<int32_t>& ids, std::vector<engine::ImageInput>& images,
                                 int32_t image_id, const std::vector<int32_t>& start_ids,
                                 const std::vector<int32_t>& end_ids) {
  size_t found = 0;
  for (int32_t t : ids) found += t == image_id ? 1 : 0;
  if (found != images.size()) {
    return invalid_param("messages",
                         "the rendered prompt holds " + std::to_string(found) +
                             " image placeholders for " + std::to_string(images.size()) +
                             " image parts (a chat template that ignores image parts, or the "
                             "placeholder written as text)");
  }
  if (images.empty()) return {};
  std::vector<int32_t> out;
  size_t k = 0;
  for (int32_t t : ids) {
    if (t != image_id) {
      out.push_back(t);
      continue;
    }
    out.insert(out.end(), start_ids.begin(), start_ids.end());
    images[k].token_offset = static_cast<int32_t>(out.size());
    out.insert(out.end(), static_cast<size_t>(images[k].num_tokens), image_id);
    out.insert(out.end(), end_ids.begin(), end_ids.end());
    ++k;
  }
  ids = std::move(out);
  return {};
}

}  // namespace m3::server
