// Tests for model/safetensors.cpp: files written here by a small writer (single, sharded, every
// dtype, metadata, corrupt variants) and one written by the Python `safetensors` package
// (fixtures/py_fixture.safetensors, tools/goldens/make_safetensors_fixture.py).
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/dtype.h"
#include "model/m3_model.h"
#include "model/safetensors.h"

namespace m3::model {
namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

// ---------------------------------------------------------------------------------------------
// A minimal safetensors writer for the tests.

struct Spec {
  std::string name;
  std::string dtype;  // safetensors spelling
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};

template <class T>
std::vector<uint8_t> to_bytes(const std::vector<T>& v) {
  std::vector<uint8_t> b(v.size() * sizeof(T));
  if (!b.empty()) std::memcpy(b.data(), v.data(), b.size());
  return b;
}

Spec f32_spec(const std::string& name, std::vector<int64_t> shape, float start = 0.f) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[i] = start + static_cast<float>(i);
  return Spec{name, "F32", std::move(shape), to_bytes(v)};
}

std::string header_json(const std::vector<Spec>& specs,
                        const std::map<std::string, std::string>& metadata) {
  json h = json::object();
  if (!metadata.empty()) h["__metadata__"] = metadata;
  uint64_t off = 0;
  for (const Spec& s : specs) {
    h[s.name] = {
        {"dtype", s.dtype}, {"shape", s.shape}, {"data_offsets", {off, off + s.bytes.size()}}};
    off += s.bytes.size();
  }
  return h.dump();
}

void write_raw(const std::string& path, const std::string& header, const std::vector<uint8_t>& data,
               uint64_t header_len_override = UINT64_MAX) {
  std::string hdr = header;
  while (hdr.size() % 8 != 0) hdr.push_back(' ');  // the reference writer pads to 8 bytes
  const uint64_t n = header_len_override == UINT64_MAX ? hdr.size() : header_len_override;
  std::ofstream out(path, std::ios::binary);
  ASSERT_TRUE(out) << path;
  for (int i = 0; i < 8; ++i) out.put(static_cast<char>((n >> (8 * i)) & 0xff));
  out.write(hdr.data(), static_cast<std::streamsize>(hdr.size()));
  out.write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size()));
}

void write_st(const std::string& path, const std::vector<Spec>& specs,
              const std::map<std::string, std::string>& metadata = {}) {
  std::vector<uint8_t> data;
  for (const Spec& s : specs) data.insert(data.end(), s.bytes.begin(), s.bytes.end());
  write_raw(path, header_json(specs, metadata), data);
}

void write_index(const std::string& path, const std::map<std::string, std::string>& weight_map) {
  json j = {{"metadata", {{"total_size", 0}}}, {"weight_map", weight_map}};
  std::ofstream(path) << j.dump(2);
}

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/m3_safetensors_test_XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string p(const std::string& name) const { return dir_ + "/" + name; }

  // Expects SafetensorsFile::open(path) to fail with a message containing every part.
  Error open_fails(const std::string& path, std::initializer_list<std::string> parts) {
    Result<std::unique_ptr<SafetensorsFile>> r = SafetensorsFile::open(path);
    EXPECT_FALSE(r.has_value()) << path << " opened although it should not";
    if (r) return Error{};
    for (const std::string& s : parts) {
      EXPECT_NE(r.error().message.find(s), std::string::npos)
          << "message lacks \"" << s << "\": " << r.error().message;
    }
    return r.error();
  }
  Error checkpoint_fails(std::initializer_list<std::string> parts,
                         const std::vector<std::string>& skip = {}) {
    Result<Checkpoint> r = Checkpoint::open(dir_, skip);
    EXPECT_FALSE(r.has_value()) << dir_ << " opened although it should not";
    if (r) return Error{};
    for (const std::string& s : parts) {
      EXPECT_NE(r.error().message.find(s), std::string::npos)
          << "message lacks \"" << s << "\": " << r.error().message;
    }
    return r.error();
  }

  std::string dir_;
};

// ---------------------------------------------------------------------------------------------
// Good files.

