// Safetensors reader (see safetensors.h). Format: 8-byte little-endian header length N, N bytes
// of JSON {name: {dtype, shape, data_offsets: [begin, end)}, "__metadata__": {str: str}}, then
// the data section; offsets are relative to the data section. Everything in the header is
// validated before a TensorInfo is published, so a TensorInfo's bytes are always inside the map.
#include "model/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

namespace m3::model {

namespace fs = std::filesystem;
using json = nlohmann::json;

// The safetensors format caps the header at 100 MB; a larger length means a corrupt file.
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;
// Guards numel*dtype_size against overflow; no real tensor comes near 2^56 bytes.
constexpr uint64_t kMaxTensorBytes = 1ull << 56;

// A read-only private mapping of a whole file. Owns the fd and the mapping.
class MappedFile {
 public:
  static Result<std::unique_ptr<MappedFile>> open(const std::string& path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      const int err = errno;
      return make_error(err == ENOENT ? ErrorCode::kNotFound : ErrorCode::kIo,
                        "cannot open " + path + ": " + std::strerror(err));
    }
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
      const int err = errno;
      ::close(fd);
      return make_error(ErrorCode::kIo, "cannot stat " + path + ": " + std::strerror(err));
    }
    if (!S_ISREG(st.st_mode)) {
      ::close(fd);
      return make_error(ErrorCode::kFormat, path + " is not a regular file");
    }
    auto m = std::unique_ptr<MappedFile>(new MappedFile());
    m->fd_ = fd;
    m->size_ = static_cast<size_t>(st.st_size);
    if (m->size_ > 0) {
      void* p = ::mmap(nullptr, m->size_, PROT_READ, MAP_PRIVATE, fd, 0);
      if (p == MAP_FAILED) {
        const int err = errno;
        return make_error(ErrorCode::kIo, "cannot mmap " + path + " (" + std::to_string(m->size_) +
                                              " bytes): " + std::strerror(err));
      }
      m->data_ = static_cast<const uint8_t*>(p);
    }
    return m;
  }

  ~MappedFile() {
    if (data_ != nullptr) ::munmap(const_cast<uint8_t*>(data_), size_);
    if (fd_ >= 0) ::close(fd_);
  }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  MappedFile() = default;
  int fd_ = -1;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

namespace {

std::string shape_to_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

std::string dtypes_to_string(const std::vector<DType>& dtypes) {
  std::string s;
  for (size_t i = 0; i < dtypes.size(); ++i) {
    if (i) s += " or ";
    s += dtype_name(dtypes[i]);
  }
  return s;
}

constexpr const char* kKnownDtypes = "F32, F16, BF16, F8_E4M3, U8, I8, I32, I64, F64, BOOL";

bool is_uint(const json& v) {
  return v.is_number_unsigned() || (v.is_number_integer() && v.get<int64_t>() >= 0);
}

// One header entry before it is checked against the file size.
struct Entry {
  TensorInfo info;
  uint64_t begin = 0;
  uint64_t end = 0;
};

Result<Entry> parse_entry(const std::string& path, const std::string& name, const json& v) {
  auto bad = [&](const std::string& what) {
    return make_error(ErrorCode::kFormat,
                      path + ": header entry for tensor '" + name + "' " + what +
                          "; the file is not valid safetensors (re-download or re-save it)",
                      name);
  };
  if (!v.is_object()) return bad("is not an object");
  Entry e;
  e.info.name = name;
  e.info.file = path;
  auto dt = v.find("dtype");
  if (dt == v.end() || !dt->is_string()) return bad("has no string \"dtype\"");
  const std::string dname = dt->get<std::string>();
  const std::optional<DType> d = dtype_from_name(dname);
  if (!d) {
    return make_error(ErrorCode::kUnsupported,
                      path + ": tensor '" + name + "' has dtype \"" + dname +
                          "\", which m3serve does not read (known: " + kKnownDtypes + ")",
                      name);
  }
  e.info.dtype = *d;
  auto sh = v.find("shape");
  if (sh == v.end() || !sh->is_array()) return bad("has no \"shape\" list");
  uint64_t numel = 1;
  for (const json& x : *sh) {
    if (!is_uint(x))
      return bad("has a shape entry that is not a non-negative integer: " + sh->dump());
    const uint64_t dim = x.get<uint64_t>();
    if (dim > kMaxTensorBytes || __builtin_mul_overflow(numel, dim, &numel) ||
        numel > kMaxTensorBytes) {
      return bad("has an impossibly large shape " + sh->dump());
    }
    e.info.shape.push_back(static_cast<int64_t>(dim));
  }
  auto off = v.find("data_offsets");
  if (off == v.end() || !off->is_array() || off->size() != 2 || !is_uint((*off)[0]) ||
      !is_uint((*off)[1])) {
    return bad("needs \"data_offsets\": [begin, end] of non-negative integers");
  }
  e.begin = (*off)[0].get<uint64_t>();
  e.end = (*off)[1].get<uint64_t>();
  if (e.end < e.begin) return bad("has data_offsets " + off->dump() + " with end < begin");
  const uint64_t want = numel * dtype_size(e.info.dtype);
  if (e.end - e.begin != want) {
    return bad("has data_offsets " + off->dump() + " spanning " + std::to_string(e.end - e.begin) +
               " bytes, but shape " + shape_to_string(e.info.shape) + " " + dname + " needs " +
               std::to_string(want) + " bytes");
  }
  e.info.nbytes = static_cast<size_t>(want);
  return e;
}

}  // namespace

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string TensorInfo::shape_str() const {
  return shape_to_string(shape);
}

