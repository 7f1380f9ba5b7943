// `m3serve process-image FILE...`: the image processor from the command line (issue #20), so its
// output can be checked against transformers' MiniMaxM3VLImageProcessor from outside:
//   m3serve process-image a.png b.jpg [--out DIR] [--min-pixels N] [--max-pixels N]
// prints one JSON object per image: {"file", "width", "height", "resized_height",
// "resized_width", "grid_thw", "num_tokens", "pixel_values_xxh64"} (XXH64, seed 0, of the
// float32 little-endian pixel values [patches, 1176]); with --out, also writes them raw to
// DIR/<file name>.f32 ("pixel_values_file"). A file that cannot be processed prints
// {"file", "error"} and makes the exit code 1; the other files are still processed.
#include <xxhash.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "app/commands.h"
#include "vision/image_decode.h"
#include "vision/image_processor.h"

namespace m3::app {

namespace {

struct ImageArgs {
  std::vector<std::string> files;
  std::string out_dir;
  int64_t min_pixels = vision::ProcessorConfig{}.min_pixels;
  int64_t max_pixels = vision::ProcessorConfig{}.max_pixels;
};

int run_image(const ImageArgs& a) {
  namespace fs = std::filesystem;
  if (!a.out_dir.empty()) {
    std::error_code ec;
    fs::create_directories(a.out_dir, ec);
    if (ec) return fail("--out " + a.out_dir + ": " + ec.message());
  }
  vision::ProcessorConfig pc;
  pc.min_pixels = a.min_pixels;
  pc.max_pixels = a.max_pixels;
  int rc = 0;
  for (const std::string& file : a.files) {
    nlohmann::ordered_json j;
    j["file"] = file;
    std::ifstream f(file, std::ios::binary);
    std::vector<uint8_t> bytes{std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
    auto img =
        f ? vision::decode_image(bytes, int64_t{1} << 28)
          : Result<vision::RgbImage>(make_error(ErrorCode::kNotFound, "cannot read " + file));
    Result<vision::ProcessedImage> p =
        img ? vision::preprocess_image(*img, pc)
            : Result<vision::ProcessedImage>(tl::unexpected(img.error()));
    if (!p) {
      j["error"] = p.error().message;
      std::printf("%s\n", j.dump().c_str());
      rc = 1;
      continue;
    }
    j["width"] = img->width;
    j["height"] = img->height;
    j["resized_height"] = p->resized_h;
    j["resized_width"] = p->resized_w;
    j["grid_thw"] = {p->grid_t, p->grid_h, p->grid_w};
    j["num_tokens"] = vision::num_image_tokens(*p, pc.merge_size);
    char hex[17];
    std::snprintf(hex, sizeof(hex), "%016llx",
                  static_cast<unsigned long long>(
                      XXH64(p->pixel_values.data(), p->pixel_values.size() * sizeof(float), 0)));
    j["pixel_values_xxh64"] = hex;
    if (!a.out_dir.empty()) {
      const fs::path out = fs::path(a.out_dir) / (fs::path(file).filename().string() + ".f32");
      std::ofstream o(out, std::ios::binary);
      o.write(reinterpret_cast<const char*>(p->pixel_values.data()),
              static_cast<std::streamsize>(p->pixel_values.size() * sizeof(float)));
      if (!o) return fail("cannot write " + out.string());
      j["pixel_values_file"] = out.string();
    }
    std::printf("%s\n", j.dump().c_str());
  }
  return rc;
}

}  // namespace

RunFn register_image(CLI::App& app) {
  auto args = std::make_shared<ImageArgs>();
  CLI::App* sub = app.add_subcommand(
      "process-image",
      "Run the MiniMax-M3 image processor (as transformers' MiniMaxM3VLImageProcessor) on "
      "image files and print the grid and a hash of the pixel values");
  sub->add_option("files", args->files, "JPEG, PNG, WebP or GIF files")->required()->take_all();
  sub->add_option("--out", args->out_dir,
                  "Write each image's float32 pixel values to DIR/<name>.f32");
  sub->add_option("--min-pixels", args->min_pixels, "smart_resize's min_pixels")
      ->capture_default_str();
  sub->add_option("--max-pixels", args->max_pixels, "smart_resize's max_pixels")
      ->capture_default_str();
  return [sub, args] { return sub->parsed() ? run_image(*args) : 0; };
}

}  // namespace m3::app