TEST_F(SafetensorsTest, SingleFileBf16RoundTrip) {
  // bf16 values written from f32 with round-to-nearest-even; reading back must give exactly the
  // rounded values (bf16 -> f32 is exact).
  const std::vector<float> src = {0.f, 1.f, -1.5f, 3.14159265f, 1e-3f, -65504.f, 1e30f, 2.5e-20f};
  std::vector<uint16_t> bits;
  for (float f : src) bits.push_back(f32_to_bf16(f));
  write_st(p("model.safetensors"),
           {Spec{"language_model.model.norm.weight", "BF16", {2, 4}, to_bytes(bits)},
            f32_spec("language_model.model.layers.3.block_sparse_moe.gate.weight", {3, 2}, 10.f)});
  Result<Checkpoint> r = Checkpoint::open(dir_);
  ASSERT_TRUE(r.has_value()) << r.error().message;
  const Checkpoint& cp = *r;
  EXPECT_EQ(cp.num_tensors(), 2u);
  EXPECT_EQ(cp.dir(), dir_);
  EXPECT_EQ(cp.total_bytes(), 8u * 2 + 6u * 4);
  EXPECT_EQ(cp.names(),
            (std::vector<std::string>{"language_model.model.layers.3.block_sparse_moe.gate.weight",
                                      "language_model.model.norm.weight"}));

  Result<const TensorInfo*> t = cp.get("language_model.model.norm.weight", {2, 4}, {DType::kBF16});
  ASSERT_TRUE(t.has_value()) << t.error().message;
  const TensorInfo& ti = **t;
  EXPECT_EQ(ti.dtype, DType::kBF16);
  EXPECT_EQ(ti.numel(), 8);
  EXPECT_EQ(ti.nbytes, 16u);
  EXPECT_EQ(ti.shape_str(), "[2, 4]");
  EXPECT_EQ(ti.file, p("model.safetensors"));
  for (size_t i = 0; i < src.size(); ++i) {
    uint16_t b;
    std::memcpy(&b, ti.data + 2 * i, 2);
    EXPECT_EQ(b, bits[i]) << i;
    EXPECT_EQ(bf16_to_f32(b), round_to_bf16(src[i])) << i;
  }
  const TensorInfo* g = cp.find("language_model.model.layers.3.block_sparse_moe.gate.weight");
  ASSERT_NE(g, nullptr);
  for (int i = 0; i < 6; ++i) {
    float f;
    std::memcpy(&f, g->data + 4 * i, 4);
    EXPECT_EQ(f, 10.f + i);
  }
  EXPECT_TRUE(cp.has("language_model.model.norm.weight"));
  EXPECT_FALSE(cp.has("language_model.model.norm"));
}

TEST_F(SafetensorsTest, EveryDtypeAndMetadata) {
  struct D {
    const char* name;
    DType dtype;
    size_t size;
  };
  const std::vector<D> all = {{"F32", DType::kF32, 4},   {"F16", DType::kF16, 2},
                              {"BF16", DType::kBF16, 2}, {"F8_E4M3", DType::kF8E4M3, 1},
                              {"U8", DType::kU8, 1},     {"I8", DType::kI8, 1},
                              {"I32", DType::kI32, 4},   {"I64", DType::kI64, 8},
                              {"F64", DType::kF64, 8},   {"BOOL", DType::kBool, 1}};
  std::vector<Spec> specs;
  for (size_t k = 0; k < all.size(); ++k) {
    std::vector<uint8_t> bytes(3 * 5 * all[k].size);
    for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(i * 7 + k);
    specs.push_back(Spec{std::string("t.") + all[k].name, all[k].name, {3, 5}, bytes});
  }
  write_st(p("x.safetensors"), specs, {{"format", "pt"}, {"note", "every dtype"}});
  Result<std::unique_ptr<SafetensorsFile>> r = SafetensorsFile::open(p("x.safetensors"));
  ASSERT_TRUE(r.has_value()) << r.error().message;
  const SafetensorsFile& f = **r;
  EXPECT_EQ(f.path(), p("x.safetensors"));
  EXPECT_EQ(f.metadata(),
            (std::map<std::string, std::string>{{"format", "pt"}, {"note", "every dtype"}}));
  ASSERT_EQ(f.tensors().size(), all.size());
  for (size_t k = 0; k < all.size(); ++k) {
    const TensorInfo& t = f.tensors().at(std::string("t.") + all[k].name);
    EXPECT_EQ(t.dtype, all[k].dtype) << all[k].name;
    EXPECT_EQ(t.shape, (std::vector<int64_t>{3, 5}));
    EXPECT_EQ(t.nbytes, 15 * all[k].size);
    EXPECT_EQ(std::vector<uint8_t>(t.data, t.data + t.nbytes), specs[k].bytes) << all[k].name;
  }
}