SafetensorsFile::~SafetensorsFile() = default;

Result<std::unique_ptr<SafetensorsFile>> SafetensorsFile::open(const std::string& path) {
  M3_TRY(std::unique_ptr<MappedFile> map, MappedFile::open(path));
  const size_t file_size = map->size();
  if (file_size < 8) {
    return make_error(ErrorCode::kFormat,
                      path + " is " + std::to_string(file_size) +
                          " bytes, too short for a safetensors header (8-byte length + JSON); "
                          "the file is truncated or not safetensors");
  }
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | map->data()[i];  // little-endian
  if (header_len > file_size - 8) {
    return make_error(ErrorCode::kFormat, path + ": header length " + std::to_string(header_len) +
                                              " runs past the end of the file (" +
                                              std::to_string(file_size) +
                                              " bytes); the file is truncated or not safetensors");
  }
  if (header_len > kMaxHeaderBytes) {
    return make_error(ErrorCode::kFormat, path + ": header length " + std::to_string(header_len) +
                                              " exceeds the 100 MB safetensors limit; the file "
                                              "is corrupt or not safetensors");
  }
  const char* hdr = reinterpret_cast<const char*>(map->data() + 8);
  json header;
  try {
    header = json::parse(hdr, hdr + header_len);
  } catch (const json::parse_error& e) {
    return make_error(ErrorCode::kFormat, path + ": the safetensors header is not valid JSON (" +
                                              e.what() +
                                              "); the file is corrupt or not safetensors");
  }
  if (!header.is_object()) {
    return make_error(ErrorCode::kFormat, path + ": the safetensors header must be a JSON object");
  }

  auto f = std::unique_ptr<SafetensorsFile>(new SafetensorsFile());
  f->path_ = path;
  std::vector<Entry> entries;
  try {
    for (auto it = header.begin(); it != header.end(); ++it) {
      if (it.key() == "__metadata__") {
        if (!it->is_object()) {
          return make_error(ErrorCode::kFormat,
                            path + ": __metadata__ must be an object of strings");
        }
        for (auto m = it->begin(); m != it->end(); ++m) {
          if (!m->is_string()) {
            return make_error(ErrorCode::kFormat, path + ": __metadata__[\"" + m.key() +
                                                      "\"] must be a string, got " + m->dump());
          }
          f->metadata_[m.key()] = m->get<std::string>();
        }
        continue;
      }
      M3_TRY(Entry e, parse_entry(path, it.key(), *it));
      entries.push_back(std::move(e));
    }
  } catch (const json::exception& e) {
    return make_error(ErrorCode::kFormat, path + ": unexpected header content: " + e.what());
  }

  // Check the data ranges in file order, so a truncated file names the first tensor it cuts.
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return a.begin < b.begin || (a.begin == b.begin && a.end < b.end);
  });
  const uint64_t data_start = 8 + header_len;
  const uint64_t data_size = file_size - data_start;
  uint64_t prev_end = 0;
  const std::string* prev_name = nullptr;
  for (const Entry& e : entries) {
    if (e.end > data_size) {
      return make_error(ErrorCode::kFormat,
                        path + " is truncated: tensor '" + e.info.name + "' needs data bytes [" +
                            std::to_string(e.begin) + ", " + std::to_string(e.end) +
                            "), so the file must be at least " +
                            std::to_string(data_start + e.end) + " bytes, but it is " +
                            std::to_string(file_size) + " bytes; re-download this file",
                        e.info.name);
    }
    if (e.begin < prev_end && e.end > e.begin) {
      return make_error(ErrorCode::kFormat,
                        path + ": tensors '" + *prev_name + "' and '" + e.info.name +
                            "' overlap in the data section; the file is corrupt",
                        e.info.name);
    }
    if (e.end > e.begin) {
      prev_end = e.end;
      prev_name = &e.info.name;
    }
  }
  for (Entry& e : entries) {
    e.info.data = map->data() + data_start + e.begin;
    std::string name = e.info.name;
    f->tensors_.emplace(std::move(name), std::move(e.info));
  }
  f->map_ = std::move(map);
  return f;
}

