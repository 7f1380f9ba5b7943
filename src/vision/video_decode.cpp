#include "vision/video_decode.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>

#if M3_HAVE_LIBAV
extern "C" {
#include <libavcodec/avcodec.h>
#include <libavformat/avformat.h>
#include <libavutil/error.h>
#include <libavutil/imgutils.h>
#include <libavutil/log.h>
#include <libswscale/swscale.h>
}
#endif

namespace m3::vision {

namespace {
Error bad(const std::string& msg) {
  return Error{ErrorCode::kInvalidArgument, msg, ""};
}
}  // namespace

#if !M3_HAVE_LIBAV

bool video_decoding_available() {
  return false;
}

Result<DecodedVideo> decode_video(std::span<const uint8_t>, const FrameSampler&, const VideoLimits&,
                                  const FrameMap&) {
  return tl::make_unexpected(
      bad("this build has no video decoding (built without libavformat/libavcodec/libswscale; "
          "install libavformat-dev libavcodec-dev libswscale-dev libavutil-dev and rebuild), "
          "send sampled frames as image_url parts"));
}

#else

bool video_decoding_available() {
  return true;
}

namespace {

// Containers a video part may be: no playlists or other demuxers that open further URLs.
constexpr const char* kFormats =
    "mov,mp4,m4a,3gp,3g2,mj2,avi,matroska,webm,mpegts,flv,ogg,mpeg,gif,ivf,h264,hevc";

std::string av_msg(int err) {
  char buf[AV_ERROR_MAX_STRING_SIZE] = {0};
  av_strerror(err, buf, sizeof(buf));
  return buf;
}

struct MemReader {
  const uint8_t* data;
  int64_t size;
  int64_t pos = 0;
};

int mem_read(void* opaque, uint8_t* buf, int n) {
  auto* r = static_cast<MemReader*>(opaque);
  const int64_t left = r->size - r->pos;
  if (left <= 0) return AVERROR_EOF;
  const int take = static_cast<int>(std::min<int64_t>(left, n));
  std::memcpy(buf, r->data + r->pos, static_cast<size_t>(take));
  r->pos += take;
  return take;
}

int64_t mem_seek(void* opaque, int64_t offset, int whence) {
  auto* r = static_cast<MemReader*>(opaque);
  whence &= ~AVSEEK_FORCE;
  if (whence == AVSEEK_SIZE) return r->size;
  int64_t p = whence == SEEK_SET   ? offset
              : whence == SEEK_CUR ? r->pos + offset
              : whence == SEEK_END ? r->size + offset
                                   : -1;
  if (p < 0 || p > r->size) return AVERROR(EINVAL);
  r->pos = p;
  return p;
}

// Nested URLs (playlists, references) are never opened.
int refuse_open(AVFormatContext*, AVIOContext**, const char*, int, AVDictionary**) {
  return AVERROR(EPERM);
}

struct FmtDel {
  void operator()(AVFormatContext* c) const { avformat_close_input(&c); }
};
struct IoDel {
  void operator()(AVIOContext* c) const {
    if (c != nullptr) av_freep(&c->buffer);
    avio_context_free(&c);
  }
};
struct CodecDel {
  void operator()(AVCodecContext* c) const { avcodec_free_context(&c); }
};
struct FrameDel {
  void operator()(AVFrame* f) const { av_frame_free(&f); }
};
struct PacketDel {
  void operator()(AVPacket* p) const { av_packet_free(&p); }
};
struct SwsDel {
  void operator()(SwsContext* s) const { sws_freeContext(s); }
};

// One open pass over the bytes: demuxer, first video stream, its decoder.
struct Pass {
  MemReader reader;
  std::unique_ptr<AVIOContext, IoDel> io;
  std::unique_ptr<AVFormatContext, FmtDel> fmt;
  std::unique_ptr<AVCodecContext, CodecDel> dec;
  int stream = -1;
};

Status open_pass(std::span<const uint8_t> bytes, Pass& p) {
  p.reader = MemReader{bytes.data(), static_cast<int64_t>(bytes.size())};
  constexpr int kBuf = 1 << 16;
  auto* buf = static_cast<uint8_t*>(av_malloc(kBuf));
  if (buf == nullptr) return tl::make_unexpected(bad("out of memory opening the video"));
  p.io.reset(avio_alloc_context(buf, kBuf, 0, &p.reader, mem_read, nullptr, mem_seek));
  if (!p.io) {
    av_free(buf);
    return tl::make_unexpected(bad("out of memory opening the video"));
  }
  AVFormatContext* fc = avformat_alloc_context();
  if (fc == nullptr) return tl::make_unexpected(bad("out of memory opening the video"));
  fc->pb = p.io.get();
  fc->flags |= AVFMT_FLAG_CUSTOM_IO;
  fc->io_open = refuse_open;
  AVDictionary* opts = nullptr;
  av_dict_set(&opts, "format_whitelist", kFormats, 0);
  av_dict_set(&opts, "protocol_whitelist", "none", 0);
  int rc = avformat_open_input(&fc, nullptr, nullptr, &opts);  // frees fc on failure
  av_dict_free(&opts);
  if (rc < 0) {
    return tl::make_unexpected(
        bad("not a video file this server reads, or a truncated one (" + av_msg(rc) +
            "); send MP4/MOV, WebM/MKV, AVI, MPEG-TS, FLV or Ogg with a codec libavcodec decodes"));
  }
  p.fmt.reset(fc);
  rc = avformat_find_stream_info(fc, nullptr);
  if (rc < 0) return tl::make_unexpected(bad("unreadable video stream info: " + av_msg(rc)));
  for (unsigned i = 0; i < fc->nb_streams; ++i) {
    if (fc->streams[i]->codecpar->codec_type == AVMEDIA_TYPE_VIDEO &&
        !(fc->streams[i]->disposition & AV_DISPOSITION_ATTACHED_PIC)) {
      p.stream = static_cast<int>(i);
      break;
    }
  }
  if (p.stream < 0)
    return tl::make_unexpected(
        bad(std::string("the ") + fc->iformat->name + " file has no video stream"));
  const AVCodecParameters* par = fc->streams[p.stream]->codecpar;
  const AVCodec* codec = avcodec_find_decoder(par->codec_id);
  if (codec == nullptr) {
    return tl::make_unexpected(bad(std::string("unsupported video codec '") +
                                   avcodec_get_name(par->codec_id) + "' in the " +
                                   fc->iformat->name + " file"));
  }
  p.dec.reset(avcodec_alloc_context3(codec));
  if (!p.dec) return tl::make_unexpected(bad("out of memory opening the video decoder"));
  rc = avcodec_parameters_to_context(p.dec.get(), par);
  if (rc < 0) return tl::make_unexpected(bad("bad video codec parameters: " + av_msg(rc)));
  p.dec->thread_count = 1;
  rc = avcodec_open2(p.dec.get(), codec, nullptr);
  if (rc < 0) {
    return tl::make_unexpected(
        bad(std::string("cannot open the ") + codec->name + " decoder: " + av_msg(rc)));
  }
  return {};
}

// Decodes every frame of the pass's stream in order, calling on_frame(index, frame) for each;
// on_frame returns false to stop early. Errors: corrupt data, over max_decoded_frames.
template <class F>
Result<int64_t> decode_all(Pass& p, const VideoLimits& lim,
                           std::chrono::steady_clock::time_point deadline, F&& on_frame) {
  std::unique_ptr<AVPacket, PacketDel> pkt(av_packet_alloc());
  std::unique_ptr<AVFrame, FrameDel> frame(av_frame_alloc());
  if (!pkt || !frame) return tl::make_unexpected(bad("out of memory decoding the video"));
  int64_t n = 0;
  bool stop = false, eof = false;
  while (!stop) {
    if (!eof) {
      const int rc = av_read_frame(p.fmt.get(), pkt.get());
      if (rc == AVERROR_EOF) {
        eof = true;
        avcodec_send_packet(p.dec.get(), nullptr);  // flush
      } else if (rc < 0) {
        return tl::make_unexpected(bad("corrupt or truncated video: " + av_msg(rc)));
      } else {
        if (pkt->stream_index != p.stream) {
          av_packet_unref(pkt.get());
          continue;
        }
        const int s = avcodec_send_packet(p.dec.get(), pkt.get());
        av_packet_unref(pkt.get());
        if (s < 0 && s != AVERROR(EAGAIN))
          return tl::make_unexpected(bad("corrupt or truncated video data at frame " +
                                         std::to_string(n) + ": " + av_msg(s)));
      }
    }
    for (;;) {
      const int r = avcodec_receive_frame(p.dec.get(), frame.get());
      if (r == AVERROR(EAGAIN)) break;
      if (r == AVERROR_EOF) return n;
      if (r < 0)
        return tl::make_unexpected(bad("corrupt or truncated video data at frame " +
                                       std::to_string(n) + ": " + av_msg(r)));
      if (n >= lim.max_decoded_frames) {
        return tl::make_unexpected(bad("the video has over " +
                                       std::to_string(lim.max_decoded_frames) +
                                       " frames; send a shorter clip"));
      }
      if (std::chrono::steady_clock::now() > deadline) {
        char s[32];
        std::snprintf(s, sizeof s, "%g", lim.max_seconds);
        return tl::make_unexpected(
            bad(std::string("decoding the video took over ") + s +
                " s (the limit VLLM_VIDEO_FETCH_TIMEOUT sets); send a shorter or smaller clip"));
      }
      M3_TRY(bool more, on_frame(n, frame.get()));
      av_frame_unref(frame.get());
      ++n;
      if (!more) {
        stop = true;
        break;
      }
    }
  }
  return n;
}

Result<RgbImage> to_rgb(const AVFrame* f, int64_t w, int64_t h) {
  if (f->width != w || f->height != h) {
    return tl::make_unexpected(bad("the frame size changes mid-stream (" + std::to_string(w) + "x" +
                                   std::to_string(h) + " -> " + std::to_string(f->width) + "x" +
                                   std::to_string(f->height) + ")"));
  }
  RgbImage img;
  img.width = w;
  img.height = h;
  img.rgb.resize(static_cast<size_t>(w * h * 3));
  if (f->format == AV_PIX_FMT_RGB24) {
    for (int64_t y = 0; y < h; ++y)
      std::memcpy(img.rgb.data() + y * w * 3, f->data[0] + y * f->linesize[0],
                  static_cast<size_t>(w * 3));
    return img;
  }
  std::unique_ptr<SwsContext, SwsDel> sws(sws_getContext(
      static_cast<int>(w), static_cast<int>(h), static_cast<AVPixelFormat>(f->format),
      static_cast<int>(w), static_cast<int>(h), AV_PIX_FMT_RGB24, SWS_BILINEAR, nullptr, nullptr,
      nullptr));
  if (!sws) {
    const char* name = av_get_pix_fmt_name(static_cast<AVPixelFormat>(f->format));
    return tl::make_unexpected(
        bad(std::string("unsupported pixel format '") + (name != nullptr ? name : "?") + "'"));
  }
  uint8_t* dst[4] = {img.rgb.data(), nullptr, nullptr, nullptr};
  int dst_stride[4] = {static_cast<int>(w * 3), 0, 0, 0};
  const int rows =
      sws_scale(sws.get(), f->data, f->linesize, 0, static_cast<int>(h), dst, dst_stride);
  if (rows != h) return tl::make_unexpected(bad("the pixel format conversion failed"));
  return img;
}

}  // namespace

Result<DecodedVideo> decode_video(std::span<const uint8_t> bytes, const FrameSampler& sample,
                                  const VideoLimits& limits, const FrameMap& map) {
  static std::once_flag quiet;
  std::call_once(quiet, [] { av_log_set_level(AV_LOG_QUIET); });  // errors come back as Errors
  if (bytes.empty()) return tl::make_unexpected(bad("the video is empty"));
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                            std::chrono::duration<double>(limits.max_seconds));
  Pass p;
  M3_TRY_STATUS(open_pass(bytes, p));
  const AVStream* st = p.fmt->streams[p.stream];
  DecodedVideo out;
  VideoHeader& hd = out.header;
  hd.width = st->codecpar->width;
  hd.height = st->codecpar->height;
  hd.container = p.fmt->iformat->name;
  hd.codec = avcodec_get_name(st->codecpar->codec_id);
  if (hd.width < 1 || hd.height < 1)
    return tl::make_unexpected(bad("the video stream has no frame size"));
  if (hd.width * hd.height > limits.max_frame_pixels) {
    return tl::make_unexpected(
        bad("video frames of " + std::to_string(hd.width) + "x" + std::to_string(hd.height) +
            " = " + std::to_string(hd.width * hd.height) +
            " pixels are over the decoder limit of " + std::to_string(limits.max_frame_pixels)));
  }
  AVRational rate = st->avg_frame_rate;  // PyAV's `average_rate`
  if (rate.num <= 0 || rate.den <= 0) rate = av_guess_frame_rate(p.fmt.get(), nullptr, nullptr);
  if (rate.num <= 0 || rate.den <= 0)
    return tl::make_unexpected(bad("the video has no frame rate"));
  hd.fps = static_cast<double>(rate.num) / static_cast<double>(rate.den);
  hd.total_frames = st->nb_frames;
  if (hd.total_frames <= 0) {
    // No count in the header (e.g. Matroska): count by decoding, then decode again.
    auto count_only = [](int64_t, const AVFrame*) -> Result<bool> { return true; };
    M3_TRY(int64_t counted, decode_all(p, limits, deadline, count_only));
    hd.total_frames = counted;
    p.dec.reset();  // in this order: the demuxer reads through the I/O context
    p.fmt.reset();
    p.io.reset();
    p.stream = -1;
    M3_TRY_STATUS(open_pass(bytes, p));
  }
  if (hd.total_frames <= 0) return tl::make_unexpected(bad("the video has no frames"));
  if (hd.total_frames > limits.max_decoded_frames) {
    return tl::make_unexpected(
        bad("the video has " + std::to_string(hd.total_frames) + " frames, over the limit of " +
            std::to_string(limits.max_decoded_frames) + "; send a shorter clip"));
  }
  M3_TRY(out.indices, sample(hd));
  if (out.indices.empty()) return tl::make_unexpected(bad("no frames were sampled"));
  size_t next = 0;
  auto keep = [&](int64_t i, const AVFrame* f) -> Result<bool> {
    while (next < out.indices.size() && out.indices[next] == i) {
      M3_TRY(RgbImage img, to_rgb(f, hd.width, hd.height));
      if (map) {
        M3_TRY(img, map(std::move(img)));
      }
      out.frames.push_back(std::move(img));
      ++next;
    }
    return next < out.indices.size();
  };
  M3_TRY(int64_t decoded, decode_all(p, limits, deadline, keep));
  if (next < out.indices.size()) {
    return tl::make_unexpected(bad("corrupt or truncated video: the header promises " +
                                   std::to_string(hd.total_frames) + " frames, " +
                                   std::to_string(decoded) + " could be decoded"));
  }
  return out;
}

#endif

}  // namespace m3::vision