TEST_F(SafetensorsTest, ScalarAndEmptyTensors) {
  write_st(p("model.safetensors"), {f32_spec("scalar", {}, 4.f), Spec{"empty", "BF16", {0, 8}, {}},
                                    f32_spec("after", {2}, 1.f)});
  Result<Checkpoint> r = Checkpoint::open(dir_);
  ASSERT_TRUE(r.has_value()) << r.error().message;
  Result<const TensorInfo*> s = r->get("scalar", {}, {DType::kF32});
  ASSERT_TRUE(s.has_value()) << s.error().message;
  EXPECT_EQ((*s)->numel(), 1);
  EXPECT_EQ((*s)->shape_str(), "[]");
  float v;
  std::memcpy(&v, (*s)->data, 4);
  EXPECT_EQ(v, 4.f);
  Result<const TensorInfo*> e = r->get("empty", {0, 8}, {});
  ASSERT_TRUE(e.has_value()) << e.error().message;
  EXPECT_EQ((*e)->nbytes, 0u);
  EXPECT_EQ((*e)->numel(), 0);
}

TEST_F(SafetensorsTest, ShardedWithIndex) {
  write_st(p("model-00001-of-00002.safetensors"), {f32_spec("a", {2, 2}), f32_spec("b", {3}, 5.f)});
  write_st(p("model-00002-of-00002.safetensors"), {f32_spec("c", {4}, 100.f)});
  write_index(p("model.safetensors.index.json"), {{"a", "model-00001-of-00002.safetensors"},
                                                  {"b", "model-00001-of-00002.safetensors"},
                                                  {"c", "model-00002-of-00002.safetensors"}});
  // A stray file the index does not name must not be read (it would be a duplicate here).
  write_st(p("consolidated.safetensors"), {f32_spec("a", {2, 2})});
  Result<Checkpoint> r = Checkpoint::open(dir_);
  ASSERT_TRUE(r.has_value()) << r.error().message;
  EXPECT_EQ(r->num_tensors(), 3u);
  EXPECT_EQ(r->find("a")->file, p("model-00001-of-00002.safetensors"));
  EXPECT_EQ(r->find("c")->file, p("model-00002-of-00002.safetensors"));
  float v;
  std::memcpy(&v, r->find("c")->data + 12, 4);
  EXPECT_EQ(v, 103.f);
  std::memcpy(&v, r->find("b")->data + 8, 4);
  EXPECT_EQ(v, 7.f);
}

TEST_F(SafetensorsTest, CheckpointMoveKeepsMappings) {
  write_st(p("model.safetensors"), {f32_spec("w", {2}, 3.f)});
  Result<Checkpoint> r = Checkpoint::open(dir_);
  ASSERT_TRUE(r.has_value()) << r.error().message;
  Checkpoint moved = std::move(*r);
  const TensorInfo* t = moved.find("w");
  ASSERT_NE(t, nullptr);
  float v;
  std::memcpy(&v, t->data + 4, 4);
  EXPECT_EQ(v, 4.f);
}

TEST_F(SafetensorsTest, GlobsSortedFilesWithoutIndex) {
  write_st(p("b.safetensors"), {f32_spec("y", {1})});
  write_st(p("a.safetensors"), {f32_spec("x", {1})});
  std::ofstream(p("README.md")) << "not a tensor file";
  Result<Checkpoint> r = Checkpoint::open(dir_);
  ASSERT_TRUE(r.has_value()) << r.error().message;
  EXPECT_EQ(r->names(), (std::vector<std::string>{"x", "y"}));
  EXPECT_EQ(r->find("x")->file, p("a.safetensors"));
}

TEST_F(SafetensorsTest, ModelSafetensorsPreferredOverOthers) {
  write_st(p("model.safetensors"), {f32_spec("x", {1})});
  write_st(p("other.safetensors"), {f32_spec("x", {1})});  // would be a duplicate if globbed
  Result<Checkpoint> r = Checkpoint::open(dir_);
  ASSERT_TRUE(r.has_value()) << r.error().message;
  EXPECT_EQ(r->num_tensors(), 1u);
}

