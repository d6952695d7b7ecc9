#include "hopper/tensor_map.h"

#include <cuda_runtime_api.h>
#include <cudaTypedefs.h>

#include <string>

namespace jax_hopper::hopper {
namespace {

constexpr unsigned kDriverApiVersion = 12000;  // cuTensorMapEncodeTiled appeared in 12.0
constexpr uint32_t kRank = 3;

PFN_cuTensorMapEncodeTiled_v12000 encode_fn(Status* status) {
  // Resolved once; the driver entry point never changes within a process.
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  static Status resolve_status = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult query;
    const cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, kDriverApiVersion,
                                                             cudaEnableDefault, &query);
    if (err != cudaSuccess) return Status::Internal(std::string("cudaGetDriverEntryPointByVersion: ") + cudaGetErrorString(err));
    if (query != cudaDriverEntryPointSuccess || ptr == nullptr)
      return Status::Internal("the CUDA driver does not provide cuTensorMapEncodeTiled");
    fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
    return Status::Ok();
  }();
  *status = resolve_status;
  return fn;
}

}  // namespace

Status encode_tensor_map_3d(CUtensorMap* map, const TensorMap3d& d) {
  Status status;
  const auto encode = encode_fn(&status);
  if (!status.ok()) return status;
  const cuuint64_t dims[kRank] = {d.inner, d.outer, d.batch};
  // Byte strides of the outer dims; the batch stride of a single matrix is never used
  // but must still be a valid (16-byte multiple) value.
  const uint64_t batch_stride = d.batch > 1 ? d.batch_stride : d.row_stride * d.outer;
  if (d.element_bytes != 2 && d.element_bytes != 4)
    return Status::Internal("tensor map element size must be 2 or 4 bytes, got " + std::to_string(d.element_bytes));
  const auto type = d.element_bytes == 2 ? CU_TENSOR_MAP_DATA_TYPE_UINT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT32;
  const cuuint64_t strides[kRank - 1] = {d.row_stride * d.element_bytes, batch_stride * d.element_bytes};
  const cuuint32_t box[kRank] = {d.box_inner, d.box_outer, 1};
  const cuuint32_t element_strides[kRank] = {1, 1, 1};
  const CUresult res = encode(map, type, kRank, const_cast<void*>(d.base), dims,
                              strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                              CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                              CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (res != CUDA_SUCCESS)
    return Status::Internal("cuTensorMapEncodeTiled failed with CUresult " + std::to_string(res) + " (extents " +
                            std::to_string(d.inner) + " x " + std::to_string(d.outer) + " x " + std::to_string(d.batch) +
                            ", row stride " +
                            std::to_string(d.row_stride) + ")");
  return Status::Ok();
}

}  // namespace jax_hopper::hopper
