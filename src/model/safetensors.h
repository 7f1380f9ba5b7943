// Safetensors reader: memory-maps .safetensors files (single file or sharded through
// model.safetensors.index.json) and exposes tensors in place, without copying.
// Called by model/weights.cpp. Invariant: every TensorInfo's data range lies inside its mapped
// file (checked at open: a truncated file is an error naming the tensor), and the mappings
// live as long as the Checkpoint.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"

namespace m3::model {

struct TensorInfo {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;  // inside the mapping
  size_t nbytes = 0;
  std::string file;  // file it came from (for messages)

  int64_t numel() const;
  std::string shape_str() const;  // "[8192, 6144]"
};

class MappedFile;  // defined in safetensors.cpp

class SafetensorsFile {
 public:
  static Result<std::unique_ptr<SafetensorsFile>> open(const std::string& path);
  ~SafetensorsFile();
  const std::map<std::string, TensorInfo>& tensors() const { return tensors_; }
  const std::string& path() const { return path_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  SafetensorsFile() = default;
  std::string path_;
  std::unique_ptr<MappedFile> map_;
  std::map<std::string, TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

// All tensors of a model directory.
class Checkpoint {
 public:
  // Opens model.safetensors.index.json when present (every shard it names must exist), else
  // model.safetensors, else every *.safetensors in the directory. `skip_prefixes`: tensors
  // whose names start with one of these are not indexed (e.g. vision tensors for a text-only
  // load); their files are still mapped if they hold other tensors.
  static Result<Checkpoint> open(const std::string& model_dir,
                                 const std::vector<std::string>& skip_prefixes = {});

  const TensorInfo* find(const std::string& name) const;
  bool has(const std::string& name) const { return find(name) != nullptr; }
  // The tensor, checked: present, of one of `dtypes` (empty: any dtype), and of `shape` (exact;
  // {} is a scalar). The error names the tensor, what was found, and the expected shape/dtype.
  Result<const TensorInfo*> get(const std::string& name, const std::vector<int64_t>& shape,
                                const std::vector<DType>& dtypes) const;
  std::vector<std::string> names() const;
  size_t num_tensors() const { return index_.size(); }
  size_t total_bytes() const;
  const std::string& dir() const { return dir_; }

 private:
  std::string dir_;
  std::vector<std::shared_ptr<SafetensorsFile>> files_;
  std::map<std::string, const TensorInfo*> index_;
};

}  // namespace m3::model