TEST_F(SafetensorsTest, SkipPrefixes) {
  write_st(p("text.safetensors"),
           {f32_spec("language_model.w", {2}), f32_spec("vision_tower.a", {2})});
  write_st(p("vision.safetensors"),
           {f32_spec("vision_tower.b", {2}), f32_spec("multi_modal_projector.c", {2})});
  // vision.safetensors holds only skipped tensors and is absent: with an index it is not opened.
  write_index(p("model.safetensors.index.json"),
              {{"language_model.w", "text.safetensors"},
               {"vision_tower.a", "text.safetensors"},
               {"vision_tower.b", "vision.safetensors"},
               {"multi_modal_projector.c", "vision.safetensors"}});
  fs::remove(p("vision.safetensors"));
  Result<Checkpoint> r = Checkpoint::open(dir_, {"vision_tower.", "multi_modal_projector."});
  ASSERT_TRUE(r.has_value()) << r.error().message;
  EXPECT_EQ(r->names(), std::vector<std::string>{"language_model.w"});
  EXPECT_FALSE(r->has("vision_tower.a"));
  // Without the skip the missing shard is an error.
  checkpoint_fails({"vision.safetensors", "missing"});
}

// ---------------------------------------------------------------------------------------------
// get() errors.

TEST_F(SafetensorsTest, GetErrors) {
  write_st(p("model.safetensors"), {f32_spec("w", {2, 3})});
  Result<Checkpoint> r = Checkpoint::open(dir_);
  ASSERT_TRUE(r.has_value()) << r.error().message;

  Result<const TensorInfo*> e = r->get("missing.weight", {8192, 6144}, {DType::kBF16});
  ASSERT_FALSE(e.has_value());
  EXPECT_EQ(e.error().code, ErrorCode::kNotFound);
  EXPECT_EQ(e.error().param, "missing.weight");
  EXPECT_EQ(e.error().message,
            "tensor 'missing.weight' not found in " + dir_ + "; expected shape [8192, 6144] BF16");

  e = r->get("w", {3, 2}, {DType::kF32});
  ASSERT_FALSE(e.has_value());
  EXPECT_NE(e.error().message.find("'w'"), std::string::npos);
  EXPECT_NE(e.error().message.find("has shape [2, 3], expected [3, 2]"), std::string::npos)
      << e.error().message;

  e = r->get("w", {2, 3}, {DType::kBF16, DType::kF8E4M3});
  ASSERT_FALSE(e.has_value());
  EXPECT_NE(e.error().message.find("has dtype F32, expected BF16 or F8_E4M3"), std::string::npos)
      << e.error().message;

  EXPECT_TRUE(r->get("w", {2, 3}, {DType::kBF16, DType::kF32}).has_value());
  EXPECT_TRUE(r->get("w", {2, 3}, {}).has_value());  // empty dtype list: any
  EXPECT_FALSE(r->get("w", {6}, {}).has_value());
}

// ---------------------------------------------------------------------------------------------
// Corrupt files.

TEST_F(SafetensorsTest, TruncatedFileNamesFirstTensorCut) {
  write_st(p("model.safetensors"),
           {f32_spec("first", {4}), f32_spec("second", {4}), f32_spec("third", {4})});
  const uint64_t full = fs::file_size(p("model.safetensors"));
  fs::resize_file(p("model.safetensors"), full - 20);  // cuts into "second" (bytes 16..32)
  Error e = open_fails(p("model.safetensors"),
                       {"truncated", "'second'", "at least " + std::to_string(full - 16),
                        "it is " + std::to_string(full - 20) + " bytes"});
  EXPECT_EQ(e.code, ErrorCode::kFormat);
  EXPECT_EQ(e.param, "second");
  checkpoint_fails({"truncated", "'second'"});
}