namespace {

bool skipped(const std::string& name, const std::vector<std::string>& skip_prefixes) {
  for (const std::string& p : skip_prefixes) {
    if (name.compare(0, p.size(), p) == 0) return true;
  }
  return false;
}

Result<std::string> read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return make_error(ErrorCode::kIo, "cannot read " + path);
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return make_error(ErrorCode::kIo, "error reading " + path);
  return ss.str();
}

// model.safetensors.index.json -> weight_map (tensor name -> shard file name).
Result<std::map<std::string, std::string>> read_weight_map(const std::string& path) {
  M3_TRY(std::string text, read_text_file(path));
  std::map<std::string, std::string> out;
  try {
    const json j = json::parse(text);
    if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object()) {
      return make_error(ErrorCode::kFormat,
                        path + " has no \"weight_map\" object (tensor name -> shard file)");
    }
    for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
      if (!it->is_string()) {
        return make_error(ErrorCode::kFormat, path + ": weight_map[\"" + it.key() +
                                                  "\"] must be a file name, got " + it->dump());
      }
      out[it.key()] = it->get<std::string>();
    }
  } catch (const json::exception& e) {
    return make_error(ErrorCode::kFormat, path + " is not valid JSON: " + e.what());
  }
  return out;
}

}  // namespace

Result<Checkpoint> Checkpoint::open(const std::string& model_dir,
                                    const std::vector<std::string>& skip_prefixes) {
  std::error_code ec;
  if (!fs::is_directory(model_dir, ec)) {
    return make_error(ErrorCode::kNotFound,
                      "model directory " + model_dir + " does not exist or is not a directory");
  }
  Checkpoint cp;
  cp.dir_ = model_dir;
  const fs::path dir(model_dir);
  const fs::path index_path = dir / "model.safetensors.index.json";

  std::vector<std::string> shard_names;  // file names inside dir, in open order
  std::map<std::string, std::string> weight_map;
  bool have_index = fs::is_regular_file(index_path, ec);
  if (have_index) {
    M3_TRY(weight_map, read_weight_map(index_path.string()));
    std::set<std::string> needed;
    for (const auto& [name, file] : weight_map) {
      // A shard holding only skipped tensors (e.g. the vision tower) need not be opened.
      if (!skipped(name, skip_prefixes)) needed.insert(file);
    }
    shard_names.assign(needed.begin(), needed.end());
  } else if (fs::is_regular_file(dir / "model.safetensors", ec)) {
    shard_names.push_back("model.safetensors");
  } else {
    for (const auto& de : fs::directory_iterator(dir, ec)) {
      if (de.path().extension() == ".safetensors" && de.is_regular_file(ec)) {
        shard_names.push_back(de.path().filename().string());
      }
    }
    if (ec) {
      return make_error(ErrorCode::kIo, "cannot list " + model_dir + ": " + ec.message());
    }
    std::sort(shard_names.begin(), shard_names.end());
    if (shard_names.empty()) {
      return make_error(ErrorCode::kNotFound,
                        "no .safetensors files in " + model_dir +
                            "; point --model at a directory holding the checkpoint's "
                            "*.safetensors (and model.safetensors.index.json when sharded)");
    }
  }

  std::map<std::string, const SafetensorsFile*> by_name;
  for (const std::string& shard : shard_names) {
    const std::string path = (dir / shard).string();
    if (have_index && !fs::exists(dir / shard, ec)) {
      return make_error(ErrorCode::kNotFound,
                        "shard " + shard + " named in " + index_path.string() +
                            " is missing from " + model_dir +
                            "; download it (or the index is stale)",
                        shard);
    }
    M3_TRY(std::unique_ptr<SafetensorsFile> file, SafetensorsFile::open(path));
    std::shared_ptr<SafetensorsFile> owned(std::move(file));
    by_name[shard] = owned.get();
    for (const auto& [name, info] : owned->tensors()) {
      if (skipped(name, skip_prefixes)) continue;
      auto [it, inserted] = cp.index_.emplace(name, &info);
      if (!inserted) {
        return make_error(ErrorCode::kFormat,
                          "tensor '" + name + "' is in both " + it->second->file + " and " + path +
                              "; a checkpoint must hold each tensor once (remove the stray file)",
                          name);
      }
    }
    cp.files_.push_back(std::move(owned));
  }

  // Every tensor the index promises must be where it says.
  for (const auto& [name, shard] : weight_map) {
    if (skipped(name, skip_prefixes)) continue;
    const SafetensorsFile* f = by_name.at(shard);
    if (f->tensors().count(name) == 0) {
      return make_error(ErrorCode::kFormat,
                        "tensor '" + name + "' is listed in " + index_path.string() + " under " +
                            shard +
                            " but that file does not contain it; the index and shards do "
                            "not match (re-download)",
                        name);
    }
  }
  return cp;
}

