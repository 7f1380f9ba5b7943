#include "vision/image_decode.h"

#include <csetjmp>
#include <cstdio>
#include <cstring>
#include <memory>

#include <jpeglib.h>
// jerror.h after jpeglib.h: the message codes (JWRN_JPEG_EOF)
#include <jerror.h>
#include <png.h>
#include <webp/decode.h>
#if M3_HAVE_GIF
#include <gif_lib.h>
#endif

namespace m3::vision {
namespace {

Error bad(std::string msg) {
  return Error{ErrorCode::kInvalidArgument, std::move(msg), {}};
}

Result<void> check_size(int64_t w, int64_t h, int64_t max_pixels, const char* fmt) {
  if (w < 1 || h < 1) return tl::unexpected(bad(std::string(fmt) + " image has no pixels"));
  if (w * h > max_pixels) {
    return tl::unexpected(bad(std::string(fmt) + " image of " + std::to_string(w) + "x" +
                              std::to_string(h) + " = " + std::to_string(w * h) +
                              " pixels is over the decoder's limit of " +
                              std::to_string(max_pixels) + " pixels; send a smaller image"));
  }
  return {};
}

// ---- JPEG: libjpeg's error handler longjmps back here instead of exit()ing ----
struct JpegErr {
  jpeg_error_mgr mgr;
  std::jmp_buf jump;
  char message[JMSG_LENGTH_MAX];
  bool truncated;
};

void jpeg_fail(j_common_ptr cinfo) {
  auto* e = reinterpret_cast<JpegErr*>(cinfo->err);
  (*cinfo->err->format_message)(cinfo, e->message);
  std::longjmp(e->jump, 1);
}
// Warnings: libjpeg pads a truncated file with grey and only warns; PIL refuses such a file
// ("image file is truncated"), so that warning is remembered. Other warnings (extraneous bytes)
// are decoded through, as PIL does.
void jpeg_warning(j_common_ptr cinfo, int level) {
  auto* e = reinterpret_cast<JpegErr*>(cinfo->err);
  if (level < 0 && cinfo->err->msg_code == JWRN_JPEG_EOF) e->truncated = true;
}

}  // namespace

int exif_orientation(std::span<const uint8_t> app1) {
  // "Exif\0\0", then a TIFF header (II or MM byte order, 42, the first IFD's offset) and IFD0's
  // entries of 12 bytes: tag 0x0112 (Orientation), type SHORT, count 1, the value inline.
  static const uint8_t kExif[6] = {'E', 'x', 'i', 'f', 0, 0};
  if (app1.size() < 6 + 8 || std::memcmp(app1.data(), kExif, 6) != 0) return 1;
  const std::span<const uint8_t> t = app1.subspan(6);
  const bool le = t[0] == 'I' && t[1] == 'I';
  if (!le && !(t[0] == 'M' && t[1] == 'M')) return 1;
  auto u16 = [&](size_t o) -> uint32_t {
    return le ? t[o] | (t[o + 1] << 8) : (t[o] << 8) | t[o + 1];
  };
  auto u32 = [&](size_t o) -> uint32_t {
    return le ? u16(o) | (u16(o + 2) << 16) : (u16(o) << 16) | u16(o + 2);
  };
  if (u16(2) != 42) return 1;
  const size_t ifd = u32(4);
  if (ifd + 2 > t.size()) return 1;
  const uint32_t n = u16(ifd);
  for (uint32_t i = 0; i < n; ++i) {
    const size_t e = ifd + 2 + size_t{12} * i;
    if (e + 12 > t.size()) return 1;
    if (u16(e) != 0x0112) continue;
    if (u16(e + 2) != 3 || u32(e + 4) != 1) return 1;  // not one SHORT: ignored, as unknown
    const uint32_t v = u16(e + 8);
    return v >= 1 && v <= 8 ? static_cast<int>(v) : 1;
  }
  return 1;
}

RgbImage apply_exif_orientation(RgbImage img, int orientation) {
  if (orientation <= 1 || orientation > 8) return img;
  const int64_t H = img.height, W = img.width;
  const bool swap = orientation >= 5;  // the transposing ones
  RgbImage out;
  out.height = swap ? W : H;
  out.width = swap ? H : W;
  out.rgb.resize(img.rgb.size());
  for (int64_t r = 0; r < out.height; ++r) {
    for (int64_t c = 0; c < out.width; ++c) {
      int64_t sr = r, sc = c;  // the source pixel of output (r, c)
      switch (orientation) {
        case 2:
          sc = W - 1 - c;
          break;  // mirrored left-right
        case 3:
          sr = H - 1 - r;
          sc = W - 1 - c;
          break;  // rotated 180
        case 4:
          sr = H - 1 - r;
          break;  // mirrored top-bottom
        case 5:
          sr = c;
          sc = r;
          break;  // transposed
        case 6:
          sr = H - 1 - c;
          sc = r;
          break;  // turned 90 clockwise to show upright
        case 7:
          sr = H - 1 - c;
          sc = W - 1 - r;
          break;  // transversed
        case 8:
          sr = c;
          sc = W - 1 - r;
          break;  // turned 90 counter-clockwise
      }
      std::memcpy(&out.rgb[static_cast<size_t>((r * out.width + c) * 3)],
                  &img.rgb[static_cast<size_t>((sr * W + sc) * 3)], 3);
    }
  }
  return out;
}

namespace {

Result<RgbImage> decode_jpeg(std::span<const uint8_t> bytes, int64_t max_pixels) {
  jpeg_decompress_struct cinfo;
  JpegErr err;
  std::memset(&cinfo, 0, sizeof(cinfo));
  cinfo.err = jpeg_std_error(&err.mgr);
  err.mgr.error_exit = jpeg_fail;
  err.mgr.emit_message = jpeg_warning;
  err.message[0] = 0;
  err.truncated = false;
  // What must survive a longjmp is on the heap (no locals are modified after setjmp).
  auto img = std::make_unique<RgbImage>();
  auto cmyk_row = std::make_unique<std::vector<uint8_t>>();  // a CMYK file's row
  if (setjmp(err.jump)) {
    jpeg_destroy_decompress(&cinfo);
    return tl::unexpected(bad(std::string("corrupt JPEG: ") + err.message));
  }
  jpeg_create_decompress(&cinfo);
  jpeg_mem_src(&cinfo, bytes.data(), static_cast<unsigned long>(bytes.size()));
  jpeg_save_markers(&cinfo, JPEG_APP0 + 1, 0xffff);  // APP1: EXIF (the orientation)
  jpeg_read_header(&cinfo, TRUE);
  int orientation = 1;
  for (jpeg_saved_marker_ptr m = cinfo.marker_list; m != nullptr; m = m->next) {
    if (m->marker == JPEG_APP0 + 1 && orientation == 1)
      orientation = exif_orientation({m->data, m->data_length});
  }
  img->orientation = orientation;
  // CMYK (and YCCK, which libjpeg turns into CMYK): read as CMYK, then PIL's conversion below.
  const bool cmyk = cinfo.jpeg_color_space == JCS_CMYK || cinfo.jpeg_color_space == JCS_YCCK;
  auto ok = check_size(cinfo.image_width, cinfo.image_height, max_pixels, "JPEG");
  if (!ok) {
    jpeg_destroy_decompress(&cinfo);
    return tl::unexpected(ok.error());
  }
  cinfo.out_color_space = cmyk ? JCS_CMYK : JCS_RGB;  // grey is replicated, as PIL's convert("RGB")
  jpeg_start_decompress(&cinfo);
  img->width = cinfo.output_width;
  img->height = cinfo.output_height;
  img->rgb.resize(static_cast<size_t>(img->width * img->height * 3));
  if (cmyk) cmyk_row->resize(static_cast<size_t>(img->width * 4));
  while (cinfo.output_scanline < cinfo.output_height) {
    uint8_t* out = img->rgb.data() + static_cast<size_t>(cinfo.output_scanline) * img->width * 3;
    JSAMPROW row = cmyk ? cmyk_row->data() : out;
    jpeg_read_scanlines(&cinfo, &row, 1);
    if (cmyk) {
      // PIL reads a CMYK JPEG's samples inverted (Adobe's convention, "CMYK;I") and converts to
      // RGB as channel = (255 - k) - (c * (255 - k)) / 255, rounded its way (MULDIV255). With the
      // stored samples s (inverted: c = 255 - s_c, k = 255 - s_k) that is s_k - muldiv(255 - s_c,
      // s_k).
      const uint8_t* in = cmyk_row->data();
      for (int64_t x = 0; x < img->width; ++x, in += 4, out += 3) {
        const int nk = in[3];
        for (int ch = 0; ch < 3; ++ch) {
          const int t = (255 - in[ch]) * nk + 128;
          const int v = nk - (((t >> 8) + t) >> 8);
          out[ch] = static_cast<uint8_t>(v < 0 ? 0 : (v > 255 ? 255 : v));
        }
      }
    }
  }
  const bool truncated = err.truncated;
  jpeg_finish_decompress(&cinfo);
  jpeg_destroy_decompress(&cinfo);
  if (truncated) return tl::unexpected(bad("corrupt or truncated JPEG data"));
  // Upright, as transformers' load_image (PIL's ImageOps.exif_transpose) shows a photo.
  const int o = img->orientation;
  return apply_exif_orientation(std::move(*img), o);
}

// ---- PNG: libpng's error handler longjmps through png_jmpbuf ----
struct PngReader {
  std::span<const uint8_t> bytes;
  size_t pos = 0;
  char message[256] = {0};
};

void png_read_mem(png_structp png, png_bytep out, png_size_t n) {
  auto* r = static_cast<PngReader*>(png_get_io_ptr(png));
  if (r->pos + n > r->bytes.size()) png_error(png, "truncated PNG data");
  std::memcpy(out, r->bytes.data() + r->pos, n);
  r->pos += n;
}
void png_fail(png_structp png, png_const_charp msg) {
  auto* r = static_cast<PngReader*>(png_get_error_ptr(png));
  std::snprintf(r->message, sizeof(r->message), "%s", msg);
  png_longjmp(png, 1);
}
void png_warn(png_structp, png_const_charp) {}

Result<RgbImage> decode_png(std::span<const uint8_t> bytes, int64_t max_pixels) {
  PngReader reader;
  reader.bytes = bytes;
  png_structp png = png_create_read_struct(PNG_LIBPNG_VER_STRING, &reader, png_fail, png_warn);
  if (png == nullptr) return tl::unexpected(bad("PNG decoder could not start"));
  png_infop info = png_create_info_struct(png);
  auto img = std::make_unique<RgbImage>();
  auto rows = std::make_unique<std::vector<png_bytep>>();
  if (setjmp(png_jmpbuf(png))) {
    png_destroy_read_struct(&png, &info, nullptr);
    return tl::unexpected(bad(std::string("corrupt PNG: ") + reader.message));
  }
  png_set_read_fn(png, &reader, png_read_mem);
  png_read_info(png, info);
  const int64_t w = png_get_image_width(png, info), h = png_get_image_height(png, info);
  if (auto ok = check_size(w, h, max_pixels, "PNG"); !ok) {
    png_destroy_read_struct(&png, &info, nullptr);
    return tl::unexpected(ok.error());
  }
  const int color = png_get_color_type(png, info);
  // 16-bit grey without alpha is PIL's mode "I;16", whose convert("RGB") clips each sample to
  // 255 (it does not scale): read it at 16 bits and clip below.
  const bool gray16 = color == PNG_COLOR_TYPE_GRAY && png_get_bit_depth(png, info) == 16;
  // To 8-bit RGB otherwise: 16-bit samples keep their high byte, palettes and grey expand, alpha
  // and the tRNS chunk are dropped (PIL's convert("RGB") does not composite either).
  if (!gray16) png_set_strip_16(png);
  png_set_packing(png);
  if (color == PNG_COLOR_TYPE_PALETTE) png_set_palette_to_rgb(png);
  if (color == PNG_COLOR_TYPE_GRAY || color == PNG_COLOR_TYPE_GRAY_ALPHA) {
    png_set_expand_gray_1_2_4_to_8(png);
    if (!gray16) png_set_gray_to_rgb(png);
  }
  if (color & PNG_COLOR_MASK_ALPHA) png_set_strip_alpha(png);
  png_set_interlace_handling(png);
  png_read_update_info(png, info);
  const size_t row_bytes = static_cast<size_t>(w) * (gray16 ? 2 : 3);
  if (png_get_rowbytes(png, info) != row_bytes) {
    png_destroy_read_struct(&png, &info, nullptr);
    return tl::unexpected(bad("PNG: unsupported pixel layout"));
  }
  img->width = w;
  img->height = h;
  img->rgb.resize(static_cast<size_t>(w * h * 3));
  auto raw = std::make_unique<std::vector<uint8_t>>();
  uint8_t* base = img->rgb.data();
  if (gray16) {
    raw->resize(row_bytes * static_cast<size_t>(h));
    base = raw->data();
  }
  rows->resize(static_cast<size_t>(h));
  for (int64_t y = 0; y < h; ++y) (*rows)[y] = base + y * row_bytes;
  png_read_image(png, rows->data());
  png_read_end(png, nullptr);
  png_destroy_read_struct(&png, &info, nullptr);
  if (gray16) {
    for (int64_t i = 0; i < w * h; ++i) {
      const unsigned v = (static_cast<unsigned>((*raw)[2 * i]) << 8) | (*raw)[2 * i + 1];
      const uint8_t c = static_cast<uint8_t>(v > 255 ? 255 : v);
      img->rgb[3 * i] = img->rgb[3 * i + 1] = img->rgb[3 * i + 2] = c;
    }
  }
  return std::move(*img);
}

Result<RgbImage> decode_webp(std::span<const uint8_t> bytes, int64_t max_pixels) {
  WebPBitstreamFeatures features;
  if (WebPGetFeatures(bytes.data(), bytes.size(), &features) != VP8_STATUS_OK)
    return tl::unexpected(bad("corrupt or truncated WebP data"));
  if (features.has_animation)
    return tl::unexpected(bad("animated WebP images are not supported; send one frame"));
  M3_TRY_STATUS(check_size(features.width, features.height, max_pixels, "WebP"));
  RgbImage img;
  img.width = features.width;
  img.height = features.height;
  img.rgb.resize(static_cast<size_t>(img.width * img.height * 3));
  // RGB output drops alpha without compositing, as PIL's convert("RGB").
  if (WebPDecodeRGBInto(bytes.data(), bytes.size(), img.rgb.data(), img.rgb.size(),
                        static_cast<int>(img.width * 3)) == nullptr) {
    return tl::unexpected(bad("corrupt or truncated WebP data"));
  }
  return img;
}

#if M3_HAVE_GIF
// ---- GIF (giflib): the first frame, as PIL's GifImagePlugin loads frame 0 and convert("RGB")
// maps it. The canvas is the logical screen, filled with the frame's transparent index when it
// has one, else index 0; the frame's rows go to their offset (interlaced rows in pass order);
// indices map through the frame's local colour table, else the global one, else are grey
// levels (PIL's mode "L"); indices past a table's end get PIL's palette filler (i, i, i).
struct GifReader {
  std::span<const uint8_t> bytes;
  size_t pos = 0;
};

int gif_read_mem(GifFileType* g, GifByteType* out, int n) {
  auto* r = static_cast<GifReader*>(g->UserData);
  const size_t k = std::min(static_cast<size_t>(std::max(n, 0)), r->bytes.size() - r->pos);
  std::memcpy(out, r->bytes.data() + r->pos, k);
  r->pos += k;
  return static_cast<int>(k);
}

struct GifCloser {
  void operator()(GifFileType* g) const {
    int e = 0;
    DGifCloseFile(g, &e);
  }
};

Result<RgbImage> decode_gif(std::span<const uint8_t> bytes, int64_t max_pixels) {
  GifReader reader{bytes, 0};
  int err = 0;
  std::unique_ptr<GifFileType, GifCloser> g(DGifOpen(&reader, gif_read_mem, &err));
  auto fail = [&](const char* what) {
    const int code = g ? g->Error : err;
    const char* msg = GifErrorString(code);
    return tl::unexpected(bad(std::string("corrupt GIF (") + what + "): " + (msg ? msg : "?")));
  };
  if (!g) return fail("header");
  const int64_t W = g->SWidth, H = g->SHeight;
  if (auto ok = check_size(W, H, max_pixels, "GIF"); !ok) return tl::unexpected(ok.error());
  int transparent = -1;  // from the graphic control extension before the first frame
  for (;;) {
    GifRecordType rt = UNDEFINED_RECORD_TYPE;
    if (DGifGetRecordType(g.get(), &rt) == GIF_ERROR) return fail("record");
    if (rt == TERMINATE_RECORD_TYPE) return tl::unexpected(bad("the GIF has no image"));
    if (rt == EXTENSION_RECORD_TYPE) {
      int code = 0;
      GifByteType* ext = nullptr;
      if (DGifGetExtension(g.get(), &code, &ext) == GIF_ERROR) return fail("extension");
      if (code == GRAPHICS_EXT_FUNC_CODE && ext != nullptr && ext[0] >= 4 && (ext[1] & 1))
        transparent = ext[4];
      while (ext != nullptr)
        if (DGifGetExtensionNext(g.get(), &ext) == GIF_ERROR) return fail("extension");
      continue;
    }
    if (rt != IMAGE_DESC_RECORD_TYPE) continue;
    if (DGifGetImageDesc(g.get()) == GIF_ERROR) return fail("image descriptor");
    const GifImageDesc& d = g->Image;
    const int64_t fx = d.Left, fy = d.Top, fw = d.Width, fh = d.Height;
    if (fw < 1 || fh < 1 || fw * fh > max_pixels)
      return tl::unexpected(bad("the GIF's first frame has no pixels or too many"));
    std::vector<uint8_t> idx(static_cast<size_t>(W * H),
                             static_cast<uint8_t>(transparent >= 0 ? transparent : 0));
    std::vector<GifPixelType> line(static_cast<size_t>(fw));
    auto put_row = [&](int64_t r) {
      const int64_t y = fy + r;
      if (y < 0 || y >= H) return;
      for (int64_t x = 0; x < fw; ++x)
        if (fx + x >= 0 && fx + x < W)
          idx[static_cast<size_t>(y * W + fx + x)] = line[static_cast<size_t>(x)];
    };
    if (d.Interlace) {
      static const int kStart[4] = {0, 4, 2, 1}, kStep[4] = {8, 8, 4, 2};
      for (int pass = 0; pass < 4; ++pass)
        for (int64_t r = kStart[pass]; r < fh; r += kStep[pass]) {
          if (DGifGetLine(g.get(), line.data(), static_cast<int>(fw)) == GIF_ERROR)
            return fail("image data");
          put_row(r);
        }
    } else {
      for (int64_t r = 0; r < fh; ++r) {
        if (DGifGetLine(g.get(), line.data(), static_cast<int>(fw)) == GIF_ERROR)
          return fail("image data");
        put_row(r);
      }
    }
    const ColorMapObject* cm = d.ColorMap != nullptr ? d.ColorMap : g->SColorMap;
    RgbImage img;
    img.width = W;
    img.height = H;
    img.rgb.resize(static_cast<size_t>(W * H * 3));
    for (size_t i = 0; i < idx.size(); ++i) {
      const int v = idx[i];
      uint8_t* o = &img.rgb[i * 3];
      if (cm != nullptr && v < cm->ColorCount) {
        o[0] = cm->Colors[v].Red;
        o[1] = cm->Colors[v].Green;
        o[2] = cm->Colors[v].Blue;
      } else {
        o[0] = o[1] = o[2] = static_cast<uint8_t>(v);
      }
    }
    return img;
  }
}
#endif

}  // namespace

ImageFormat sniff_image_format(std::span<const uint8_t> b) {
  if (b.size() >= 3 && b[0] == 0xFF && b[1] == 0xD8 && b[2] == 0xFF) return ImageFormat::kJpeg;
  static const uint8_t kPng[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1A, '\n'};
  if (b.size() >= 8 && std::memcmp(b.data(), kPng, 8) == 0) return ImageFormat::kPng;
  if (b.size() >= 12 && std::memcmp(b.data(), "RIFF", 4) == 0 &&
      std::memcmp(b.data() + 8, "WEBP", 4) == 0)
    return ImageFormat::kWebp;
  if (b.size() >= 6 &&
      (std::memcmp(b.data(), "GIF87a", 6) == 0 || std::memcmp(b.data(), "GIF89a", 6) == 0))
    return ImageFormat::kGif;
  return ImageFormat::kUnknown;
}

bool gif_decoding_available() {
  return M3_HAVE_GIF != 0;
}

const char* image_format_name(ImageFormat f) {
  switch (f) {
    case ImageFormat::kJpeg:
      return "JPEG";
    case ImageFormat::kPng:
      return "PNG";
    case ImageFormat::kWebp:
      return "WebP";
    case ImageFormat::kGif:
      return "GIF";
    default:
      return "unknown";
  }
}

Result<RgbImage> decode_image(std::span<const uint8_t> bytes, int64_t max_pixels) {
  switch (sniff_image_format(bytes)) {
    case ImageFormat::kJpeg:
      return decode_jpeg(bytes, max_pixels);
    case ImageFormat::kPng:
      return decode_png(bytes, max_pixels);
    case ImageFormat::kWebp:
      return decode_webp(bytes, max_pixels);
    case ImageFormat::kGif:
#if M3_HAVE_GIF
      return decode_gif(bytes, max_pixels);
#else
      return make_error(ErrorCode::kInvalidArgument,
                        "GIF images need a build with giflib (libgif-dev), which this one lacks; "
                        "send the image as PNG");
#endif
    default:
      return make_error(ErrorCode::kInvalidArgument,
                        bytes.empty()
                            ? "the image is empty"
                            : "unsupported image format (supported: JPEG, PNG, WebP, GIF)");
  }
}

}  // namespace m3::vision