TEST_F(SafetensorsTest, HeaderLengthPastEof) {
  const std::string hdr = header_json({f32_spec("w", {2})}, {});
  write_raw(p("a.safetensors"), hdr, std::vector<uint8_t>(8, 0), 1u << 20);
  open_fails(p("a.safetensors"), {"header length 1048576", "past the end"});
  write_raw(p("b.safetensors"), hdr, {}, UINT64_MAX - 3);
  open_fails(p("b.safetensors"), {"past the end"});
  std::ofstream(p("c.safetensors")) << "abc";
  open_fails(p("c.safetensors"), {"3 bytes", "too short"});
  std::ofstream(p("d.safetensors"));
  open_fails(p("d.safetensors"), {"0 bytes"});
}

TEST_F(SafetensorsTest, BadHeaderJson) {
  write_raw(p("a.safetensors"), "{\"w\": {\"dtype\": \"F32\",", {});
  open_fails(p("a.safetensors"), {"not valid JSON"});
  write_raw(p("b.safetensors"), "[1, 2]", {});
  open_fails(p("b.safetensors"), {"JSON object"});
  write_raw(p("c.safetensors"), R"({"w": {"dtype": "F32", "shape": [1]}})",
            std::vector<uint8_t>(4));
  open_fails(p("c.safetensors"), {"'w'", "data_offsets"});
  write_raw(p("d.safetensors"), R"({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}})",
            std::vector<uint8_t>(4));
  open_fails(p("d.safetensors"), {"'w'", "shape"});
  write_raw(p("e.safetensors"), R"({"__metadata__": {"a": 1}})", {});
  open_fails(p("e.safetensors"), {"__metadata__", "must be a string"});
  write_raw(p("f.safetensors"), R"({"w": 5})", {});
  open_fails(p("f.safetensors"), {"'w'", "not an object"});
}

TEST_F(SafetensorsTest, UnknownDtype) {
  write_raw(p("a.safetensors"),
            R"({"w": {"dtype": "F8_E5M2", "shape": [2], "data_offsets": [0, 2]}})",
            std::vector<uint8_t>(2));
  Error e = open_fails(p("a.safetensors"), {"'w'", "\"F8_E5M2\"", "BF16", "F8_E4M3"});
  EXPECT_EQ(e.code, ErrorCode::kUnsupported);
}

TEST_F(SafetensorsTest, OffsetsDoNotMatchShape) {
  write_raw(p("a.safetensors"),
            R"({"w": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 8]}})",
            std::vector<uint8_t>(16));
  open_fails(p("a.safetensors"), {"'w'", "spanning 8 bytes", "[2, 3] BF16 needs 12 bytes"});
  write_raw(p("b.safetensors"), R"({"w": {"dtype": "U8", "shape": [0], "data_offsets": [4, 0]}})",
            std::vector<uint8_t>(8));
  open_fails(p("b.safetensors"), {"'w'", "end < begin"});
  write_raw(p("c.safetensors"),
            R"({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
                "b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]}})",
            std::vector<uint8_t>(8));
  open_fails(p("c.safetensors"), {"'a'", "'b'", "overlap"});
}

// ---------------------------------------------------------------------------------------------
// Directory-level errors.

TEST_F(SafetensorsTest, NoFiles) {
  Error e = checkpoint_fails({"no .safetensors files in " + dir_});
  EXPECT_EQ(e.code, ErrorCode::kNotFound);
  fs::remove_all(dir_);
  checkpoint_fails({dir_, "does not exist"});
  fs::create_directories(dir_);  // for TearDown
}

TEST_F(SafetensorsTest, MissingShard) {
  write_st(p("s1.safetensors"), {f32_spec("a", {1})});
  write_index(p("model.safetensors.index.json"),
              {{"a", "s1.safetensors"}, {"b", "s2.safetensors"}});
  Error e = checkpoint_fails({"shard s2.safetensors", "model.safetensors.index.json", "missing"});
  EXPECT_EQ(e.code, ErrorCode::kNotFound);
  EXPECT_EQ(e.param, "s2.safetensors");
}

TEST_F(SafetensorsTest, IndexedTensorAbsentFromShard) {
  write_st(p("s1.safetensors"), {f32_spec("a", {1})});
  write_st(p("s2.safetensors"), {f32_spec("c", {1})});
  write_index(p("model.safetensors.index.json"),
              {{"a", "s1.safetensors"}, {"b", "s2.safetensors"}});
  checkpoint_fails({"'b'", "s2.safetensors", "does not contain it"});
}