const TensorInfo* Checkpoint::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : it->second;
}

Result<const TensorInfo*> Checkpoint::get(const std::string& name,
                                          const std::vector<int64_t>& shape,
                                          const std::vector<DType>& dtypes) const {
  const TensorInfo* t = find(name);
  std::string want_dtype;
  if (!dtypes.empty()) {
    want_dtype.push_back(' ');
    want_dtype.append(dtypes_to_string(dtypes));
  }
  if (t == nullptr) {
    return make_error(ErrorCode::kNotFound,
                      "tensor '" + name + "' not found in " + dir_ + "; expected shape " +
                          shape_to_string(shape) + want_dtype,
                      name);
  }
  if (t->shape != shape) {
    return make_error(ErrorCode::kFormat,
                      "tensor '" + name + "' in " + t->file + " has shape " + t->shape_str() +
                          ", expected " + shape_to_string(shape) +
                          "; the checkpoint does not match config.json",
                      name);
  }
  if (!dtypes.empty() && std::find(dtypes.begin(), dtypes.end(), t->dtype) == dtypes.end()) {
    return make_error(ErrorCode::kUnsupported,
                      "tensor '" + name + "' in " + t->file + " has dtype " + dtype_name(t->dtype) +
                          ", expected" + want_dtype,
                      name);
  }
  return t;
}

std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> out;
  out.reserve(index_.size());
  for (const auto& [name, info] : index_) out.push_back(name);
  return out;
}

size_t Checkpoint::total_bytes() const {
  size_t n = 0;
  for (const auto& [name, info] : index_) n += info->nbytes;
  return n;
}

}  // namespace m3::model
