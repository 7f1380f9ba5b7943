#include "dist/nccl_communicator.h"

#include "core/check.h"
#include "dist/nccl_env.h"
#include "gpu/cuda_check.h"

// A failing collective after start-up is a fault (like a CUDA error): end the process, naming it.
#define M3_NCCL_CHECK(expr)                                                                  \
  do {                                                                                       \
    ncclResult_t m3_nccl_ = (expr);                                                          \
    M3_CHECK(m3_nccl_ == ncclSuccess, "%s failed: %s", #expr, ncclGetErrorString(m3_nccl_)); \
  } while (0)

namespace m3::dist {

namespace {
Error nccl_error(const std::string& what, ncclResult_t r) {
  return Error{ErrorCode::kUnavailable, what + " failed: " + ncclGetErrorString(r), ""};
}
}  // namespace

Result<ncclUniqueId> make_nccl_unique_id() {
  M3_TRY_STATUS(prepare_nccl_environment());
  ncclUniqueId id;
  const ncclResult_t r = ncclGetUniqueId(&id);
  if (r != ncclSuccess) return tl::unexpected(nccl_error("ncclGetUniqueId", r));
  return id;
}

Result<std::unique_ptr<NcclCommunicator>> NcclCommunicator::create(int rank, int world_size,
                                                                   int device,
                                                                   const ncclUniqueId& id) {
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    return make_error(ErrorCode::kInvalidArgument,
                      "NCCL rank " + std::to_string(rank) + " is outside a group of " +
                          std::to_string(world_size) + " ranks",
                      "rank");
  }
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || device < 0 || device >= count) {
    return make_error(
        ErrorCode::kUnavailable,
        "NCCL rank " + std::to_string(rank) + " wants GPU " + std::to_string(device) +
            " but this machine has " + std::to_string(count) +
            " usable GPUs; lower --tensor-parallel-size or check CUDA_VISIBLE_DEVICES",
        "--tensor-parallel-size");
  }
  M3_TRY_STATUS(prepare_nccl_environment());
  M3_CUDA_CHECK(cudaSetDevice(device));
  cudaStream_t stream = nullptr;
  M3_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  float* scratch = nullptr;
  M3_CUDA_CHECK(cudaMalloc(&scratch, sizeof(float)));
  ncclComm_t comm = nullptr;
  const ncclResult_t r = ncclCommInitRank(&comm, world_size, id, rank);
  if (r != ncclSuccess) {
    cudaFree(scratch);
    cudaStreamDestroy(stream);
    return tl::unexpected(nccl_error("ncclCommInitRank (rank " + std::to_string(rank) + " of " +
                                         std::to_string(world_size) + ")",
                                     r));
  }
  return std::unique_ptr<NcclCommunicator>(
      new NcclCommunicator(rank, world_size, device, comm, stream, scratch));
}

NcclCommunicator::NcclCommunicator(int rank, int world, int device, ncclComm_t comm,
                                   cudaStream_t stream, float* scratch)
    : rank_(rank),
      world_(world),
      device_(device),
      comm_(comm),
      stream_(stream),
      scratch_(scratch) {}

NcclCommunicator::~NcclCommunicator() {
  cudaSetDevice(device_);
  if (comm_) ncclCommDestroy(comm_);
  if (scratch_) cudaFree(scratch_);
  if (stream_) cudaStreamDestroy(stream_);
}

void NcclCommunicator::all_reduce_sum(float* data, int64_t n) {
  if (one_shot_ != nullptr && n <= one_shot_->max_floats()) {
    one_shot_->all_reduce_sum(rank_, data, n, stream_);
    return;
  }
  M3_NCCL_CHECK(
      ncclAllReduce(data, data, static_cast<size_t>(n), ncclFloat32, ncclSum, comm_, stream_));
}

void NcclCommunicator::all_gather(const float* send, int64_t n, float* recv) {
  M3_NCCL_CHECK(ncclAllGather(send, recv, static_cast<size_t>(n), ncclFloat32, comm_, stream_));
}

void NcclCommunicator::all_gather(const int32_t* send, int64_t n, int32_t* recv) {
  M3_NCCL_CHECK(ncclAllGather(send, recv, static_cast<size_t>(n), ncclInt32, comm_, stream_));
}

void NcclCommunicator::reduce_scatter_sum(const float* send, int64_t n, float* recv) {
  M3_NCCL_CHECK(
      ncclReduceScatter(send, recv, static_cast<size_t>(n), ncclFloat32, ncclSum, comm_, stream_));
}

template <class T>
void NcclCommunicator::a2a(const T* send, const int64_t* send_counts, T* recv,
                           const int64_t* recv_counts, ncclDataType_t type) {
  // NCCL has no all-to-all-v primitive: grouped point-to-point sends and receives are one.
  int64_t soff = 0, roff = 0;
  M3_NCCL_CHECK(ncclGroupStart());
  for (int peer = 0; peer < world_; ++peer) {
    if (send_counts[peer] > 0)
      M3_NCCL_CHECK(ncclSend(send + soff, static_cast<size_t>(send_counts[peer]), type, peer, comm_,
                             stream_));
    if (recv_counts[peer] > 0)
      M3_NCCL_CHECK(ncclRecv(recv + roff, static_cast<size_t>(recv_counts[peer]), type, peer, comm_,
                             stream_));
    soff += send_counts[peer];
    roff += recv_counts[peer];
  }
  M3_NCCL_CHECK(ncclGroupEnd());
}

void NcclCommunicator::all_to_all_v(const float* send, const int64_t* send_counts, float* recv,
                                    const int64_t* recv_counts) {
  a2a(send, send_counts, recv, recv_counts, ncclFloat32);
}

void NcclCommunicator::all_to_all_v(const int32_t* send, const int64_t* send_counts, int32_t* recv,
                                    const int64_t* recv_counts) {
  a2a(send, send_counts, recv, recv_counts, ncclInt32);
}

void NcclCommunicator::broadcast(float* data, int64_t n, int root) {
  M3_NCCL_CHECK(
      ncclBroadcast(data, data, static_cast<size_t>(n), ncclFloat32, root, comm_, stream_));
}

void NcclCommunicator::broadcast(int32_t* data, int64_t n, int root) {
  M3_NCCL_CHECK(ncclBroadcast(data, data, static_cast<size_t>(n), ncclInt32, root, comm_, stream_));
}

void NcclCommunicator::barrier() {
  // A one-element all-reduce completes on a rank only once every rank has joined it.
  M3_NCCL_CHECK(ncclAllReduce(scratch_, scratch_, 1, ncclFloat32, ncclSum, comm_, stream_));
  M3_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

}  // namespace m3::dist