TEST_F(SafetensorsTest, BadIndex) {
  write_st(p("s1.safetensors"), {f32_spec("a", {1})});
  std::ofstream(p("model.safetensors.index.json")) << "{\"weight_map\": [}";
  checkpoint_fails({"model.safetensors.index.json", "not valid JSON"});
  std::ofstream(p("model.safetensors.index.json")) << "{\"metadata\": {}}";
  checkpoint_fails({"weight_map"});
}

TEST_F(SafetensorsTest, DuplicateTensorAcrossFiles) {
  write_st(p("a.safetensors"), {f32_spec("w", {1}), f32_spec("x", {1})});
  write_st(p("b.safetensors"), {f32_spec("w", {1})});
  Error e = checkpoint_fails({"'w'", "a.safetensors", "b.safetensors"});
  EXPECT_EQ(e.param, "w");
  // Skipping the duplicated name makes the directory loadable.
  Result<Checkpoint> r = Checkpoint::open(dir_, {"w"});
  ASSERT_TRUE(r.has_value()) << r.error().message;
  EXPECT_EQ(r->names(), std::vector<std::string>{"x"});
}

// ---------------------------------------------------------------------------------------------
// A file written by the Python safetensors package.

std::string fixture_path(const std::string& name) {
  return std::string(M3_SOURCE_DIR) + "/tests/unit/model/fixtures/" + name;
}

TEST(SafetensorsPython, ReadsReferenceWriterFile) {
  std::ifstream in(fixture_path("py_fixture_expected.json"));
  ASSERT_TRUE(in);
  const json doc = json::parse(in);
  Result<std::unique_ptr<SafetensorsFile>> r =
      SafetensorsFile::open(fixture_path("py_fixture.safetensors"));
  ASSERT_TRUE(r.has_value()) << r.error().message;
  const SafetensorsFile& f = **r;
  using StrMap = std::map<std::string, std::string>;
  EXPECT_EQ(f.metadata(), doc["metadata"].get<StrMap>());
  ASSERT_EQ(f.tensors().size(), doc["tensors"].size());

  for (auto it = doc["tensors"].begin(); it != doc["tensors"].end(); ++it) {
    SCOPED_TRACE(it.key());
    const json& want = *it;
    auto found = f.tensors().find(it.key());
    ASSERT_NE(found, f.tensors().end());
    const TensorInfo& t = found->second;
    EXPECT_EQ(dtype_name(t.dtype), want["dtype"].get<std::string>());
    EXPECT_EQ(t.shape, want["shape"].get<std::vector<int64_t>>());
    const size_t n = static_cast<size_t>(t.numel());
    EXPECT_EQ(t.nbytes, n * dtype_size(t.dtype));
    if (want.contains("bits")) {  // BF16 / F8: the exact stored codes
      const auto bits = want["bits"].get<std::vector<uint32_t>>();
      ASSERT_EQ(bits.size(), n);
      for (size_t i = 0; i < n; ++i) {
        uint32_t b = 0;
        std::memcpy(&b, t.data + i * dtype_size(t.dtype), dtype_size(t.dtype));
        EXPECT_EQ(b, bits[i]) << i;
      }
    }
    if (want.contains("values")) {
      // Decoded values must equal Python's exactly: every conversion here is exact (widening
      // to f32/f64, bf16/f8 decoding by bit manipulation).
      const json& vals = want["values"];
      ASSERT_EQ(vals.size(), n);
      for (size_t i = 0; i < n; ++i) {
        double got = 0;
        switch (t.dtype) {
          case DType::kF32: {
            float v;
            std::memcpy(&v, t.data + 4 * i, 4);
            got = v;
            break;
          }
          case DType::kF64: {
            std::memcpy(&got, t.data + 8 * i, 8);
            break;
          }
          case DType::kF16: {
            uint16_t h;
            std::memcpy(&h, t.data + 2 * i, 2);
            got = f16_to_f32(h);
            break;
          }
          case DType::kBF16: {
            uint16_t h;
            std::memcpy(&h, t.data + 2 * i, 2);
            got = bf16_to_f32(h);
            break;
          }
          case DType::kF8E4M3:
            got = fp8_e4m3_to_f32(t.data[i]);
            break;
          default:
            FAIL() << "unexpected float dtype";
        }
        if (vals[i].is_null()) {
          EXPECT_TRUE(std::isnan(got)) << i;
        } else {
          const double w = vals[i].get<double>();
          EXPECT_EQ(got, w) << i;
          EXPECT_EQ(std::signbit(got), std::signbit(w)) << i;  // -0.0 stays -0.0
        }
      }
    }
    if (want.contains("ints")) {
      const auto ints = want["ints"].get<std::vector<int64_t>>();
      ASSERT_EQ(ints.size(), n);
      for (size_t i = 0; i < n; ++i) {
        int64_t got = 0;
        switch (t.dtype) {
          case DType::kU8:
            got = t.data[i];
            break;
          case DType::kBool:
            got = t.data[i];
            break;
          case DType::kI8:
            got = static_cast<int8_t>(t.data[i]);
            break;
          case DType::kI32: {
            int32_t v;
            std::memcpy(&v, t.data + 4 * i, 4);
            got = v;
            break;
          }
          case DType::kI64:
            std::memcpy(&got, t.data + 8 * i, 8);
            break;
          default:
            FAIL() << "unexpected int dtype";
        }
        EXPECT_EQ(got, ints[i]) << i;
      }
    }
  }
}

