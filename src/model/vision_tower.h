// VisionTower: the MiniMax-M3 vision tower, projector and patch merge (m3-model.md §2.4, §7) on
// the CPU: the weights read in place from the checkpoint (bf16/f32), and the one forward written
// over an ops class (model/vision_forward.h: VisionForward<Ops>; VisionCpuOps here, a GPU ops
// class later). encode() turns the processor's patch rows of one request's images into the
// text-hidden embeddings that replace their image placeholder tokens, image after image.
// Called by M3Model::encode_images (the CPU backend, on the engine thread) and the tower tests.
// Invariant: after load succeeds every view has the shape the config implies; encode() is not
// reentrant (it owns its scratch) and is deterministic for a given input.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "core/error.h"
#include "kernels/views.h"
#include "model/config.h"
#include "model/safetensors.h"

namespace m3::model {

// One image (or video segment) as the processor laid it out: grid in patches and
// grid_t*grid_h*grid_w rows of patch_row_size() floats in merge-window order.
struct VisionImage {
  int64_t grid_t = 1, grid_h = 0, grid_w = 0;
  const float* patches = nullptr;
  int64_t num_patches() const { return grid_t * grid_h * grid_w; }
};

struct VisionLayerWeights {
  kernels::VecRef ln1_w, ln1_b, ln2_w, ln2_b;
  kernels::MatRef q, k, v, o, fc1, fc2;
  kernels::VecRef q_b, k_b, v_b, o_b, fc1_b, fc2_b;
};

struct VisionWeights {
  kernels::MatRef patch_embed;  // [hidden, patch_row_size] (the Conv3d kernel, flattened)
  kernels::VecRef pre_ln_w, pre_ln_b;
  std::vector<VisionLayerWeights> layers;
  kernels::MatRef proj1, proj2, merge1, merge2;          // projector 1280->P->H, merge 4H->P->H
  kernels::VecRef proj1_b, proj2_b, merge1_b, merge2_b;  // n == 0 without projector bias
  std::shared_ptr<Checkpoint> checkpoint;                // keeps the mappings alive
};

// Loads and checks every vision tensor `cfg.vision` implies. The encoder MLP is read under
// `mlp.` (the shipped checkpoint) or `block_sparse_moe.` (what transformers 5.17 writes).
// Errors name the tensor, what was found and the expected shape.
Result<std::unique_ptr<VisionWeights>> load_vision_weights(std::shared_ptr<Checkpoint> ckpt,
                                                           const M3Config& cfg);

class VisionCpuOps;
template <class Ops>
class VisionForward;

class VisionTower {
 public:
  VisionTower(const M3Config& cfg, std::unique_ptr<VisionWeights> w);
  ~VisionTower();
  static Result<std::unique_ptr<VisionTower>> load(std::shared_ptr<Checkpoint> ckpt,
                                                   const M3Config& cfg);

  // Tokens an image of this grid becomes.
  int64_t num_tokens(const VisionImage& img) const;
  // embeds: [sum of num_tokens, text hidden] f32 for `images` in order. tower_hidden (may be
  // null): the encoder's last hidden state [sum of patches, vision hidden]. Under the
  // transformers layout the images of one call attend to each other (as transformers' one
  // forward does); under the reference layout each image is its own attention block.
  void encode(std::span<const VisionImage> images, std::vector<float>* embeds,
              std::vector<float>* tower_hidden = nullptr) const;

  const M3Config& config() const { return cfg_; }
  // The weights as loaded (host views; the GPU tower uploads them).
  const VisionWeights& weights() const { return *w_; }

 private:
  M3Config cfg_;
  std::unique_ptr<VisionWeights> w_;
  std::unique_ptr<VisionCpuOps> ops_;
  std::unique_ptr<VisionForward<VisionCpuOps>> fw_;
};

}  // namespace m3::model