TEST(SafetensorsPython, CheckpointOverFixtureDir) {
  // The fixture directory has exactly one .safetensors file (the glob path).
  Result<Checkpoint> r =
      Checkpoint::open(std::string(M3_SOURCE_DIR) + "/tests/unit/model/fixtures");
  ASSERT_TRUE(r.has_value()) << r.error().message;
  EXPECT_EQ(r->num_tensors(), 12u);
  EXPECT_TRUE(r->get("layers.0.bf16", {3, 4}, {DType::kBF16}).has_value());
  EXPECT_TRUE(r->get("layers.1.f8", {16, 16}, {DType::kF8E4M3}).has_value());
}

// The fp8 K/V scales (docs/KV_CACHE.md): read per layer where the checkpoint has them (vLLM's
// names, either spelling), 1.0 elsewhere; a scale of the wrong shape or value names its tensor.
TEST_F(SafetensorsTest, KvScalesLoadPerLayerOrFailNamingTheTensor) {
  M3Config cfg;
  cfg.num_hidden_layers = 3;
  auto scalar = [](const std::string& name, float v) {
    return Spec{name, "F32", {}, to_bytes(std::vector<float>{v})};
  };
  write_st(p("model.safetensors"),
           {scalar("language_model.model.layers.0.self_attn.k_scale", 0.5f),
            scalar("language_model.model.layers.2.self_attn.v_proj.v_scale", 4.f)});
  {
    auto ck = Checkpoint::open(dir_);
    ASSERT_TRUE(ck.has_value()) << ck.error().message;
    ASSERT_TRUE(load_kv_scales(*ck, cfg).has_value());
    EXPECT_EQ(cfg.k_scale(0), 0.5f);
    EXPECT_EQ(cfg.k_scale(1), 1.f);
    EXPECT_EQ(cfg.v_scale(2), 4.f);
    EXPECT_EQ(cfg.v_scale(0), 1.f);
  }
  M3Config none;
  none.num_hidden_layers = 3;
  write_st(p("model.safetensors"), {f32_spec("model.norm.weight", {4})});
  {
    auto ck = Checkpoint::open(dir_);
    ASSERT_TRUE(ck.has_value());
    ASSERT_TRUE(load_kv_scales(*ck, none).has_value());
    EXPECT_TRUE(none.kv_k_scale.empty());
    EXPECT_EQ(none.k_scale(2), 1.f);
  }
  for (const Spec& bad : {f32_spec("model.layers.1.self_attn.k_scale", {4}),
                          scalar("model.layers.1.self_attn.k_scale", -1.f)}) {
    write_st(p("model.safetensors"), {bad});
    auto ck = Checkpoint::open(dir_);
    ASSERT_TRUE(ck.has_value());
    M3Config c;
    c.num_hidden_layers = 3;
    auto st = load_kv_scales(*ck, c);
    ASSERT_FALSE(st.has_value());
    EXPECT_NE(st.error().message.find("model.layers.1.self_attn.k_scale"), std::string::npos)
        << st.error().message;
  }
}

}  // namespace
}  // namespace m3::model
